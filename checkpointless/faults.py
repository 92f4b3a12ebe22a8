"""Fault specifications and in-process fault injection.

A fault is test infrastructure, not ad-hoc code (STYLE.md, 8): the schedule is
parsed once, handed to every process of the job, and fired by the process that
is hit, with a real signal (``SIGKILL``, ``SIGSTOP``) or a real exception, at a
fixed point inside the training step (just before the gradient reduction, when
the peers are already waiting in the collective: the worst moment).

Grammar of a spec (``--fault`` on the command line)::

    KIND:rank=R@step=S          KIND in kill | hang | exception | corrupt
    KIND:rank=R1,R2@step=S      several ranks at the same step
    kill:node=N@step=S          SIGKILL host N's agent and every process of that host at once, inside
                                step S (a power loss; ``checkpointless cluster`` and multi-host jobs)
    partition:node=N@step=S[,for=T]
                                cut host N off the network inside step S, its processes alive (its
                                interface down, as root in its network namespace), for T seconds or
                                for good; the host must fence itself (multi-host jobs)
    KIND:rank=R@check=S         KIND in kill | hang: at the replicas' consistency check before
                                step S, just before the digests are exchanged (the peers wait in
                                that collective); S is 1 or a multiple of recovery.consistency_every
    kill:spare@recovery         kill the spare that receives state in the next recovery
    kill:spare@join             kill the spare taking a rank before its generation's group forms
    kill:source@recovery        kill the survivor that sends state in the next recovery
    none                        no fault at all

``corrupt`` flips the lowest bit of the first element of the rank's first
parameter (silent data corruption: the process runs on, its replica now differs;
the replicas' consistency check finds it).

Every fault fires once: a replacement that re-executes the step is not hit again.
A fault that never fired (the script ran fewer steps than ``--steps``, no recovery
came) is named by :func:`unfired`: the launcher lists it in ``report.json``
(``unfired_faults``) and the command line fails the run.
Firing is claimed atomically in the control store per (fault, rank) for step faults,
per fault for recovery faults, so exactly one process fires it for each rank it names
(and a recovery fault fires in one recovery only).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from checkpointless.control import keys
from checkpointless.control.vocab import Event
from checkpointless.errors import InjectedFault

KINDS = ("kill", "hang", "exception", "corrupt")
_RECOVERY_SPECS = {
    "recovery": "kill:spare@recovery",
    "join": "kill:spare@join",
    "source": "kill:source@recovery",
}

_SPEC = re.compile(
    r"^(?P<kind>[a-z]+):rank=(?P<ranks>\d+(?:,\d+)*)@(?P<at>step|check|digests)=(?P<step>\d+)$"
)
_NODE_SPEC = re.compile(
    r"^(?P<kind>kill|partition):node=(?P<node>\d+)@step=(?P<step>\d+)(?:,for=(?P<for>\d+(?:\.\d+)?))?$"
)
_CHECK_KINDS = ("kill", "hang")  # what can strike at a consistency check
_PER_RANK = ("step", "check", "digests")  # moments that name their ranks (the rest are moments of a recovery)


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One scheduled fault.

    ``at`` is ``"step"`` (inside step ``step``, before the gradient reduction), ``"check"`` (at
    the consistency check before step ``step``), or a moment of the next recovery (``ranks``
    empty): ``"recovery"`` the spare receiving state, ``"join"`` the spare before its group
    forms, ``"source"`` the survivor sending state.
    """

    kind: str
    ranks: tuple[int, ...]
    step: int | None
    at: str = "step"  # "step", "check", or a moment of recovery: "recovery", "join", "source"
    node: int | None = None  # a host fault: every process of host ``node`` (``ranks`` empty)
    duration: float | None = None  # a partition's length in seconds (None: for good)

    def __str__(self) -> str:
        if self.at in _RECOVERY_SPECS:
            return _RECOVERY_SPECS[self.at]
        if self.node is not None:
            cut = f",for={self.duration:g}" if self.duration is not None else ""
            return f"{self.kind}:node={self.node}@{self.at}={self.step}{cut}"
        return f"{self.kind}:rank={','.join(map(str, self.ranks))}@{self.at}={self.step}"

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "ranks": list(self.ranks),
            "step": self.step,
            "at": self.at,
            "node": self.node,
            "duration": self.duration,
        }

    @staticmethod
    def from_json(d: dict[str, object]) -> FaultSpec:
        ranks = d["ranks"]
        step = d["step"]
        assert isinstance(ranks, list)
        return FaultSpec(
            kind=str(d["kind"]),
            ranks=tuple(int(r) for r in ranks),
            step=None if step is None else int(str(step)),
            at=str(d.get("at", "step")),
            node=None if d.get("node") is None else int(str(d["node"])),
            duration=None if d.get("duration") is None else float(str(d["duration"])),
        )


def parse_fault(spec: str) -> FaultSpec:
    """Parse one ``--fault`` value; raise ``ValueError`` naming what is wrong."""
    text = spec.strip()
    for at, name in _RECOVERY_SPECS.items():
        if text == name:
            return FaultSpec(kind="kill", ranks=(), step=None, at=at)
    kind = text.split(":", 1)[0]
    node = _NODE_SPEC.match(text)
    if node is not None:
        if node["for"] is not None and node["kind"] != "partition":
            raise ValueError(f"fault {spec!r}: only a partition lasts for a time (,for=T)")
        return FaultSpec(kind=node["kind"], ranks=(), step=int(node["step"]), node=int(node["node"]),
                         duration=None if node["for"] is None else float(node["for"]))  # fmt: skip
    if text.split(":", 1)[-1].startswith("node=") or kind == "partition":
        raise ValueError(
            f"cannot parse fault {spec!r}: a host fault is kill:node=N@step=S or partition:node=N@step=S[,for=T]"
        )
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r} in {spec!r} (expected one of {', '.join(KINDS)})")
    m = _SPEC.match(text)
    if m is None:
        raise ValueError(
            f"cannot parse fault {spec!r}: expected KIND:rank=R[,R...]@step=S, KIND:rank=R@check=S, KIND:rank=R@digests=S, "
            "kill:node=N@step=S, "
            f"{', '.join(_RECOVERY_SPECS.values())}"
        )
    ranks = tuple(int(r) for r in m["ranks"].split(","))
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"fault {spec!r} names a rank twice")
    if m["at"] in ("check", "digests") and kind not in _CHECK_KINDS:
        raise ValueError(
            f"fault {spec!r}: only {' and '.join(_CHECK_KINDS)} can strike at a consistency check"
        )
    return FaultSpec(kind=kind, ranks=ranks, step=int(m["step"]), at=m["at"])


def parse_faults(specs: list[str]) -> list[FaultSpec]:
    """Parse every ``--fault``; ``["none"]`` is the empty schedule."""
    if any(s.strip() == "none" for s in specs):
        if len(specs) > 1:
            raise ValueError("--fault none cannot be combined with other faults")
        return []
    return [parse_fault(s) for s in specs]


def validate_schedule(
    faults: list[FaultSpec],
    *,
    workers: int,
    spares: int,
    steps: int,
    durable: bool = False,
    shards: int = 1,
    consistency_every: int = 0,
    nodes: int = 0,
    nproc_per_node: int = 0,
) -> None:
    """Check a schedule against the job's shape; raise ``ValueError`` naming the problem.

    ``nodes`` and ``nproc_per_node``: the job's worker hosts (0: one host, no host faults); host
    ``n`` starts with ranks ``n * nproc_per_node`` to ``(n + 1) * nproc_per_node - 1``.

    Without an elastic mode a job needs a spare for every rank that fails at once,
    and at least one survivor to hold the state, unless the durable tier (``durable``)
    is there to roll back to.
    """
    per_step: dict[int, set[int]] = {}  # ranks that need a replacement, by step
    for f in faults:
        if f.node is not None:
            if nodes < 1:
                raise ValueError(
                    f"fault {f}: a host fault needs a job on several hosts (checkpointless cluster)"
                )
            if not 0 <= f.node < nodes:
                raise ValueError(
                    f"fault {f}: node {f.node} does not exist (--nodes {nodes}: nodes 0..{nodes - 1})"
                )
            f = FaultSpec(kind=f.kind, step=f.step, ranks=tuple(
                range(f.node * nproc_per_node, (f.node + 1) * nproc_per_node)))  # fmt: skip
        if f.at not in _PER_RANK:
            if spares < 1:
                raise ValueError(f"fault {f}: there is no spare to kill (--spares 0)")
            continue
        assert f.step is not None
        for r in f.ranks:
            if not 0 <= r < workers:
                raise ValueError(f"fault {f}: rank {r} is out of range for --workers {workers}")
        if f.step >= steps:
            raise ValueError(f"fault {f}: step {f.step} is beyond --steps {steps} (steps are 0..{steps - 1})")
        if f.at in ("check", "digests") and not (
            f.step == 1 or (consistency_every > 0 and f.step > 0 and f.step % consistency_every == 0)
        ):
            raise ValueError(
                f"fault {f}: no consistency check runs before step {f.step} (checks run before step 1 and "
                f"every recovery.consistency_every={consistency_every} steps)"
            )
        if f.kind in ("exception", "corrupt"):
            continue  # the rank stays alive (re-executes the step, or is re-synced) in place
        ranks = per_step.setdefault(f.step, set())
        if ranks & set(f.ranks):
            raise ValueError(f"fault {f}: rank already faulted at step {f.step}")
        ranks.update(f.ranks)
    for step, ranks in per_step.items():
        n_replaced = len(ranks)
        if n_replaced > spares:
            raise ValueError(
                f"{n_replaced} ranks fail at step {step} but only {spares} spare(s) are configured "
                "(elastic shrink without spares is not supported yet)"
            )
        if n_replaced >= workers and not durable:
            raise ValueError(
                f"every rank fails at step {step}: no live replica would hold the state "
                "(set recovery.durable_every and durable_dir to roll back to a durable snapshot)"
            )
        for shard in range(shards):
            copies = set(range(shard, workers, shards))
            if copies <= ranks and not durable:
                raise ValueError(
                    f"ranks {', '.join(map(str, sorted(copies)))} (every copy of shard {shard}) fail at step "
                    f"{step}: no live replica would hold that shard (set recovery.durable_every and "
                    "durable_dir to roll back to a durable snapshot)"
                )


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
        missed = hit is None or (f.at in _PER_RANK and not set(f.ranks) <= hit)
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
        """``node``: this process's host in the job (``control.env.ENV_NODE``), ``agent_pid`` its
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
        who = rank if fault.at in _PER_RANK and fault.node is None else -1
        if self._claimer is None or not self._claimer.claim(keys.fault_fired(index, who)):
            return
        if on_fire is not None:
            on_fire(index, fault, rank, step)
        if fault.node is not None:  # the host's relay goes down with it: its events first
            drain = getattr(self._claimer, "drain", None)
            if drain is not None:
                drain(2.0)
        if fault.kind == "partition":
            _cut_host_off(fault.duration)
            return  # this process lives on, cut off: its lease and its host's fence end it
        if fault.node is not None and self._agent_pid > 0:
            # the host's agent first: every other process of the host dies with it (the agent
            # starts them with PR_SET_PDEATHSIG), then this one, as a power loss takes them all
            os.kill(self._agent_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "kill":
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
