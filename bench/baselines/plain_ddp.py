"""Plain DDP, no fault tolerance: the steady-state reference every system is compared with.

Two processes started directly (``init_process_group`` over a ``TCPStore`` on a free port),
``torch.nn.parallel.DistributedDataParallel`` over gloo, no checkpoints, no launcher agent. It
logs the common JSONL format (``baselines.StepLog``) like every other system.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.baselines import (
    PYTHON,
    WORLD,
    RunResult,
    StepLog,
    build,
    child_env,
    digest,
    end_group,
    first_commit_time,
    free_port,
    reseed,
    spec_from_json,
    spec_to_json,
    start,
)

SYSTEM = "plain_ddp"
ENDLESS = 10**9


def worker(cfg: dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log = StepLog(Path(cfg["run_dir"]), rank, SYSTEM)
    log.write("start", attempt=0)
    spec = spec_from_json(cfg["spec"])
    steps = int(cfg["steps"])
    dist.init_process_group("gloo")
    model, opt, data = build(spec)
    ddp = DDP(model)
    log.write("resume", step=0, source="init")
    for step in range(steps):
        reseed(spec.seed, step, rank)
        inputs, targets = data.batch(step, rank, world)
        loss = ddp(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        log.write("commit", step=step, batch=[step, rank, world], loss=round(float(loss.item()), 5))
    if steps < ENDLESS:
        log.write("final", step=steps - 1, digest=digest(model, opt, steps - 1))
    log.close()
    dist.barrier()  # both ranks done with every collective before either tears gloo down
    dist.destroy_process_group()
    return 0


def run(
    spec: Any, run_dir: Path, *, steps: int | None, duration_s: float | None = None, timeout_s: float = 600.0
) -> RunResult:
    """``steps`` steps, or endless for ``duration_s`` seconds after the first commit."""
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg = {"spec": spec_to_json(spec), "run_dir": str(run_dir), "steps": ENDLESS if steps is None else steps}
    port = free_port()
    procs = []
    t_start = time.time()
    error: str | None = None
    window: tuple[float, float] | None = None
    try:
        for rank in range(WORLD):
            env = child_env(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )  # fmt: skip
            cmd = [PYTHON, "-m", "bench.baselines.plain_ddp", "--worker", json.dumps(cfg)]
            procs.append(start(cmd, run_dir / f"rank{rank}.out", env))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                if duration_s is not None or any(c != 0 for c in codes):
                    error = f"workers exited with {codes}"
                break
            if any(c not in (None, 0) for c in codes):
                error = f"a worker failed: {codes}"
                break
            if time.monotonic() > deadline:
                error = f"timeout after {timeout_s:.0f}s"
                break
            if duration_s is not None:
                t0 = window[0] if window else first_commit_time(run_dir)
                if t0 is not None:
                    window = (t0, t0 + duration_s)
                    if time.time() >= window[1]:
                        break
            time.sleep(0.05)
    finally:
        for p in procs:
            end_group(p)
    return RunResult(SYSTEM, run_dir, error is None, time.time() - t_start, error, {}, window)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worker", help="worker config as JSON (set by the driver)")
    a = p.parse_args(argv)
    if a.worker:
        return worker(json.loads(a.worker))
    from checkpointless.launch.demo import DemoModel

    print(run(DemoModel(steps=30, eval_every=0), Path("bench/out/compare/plain-try"), steps=30))
    return 0


if __name__ == "__main__":
    sys.exit(main())
