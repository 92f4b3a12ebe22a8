"""Steady-state cost of every system against plain DDP, at two model sizes, no faults.

Each system (``plain_ddp``, ``checkpointless`` with one idle hot spare, ``torchrun`` + DCP
checkpointing every 50 steps, ``torchft``) trains the same model on the same data with world
size 2 for ``STEPS`` steps (quick: fewer); the step time is the median gap between consecutive
commits of one process (``baselines.analyse``), the first ``WARMUP`` steps' start-up included in
neither. The order of the systems alternates between the two sizes to spread the machine's
drifting load. Reported: median step time and its ratio to plain DDP of the same size.

Usage: ``python -m bench.steady_compare [--quick]`` -> ``bench/out/steady_compare.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import common, compare
from bench.baselines import THREAD_ENV, torchft_ddp

STEPS = 260
QUICK_STEPS = 60
SIZES: dict[str, dict[str, int]] = {
    "small (0.4M params)": {},  # compare.model_spec's defaults: d_model 128, 2 layers
    "10.9M params": {"vocab_size": 256, "d_model": 384, "n_layer": 6, "n_head": 6, "global_batch": 8},
}
SYSTEMS = ["plain_ddp", "checkpointless", "torchrun", "torchft"]


def run(quick: bool, out: Path) -> dict[str, Any]:
    common.pin_threads()
    os.environ.update(THREAD_ENV)
    steps = QUICK_STEPS if quick else STEPS
    dest = common.fresh_dir(out / "steady_compare")
    systems = [s for s in SYSTEMS if s != "torchft" or torchft_ddp.available() is None]
    jobs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    sizes = list(SIZES.items())[:1] if quick else list(SIZES.items())  # quick: the small model only
    for i, (size, overrides) in enumerate(sizes):
        spec = replace(compare.model_spec(steps), **overrides)
        order = systems if i % 2 == 0 else list(reversed(systems))
        by_system: dict[str, dict[str, Any]] = {}
        for system in order:
            kw: dict[str, Any] = {"every": 50, "max_restarts": 0} if system == "torchrun" else {}
            name = f"{system}-{i}"
            by_system[system] = compare.one(system, name, dest, jobs, spec=spec, steps=steps, **kw)
        base = by_system["plain_ddp"]["analysis"]["step_time_s"]
        for system in systems:
            a = by_system[system]["analysis"]
            rows.append(
                {
                    "size": size,
                    "system": system,
                    "ok": by_system[system]["ok"],
                    "steps": steps,
                    "step_time_s": a["step_time_s"],
                    "ratio_to_ddp": a["step_time_s"] / base if base else None,
                }
            )
    return {
        "quick": quick,
        "steps": steps,
        "systems": systems,
        "rows": rows,
        "machine": common.machine_info(),
    }


def markdown(results: dict[str, Any]) -> str:
    table = common.md_table(
        ["model", "system", "steps", "median step s", "vs plain DDP", "overhead"],
        [
            [
                r["size"], r["system"] + ("" if r["ok"] else " (FAILED)"), r["steps"], common.fmt(r["step_time_s"]),
                common.fmt(r["ratio_to_ddp"]),
                "–" if r["system"] == "plain_ddp" or r["ratio_to_ddp"] is None else f"{(r['ratio_to_ddp'] - 1) * 100:+.1f}%",
            ]
            for r in results["rows"]
        ],
    )  # fmt: skip
    return (
        f"{results['steps']} fault-free steps per system and size, world size 2, one run each "
        "(the order of the systems alternates between sizes). torchrun's step time includes its DCP "
        "checkpoint every 50 steps (as a median it mostly does not show: see its goodput above); "
        "checkpointless keeps one idle hot spare process.\n\n" + table + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    res = run(a.quick, common.OUT)
    common.write_json(common.OUT / "steady_compare.json", res)
    print(markdown(res))
    return 0 if all(r["ok"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
