"""Cost of the replica consistency check (``RecoveryConfig.consistency_every``) per training step.

The check hashes every replica's registered state (BLAKE3 per tensor, in the transfer's thread
pool; ``state.entry_digests``) and all-gathers one 32-byte digest. Its cost per step at interval
K is ``check_s / (K x step_s)``. This benchmark times ``check_s`` in one process on the model and
optimizer state of two sizes (the 10.9M-parameter model of ``steady_state`` and the 126.6M one of
``large_state``, AdamW state after one step), single-threaded torch like every worker, ``reps``
times each, and takes the step time of the same model from the last ``steady_state`` /
``large_state`` results in ``bench/results/`` (a measured step, not an assumed one). The 32-byte
all-gather is not timed here (a few hundred microseconds on loopback gloo); the hashing is the cost.

Usage: ``python -m bench.consistency [--quick]`` -> ``bench/out/consistency.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import common

SIZES: dict[str, dict[str, int]] = {
    "10.9M params": {"vocab_size": 256, "d_model": 384, "n_layer": 6, "n_head": 6, "global_batch": 8},
    "126.6M params": {"vocab_size": 256, "d_model": 1024, "n_layer": 10, "n_head": 16, "seq_len": 64,
                      "global_batch": 2},
}  # fmt: skip


def _step_time(key: str) -> float | None:
    """The measured step time of the same model in the committed results (None if absent)."""
    path = common.RESULTS / ("steady_state.json" if key.startswith("10.9M") else "large_state.json")
    if not path.is_file():
        return None
    res = json.loads(path.read_text())
    if key.startswith("10.9M"):
        value = res.get("summary", {}).get("checkpointless", {}).get("interval", {}).get("median")
        return float(value) if value else None
    rows = [r for r in res.get("rows", []) if r.get("system") == "checkpointless"]
    return float(rows[0]["step_time_s"]) if rows and rows[0].get("step_time_s") else None


def run(quick: bool, out: Path) -> dict[str, Any]:
    common.pin_threads()
    import torch

    from checkpointless.config import RecoveryConfig
    from checkpointless.launch.demo import DemoModel, build
    from checkpointless.state import combined_digest, entry_digests

    every = RecoveryConfig().consistency_every
    reps = 3 if quick else 7
    rows = []
    for key, fields in SIZES.items():
        model, opt, data = build(replace(DemoModel(steps=1, eval_every=0), **fields))
        x, y = data.batch(0, 0, 1)
        model(x, y).backward()
        opt.step()  # AdamW's moments exist, as on a replica mid-run
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        nbytes = sum(t.numel() * t.element_size() for t in (*model.state_dict().values(),))
        nbytes += sum(
            v.numel() * v.element_size()
            for s in opt.state_dict()["state"].values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            combined_digest(entry_digests(state))
            times.append(time.perf_counter() - t0)
        check_s = statistics.median(times)
        step_s = _step_time(key)
        rows.append(
            {
                "model": key,
                "state_bytes": nbytes,
                "check_s": check_s,
                "check_range_s": [min(times), max(times)],
                "gbps": nbytes / check_s / 1e9,
                "step_s": step_s,
                "every": every,
                "overhead": check_s / (every * step_s) if step_s else None,
            }
        )
        del model, opt, state
    return {"quick": quick, "reps": reps, "every": every, "rows": rows, "machine": common.machine_info()}


def markdown(res: dict[str, Any]) -> str:
    table = common.md_table(
        ["model", "state MB", "check s (median)", "range s", "GB/s", "step s (measured)",
         f"overhead per step at every {res['every']}"],
        [
            [r["model"], f"{r['state_bytes'] / 1e6:.0f}", common.fmt(r["check_s"], 4),
             f"{r['check_range_s'][0]:.4f}-{r['check_range_s'][1]:.4f}", common.fmt(r["gbps"], 2),
             common.fmt(r["step_s"]), "–" if r["overhead"] is None else f"{100 * r['overhead']:.2f}%"]
            for r in res["rows"]
        ],
    )  # fmt: skip
    return (
        f"Median of {res['reps']} checks per size, one process, one torch thread (the hash pool's threads "
        "run BLAKE3 in parallel). Step times: the checkpointless step of the same model in this page's "
        "steady-state and 1.5 GB sections.\n\n" + table + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    res = run(a.quick, common.OUT)
    common.write_json(common.OUT / "consistency.json", res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
