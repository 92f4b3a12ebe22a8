"""Helpers for integration tests: run a real job of real processes and compare to a fault-free run."""

from __future__ import annotations

import functools
from pathlib import Path

from checkpointless.config import JobConfig, RecoveryConfig
from checkpointless.demo import DemoModel, worker_command
from checkpointless.faults import parse_faults
from checkpointless.launch import JobResult, Launcher

TINY = {
    "vocab_size": 32,
    "seq_len": 16,
    "d_model": 32,
    "n_layer": 1,
    "n_head": 2,
    "global_batch": 12,
    "eval_every": 0,
}


def run_job(
    *,
    workers: int = 2,
    spares: int = 1,
    steps: int = 10,
    faults: list[str] | None = None,
    out: Path | None = None,
    hang_timeout_s: float = 2.0,
    timeout_s: float = 150.0,
    command: list[str] | None = None,
) -> JobResult:
    job = JobConfig(
        workers=workers,
        spares=spares,
        faults=parse_faults(faults or []),
        recovery=RecoveryConfig(
            hang_timeout_s=hang_timeout_s, collective_timeout_s=30.0, plan_timeout_s=60.0
        ),
    )
    cmd = command or worker_command(DemoModel(steps=steps, **TINY))  # type: ignore[arg-type]
    return Launcher(job, cmd, total_steps=steps, out_dir=out, timeout_s=timeout_s).run()


@functools.cache
def reference_digest(workers: int, steps: int) -> str:
    """Final state of the fault-free run of this shape (computed once per test session)."""
    result = run_job(workers=workers, spares=0, steps=steps)
    assert result.ok, result.error
    assert result.digest
    return result.digest


def logs_of(result: JobResult) -> str:
    parts = []
    for name, path in sorted(result.logs.items()):
        if path.exists():
            parts.append(f"--- {name}\n{path.read_text()[-3000:]}")
    return "\n".join(parts)
