"""Hangs at matched settings: checkpointless against torchft, rank 1 stopped (SIGSTOP) mid-step.

A hang (a stopped process, a frozen host) is found by timing out, so its cost is mostly the timeout a
system is configured with. Each system runs at two settings chosen to match:

- ``checkpointless``: ``hang_timeout_s`` 2.0 (the former default) and 0.5 (the default since then),
  heartbeat every 0.1 s; the coordinator kills the stopped process and a hot spare takes its rank;
- ``torchft`` (0.2.0): the lighthouse heartbeat timeout at 300 ms (its short setting in ``compare``)
  and the process group timeout at the same 2.0 s and 0.5 s. torchft finds a hung peer by the
  survivor's all-reduce timing out (the lighthouse heartbeat only drops the silent group from the
  next quorum), so its process group timeout is the setting that matches checkpointless'
  ``hang_timeout_s``. Nothing in torchft ends the stopped group: the survivor trains on alone.

Per repetition (interleaved, the order alternating), one job per configuration of 2 ranks (the
``compare`` model) stops rank 1 after the forward pass of step ``HANG_STEP`` (its own ``hang`` fault;
torchft's worker SIGSTOPs itself at the same point). Measured from the common log
(``baselines.analyse``): the survivor's stall, stop -> its next commit that survives;
``all ranks`` stop -> both ranks train again (torchft: never, the group stays stopped). The
paired ratio checkpointless / torchft at the same timeout, per repetition, is summarised as a
geometric mean with a 95% t interval. A fault-free job per configuration counts false failures
(checkpointless: faults detected; torchft: commits made with fewer than both groups).

Usage: ``OMP_NUM_THREADS=1 python -m bench.hang_compare [--quick] [--reps N]`` ->
``bench/out/hang_compare.json`` (``python -m bench.run_all --only hang_compare`` also renders it into the page).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import common, compare
from bench.baselines import THREAD_ENV, torchft_ddp

STEPS = 60
HANG_STEP = 30
TIMEOUTS_S = (2.0, 0.5)
TORCHFT_HB_MS = 300
REPS, QUICK_REPS = 5, 2


def configs() -> list[dict[str, Any]]:
    """Every configuration: system, the matched timeout, and the runner's keyword arguments."""
    from checkpointless.config import RecoveryConfig

    out: list[dict[str, Any]] = []
    for t in TIMEOUTS_S:
        out.append({"name": f"checkpointless-{t:g}", "system": "checkpointless", "timeout_s": t,
                    "kw": {"recovery": RecoveryConfig(hang_timeout_s=t, heartbeat_interval_s=0.1)},
                    "setting": f"hang_timeout_s={t:g}, heartbeat 0.1 s"})  # fmt: skip
        out.append({"name": f"torchft-{t:g}", "system": "torchft", "timeout_s": t,
                    "kw": {"heartbeat_timeout_ms": TORCHFT_HB_MS, "pg_timeout_s": t},
                    "setting": f"pg timeout {t:g} s, lighthouse heartbeat {TORCHFT_HB_MS} ms"})  # fmt: skip
    return out


def _false_failures(job: dict[str, Any], recs: list[dict[str, Any]]) -> int:
    if job["system"] == "checkpointless":
        return len(job["extra"].get("report_faults") or [])
    return sum(1 for r in recs if r["ev"] == "commit" and int(r.get("participants") or 2) < 2)


def run(quick: bool, out: Path, reps: int | None = None) -> dict[str, Any]:
    from bench import baselines

    common.pin_threads()
    os.environ.update(THREAD_ENV)
    dest = common.fresh_dir(out / "hang_compare")
    why = torchft_ddp.available()
    cfgs = [c for c in configs() if c["system"] != "torchft" or why is None]
    reps = reps or (QUICK_REPS if quick else REPS)
    spec = compare.model_spec(STEPS)
    jobs: list[dict[str, Any]] = []
    free: dict[str, dict[str, Any]] = {}
    for c in cfgs:  # fault-free twins: false failures at this setting
        job = compare.one(c["system"], f"{c['name']}-free", dest, jobs, spec=spec, steps=STEPS, **c["kw"])
        free[c["name"]] = {
            "ok": job["ok"],
            "false_failures": _false_failures(job, baselines.read_logs(dest / job["name"])),
        }
    per: dict[str, list[dict[str, Any]]] = {c["name"]: [] for c in cfgs}
    for i in range(reps):
        for c in cfgs if i % 2 == 0 else list(reversed(cfgs)):
            job = compare.one(c["system"], f"{c['name']}-hang-{i}", dest, jobs, spec=spec, steps=STEPS,
                              kill_step=HANG_STEP, fault="hang", **c["kw"])  # fmt: skip
            f = job["analysis"]["faults"][0] if job["analysis"]["faults"] else {}
            per[c["name"]].append({"rep": i, "ok": job["ok"], "error": job["error"], "stall_s": f.get("next_commit_s"),
                                   "all_ranks_s": f.get("all_ranks_s"), "lost_steps": f.get("lost_steps")})  # fmt: skip
    rows: list[dict[str, Any]] = []
    for c in cfgs:
        stalls = [r["stall_s"] for r in per[c["name"]] if r["ok"] and r["stall_s"] is not None]
        alls = [r["all_ranks_s"] for r in per[c["name"]] if r["ok"] and r["all_ranks_s"] is not None]
        rows.append({"name": c["name"], "system": c["system"], "timeout_s": c["timeout_s"], "setting": c["setting"],
                     "stall_s": common.summary(stalls), "all_ranks_s": common.summary(alls),
                     "failed": sum(1 for r in per[c["name"]] if not r["ok"]), **free[c["name"]]})  # fmt: skip
    pairs: list[dict[str, Any]] = []
    for t in TIMEOUTS_S:
        a, b = per.get(f"checkpointless-{t:g}"), per.get(f"torchft-{t:g}")
        if not a or not b:
            continue
        ratios = [x["stall_s"] / y["stall_s"] for x, y in zip(a, b, strict=True)
                  if x["ok"] and y["ok"] and x["stall_s"] and y["stall_s"]]  # fmt: skip
        pairs.append({"timeout_s": t, "ratios": ratios, "interval": common.paired_interval(ratios)})
    return {"quick": quick, "reps": reps, "steps": STEPS, "hang_step": HANG_STEP, "skipped": why,
            "rows": rows, "per_rep": per, "pairs": pairs, "jobs": jobs}  # fmt: skip


def _skipped(res: dict[str, Any], name: str) -> str:
    """Batches of the faulted jobs that no surviving update read (median): the data a survivor that
    trains on alone leaves out."""
    vals = [j["analysis"]["lineage"]["skipped"] for j in res.get("jobs", [])
            if j["name"].startswith(f"{name}-hang-") and j.get("analysis")]  # fmt: skip
    return common.fmt(float(statistics.median(vals)), 0) if vals else "–"


def markdown(res: dict[str, Any]) -> str:
    rows = [
        [r["system"], r["setting"], r["stall_s"].get("n", 0), common.fmt(r["stall_s"].get("median")),
         common.fmt(r["stall_s"].get("p95")), common.fmt(r["all_ranks_s"].get("median")) if r["all_ranks_s"].get("n") else "never",
         _skipped(res, r["name"]), r["failed"], r["false_failures"]]
        for r in res["rows"]
    ]  # fmt: skip
    table = common.md_table(
        ["system", "setting", "n", "stall median s", "stall p95 s", "all ranks train again, median s",
         "batches skipped per job", "failed jobs", "false failures (fault-free job)"], rows)  # fmt: skip
    lines = [
        f"Rank 1 stopped (SIGSTOP) after the forward pass of step {res['hang_step']} of {res['steps']}, world size 2, "
        f"{res['reps']} interleaved repetitions per configuration.",
        "",
        table,
        "",
    ]
    for p in res["pairs"]:
        iv = p["interval"]
        text = f"{iv[0]:.3f} [{iv[1]:.3f}, {iv[2]:.3f}]" if iv else "– (fewer than two pairs)"
        lines.append(f"- stall checkpointless / torchft at a {p['timeout_s']:g} s timeout, paired per repetition "
                     f"(geometric mean, 95% interval): {text}, n={len(p['ratios'])}")  # fmt: skip
    if res.get("skipped"):
        lines.append(f"- torchft not run: {res['skipped']}")
    lines += [
        "",
        "**Reading.** At the same timeout torchft's survivor commits again sooner: it does not wait for a "
        "replacement but goes on alone, on its own half of the global batch, for the rest of the job (the "
        "stopped group is never ended nor replaced: the skipped batches, and a final state unlike its fault-free "
        "run's). checkpointless kills the stopped process, and a hot spare takes its rank with the state: every "
        "rank trains again at the stall shown, nothing skipped, the final state bitwise the fault-free run's. "
        "The extra time over the timeout is that recovery (the kill, a new group, the state transfer, the "
        "re-executed step).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--reps", type=int)
    a = p.parse_args(argv)
    res = run(a.quick, common.OUT, a.reps)
    res.update({f"_{k}": v for k, v in common.git_state().items()})
    common.write_json(common.OUT / "hang_compare.json", res)
    print(markdown(res))
    return 0 if not any(r["failed"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
