"""The fault grammar: what ``--fault`` (and ``recovery.faults`` in a recipe) may say, parsed into
``FaultSpec``s and checked against the job's shape before anything starts. Firing them is the
injector's (``faults.py``); this module is plain data, below the job's configuration, which holds
the schedule.

Grammar of a spec::
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
    kill:survivor@takeover      kill the next survivor that takes a lost rank's shares over inside
                                its step, once it is in the new generation and before it computes
                                them (--never-wait)
    partition:spare@recovery[,for=T]  partition:spare@join[,for=T]  partition:source@recovery[,for=T]
                                cut the host of that process off the network at that moment (as
                                ``partition:node``: for T seconds or for good; multi-host jobs)
    preempt:rank=R@step=S,notice=T
                                a preemption notice inside step S: SIGTERM to rank R's process, then
                                SIGKILL T seconds later (T a decimal; the rank hands its place over
                                meanwhile, to a spare or, in an elastic job, to the others)
    preempt:node=N@step=S,notice=T
                                the same for host N: SIGTERM to its agent (which drains the host:
                                every rank on it is handed over), SIGKILL to the agent T seconds later
    none                        no fault at all

``corrupt`` flips the lowest bit of the first element of the rank's first parameter (silent data
corruption: the process runs on, its replica now differs; the replicas' consistency check finds it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("kill", "hang", "exception", "corrupt")
_RECOVERY_SPECS = {  # a moment of a recovery -> how a spec names it (after ``KIND:``)
    "recovery": "spare@recovery",
    "join": "spare@join",
    "source": "source@recovery",
    "takeover": "survivor@takeover",
}
_RECOVERY_SPEC = re.compile(
    r"^(?P<kind>kill|partition):(?P<moment>spare@recovery|spare@join|source@recovery|survivor@takeover)"
    r"(?:,for=(?P<for>\d+(?:\.\d+)?))?$"
)

_SPEC = re.compile(
    r"^(?P<kind>[a-z]+):rank=(?P<ranks>\d+(?:,\d+)*)@(?P<at>step|check|digests)=(?P<step>\d+)$"
)
_PREEMPT_SPEC = re.compile(
    r"^preempt:(?:rank=(?P<rank>\d+)|node=(?P<node>\d+))@step=(?P<step>\d+),notice=(?P<notice>\d+(?:\.\d+)?)$"
)
_NODE_SPEC = re.compile(
    r"^(?P<kind>kill|partition):node=(?P<node>\d+)@step=(?P<step>\d+)(?:,for=(?P<for>\d+(?:\.\d+)?))?$"
)
_CHECK_KINDS = ("kill", "hang")  # what can strike at a consistency check
PER_RANK = ("step", "check", "digests")  # moments that name their ranks (the rest are moments of a recovery)


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One scheduled fault.

    ``at`` is ``"step"`` (inside step ``step``, before the gradient reduction), ``"check"`` (at
    the consistency check before step ``step``), or a moment of the next recovery (``ranks``
    empty): ``"recovery"`` the spare receiving state, ``"join"`` the spare before its group
    forms, ``"source"`` the survivor sending state, ``"takeover"`` a survivor about to compute a
    lost rank's shares in its step (``takeover.py``).
    """

    kind: str
    ranks: tuple[int, ...]
    step: int | None
    at: str = "step"  # "step", "check", or a moment of recovery: "recovery", "join", "source", "takeover"
    node: int | None = None  # a host fault: every process of host ``node`` (``ranks`` empty)
    duration: float | None = None  # a partition's length in seconds (None: for good); a preemption's notice

    def __str__(self) -> str:
        if self.kind == "preempt":
            who = f"node={self.node}" if self.node is not None else f"rank={self.ranks[0]}"
            return f"preempt:{who}@step={self.step},notice={self.duration:g}"
        cut = f",for={self.duration:g}" if self.duration is not None else ""
        if self.at in _RECOVERY_SPECS:
            return f"{self.kind}:{_RECOVERY_SPECS[self.at]}{cut}"
        if self.node is not None:
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
    moment = _RECOVERY_SPEC.match(text)
    if moment is not None:
        if moment["for"] is not None and moment["kind"] != "partition":
            raise ValueError(f"fault {spec!r}: only a partition lasts for a time (,for=T)")
        at = next(a for a, name in _RECOVERY_SPECS.items() if name == moment["moment"])
        return FaultSpec(kind=moment["kind"], ranks=(), step=None, at=at,
                         duration=None if moment["for"] is None else float(moment["for"]))  # fmt: skip
    kind = text.split(":", 1)[0]
    if kind == "preempt":
        preempt = _PREEMPT_SPEC.match(text)
        if preempt is None:
            raise ValueError(
                f"cannot parse fault {spec!r}: a preemption is preempt:rank=R@step=S,notice=T or "
                "preempt:node=N@step=S,notice=T"
            )
        notice = float(preempt["notice"])
        if preempt["node"] is not None:
            return FaultSpec(kind="preempt", ranks=(), step=int(preempt["step"]), node=int(preempt["node"]),
                             duration=notice)  # fmt: skip
        return FaultSpec(
            kind="preempt", ranks=(int(preempt["rank"]),), step=int(preempt["step"]), duration=notice
        )
    node = _NODE_SPEC.match(text)
    if node is not None:
        if node["for"] is not None and node["kind"] != "partition":
            raise ValueError(f"fault {spec!r}: only a partition lasts for a time (,for=T)")
        return FaultSpec(kind=node["kind"], ranks=(), step=int(node["step"]), node=int(node["node"]),
                         duration=None if node["for"] is None else float(node["for"]))  # fmt: skip
    if text.split(":", 1)[-1].startswith("node=") or kind == "partition":
        raise ValueError(
            f"cannot parse fault {spec!r}: a host fault is kill:node=N@step=S, partition:node=N@step=S[,for=T] "
            "or partition:spare@recovery|join[,for=T], partition:source@recovery[,for=T]"
        )
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r} in {spec!r} (expected one of {', '.join(KINDS)})")
    m = _SPEC.match(text)
    if m is None:
        raise ValueError(
            f"cannot parse fault {spec!r}: expected KIND:rank=R[,R...]@step=S, KIND:rank=R@check=S, KIND:rank=R@digests=S, "
            "kill:node=N@step=S, "
            f"{', '.join('kill:' + name for name in _RECOVERY_SPECS.values())}"
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
    min_workers: int = 0,
    never_wait: bool = False,
) -> None:
    """Check a schedule against the job's shape; raise ``ValueError`` naming the problem.

    ``nodes`` and ``nproc_per_node``: the job's worker hosts (0: one host, no host faults); host
    ``n`` starts with ranks ``n * nproc_per_node`` to ``(n + 1) * nproc_per_node - 1``.

    Without an elastic mode a job needs a spare for every rank that fails at once,
    and at least one survivor to hold the state, unless the durable tier (``durable``)
    is there to roll back to. An elastic job (``min_workers`` below ``workers``) may lose more
    ranks than it has spares while at least ``min_workers`` live; the faults' ranks are those of
    the generation they strike in (the survivors are numbered anew after a shrink).
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
        if f.at == "takeover":
            if not never_wait or f.kind != "kill":
                raise ValueError(
                    f"fault {f}: only kill, and survivors take shares over only under --never-wait"
                )
            continue
        if f.at not in PER_RANK:
            if spares < 1:
                raise ValueError(f"fault {f}: there is no spare to {f.kind} (--spares 0)")
            if f.kind == "partition" and nodes < 1:
                raise ValueError(
                    f"fault {f}: a partition needs a job on several hosts (checkpointless cluster)"
                )
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
        if f.kind == "preempt" and spares < 1 and not 0 < min_workers < workers:
            raise ValueError(f"fault {f}: no spare can take the rank (--spares 0) and the job cannot shrink "
                             "(--min-workers)")  # fmt: skip
        ranks = per_step.setdefault(f.step, set())
        if ranks & set(f.ranks):
            raise ValueError(f"fault {f}: rank already faulted at step {f.step}")
        ranks.update(f.ranks)
    for step, ranks in per_step.items():
        n_replaced = len(ranks)
        if n_replaced > spares and 0 < min_workers < workers:
            if workers - n_replaced + spares < min_workers:
                raise ValueError(
                    f"{n_replaced} ranks fail at step {step} with {spares} spare(s): fewer than --min-workers "
                    f"{min_workers} would be left"
                )
        elif n_replaced > spares:
            raise ValueError(
                f"{n_replaced} ranks fail at step {step} but only {spares} spare(s) are configured "
                "(--min-workers lets a job go on smaller)"
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
