"""torchft (0.2.0) DDP: one replica group per worker, a lighthouse, failed groups restarted by the driver.

This file is both

- the training script (``--worker``): one process = one replica group of size 1 (its own
  ``TCPStore``), ``torchft.Manager`` (gloo ``ProcessGroupGloo``, ``min_replica_size=1``, the
  default asynchronous quorum, default HTTP checkpoint transport for healing) and
  ``torchft.DistributedDataParallel``. The step index comes from ``manager.current_step()``;
  the batch is ``SyntheticTokens.batch(step, replica_group, 2)``: while a group is down, the
  other keeps training alone on its own half of the global batch (torchft's design: the dead
  group's batches of those steps are dropped, which ``analyse`` reports as skipped). On the
  first attempt only (marker file), group ``kill_rank`` SIGKILLs itself at ``kill_step`` after
  the forward pass;
- the driver (``run``): starts the lighthouse (the ``torchft_lighthouse`` binary,
  ``--min_replicas 1``), starts both groups, restarts a group whose process died (that is the
  launcher's job in torchft), optionally SIGKILLs group 1 every ``kill_every_s`` seconds, and
  ends everything it started.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
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
    digest,
    end_group,
    first_commit_time,
    free_port,
    reseed,
    spec_from_json,
    spec_to_json,
    start,
)

SYSTEM = "torchft"
ENDLESS = 10**9


def available() -> str | None:
    """None when torchft imports and its lighthouse binary exists, else why not (the error text)."""
    try:
        import torchft  # noqa: F401
        from torchft import DistributedDataParallel, Manager, ProcessGroupGloo  # noqa: F401
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if not (Path(PYTHON).parent / "torchft_lighthouse").exists():
        return f"no torchft_lighthouse next to {PYTHON}"
    return None


def _ddp_class() -> Any:
    """``torchft.DistributedDataParallel`` with a comm hook that survives a failed all-reduce.

    torchft 0.2.0's hook does ``work.wait(); assert work.get_future()._fut``: when the peer
    died mid-all-reduce, ``wait()`` reports the error to the manager and returns False, the
    future was never chained, and the ``AssertionError`` escapes ``loss.backward()``, killing
    the *surviving* replica too (and after the first error the manager returns a
    ``_DummyWork`` whose future has no ``_fut`` at all). This hook does the same on success
    and, on failure, completes with the local buffer: ``should_commit()`` then returns False
    and the step is discarded, which is what the manager intends.
    """
    import torch
    from torchft import DistributedDataParallel

    class _DDP(DistributedDataParallel):  # type: ignore[misc]
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
            work = state.allreduce(bucket.buffer())
            if work.wait():
                fut = getattr(work.get_future(), "_fut", None)
                if fut is not None:
                    return fut
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return _DDP


def worker(cfg: dict[str, Any]) -> int:
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    group = int(os.environ["REPLICA_GROUP_ID"])
    attempt = int(os.environ.get("BENCH_ATTEMPT", "0"))
    run_dir = Path(cfg["run_dir"])
    log = StepLog(run_dir, group, SYSTEM)
    log.write("start", attempt=attempt)
    spec = spec_from_json(cfg["spec"])
    steps = int(cfg["steps"])
    kill_step, kill_rank = cfg.get("kill_step"), int(cfg.get("kill_rank", 1))
    fault_signal = signal.SIGSTOP if cfg.get("fault") == "hang" else signal.SIGKILL
    marker = run_dir / "killed-once"

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model, opt, data = build(spec)

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=cfg["pg_timeout_s"])),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"bench_{group}",
        timeout=timedelta(seconds=30),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=cfg["lighthouse"],
    )
    ddp = _ddp_class()(manager, model)
    if attempt == 0:  # both groups up before the first quorum (else group 0 starts alone)
        (run_dir / f"ready-{group}").touch()
        while not all((run_dir / f"ready-{g}").exists() for g in range(WORLD)):
            time.sleep(0.02)
    log.write("resume", step=None, source="quorum")
    while True:
        s_pre = manager.current_step()
        if s_pre >= steps:
            break
        opt.zero_grad(set_to_none=False)
        manager.start_quorum()  # asynchronous: overlaps the forward pass
        reseed(spec.seed, s_pre, group)
        inputs, targets = data.batch(s_pre, group, WORLD)
        loss = ddp(inputs, targets)
        if kill_step is not None and s_pre == int(kill_step) and group == kill_rank and not marker.exists():
            marker.write_text(str(os.getpid()))
            log.write("fault", step=s_pre, how="self")
            os.kill(os.getpid(), fault_signal)
        loss.backward()
        manager.wait_quorum()
        s = manager.current_step()  # a healing group jumps to the group it heals from
        participating = manager.is_participating() and s == s_pre
        participants = manager.num_participants()
        if manager.should_commit():
            opt.step()
            log.write(
                "commit", step=s, batch=[s_pre, group, WORLD], participating=participating,
                participants=participants, loss=round(float(loss.item()), 5),
            )  # fmt: skip
    if steps < ENDLESS:
        last = manager.current_step() - 1
        log.write("final", step=last, digest=digest(model, opt, last))
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)


def run(
    spec: Any,
    run_dir: Path,
    *,
    steps: int | None,
    kill_step: int | None = None,
    kill_rank: int = 1,
    fault: str = "kill",
    duration_s: float | None = None,
    kill_every_s: float = 0.0,
    heartbeat_timeout_ms: int = 2000,
    join_timeout_ms: int = 10000,
    pg_timeout_s: float = 5.0,
    max_restarts: int = 5,
    timeout_s: float = 600.0,
) -> RunResult:
    """Both replica groups for ``steps`` steps (or ``duration_s`` after the first commit); a dead
    group is restarted at once. ``fault="hang"`` stops group ``kill_rank`` at ``kill_step`` instead
    (SIGSTOP): the job ends when the other group has finished its steps alone. Every process is ended, and the lighthouse shut down, before return."""
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    port = free_port()
    lighthouse = start(
        [str(Path(PYTHON).parent / "torchft_lighthouse"), "--min_replicas", "1", "--bind", f"[::]:{port}",
         "--quorum_tick_ms", "100", "--join_timeout_ms", str(join_timeout_ms),
         "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)],
        run_dir / "lighthouse.out", child_env(),
    )  # fmt: skip
    cfg = {
        "spec": spec_to_json(spec),
        "run_dir": str(run_dir),
        "steps": ENDLESS if steps is None else steps,
        "kill_step": kill_step,
        "kill_rank": kill_rank,
        "fault": fault,
        "lighthouse": f"http://127.0.0.1:{port}",
        "pg_timeout_s": pg_timeout_s,
    }
    cmd = [PYTHON, "-m", "bench.baselines.torchft_ddp", "--worker", json.dumps(cfg)]
    killer = PeriodicKiller(run_dir, kill_every_s, rank=1)
    attempts = dict.fromkeys(range(WORLD), 0)
    procs: dict[int, Any] = {}
    done: set[int] = set()
    restarts = 0
    t_start = time.time()
    error: str | None = None
    window: tuple[float, float] | None = None

    def spawn(g: int) -> None:
        env = child_env(
            REPLICA_GROUP_ID=str(g), NUM_REPLICA_GROUPS=str(WORLD), BENCH_ATTEMPT=str(attempts[g])
        )
        procs[g] = start(cmd, run_dir / f"group{g}.out", env)

    try:
        for g in range(WORLD):
            spawn(g)
        deadline = time.monotonic() + timeout_s
        while len(done) < WORLD:
            if fault == "hang" and done and (run_dir / "killed-once").exists():
                for g in set(procs) - done:  # the stopped group: nothing in torchft ends it
                    end_group(procs[g], grace_s=0.0)
                    done.add(g)
                break
            for g, p in list(procs.items()):
                rc = p.poll()
                if rc is None or g in done:
                    continue
                if rc == 0:
                    done.add(g)
                else:  # the launcher restarts a failed replica group
                    p.wait()
                    if restarts >= max_restarts:
                        raise RuntimeError(f"group {g} failed {restarts + 1} times (last exit {rc})")
                    attempts[g] += 1
                    restarts += 1
                    spawn(g)
            if time.monotonic() > deadline:
                error = f"timeout after {timeout_s:.0f}s"
                break
            if duration_s is not None:
                if done:
                    error = "a group finished early"
                    break
                if killer.t0 is None:
                    killer.t0 = first_commit_time(run_dir)
                if killer.t0 is not None:
                    window = (killer.t0, killer.t0 + duration_s)
                    if time.time() >= window[1]:
                        break
                    p1 = procs[1]
                    killer.tick(lambda p1=p1: p1.pid if p1.poll() is None else None)
            time.sleep(0.05)
    except RuntimeError as e:
        error = str(e)
    finally:
        for p in procs.values():
            end_group(p, grace_s=2.0)
        killer.close()
        end_group(lighthouse, grace_s=2.0)
    return RunResult(
        SYSTEM, run_dir, error is None, time.time() - t_start, error,
        {"restarts": restarts, "kills": killer.kills, "heartbeat_timeout_ms": heartbeat_timeout_ms}, window,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help="worker config as JSON (set by the driver)")
    a = p.parse_args(argv)
    if a.worker:
        return worker(json.loads(a.worker))
    from checkpointless.launch.demo import DemoModel

    res = run(
        DemoModel(steps=40, eval_every=0), Path("bench/out/compare/torchft-try"), steps=40, kill_step=20
    )
    print(res)
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
