"""Where the time of a kill goes: a checkpointless job's own fault-free rate against the same job
with rank 1 SIGKILLed every ``interval`` seconds, split into the survivors' stall and the rest.

A kill costs ``window x (1 - faulted rate / fault-free rate) / kills`` seconds of training. The
stall (kill -> every rank commits again) is part of it; the remainder is the slowdown after the
recovery: the refilled spare's start-up (importing torch, building the model) competing with the
workers for the cores. ``RecoveryConfig.spare_start_nice`` can start spares niced so that start-up
takes only the CPU training leaves idle; this benchmark runs both settings, interleaved, ``reps``
times, and reports when the refilled spare was ready.

Usage: ``python -m bench.kill_cost [--quick] [--reps N] [--window S] [--interval S]``
-> ``bench/out/kill_cost/kill_cost.json`` (+ markdown for docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench import common, compare
from checkpointless.config import RecoveryConfig
from checkpointless.protocol.vocab import Event

OUT = common.OUT / "kill_cost"
SETTINGS = {"nice 0 (default)": 0, "nice 10": 10}


def run(reps: int, window_s: float, interval_s: float, out: Path) -> dict[str, Any]:
    out = common.fresh_dir(out)
    spec = compare.model_spec(100)
    jobs: list[dict[str, Any]] = []
    for rep in range(reps):  # interleaved: a drift in machine load hits every cell alike
        for label, nice in SETTINGS.items():
            recovery = RecoveryConfig(spare_start_nice=nice)
            for faulted in (False, True):
                name = f"r{rep}-nice{nice}-{'kill' if faulted else 'free'}"
                info = compare.one(
                    "checkpointless", name, out, jobs, label=label, interval_s=interval_s if faulted else None,
                    spec=spec, steps=None, duration_s=window_s, kill_every_s=interval_s if faulted else 0.0,
                    timeout_s=window_s + 300, recovery=recovery,
                )  # fmt: skip
                info["nice"], info["faulted"], info["rep"] = nice, faulted, rep
                info["refill_s"] = refill_times(out / name / "job" / "events.jsonl")
    return {"reps": reps, "window_s": window_s, "interval_s": interval_s, "machine": common.machine_info(),
            "jobs": jobs, "cells": cells(jobs, window_s)}  # fmt: skip


def refill_times(events_path: Path) -> list[float]:
    """Seconds from each spare's assignment (the pool refills at once) to the next spare's readiness."""
    try:
        events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    except OSError:
        return []
    events.sort(key=lambda e: e["t"])
    out = []
    for e in events:
        if e["kind"] == Event.SPARE_ASSIGNED:
            ready = next((r["t"] for r in events if r["kind"] == Event.SPARE_READY and r["t"] > e["t"]), None)
            if ready is not None:
                out.append(ready - e["t"])
    return out


def cells(jobs: list[dict[str, Any]], window_s: float) -> list[dict[str, Any]]:
    """Per setting: goodput against its own fault-free rate and seconds lost per kill, with spread."""
    out = []
    for label, nice in SETTINGS.items():
        ratios, per_kill, stalls, refills = [], [], [], []
        reps = sorted({j["rep"] for j in jobs if j["nice"] == nice})
        for rep in reps:
            free = next(j for j in jobs if j["nice"] == nice and j["rep"] == rep and not j["faulted"])
            kill = next(j for j in jobs if j["nice"] == nice and j["rep"] == rep and j["faulted"])
            r_free, r_kill = free["analysis"]["steps_per_s"], kill["analysis"]["steps_per_s"]
            kills = kill["extra"].get("kills") or 0
            if not (r_free and r_kill and kills):
                continue
            ratios.append(r_kill / r_free)
            per_kill.append(window_s * (1 - r_kill / r_free) / kills)
            stalls += [
                f["all_ranks_s"] for f in kill["analysis"]["faults"] if f.get("all_ranks_s") is not None
            ]
            refills += kill.get("refill_s", [])
        out.append({"setting": label, "nice": nice, "goodput_vs_own": common.summary(ratios),
                    "lost_s_per_kill": common.summary(per_kill), "stall_s": common.summary(stalls),
                    "refill_s": common.summary(refills)})  # fmt: skip
    return out


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"checkpointless alone, the demo model, 2 workers + 1 spare, a {res['window_s']:.0f} s window, rank 1 "
        f"SIGKILLed every {res['interval_s']:.0f} s, against the same setting's fault-free run of the same "
        f"window; {res['reps']} repetitions, interleaved. Median [min, max].",
        "",
        "| spares start at | goodput vs own fault-free | seconds lost per kill | of which stall (kill -> every rank commits) | refilled spare ready after s |",
        "|---|---|---|---|---|",
    ]
    for c in res["cells"]:
        g, k, s, f = c["goodput_vs_own"], c["lost_s_per_kill"], c["stall_s"], c["refill_s"]

        def cell(x: dict[str, Any], d: int = 3) -> str:
            return f"{x['median']:.{d}f} [{x['min']:.{d}f}, {x['max']:.{d}f}]" if x.get("n") else "–"

        lines.append(f"| {c['setting']} | {cell(g)} | {cell(k, 2)} | {cell(s, 2)} | {cell(f, 1)} |")
    base = res["cells"][0]
    if base["lost_s_per_kill"].get("n") and base["stall_s"].get("n"):
        lost, stall = base["lost_s_per_kill"]["median"], base["stall_s"]["median"]
        ready = base["refill_s"].get("median")
        lines += [
            "",
            f"Where the time goes (default setting): a kill costs {lost:.2f} s of training, of which "
            f"{stall:.2f} s is the survivors' stall; the other {max(0.0, lost - stall):.2f} s is lost while "
            f"the refilled spare starts"
            + (f" (ready {ready:.1f} s after the kill)" if ready is not None else "")
            + ": it imports torch and builds the model on the cores the two workers keep busy. Starting it "
            "niced spreads that CPU time over a longer start-up rather than removing it, and delays the "
            "refill; where workers leave CPU idle (GPU training) or spares have cores of their own, the "
            "start-up costs the workers nothing.",
        ]
    return "\n".join(lines) + "\n"


def run_bench(quick: bool, out: Path) -> dict[str, Any]:
    """Entry point for ``bench/run_all.py``: 2 repetitions of 40 s windows, a kill every 10 s (quick: 1 of 20 s)."""
    import os

    from bench import baselines

    common.pin_threads()
    os.environ.update(baselines.THREAD_ENV)
    return run(1 if quick else 2, 20.0 if quick else 40.0, 10.0, out / "kill_cost")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 repetitions of 60 s")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--window", type=float, default=120.0, help="seconds per job")
    p.add_argument("--interval", type=float, default=20.0, help="seconds between kills")
    args = p.parse_args(argv)
    reps, window = (2, 60.0) if args.quick else (args.reps, args.window)
    res = run(reps, window, args.interval, OUT)
    (OUT / "kill_cost.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (OUT / "kill_cost.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
