"""Helpers for integration tests: run a real job of real processes and compare to a fault-free run."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from pathlib import Path

from checkpointless.config import JobConfig, RecoveryConfig
from checkpointless.control.coordinator import Coordinator
from checkpointless.fault_grammar import parse_faults
from checkpointless.launch.demo import DemoModel, worker_command
from checkpointless.launch.launcher import JobResult, Launcher

COMMITTED = re.compile(r'"kind": "steps?_committed"')
"""A commit in ``events.jsonl``'s text: a rank's, or a host's packed ones (``observe.fields.commits``)."""

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
    shards: int = 1,
    steps: int = 10,
    faults: list[str] | None = None,
    out: Path | None = None,
    hang_timeout_s: float = RecoveryConfig().hang_timeout_s,
    progress_timeout_s: float = 60.0,
    spare_restart_limit: int = 3,
    spare_start_nice: int = 0,
    consistency_every: int = RecoveryConfig().consistency_every,
    durable_every: int = 0,
    durable_dir: Path | None = None,
    timeout_s: float = 150.0,
    command: list[str] | None = None,
    global_batch: int | None = None,
    on_tick: Callable[[Coordinator], None] | None = None,
    launcher: list[Launcher] | None = None,
    expect_fired: bool = True,
    shares: int = 0,
    min_workers: int = 0,
    max_workers: int = 0,
    resize_interval_s: float = 600.0,
    exact_resize: bool = False,
    never_wait: bool = False,
) -> JobResult:
    """Run a tiny demo job (or ``command``); ``launcher`` receives the Launcher before it runs.

    ``resize_interval_s`` is long by default: an elastic job that shrank does not grow back (a test
    of growth sets it). With ``expect_fired`` (the default), a job that ran to the end must show every injected fault
    firing: a test of recovery cannot pass because its fault never struck.
    """
    recovery = RecoveryConfig(
        hang_timeout_s=hang_timeout_s,
        progress_timeout_s=progress_timeout_s,
        collective_timeout_s=30.0,
        plan_timeout_s=60.0,
        spare_restart_limit=spare_restart_limit,
        spare_start_nice=spare_start_nice,
        consistency_every=consistency_every,
        durable_every=durable_every,
        durable_dir=None if durable_dir is None else str(durable_dir),
        shares=shares,
        min_workers=min_workers,
        max_workers=max_workers,
        resize_interval_s=resize_interval_s,  # by default no elastic job grows back before it ends
        exact_resize=exact_resize,
        never_wait=never_wait,
    )
    job = JobConfig(
        workers=workers, spares=spares, shards=shards, faults=parse_faults(faults or []), recovery=recovery
    )
    spec = {**TINY, "global_batch": global_batch or TINY["global_batch"]}
    cmd = command or worker_command(DemoModel(steps=steps, **spec))  # type: ignore[arg-type]
    runner = Launcher(job, cmd, total_steps=steps, out_dir=out, timeout_s=timeout_s, on_tick=on_tick)
    if launcher is not None:
        launcher.append(runner)
    result = runner.run()
    if expect_fired and result.ok:
        assert injected_fired(result) == sorted(set(faults or [])), (faults, result.report["faults"])
    return result


def injected_fired(result: JobResult) -> list[str]:
    """The specs of the injected faults that actually fired (from the processes' own events)."""
    return sorted({str(f["spec"]) for f in result.report["faults"] if f.get("injected")})


@functools.cache
def reference_digest(workers: int, steps: int, global_batch: int | None = None) -> str:
    """Final state of the fault-free run of this shape (computed once per test session)."""
    result = run_job(workers=workers, spares=0, steps=steps, global_batch=global_batch)
    assert result.ok, result.error
    assert result.digest
    return result.digest


def logs_of(result: JobResult) -> str:
    parts = []
    for name, path in sorted(result.logs.items()):
        if path.exists():
            parts.append(f"--- {name}\n{path.read_text()[-3000:]}")
    return "\n".join(parts)


def kill_while_starting(
    proc: str, launcher: list[Launcher], killed: list[str]
) -> Callable[[Coordinator], None]:
    """An ``on_tick`` that SIGKILLs ``proc`` once, while it starts (before it joins the job);
    ``launcher`` is the list ``run_job`` puts its Launcher in, ``killed`` records the kill."""

    def tick(coord: Coordinator) -> None:
        p = coord.procs.get(proc)
        if not killed and p is not None and not p.joined:
            launcher[0].children[proc].popen.kill()
            killed.append(proc)

    return tick


HELD = Path(__file__).resolve().parent / "scripts" / "held.py"


def held(command: list[str], at: int, release: Path) -> list[str]:
    """``command`` (``python SCRIPT ...`` or ``python -m MODULE ...``) with every member waiting
    before step ``at`` until ``release`` exists (tests/scripts/held.py)."""
    return [command[0], str(HELD), "--at", str(at), "--release", str(release), "--", *command[1:]]


def abort_once_at(step: int, aborted: list[int], release: Path) -> Callable[[Coordinator], None]:
    """An ``on_tick`` that makes the coordinator abort generation 0 once every member committed
    ``step``, with no fault among them: what a lost host's detection publishes while the
    members' collectives still work (``aborted`` records the generation). Run the command
    ``held(command, step + 1, release)``: the members wait there, so the abort strikes
    mid-run whatever the machine's speed, and go on once it is published."""

    def tick(coord: Coordinator) -> None:
        if aborted or coord.plan is None or coord.plan.gen != 0:
            return
        if all(int(coord.procs[n].hb.get("committed", -1)) >= step for n in coord.members.values()):
            coord.fail(time.monotonic())
            aborted.append(coord.plan.gen)
            release.touch()

    return tick


def assert_left_in_place(result: JobResult) -> None:
    """The job went on after an abort with the same processes: one more generation, no fault,
    nobody exited or replaced."""
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.report["generations"] == 1 and result.report["faults"] == [], result.report["faults"]
    kinds = [e["kind"] for e in result.events]
    assert "process_exited" not in kinds and "spare_assigned" not in kinds


def pids_whose_command(matches: Callable[[str], bool]) -> list[int]:
    """Pids of the live processes whose command line (arguments joined by spaces) ``matches``."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if matches(cmd):
                pids.append(int(d.name))
    return pids
