"""Run every benchmark and write ``bench/results/*.json`` (raw data) and the benchmark pages (tables).

Usage::

    OMP_NUM_THREADS=1 python -m bench.run_all           # full: ~90 min on 2 cores
    OMP_NUM_THREADS=1 python -m bench.run_all --quick   # smoke: ~10 min
    python -m bench.run_all --render                    # rebuild the pages from bench/results/, run nothing

``bench/results/`` (committed) holds one small JSON per benchmark plus ``machine.json`` (the machine and
the last run's command): everything the page's tables are made from. Logs, plots and the full raw
data (e.g. per-step curves) stay in ``bench/out/`` (git-ignored). The pages (``docs/benchmarks/``,
git-ignored: ``bench/docs_pages.py``) are rendered from the results alone, also by ``make docs`` at
every build; ``--doc FILE`` also writes everything as one Markdown page.

Benchmarks (each also runs alone: ``python -m bench.NAME [--quick]``):

- ``transfer``: ``send_state``/``recv_state`` throughput between two processes, gloo on loopback;
- ``recovery_stall``: survivor stall after real kill and hang faults, with its time split;
- ``steady_state``: step time against plain ``DistributedDataParallel``, interleaved;
- ``compare``: recovery, goodput under repeated kills and exactness against torchrun + DCP
  checkpoint-restart, torchft (at a 2,000 ms and a 300 ms lighthouse heartbeat) and plain DDP;
  goodput against each system's own fault-free twin, 5 interleaved repetitions (``make bench``
  uses 30 s windows and one kill interval to stay near an hour; ``python -m bench.compare`` alone
  runs 120 s windows at two intervals, ~2 h);
- ``large_state``: the same side by side at 1.5 GB of state and a 2 s step (where a restart costs
  seconds): training lost per kill, recovery, against each system's own fault-free rate;
- ``consistency``: the replica consistency check's cost per step at its default interval;
- ``hsdp``: sharded (FSDP2 HSDP 2x2) kill stall and bytes moved per recovery against DDP on the same
  model, and steady-state step time against plain FSDP2 HSDP;
- ``hang_compare``: a hang (SIGSTOP) side by side with torchft at matched timeouts (2 s and 0.5 s),
  paired per repetition, with false failures of fault-free jobs at each setting;
- ``kill_cost``: where a kill's time goes (stall vs slowdown after it), spares started niced or not;
- ``steady_compare``: fault-free step time of every system against plain DDP at two model sizes;
- ``integrations``: the Hugging Face ``Trainer`` under ``checkpointless launch`` against
  ``transformers.Trainer`` under ``torchrun`` (same script), paired step times; Lightning once its
  strategy exists;
- ``hf_eval``: the Hugging Face ``Trainer``'s evaluation during training, its batches shared by the
  ranks, against ``torchrun``'s distributed evaluation and one process evaluating the whole set;
- ``control_load``: the launcher's, heartbeats' and idle spare's CPU and wake-ups on HSDP 2x2, the
  workers' per-step wake-ups against plain FSDP2, and plain FSDP2 with a session per rank vs one;
- ``control_scale``: the real coordinator (store and loop) driven by simulated host agents at 10 to
  2,000 hosts x 8 ranks: a host's power loss to detection and plan, CPU, memory, store traffic, where
  its loop's time goes; group re-formation at 2,000 hosts on paper (``--quick``: 10 and 100 hosts);
- ``scale``: goodput of checkpoint-restart vs checkpointless from 1,000 to 100,000 accelerators,
  simulated with parameters taken from the measurements above;
- ``node_stall``: several hosts (network namespaces, root): kill-node and partition stall against
  the single-host kill stall, 2 hosts x 2 ranks + 2 spare hosts, bitwise against the fault-free run;
- ``startup``: a job's start, wall time and CPU with and without the fork server, interleaved;
- ``share_cost``: step time of the share loop and of ``--exact-resize`` against the plain step,
  interleaved, paired per repetition;
- ``never_wait``: the survivor's stall after a kill, today's replacement against ``--never-wait``,
  at 130 MB and 1.5 GB of state, paired per kill.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import (
    common,
    compare,
    consistency,
    control_load,
    control_scale,
    hang_compare,
    hf_eval,
    hsdp,
    integrations,
    kill_cost,
    large_state,
    never_wait,
    node_stall,
    recovery_stall,
    scale,
    share_cost,
    startup,
    steady_compare,
    steady_state,
    transfer,
)

#: Where the documentation's benchmark pages are written (``make docs`` writes them too).
PAGES = common.REPO / "docs" / "benchmarks"
#: Where a run puts the plots the pages show (committed; the pages copy them beside themselves).
IMAGES = common.REPO / "docs"
#: A committed result above this size is reported (the tables need summaries, not raw series).
MAX_RESULT_BYTES = 200_000

BENCHES: list[tuple[str, str, Any]] = [
    ("transfer", "State transfer throughput", transfer),
    ("recovery_stall", "Recovery stall (kill, hang)", recovery_stall),
    ("steady_state", "Steady-state overhead against DDP", steady_state),
    ("compare", "Side by side: torchrun + DCP, torchft, plain DDP, checkpointless", compare),
    ("hang_compare", "Hangs at matched settings: checkpointless against torchft", hang_compare),
    ("kill_cost", "Where the time of a kill goes", kill_cost),
    ("large_state", "Side by side at 1.5 GB of state", large_state),
    ("consistency", "Cost of the replica consistency check", consistency),
    ("hsdp", "Sharded (FSDP2 HSDP): kill stall, bytes per recovery, steady state vs plain FSDP2", hsdp),
    ("steady_compare", "Steady state side by side, two model sizes", steady_compare),
    ("integrations", "Integrations against the same script without checkpointless", integrations),
    ("hf_eval", "Hugging Face Trainer: evaluation time during training, shared by the ranks", hf_eval),
    (
        "control_load",
        "What the control plane takes from the training cores (counted from /proc)",
        control_load,
    ),
    ("control_scale", "Control plane at scale", control_scale),
    ("scale", "Goodput at cluster scale (simulation from these measurements)", scale),
    ("node_stall", "Several hosts: kill-node and partition stall, next to the single-host kill", node_stall),
    ("startup", "A job's start with and without the fork server", startup),
    ("share_cost", "Steady cost of the share loop and of --exact-resize against the plain step", share_cost),
    (
        "never_wait",
        "Never wait: the survivor's stall after a kill, replacement against --never-wait",
        never_wait,
    ),
]


def _verdict(ok: bool | None) -> str:
    return "–" if ok is None else ("met" if ok else "**not met**")


def targets(results: dict[str, Any]) -> str:
    rows: list[list[Any]] = []
    rec = results.get("recovery_stall")
    if rec and "summary" in rec:
        for kind, limit, label in (("kill", 1.0, "kill: survivor stall, median"),
                                   ("hang", 3.0, "hang: survivor stall incl. detection, median")):  # fmt: skip
            st = rec["summary"][kind]["stall_s"]
            if st.get("n"):
                rows.append(
                    [label, f"≤ {limit:g} s", f"{st['median']:.3f} s (p95 {st['p95']:.3f} s, n={st['n']})",
                     _verdict(st["median"] <= limit)]
                )  # fmt: skip
        fl = rec.get("floor") or {}
        if fl.get("ratio"):
            g, lo, hi = fl["ratio"]
            rows.append(["kill: survivor gap vs its floor measured in the same run (geometric mean, 95% interval)",
                         "≤ 1.2", f"{g:.3f} [{lo:.3f}, {hi:.3f}], n={len(fl['faults'])}",
                         common.interval_verdict(lo, hi, 1.2)])  # fmt: skip
        if fl.get("transfer_vs_raw"):
            g, lo, hi = fl["transfer_vs_raw"]
            rows.append(["kill: transfer inside the recovery vs raw gloo into the same tensors", "≥ 0.8×",
                         f"{g:.2f}× [{lo:.2f}, {hi:.2f}]",
                         "met" if lo >= 0.8 else ("**not met**" if hi < 0.8 else "not established")])  # fmt: skip
        rows.append(
            ["final state of every faulted run = fault-free run", "bitwise", str(rec["all_digests_match"]),
             _verdict(rec["all_digests_match"])]
        )  # fmt: skip
    ss = results.get("steady_state")
    if ss and "summary" in ss:
        s = ss["summary"]["checkpointless"]
        pi = common.paired_interval(s.get("paired_ratios") or [])
        if pi is None:
            rows.append(
                ["steady-state step time overhead vs DDP (median)", "≤ 1%",
                 f"{s['overhead_pct']:+.1f}% (paired per-rep ratio {s['paired_ratio_median']:.3f})",
                 _verdict(s["overhead_pct"] <= 1.0)]
            )  # fmt: skip
        else:
            g, lo, hi = pi
            rows.append(
                ["steady-state step time vs DDP, paired per-repetition ratio (geometric mean, 95% interval)",
                 "≤ 1.01", f"{g:.3f} [{lo:.3f}, {hi:.3f}], n={len(s['paired_ratios'])}",
                 common.interval_verdict(lo, hi, 1.01)]
            )  # fmt: skip
    hc = results.get("hang_compare")
    for pair in (hc or {}).get("pairs", []):
        if pair.get("interval"):
            g, lo, hi = pair["interval"]
            rows.append(
                [f"hang stall vs torchft at the same {pair['timeout_s']:g} s timeout, paired ratio (geometric mean, "
                 "95% interval)", "< 1", f"{g:.3f} [{lo:.3f}, {hi:.3f}], n={len(pair['ratios'])}",
                 common.interval_verdict(lo, hi, 1.0)]
            )  # fmt: skip
    tr = results.get("transfer")
    if tr and "rows" in tr:
        for r in tr["rows"]:
            if r["bytes"] < 100e6:
                continue
            if r.get("into_vs_wire") is None:  # results of the SHA-256 wire format: no in-place column
                rows.append([f"state transfer, {r['bytes'] / 1e6:.0f} MB", "≥ 0.8× raw gloo",
                             f"{r['e2e_gbps'] / r['wire_gbps']:.2f}× ({r['e2e_gbps']:.2f} GB/s)",
                             _verdict(r["e2e_gbps"] / r["wire_gbps"] >= 0.8)])  # fmt: skip
                continue
            rows.append(
                [f"state transfer into the receiver's tensors, {r['bytes'] / 1e6:.0f} MB", "≥ 0.8× raw gloo",
                 f"{r['into_vs_wire']:.2f}× ({r['into_gbps']:.2f} GB/s; raw gloo into the same tensors "
                 f"{r.get('wire_into_gbps', r['wire_gbps']):.2f})",
                 _verdict(r["into_vs_wire"] >= 0.8)]
            )  # fmt: skip
    cons = results.get("consistency")
    if cons and "rows" in cons:
        for r in cons["rows"]:
            if r.get("overhead") is not None:
                rows.append(
                    [f"consistency check per step, every {r['every']} steps, {r['model']}", "≤ 1%",
                     f"{100 * r['overhead']:.2f}%", _verdict(r["overhead"] <= 0.01)]
                )  # fmt: skip
    hs = results.get("hsdp")
    if hs and "kill" in hs:
        by = {r["layout"]: r for r in hs["kill"] if r.get("ok")}
        if "HSDP 2x2" in by and "DDP 4x1" in by:
            h, d = by["HSDP 2x2"]["stall_s"], by["DDP 4x1"]["stall_s"]
            rows.append(
                ["HSDP 2x2 kill stall (DDP 4x1 on the same model)", "–",
                 f"{h['median']:.3f} s, p95 {h['p95']:.3f} s, n={h['n']} (DDP {d['median']:.3f} s)", "–"]
            )  # fmt: skip
        ratio = hs.get("bytes_ratio_hsdp_to_ddp")
        if ratio is not None:
            rows.append(["bytes moved per recovery, HSDP 2x2 / DDP", "≈ 1/shards = 0.50", f"{ratio:.2f}",
                         _verdict(0.4 <= ratio <= 0.6)])  # fmt: skip
        pairs = hs.get("steady", {}).get("pairs", [])
        pi = common.paired_interval([p["checkpointless"] / p["plain"] for p in pairs])
        if pi is not None:
            g, lo, hi = pi
            rows.append(
                ["HSDP steady-state step time vs plain FSDP2 HSDP, paired ratio (geometric mean, 95% interval)",
                 "≤ 1.03", f"{g:.3f} [{lo:.3f}, {hi:.3f}], n={len(pairs)}", common.interval_verdict(lo, hi, 1.03)]
            )  # fmt: skip
    if results.get("share_cost"):
        rows += share_cost.verdict_rows(results["share_cost"])
    if results.get("never_wait"):
        rows += never_wait.verdict_rows(results["never_wait"])
    integ = results.get("integrations")
    if integ:
        rows += integrations.verdict_rows(integ)
    if results.get("node_stall"):
        rows += node_stall.verdict_rows(results["node_stall"])
    cs = results.get("control_scale")
    if cs and cs.get("rows"):
        big = next((r for r in cs["rows"] if r.get("hosts") == 2000
                    and r.get("hang_timeout_s") == control_scale.SERIES_HANG_S), None)  # fmt: skip
        if big is not None:
            for what, target, measured, verdict in control_scale.verdicts(cs, big):
                rows.append([f"control plane at 2,000 hosts x 8 ranks: {what}", target, measured, verdict])
    return common.md_table(["what", "target", "measured", "verdict"], rows)


def slim(key: str, res: dict[str, Any]) -> dict[str, Any]:
    """What the committed ``bench/results/KEY.json`` keeps: what the tables need, not raw series.

    Dropped (they stay in ``bench/out/``): ``compare``'s and ``kill_cost``'s per-job step curves
    and ``steady_state``'s and ``share_cost``'s per-step intervals (their tables use the summaries).
    """
    res = json.loads(json.dumps(res, default=str))  # a deep copy, JSON types only
    if key in ("compare", "kill_cost", "hang_compare"):
        for job in res.get("jobs", []):
            if isinstance(job.get("analysis"), dict):
                job["analysis"].pop("curve", None)
    if key in ("steady_state", "share_cost"):
        for runs in (res.get("runs") or {}).values():
            for r in runs if isinstance(runs, list) else []:
                for k in ("intervals", "inner"):
                    if isinstance(r.get(k), list):
                        r[f"n_{k}"] = len(r.pop(k))
    return res


def save_result(results_dir: Path, key: str, res: dict[str, Any]) -> Path:
    path = results_dir / f"{key}.json"
    common.write_json(path, slim(key, res))
    size = path.stat().st_size
    if size > MAX_RESULT_BYTES:
        print(
            f"   warning: {common.rel(path)} is {size / 1e3:.0f} kB (> {MAX_RESULT_BYTES / 1e3:.0f} kB)",
            flush=True,
        )
    return path


def load_results(results_dir: Path) -> dict[str, Any]:
    """Every ``KEY.json`` of ``results_dir`` whose KEY is a benchmark."""
    out: dict[str, Any] = {}
    for key, _, _ in BENCHES:
        path = results_dir / f"{key}.json"
        if path.is_file():
            out[key] = json.loads(path.read_text())
    return out


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def simulate_defaults() -> str:
    """The section on ``checkpointless simulate``'s defaults: each value, where it comes from, what
    they give at 16,384 GPUs, the references. Made from the code (``ClusterParams``'s field
    metadata), not from a result: the page says what the command does now."""
    from dataclasses import fields

    from checkpointless.analysis import cluster_params as cp
    from checkpointless.analysis import goodput_model as gm

    p = cp.ClusterParams()
    cr, cl = gm.goodput_checkpoint_restart(p), gm.goodput_checkpointless(p)
    rows = [
        [f"`--{f.name.replace('_', '-')}`" if f.name != "n_accelerators" else "`--sizes` (reference size)",
         _num(getattr(p, f.name)), str(f.metadata.get("help", "")), str(f.metadata.get("source", ""))]
        for f in fields(cp.ClusterParams)
    ]  # fmt: skip
    return "\n".join(
        [
            "## `checkpointless simulate`: defaults and their sources",
            "",
            "`checkpointless simulate` (`checkpointless/analysis/`) runs the goodput model of the scale section "
            "above on defaults calibrated to published cluster figures, not on this machine's measurements: the "
            "failure rate, step time and per-GPU state come from the Llama 3 report (16,384 H100 GPUs); the "
            "checkpoint and restart costs are **assumptions**, chosen inside the ranges the sources allow "
            "and marked as such. `checkpointless simulate --params bench/results/scale.json` runs the model on "
            "the parameters `make bench` measured here instead (fixed software costs of a tiny model on 2 "
            "cores, see the scale section); flags override either.",
            "",
            f"At 16,384 GPUs (`checkpointless simulate --sizes 16384`) the defaults give checkpoint-restart "
            f"{cr:.3f} of wall time as useful training (restart {p.restart_cost_s:.0f} s, checkpoint every "
            f"{gm.checkpoint_restart_interval(p):.0f} s of compute, job MTBF {p.mtbf_s / 3600:.2f} h) and "
            f"checkpointless {cl:.3f}. Llama 3 reports higher than "
            f"{cp.LLAMA3_EFFECTIVE_TRAINING_TIME:.0%} effective training time with checkpoint-restart on that "
            "cluster; a unit test keeps the calibrated checkpoint-restart figure above it "
            "(`tests/unit/test_simulate.py`). The model counts every one of the 419 unexpected interruptions "
            "as a failure and leaves out the 47 planned ones.",
            "",
            common.md_table(["parameter", "default", "what", "source"], rows),
            "",
            "Sources:",
            "",
            *(f"- {ref}" for ref in cp.REFERENCES),
            "",
        ]
    )


def code_version(res: dict[str, Any]) -> str:
    """``commit: <sha>`` (``, dirty tree`` when uncommitted or untracked files were present), or
    ``commit: unrecorded`` for a result written before the commit was recorded."""
    commit = res.get("_commit")
    if not commit:
        return "commit: unrecorded"
    dirty = res.get("_dirty")
    note = {True: ", dirty tree (uncommitted or untracked files)", False: ", clean tree"}.get(dirty, "")
    return f"commit: `{str(commit)[:12]}`{note}"


def provenance(res: dict[str, Any]) -> str:
    """The line under a section's title: which command measured it, when, and at which commit."""
    if res.get("_command"):
        return f"*Measured by `{res['_command']}` on {res.get('_date', '?')}; {code_version(res)}.*"
    return f"*{code_version(res)[0].upper()}{code_version(res)[1:]}.*"


def render(argv: list[str], quick: bool, machine: dict[str, Any], results: dict[str, Any],
           errors: dict[str, str], wall: float, load_end: list[float]) -> str:  # fmt: skip
    cmd = "OMP_NUM_THREADS=1 python -m bench.run_all" + ("".join(" " + shlex.quote(a) for a in argv))
    parts = [
        "# Benchmarks",
        "",
        "Generated by `bench/run_all.py`; do not edit by hand. The raw results behind every table are "
        "committed in `bench/results/*.json` (one per benchmark, plus `machine.json`); "
        "`python -m bench.run_all --render` regenerates this page from them without running anything. "
        "Logs, plots and full raw series (e.g. per-step curves) are in `bench/out/` (git-ignored, made by a run).",
        "",
        f"- **Command:** `{cmd}` ({'quick mode: fewer repetitions and faults' if quick else 'full mode'})"
        + (
            "; the sections not named by `--only` come from their last run (their JSON under `bench/results/`), "
            "each says which command and date measured it"
            if "--only" in argv
            else ""
        ),
        f"- **Date:** {machine['date']}, total wall time {wall / 60:.1f} min",
        f"- **Code:** {code_version(machine)} at the start of the run; each section gives the commit it was "
        "measured at (`_commit`, `_dirty` in its JSON: `git rev-parse HEAD` and whether `git status "
        "--porcelain` listed anything when that benchmark started)",
        f"- **Software:** torch {machine['torch']}, Python {machine['python']}, {machine['platform']}",
        f"- **Machine:** CPUs = {machine['nproc']}; load average (1, 5, 15 min) at start "
        f"{machine['loadavg']}, at end {load_end}. A shared 2-core VM: absolute times are noisy (hence "
        "medians, p95, ranges and interleaved repetitions; ratios are taken within a repetition).",
        "- Every process runs with `OMP_NUM_THREADS=1` and `torch.set_num_threads(1)`; collectives are "
        "gloo over loopback TCP.",
        "",
        "<details><summary>lscpu / free</summary>",
        "",
        "```",
        *machine["lscpu"],
        "",
        machine["free"],
        "```",
        "",
        "</details>",
        "",
        "## Summary against the targets",
        "",
        targets(results),
        "",
    ]
    for key, title, mod in BENCHES:
        parts += [f"## {title} (`bench/{key}.py`)", ""]
        if key in results:
            parts += [provenance(results[key]), ""]
        doc = (mod.__doc__ or "").split("Usage:")[0].strip()
        parts += ["<details><summary>Method</summary>", "", doc, "", "</details>", ""]
        if key in results:
            parts += [mod.markdown(results[key]), ""]
        else:
            parts += ["**Failed:**", "", "```", errors.get(key, "not run").strip()[-3000:], "```", ""]
    parts += [simulate_defaults()]
    text = "\n".join(parts)
    # no machine's absolute path in the page (older results may carry one)
    return text.replace(str(common.REPO) + "/", "").replace(str(common.REPO), ".")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run of a few minutes)")
    p.add_argument("--only", choices=[b[0] for b in BENCHES], action="append", help="run only these")
    p.add_argument(
        "--doc", type=Path, default=None, help="also write every section as this one Markdown page"
    )
    p.add_argument(
        "--pages",
        type=Path,
        default=None,
        help=f"where to write the benchmark pages (default: {common.rel(PAGES)}, unless --doc is given)",
    )
    p.add_argument(
        "--results",
        type=Path,
        default=common.RESULTS,
        help="directory of the committed results (default: %(default)s)",
    )
    p.add_argument(
        "--render", action="store_true", help="only rebuild the page from the results directory; run nothing"
    )
    a = p.parse_args(argv)
    if a.render:
        return render_only(a.results, a.doc, a.pages)
    machine = common.machine_info()
    git = common.git_state()
    machine["_commit"], machine["_dirty"] = git["commit"], git["dirty"]
    common.OUT.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    t0 = time.monotonic()
    for key, title, mod in BENCHES:
        if a.only and key not in a.only:
            saved = a.results / f"{key}.json"
            if saved.exists():  # re-render the whole page: sections not re-run come from their last run
                results[key] = json.loads(saved.read_text())
            continue
        print(f"== {title} ({'quick' if a.quick else 'full'})", flush=True)
        t = time.monotonic()
        run: Callable[[bool, Path], dict[str, Any]] = getattr(mod, "run_bench", mod.run)
        git = common.git_state()  # the code this benchmark measures: the tree as it starts
        try:
            res = run(a.quick, common.OUT)
            if res.get("image_src"):  # a plot the section shows: beside the page written (--doc)
                IMAGES.mkdir(parents=True, exist_ok=True)
                shutil.copy(res.pop("image_src"), IMAGES / res["image"])
            res["_command"] = f"OMP_NUM_THREADS=1 python -m bench.run_all {' '.join(argv)}".strip()
            res["_date"] = machine["date"]
            res["_commit"], res["_dirty"] = git["commit"], git["dirty"]
            common.write_json(common.OUT / f"{key}.json", res)  # full raw data (git-ignored)
            save_result(a.results, key, res)
            results[key] = json.loads((a.results / f"{key}.json").read_text())
        except Exception:
            errors[key] = traceback.format_exc()
            print(errors[key], file=sys.stderr, flush=True)
        print(f"   {key}: {time.monotonic() - t:.0f}s", flush=True)
    wall = time.monotonic() - t0
    load_end = common.load_average()
    machine["run"] = {
        "argv": argv,
        "quick": a.quick,
        "wall_s": wall,
        "loadavg_end": load_end,
        "errors": {k: v.strip()[-3000:] for k, v in errors.items()},
    }
    common.write_json(a.results / "machine.json", machine)
    if a.doc is not None:
        a.doc.parent.mkdir(parents=True, exist_ok=True)
        a.doc.write_text(render(argv, a.quick, machine, results, errors, wall, load_end))
        print(f"wrote {common.rel(a.doc)}")
    pages = a.pages or (PAGES if a.doc is None else None)
    if pages is not None:
        from bench import docs_pages

        docs_pages.write_pages(pages, a.results, IMAGES)
        print(f"wrote {common.rel(pages)}/")
    print(f"wrote {common.rel(a.results)}/*.json ({wall / 60:.1f} min)")
    return 1 if errors else 0


def render_only(results_dir: Path, doc: Path | None, pages: Path | None = None) -> int:
    """Rebuild the pages from ``results_dir`` (``machine.json`` + one JSON per benchmark); run nothing.

    ``pages`` (default ``PAGES`` when no ``doc`` is given): the documentation's pages, one per
    benchmark; ``doc``: every section on one Markdown page."""
    mpath = results_dir / "machine.json"
    if not mpath.is_file():
        print(f"no {common.rel(mpath)}: run the benchmarks first (python -m bench.run_all)", file=sys.stderr)
        return 2
    machine = json.loads(mpath.read_text())
    if pages is not None or doc is None:
        from bench import docs_pages

        pages = pages or PAGES
        docs_pages.write_pages(pages, results_dir, IMAGES)
        print(f"wrote {common.rel(pages)}/ from {common.rel(results_dir)}/*.json")
    if doc is None:
        return 0
    run_info = machine.get("run", {})
    results = load_results(results_dir)
    errors = dict(run_info.get("errors", {}))
    text = render(
        list(run_info.get("argv", [])),
        bool(run_info.get("quick", False)),
        machine,
        results,
        errors,
        float(run_info.get("wall_s", 0.0)),
        list(run_info.get("loadavg_end", [])),
    )
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    print(f"wrote {common.rel(doc)} from {common.rel(results_dir)}/*.json ({len(results)} benchmarks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
