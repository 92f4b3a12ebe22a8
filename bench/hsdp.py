"""Sharded (FSDP2 HSDP) checkpointless: kill stall and bytes moved against DDP, steady state against plain FSDP2.

The model is the ``llama-tiny`` recipe (a real ``LlamaForCausalLM``, 0.8M parameters), on 4
workers:

- **kill**: one ``checkpointless run`` per layout, ``DDP 4x1`` (4 replicas, ``shards=1``) and
  ``HSDP 2x2`` (2 replicas x 2 shards), each with ``KILLS`` SIGKILLs of a worker (every
  ``EVERY`` steps, the rank rotating over 0..3) and 2 hot spares. Per fault: the survivors'
  stall (``report.json``, fault -> every rank committed again) and the bytes every transfer of
  that recovery moved (``transfer_ended`` events). HSDP should move about 1/shards of DDP.
- **steady**: step time of HSDP checkpointless (one idle spare) against plain FSDP2 HSDP with
  the same model, layout, data and update (``baselines/fsdp2_plain.py``: no session, no spare,
  no control store), ``STEADY_STEPS`` steps each, alternating A/B ``REPS`` times; the step time
  is the median gap between consecutive steps of rank 0 after ``WARMUP`` steps.

Usage: ``python -m bench.hsdp [--quick]`` -> ``bench/out/hsdp.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import common, split
from checkpointless.protocol.vocab import Event

RECIPE = common.REPO / "recipes" / "llama-tiny.yaml"
COMMON_SET = ["data.eval_every=0", "optim.warmup_steps=2"]
KILLS, QUICK_KILLS = 10, 3
EVERY = 25
STEADY_STEPS, QUICK_STEADY_STEPS = 100, 50
WARMUP = 10
REPS, QUICK_REPS = 8, 1
LAYOUTS = {"DDP 4x1": 1, "HSDP 2x2": 2}


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _run_cli(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [common.PYTHON, "-m", "checkpointless", "run", str(RECIPE), "--quiet", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=common.child_env(),
                          cwd=common.REPO)  # fmt: skip


def _events(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]


def kill_run(layout: str, shards: int, kills: int, dest: Path) -> dict[str, Any]:
    steps = EVERY * (kills + 1)
    faults = [f"kill:rank={i % 4}@step={EVERY * (i + 1)}" for i in range(kills)]
    out = dest / f"kill-{shards}"
    args = ["--workers", "4", "--spares", "2", "--out", str(out),
            *_sets([*COMMON_SET, f"train.steps={steps}", f"parallel.shards={shards}"])]  # fmt: skip
    for f in faults:
        args += ["--fault", f]
    t0 = time.monotonic()
    p = _run_cli(args, timeout=1200)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        return {"layout": layout, "shards": shards, "ok": False, "error": p.stderr[-2000:], "wall_s": wall}
    report = json.loads((out / "report.json").read_text())
    events = list(_events(out))
    struck = [
        (float(e["t"]), set(e.get("ranks") or [e["rank"]]))
        for e in events
        if e["kind"] == Event.FAULT_INJECTED
    ]
    by_gen: dict[int, int] = {}
    for e in events:
        if e["kind"] == Event.TRANSFER_ENDED:
            by_gen[int(e["gen"])] = by_gen.get(int(e["gen"]), 0) + int(e["bytes"])
    stalls = [f["stall_s"] for f in report["faults"] if f.get("stall_s") is not None]
    moved = [by_gen.get(g, 0) for g in range(1, len(report["faults"]) + 1)]
    return {
        "layout": layout,
        "shards": shards,
        "ok": True,
        "kills": kills,
        "steps": steps,
        "wall_s": wall,
        "stall_s": common.summary(stalls),
        "stalls": stalls,
        "bytes_per_recovery": common.summary([float(b) for b in moved]),
        "lost_steps": sum(int(f.get("lost_steps") or 0) for f in report["faults"]),
        "digest": report.get("final_state_sha256"),
        "split": split.stall_splits(events, struck),
    }


def _gaps(times: list[float]) -> float:
    t = times[WARMUP:]
    return statistics.median(b - a for a, b in itertools.pairwise(t))


def steady_checkpointless(steps: int, out: Path) -> float | None:
    args = ["--workers", "4", "--spares", "1", "--out", str(out),
            *_sets([*COMMON_SET, f"train.steps={steps}", "parallel.shards=2"])]  # fmt: skip
    p = _run_cli(args, timeout=900)
    if p.returncode != 0:
        print(p.stderr[-2000:], file=sys.stderr)
        return None
    times = [e["t"] for e in _events(out) if e["kind"] == Event.STEP_COMMITTED and e.get("rank") == 0]
    return _gaps(times)


def steady_plain(steps: int, out: Path) -> float | None:
    cmd = [common.PYTHON, str(common.BENCH_DIR / "baselines" / "fsdp2_plain.py"), str(RECIPE), "--workers", "4",
           "--shards", "2", "--out", str(out), *_sets([*COMMON_SET, f"train.steps={steps}"])]  # fmt: skip
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env=common.child_env(), cwd=common.REPO
    )
    if p.returncode != 0:
        print(p.stderr[-2000:], file=sys.stderr)
        return None
    return _gaps(json.loads((out / "times.json").read_text()))


def run(quick: bool, out: Path) -> dict[str, Any]:
    common.pin_threads()
    dest = common.fresh_dir(out / "hsdp")
    kills = QUICK_KILLS if quick else KILLS
    kill_rows = [kill_run(layout, shards, kills, dest) for layout, shards in LAYOUTS.items()]
    steps = QUICK_STEADY_STEPS if quick else STEADY_STEPS
    pairs: list[dict[str, float | None]] = []
    for rep in range(QUICK_REPS if quick else REPS):
        order = ["plain", "checkpointless"] if rep % 2 == 0 else ["checkpointless", "plain"]
        pair: dict[str, float | None] = {}
        for system in order:
            where = dest / f"steady-{system}-{rep}"
            pair[system] = (steady_plain if system == "plain" else steady_checkpointless)(steps, where)
        pairs.append(pair)
    ratios = [p["checkpointless"] / p["plain"] for p in pairs if p["checkpointless"] and p["plain"]]
    ddp, hsdp = kill_rows
    return {
        "quick": quick,
        "model": "llama-tiny (0.8M params)",
        "kill": kill_rows,
        "bytes_ratio_hsdp_to_ddp": (
            hsdp["bytes_per_recovery"]["median"] / ddp["bytes_per_recovery"]["median"]
            if hsdp["ok"] and ddp["ok"] and ddp["bytes_per_recovery"]["median"]
            else None
        ),
        "steady": {
            "steps": steps,
            "warmup": WARMUP,
            "pairs": pairs,
            "plain_s": common.summary([p["plain"] for p in pairs]),
            "checkpointless_s": common.summary([p["checkpointless"] for p in pairs]),
            "ratio": common.summary(ratios),
        },
        "machine": common.machine_info(),
    }


def markdown(res: dict[str, Any]) -> str:
    rows = []
    for r in res["kill"]:
        if not r["ok"]:
            rows.append([r["layout"], "FAILED", "", "", "", ""])
            continue
        st, b = r["stall_s"], r["bytes_per_recovery"]
        rows.append([r["layout"], r["kills"], f"{st['median']:.3f}", f"{st['p95']:.3f}", f"{b['median'] / 1e6:.2f}",
                     r["lost_steps"]])  # fmt: skip
    kill = common.md_table(
        ["layout (4 workers)", "kills", "stall s median", "stall s p95", "MB moved per recovery (median)",
         "lost steps"], rows)  # fmt: skip
    ratio = res["bytes_ratio_hsdp_to_ddp"]
    s = res["steady"]
    steady = common.md_table(
        ["system (HSDP 2x2)", "median step s (median of reps)", "range"],
        [["plain FSDP2", common.fmt(s["plain_s"].get("median")),
          f"{common.fmt(s['plain_s'].get('min'))}-{common.fmt(s['plain_s'].get('max'))}"],
         ["checkpointless", common.fmt(s["checkpointless_s"].get("median")),
          f"{common.fmt(s['checkpointless_s'].get('min'))}-{common.fmt(s['checkpointless_s'].get('max'))}"]],
    )  # fmt: skip
    r = s["ratio"]
    return (
        f"Model: {res['model']}, 4 workers. Kills: every {EVERY} steps, the rank rotating, 2 hot spares.\n\n"
        + kill
        + "\n\n"
        + "".join(
            f"{text}\n\n"
            for r in res["kill"]
            if r.get("ok") and (text := split.describe(r.get("split") or [], f"checkpointless {r['layout']}"))
        )
        + (
            ""
            if ratio is None
            else f"Bytes moved per recovery, HSDP / DDP: **{ratio:.2f}** (1/shards = 0.50).\n\n"
        )
        + f"Steady state, {s['steps']} steps per run, first {s['warmup']} not counted, "
        f"{len(s['pairs'])} alternating pair(s):\n\n"
        + steady
        + "\n\n"
        + (
            ""
            if not r.get("n")
            else f"checkpointless / plain FSDP2, per pair: median **{r['median']:.3f}** "
            f"(min {r['min']:.3f}, max {r['max']:.3f}).\n"
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    res = run(a.quick, common.OUT)
    common.write_json(common.OUT / "hsdp.json", res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
