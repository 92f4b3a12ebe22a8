"""Checkpoint-and-restart the torchrun way: DDP + ``torch.distributed.checkpoint`` (DCP) + torchrun restarts.

This file is both

- the training script (``--worker``) that ``python -m torch.distributed.run --nproc-per-node 2
  --max-restarts K`` starts on every rank: it resumes from the newest complete DCP checkpoint
  (model + optimizer + step; the data position is the step, since a batch is a pure function
  of the step), saves one every ``every`` steps, and on the first attempt only (marker file)
  SIGKILLs itself on ``kill_rank`` at ``kill_step`` (after the forward pass, before the
  backward pass and its gradient all-reduce: the same point checkpointless' ``kill`` fault
  fires at);
- the driver (``run``) that starts torchrun, optionally kills rank 1 every ``kill_every_s``
  seconds from outside, stops a time-limited run, and ends every process it started.

torchrun has no survivors: when one worker dies it stops the others and restarts the whole
group, which reloads the checkpoint and redoes the steps after it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench.baselines import (
    PYTHON,
    WORLD,
    PeriodicKiller,
    RunResult,
    StepLog,
    build,
    child_env,
    current_pid,
    digest,
    end_group,
    first_commit_time,
    reseed,
    spec_from_json,
    spec_to_json,
    start,
)

SYSTEM = "torchrun"
ENDLESS = 10**9


# -- the training script ------------------------------------------------------------
def _ckpt_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step-{step:09d}"


def latest_checkpoint(ckpt_dir: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint (DCP writes ``.metadata`` last, on the coordinator)."""
    best: tuple[int, Path] | None = None
    if not ckpt_dir.is_dir():
        return None
    for p in ckpt_dir.glob("step-*"):
        if (p / ".metadata").exists():
            s = int(p.name.split("-")[1])
            if best is None or s > best[0]:
                best = (s, p)
    return best


def _state(ddp: Any, opt: Any, step: int) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(ddp, opt)
    return {"model": msd, "optim": osd, "progress": {"step": torch.tensor(step, dtype=torch.int64)}}


def save(ddp: Any, opt: Any, step: int, ckpt_dir: Path, rank: int) -> float:
    """Collective DCP save of the state *before* ``step``; rank 0 keeps only the two newest."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    dcp.save(_state(ddp, opt, step), checkpoint_id=str(_ckpt_path(ckpt_dir, step)))
    seconds = time.perf_counter() - t0
    if rank == 0:
        done = sorted(p for p in ckpt_dir.glob("step-*") if (p / ".metadata").exists())
        for old in done[:-2]:
            shutil.rmtree(old, ignore_errors=True)
    return seconds


def load(ddp: Any, opt: Any, path: Path) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(ddp, opt, 0)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(ddp, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["progress"]["step"])


def worker(cfg: dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run_dir, ckpt_dir = Path(cfg["run_dir"]), Path(cfg["ckpt_dir"])
    log = StepLog(run_dir, rank, SYSTEM)
    log.write("start", attempt=attempt)
    spec = spec_from_json(cfg["spec"])
    steps, every = int(cfg["steps"]), int(cfg["every"])
    kill_step, kill_rank = cfg.get("kill_step"), int(cfg.get("kill_rank", 1))
    marker = run_dir / "killed-once"

    # Explicit per-attempt prefix: with the agent's store shared across restarts, a restarted
    # rank 1 that starts before rank 0 can read rank 0's gloo address from the previous attempt
    # and fail with "Connection refused" (seen with torch 2.13 + torchrun --standalone).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    prefixed = dist.PrefixStore(f"/bench/attempt_{attempt}", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world)
    model, opt, data = build(spec)
    ddp = DDP(model)
    step0, source = 0, "init"
    latest = latest_checkpoint(ckpt_dir)
    if latest is not None:
        t0 = time.perf_counter()
        step0 = load(ddp, opt, latest[1])
        source = "checkpoint"
        log.write("loaded", step=step0, seconds=time.perf_counter() - t0)
    log.write("resume", step=step0, source=source)
    step = step0
    for step in range(step0, steps):
        reseed(spec.seed, step, rank)
        inputs, targets = data.batch(step, rank, world)
        loss = ddp(inputs, targets)
        if kill_step is not None and step == int(kill_step) and rank == kill_rank and not marker.exists():
            marker.write_text(str(os.getpid()))
            log.write("fault", step=step, how="self")
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        log.write("commit", step=step, batch=[step, rank, world], loss=round(float(loss.item()), 5))
        if every > 0 and (step + 1) % every == 0 and step + 1 < steps:
            seconds = save(ddp, opt, step + 1, ckpt_dir, rank)
            log.write("ckpt", step=step + 1, seconds=seconds)
    if steps < ENDLESS:
        log.write("final", step=steps - 1, digest=digest(model, opt, steps - 1))
    log.close()
    dist.barrier()  # both ranks done with every collective before either tears gloo down (else: SIGABRT)
    dist.destroy_process_group()
    return 0


# -- the driver ------------------------------------------------------------------------
def run(
    spec: Any,
    run_dir: Path,
    *,
    steps: int | None,
    every: int,
    kill_step: int | None = None,
    kill_rank: int = 1,
    max_restarts: int = 3,
    duration_s: float | None = None,
    kill_every_s: float = 0.0,
    timeout_s: float = 600.0,
) -> RunResult:
    """Run torchrun on this script: ``steps`` steps, or endless for ``duration_s`` after the first commit.

    With ``kill_every_s`` the current rank-1 process is SIGKILLed from outside every that many
    seconds after the first commit. Every process is ended before this returns.
    """
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    ckpt_dir = run_dir / "ckpt"
    cfg = {
        "spec": spec_to_json(spec),
        "run_dir": str(run_dir),
        "ckpt_dir": str(ckpt_dir),
        "steps": ENDLESS if steps is None else steps,
        "every": every,
        "kill_step": kill_step,
        "kill_rank": kill_rank,
    }
    cmd = [
        PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
        "--module", "bench.baselines.torchrun_dcp", "--worker", json.dumps(cfg),
    ]  # fmt: skip
    killer = PeriodicKiller(run_dir, kill_every_s, rank=1)
    t_start = time.time()
    proc = start(cmd, run_dir / "torchrun.out", child_env())
    error: str | None = None
    window: tuple[float, float] | None = None
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            rc = proc.poll()
            if rc is not None:
                if duration_s is not None:
                    error = f"torchrun exited early with {rc}"
                elif rc != 0:
                    error = f"torchrun exited with {rc}"
                break
            if time.monotonic() > deadline:
                error = f"timeout after {timeout_s:.0f}s"
                break
            if duration_s is not None:
                if killer.t0 is None:
                    killer.t0 = first_commit_time(run_dir)
                if killer.t0 is not None:
                    window = (killer.t0, killer.t0 + duration_s)
                    if time.time() >= window[1]:
                        break
                    killer.tick(lambda: current_pid(run_dir, 1, after=killer._last_kill))
            time.sleep(0.05)
    finally:
        end_group(proc)
        killer.close()
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return RunResult(
        SYSTEM, run_dir, error is None, time.time() - t_start, error,
        {"every": every, "max_restarts": max_restarts, "kills": killer.kills}, window,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help="worker config as JSON (set by the driver)")
    a = p.parse_args(argv)
    if a.worker:
        return worker(json.loads(a.worker))
    from checkpointless.launch.demo import DemoModel

    res = run(
        DemoModel(steps=40, eval_every=0),
        Path("bench/out/compare/torchrun-try"),
        steps=40,
        every=10,
        kill_step=25,
    )
    print(res)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
