"""In-process fault injection (the specs' grammar: ``fault_grammar.py``).

A fault is test infrastructure, not ad-hoc code (STYLE.md, 8): the schedule is
parsed once, handed to every process of the job, and fired by the process that
is hit, with a real signal (``SIGKILL``, ``SIGSTOP``) or a real exception, at a
fixed point inside the training step (just before the gradient reduction, when
the peers are already waiting in the collective: the worst moment).

The grammar of a spec (``--fault``, ``recovery.faults``) and its checks are ``fault_grammar.py``'s.

Every fault fires once: a replacement that re-executes the step is not hit again.
A fault that never fired (the script ran fewer steps than ``--steps``, no recovery
came) is named by :func:`unfired`: the launcher lists it in ``report.json``
(``unfired_faults``) and the command line fails the run.
Firing is claimed atomically in the control store per (fault, rank) for step faults,
per fault for recovery faults, so exactly one process fires it for each rank it names
(and a recovery fault fires in one recovery only).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from checkpointless.errors import InjectedFault
from checkpointless.fault_grammar import PER_RANK, FaultSpec
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event


def unfired(faults: list[FaultSpec], events: Iterable[dict[str, Any]]) -> list[str]:
    """The specs of ``faults`` that did not fire, from a job's events (the ``fault_injected`` events
    the processes emit as they fire a fault: ``index`` in the schedule, ``rank``).

    A fault that names ranks fired when it fired in each of them; a recovery fault, when it fired
    at all. In schedule order, each spec once.
    """
    fired: dict[int, set[int]] = {}
    for e in events:
        if e.get("kind") == Event.FAULT_INJECTED and isinstance(e.get("index"), int):
            fired.setdefault(e["index"], set()).add(e.get("rank", -1))
    out: list[str] = []
    for i, f in enumerate(faults):
        hit = fired.get(i)
        missed = hit is None or (f.at in PER_RANK and not set(f.ranks) <= hit)
        if missed and str(f) not in out:
            out.append(str(f))
    return out


class _Claimer(Protocol):
    def claim(self, key: str) -> bool: ...


class FaultInjector:
    """Fires scheduled faults inside one process.

    ``claim`` is an atomic "first one wins" on the control store, so a fault fires
    once per named rank per job, even though every process holds the whole
    schedule and a replacement re-executes the faulted step.
    """

    def __init__(
        self,
        faults: list[FaultSpec],
        claimer: _Claimer | None,
        *,
        node: int | None = None,
        agent_pid: int = 0,
    ) -> None:
        """``node``: this process's host in the job (``protocol.env.ENV_NODE``), ``agent_pid`` its
        agent's process: what a host fault kills."""
        self._faults = list(enumerate(faults))
        self._claimer = claimer
        self._node, self._agent_pid = node, agent_pid

    def _fire(
        self,
        index: int,
        fault: FaultSpec,
        on_fire: _OnFire | None,
        rank: int,
        step: int,
        corrupt: Callable[[], None] | None = None,
    ) -> None:
        # A step fault fires once per rank it names; a recovery fault once per job, whichever
        # recovery comes first (never again in a later one).
        who = rank if fault.at in PER_RANK and fault.node is None else -1
        if self._claimer is None or not self._claimer.claim(keys.fault_fired(index, who)):
            return
        if on_fire is not None:
            on_fire(index, fault, rank, step)
        if fault.node is not None or fault.kind == "partition":  # the host's relay goes: its events first
            drain = getattr(self._claimer, "drain", None)
            if drain is not None:
                drain(2.0)
        if fault.kind == "partition":
            _cut_host_off(fault.duration)
            return  # this process lives on, cut off: its lease and its host's fence end it
        if fault.node is not None and self._agent_pid > 0 and fault.kind != "preempt":
            # the host's agent first: every other process of the host dies with it (the agent
            # starts them with PR_SET_PDEATHSIG), then this one, as a power loss takes them all
            os.kill(self._agent_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "preempt":
            assert fault.duration is not None
            _preempt(fault.duration, self._agent_pid if fault.node is not None else os.getpid())
        elif fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "corrupt":
            if corrupt is None:
                raise InjectedFault(f"injected fault {fault} on rank {rank}: nothing to corrupt here")
            corrupt()
        else:
            raise InjectedFault(f"injected fault {fault} on rank {rank}")

    def at_step(
        self,
        rank: int,
        step: int,
        on_fire: _OnFire | None = None,
        corrupt: Callable[[], None] | None = None,
    ) -> None:
        """Called by a worker inside step ``step``, before the gradient reduction; ``corrupt``
        flips a bit of its state (the ``corrupt`` kind)."""
        for i, f in self._faults:
            if (
                f.at == "step"
                and f.step == step
                and (rank in f.ranks or (f.node is not None and f.node == self._node))
            ):
                self._fire(i, f, on_fire, rank, step, corrupt)

    def at_check(self, rank: int, step: int, on_fire: _OnFire | None = None, *, at: str = "check") -> None:
        """Called by a worker at the consistency check before step ``step``: ``check`` before the
        replicas exchange digests, ``digests`` after they found a difference, before they publish
        the per-entry digests that name it."""
        for i, f in self._faults:
            if f.at == at and f.step == step and rank in f.ranks:
                self._fire(i, f, on_fire, rank, step)

    def at_recovery(
        self, rank: int, step: int, on_fire: _OnFire | None = None, *, at: str = "recovery"
    ) -> None:
        """Called at a moment ``at`` of a recovery: ``"recovery"`` by a replacement receiving
        state, ``"join"`` by a replacement before its group forms, ``"source"`` by a sender."""
        for i, f in self._faults:
            if f.at == at:
                self._fire(i, f, on_fire, rank, step)


def _preempt(notice: float, pid: int) -> None:
    """A preemption notice: SIGTERM to ``pid`` (this process, or its host's agent) now, SIGKILL
    ``notice`` seconds later from a process of its own (what a cloud or a cluster's scheduler
    does), which this one ends if it exits first."""
    import atexit
    import subprocess

    killer = subprocess.Popen(["sh", "-c", f"sleep {notice:g}; kill -9 {pid}"], start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    atexit.register(_end_group, killer)
    os.kill(pid, signal.SIGTERM)


def _end_group(p: Any) -> None:
    """End a process started in a session of its own, and its children (a shell's ``sleep``)."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=5)


def _cut_host_off(duration: float | None) -> None:
    """Take this host's interface (``GLOO_SOCKET_IFNAME``, which its agent set) down, and up again
    after ``duration`` seconds, from a process of its own (this one will not outlive the cut)."""
    import shutil
    import subprocess

    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if not ifname or ifname == "lo" or shutil.which("ip") is None:
        raise InjectedFault(
            "a partition fault needs a host of its own (checkpointless cluster, or an agent's --addr)"
        )
    # down before this step goes on (a detached ``ip`` raced the step's own reduction, which could
    # still complete and commit the step), up again later from a process of its own
    subprocess.run(["ip", "link", "set", ifname, "down"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=10, check=False)  # fmt: skip
    if duration is not None:
        subprocess.Popen(["sh", "-c", f"sleep {duration:g}; ip link set {ifname} up"], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


class _OnFire(Protocol):
    def __call__(self, index: int, fault: FaultSpec, rank: int, step: int) -> None: ...
