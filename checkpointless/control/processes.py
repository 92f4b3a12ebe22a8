"""The coordinator's process table: every process of the job as the coordinator sees it.

A process is reached through a ``ProcessHandle`` (the process backend: the local supervisor on one
host, a host's agent on several, ``launch/``) and seen through its ``ProcessView``: its role, its
latest verified heartbeat, when it last changed, whether the coordinator killed it. The table is
one object the coordinator holds and the backend reads (``heard_from``, ``is_worker``: where a
host's spares may go, whether a silent host's processes were heard from another way).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from checkpointless.protocol.vocab import Phase, Role


class ProcessHandle(Protocol):
    """What the coordinator needs of a process the backend started."""

    name: str
    host: str  # the host it runs on (its host agent's): the unit of failure and replacement
    relayed: bool
    """Its heartbeats and events come through its host's relay (``launch/relay.py``), not from the
    process itself: the coordinator reads its host's value, not its own keys."""

    @property
    def leaving(self) -> bool:
        """Its host is being drained (a notice): a spare there is given no rank."""
        ...

    @property
    def pid(self) -> int:
        """Its pid on its host (0 until known)."""
        ...

    def alive(self) -> bool: ...

    def kill(self) -> None: ...

    def exitcode(self) -> int | None:
        """The exit status once dead (negative: killed by that signal), else None."""
        ...

    def log_tail(self) -> str:
        """The last Python exception line of the process's output, else its last non-empty line
        ("" if none)."""
        ...

    def cpu_seconds(self) -> float | None:
        """The CPU time the process (and its descendants) has used so far, None where the caller
        cannot see it (another host, no ``/proc``)."""
        ...

    def cpu_age(self) -> float:
        """Seconds since ``cpu_seconds``'s figure was read (0 for a process read live; another
        host's process: since its agent's last status)."""
        ...


class ProcessBackend(Protocol):
    """Whatever owns the job's processes: the local supervisor (one host: ``launch/supervisor.py``)
    or the hosts' agents (several: ``launch/remote.py``). The coordinator and the launcher ask;
    the backend does, and its handles report what happened (a kill is confirmed by the exit)."""

    @property
    def children(self) -> Mapping[str, ProcessHandle]:
        """Every process it started, by name (dead ones too)."""
        ...

    @property
    def spares(self) -> Sequence[str]:
        """Every spare it started, by name, in order."""
        ...

    def start_job(self) -> tuple[Sequence[ProcessHandle], Sequence[ProcessHandle]]:
        """Start the job's workers (rank order) and spares (on several hosts: once the hosts'
        agents joined); both lists of handles."""
        ...

    def spawn_spare(self) -> ProcessHandle | None:
        """Start one more spare; None when no host has a free slot."""
        ...

    def probe(self, names: list[str]) -> None:
        """Ask for a sign of life of these processes' hosts (the coordinator waits for them)."""
        ...

    def refresh(self) -> Sequence[ProcessHandle]:
        """Take in the hosts' news; the spares started meanwhile (a lost host came back and serves
        as a spare host) for the coordinator's pool."""
        ...

    def wait_exit(self, handle: ProcessHandle, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for ``handle``'s process to exit (it may not)."""
        ...

    def usage(self, local: Callable[[], dict[str, Any]]) -> dict[str, tuple[dict[str, Any], list[str]]]:
        """Each host's latest usage sample (``local()`` samples this host) and its processes."""
        ...

    def log_paths(self) -> dict[str, Path]:
        """Where each process's log is, where the launcher's host can name it."""
        ...

    def stop(self) -> None:
        """Stop every process (politely, then by force) and wait for them."""
        ...

    def close(self) -> None:
        """Free what outlives the processes on this host (the node's batch cache)."""
        ...


@dataclass
class ProcessView:
    """One process as the coordinator sees it."""

    handle: ProcessHandle
    role: Role
    raw_hb: bytes = b""
    hb: dict[str, Any] = field(default_factory=dict)
    last_change: float = 0.0
    phase_since: float = 0.0  # when (phase, attempt) last changed
    started: float = 0.0
    killed: bool = False
    was_ready: bool = False  # a spare that reached its waiting phase
    cpu_mark: tuple[float, float] | None = None  # (when, CPU seconds) sampled while it is silent
    busy: bool | None = None  # silent, and it used CPU in the last sampled window (None: not sampled)
    read_since: float = 0.0  # the coordinator's wall clock when the last read of its heartbeat began
    forgiven: float = 0.0  # the coordinator's stalls credited to its silence since its last heartbeat

    @property
    def joined(self) -> bool:
        """The process has sent a (valid) heartbeat: it runs a ``Session``."""
        return bool(self.raw_hb)

    @property
    def live(self) -> bool:
        """Not gone: it holds a rank or waits as a spare."""
        return self.role != Role.GONE

    def heard(self, hb: dict[str, Any], raw: bytes, now: float) -> None:
        """A new verified heartbeat: the silence clocks start again."""
        if (hb.get("phase"), hb.get("attempt")) != (self.hb.get("phase"), self.hb.get("attempt")):
            self.phase_since = now
        self.raw_hb, self.last_change, self.hb = raw, now, hb
        self.cpu_mark, self.busy, self.forgiven = None, None, 0.0

    def reading(self, began: float) -> float:
        """A read of its heartbeat begins at ``began`` (the coordinator's wall clock); when the
        previous one began (a new heartbeat was written after that)."""
        after, self.read_since = self.read_since, began
        return after

    def sampled(self, cpu_mark: tuple[float, float] | None, busy: bool | None) -> None:
        """The CPU samples of its silence, as the hang rule's verdict has them (``detection.hung``)."""
        self.cpu_mark, self.busy = cpu_mark, busy

    def forgive(self, credit: float, now: float) -> None:
        """The coordinator's own stall: ``credit`` seconds of its silence are not counted (its CPU
        samples start again)."""
        self.last_change = min(now, self.last_change + credit)
        self.forgiven += credit
        self.cpu_mark, self.busy = None, None

    def spare_ready(self) -> None:
        """A spare reached its waiting phase (its heartbeat says so)."""
        self.was_ready = True

    def kill(self) -> None:
        """The coordinator kills it: marked killed, and its backend asked to kill it."""
        self.killed = True
        self.handle.kill()

    def assign(self) -> None:
        """It holds a rank from now on (a spare that replaces a rank or grows the job)."""
        self.role = Role.WORKER

    def retire(self) -> Role:
        """It is gone from the job (it exited, or a new plan replaced or dropped it): its role until now."""
        role, self.role = self.role, Role.GONE
        return role


class ProcessTable:
    """Every process of the job by name (see the module docstring)."""

    def __init__(self) -> None:
        self.procs: dict[str, ProcessView] = {}

    def add(self, handle: ProcessHandle, role: Role, now: float) -> ProcessView:
        view = ProcessView(handle, role, last_change=now, started=now, read_since=time.time())
        self.procs[handle.name] = view
        return view

    def __getitem__(self, name: str) -> ProcessView:
        return self.procs[name]

    def __contains__(self, name: object) -> bool:
        return name in self.procs

    def get(self, name: str) -> ProcessView | None:
        return self.procs.get(name)

    def live(self) -> list[tuple[str, ProcessView]]:
        return [(n, p) for n, p in self.procs.items() if p.live]

    def ready_spares(self) -> list[str]:
        """Spares waiting for a rank (their heartbeat says so), alive, on a host not being drained."""
        return [
            n for n, p in self.procs.items()
            if p.role == Role.SPARE and not p.killed and p.hb.get("phase") == Phase.SPARE and not p.handle.leaving
            and p.handle.alive()
        ]  # fmt: skip

    def live_spares(self) -> list[str]:
        """Spares alive, ready or still starting."""
        return [n for n, p in self.procs.items() if p.role == Role.SPARE and p.handle.alive()]

    def announced_chunks(self) -> dict[str, int]:
        """How many event chunks each live process's last heartbeat says it has written (the
        processes that write their own: a relayed one's come with its host's)."""
        return {
            n: int(p.hb["chunks"]) for n, p in self.procs.items()
            if p.live and "chunks" in p.hb and not p.handle.relayed
        }  # fmt: skip

    def clock_of(self, name: str) -> str:
        """The name a process's clock offset is kept under: its host's, when its agent relays."""
        p = self.procs.get(name)
        return p.handle.host if p is not None and p.handle.relayed else name

    def heard_from(self, name: str) -> float:
        """When the coordinator last heard from process ``name`` (its clock; -inf: never)."""
        p = self.procs.get(name)
        return p.last_change if p is not None else float("-inf")

    def is_worker(self, name: str) -> bool:
        """Whether process ``name`` holds a rank."""
        p = self.procs.get(name)
        return p is not None and p.role == Role.WORKER
