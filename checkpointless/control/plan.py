"""Recovery plans: who holds which rank in a generation, and who sends state to whom.

``make_plan`` is a pure function of what the coordinator observed, so the whole
decision can be tested without processes. Recovery is per (shard, replica
group): a rank's state can only come from a survivor holding the same shard.
DDP is the case of one shard.

The topology is data (``hosts``: the host of every process): the node is the unit of failure.
A host whose every rank is lost is replaced as a whole by one spare host (the smallest with
enough ready spares); a rank lost on a host that lives on takes a spare of its own host first.
Sources are spread over the hosts that hold the state, so that the receivers of a lost host pull
from several hosts at once, one stream per rank. On one host all of this is today's single-host
plan.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from checkpointless.errors import PlanError


@dataclass(frozen=True, slots=True)
class ReplicaMap:
    """Layout of ``world_size`` ranks as ``replicas x shards`` (HSDP); shards=1 is DDP.

    Rank r holds shard ``r % shards`` and is replica ``r // shards`` of it.
    """

    world_size: int
    shards: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.shards < 1 or self.world_size % self.shards:
            raise ValueError(f"shards={self.shards} must divide world_size={self.world_size}")

    def shard_of(self, rank: int) -> int:
        return rank % self.shards

    def replica_group(self, rank: int) -> list[int]:
        """Ranks holding bitwise identical copies of ``rank``'s state."""
        return list(range(self.shard_of(rank), self.world_size, self.shards))


@dataclass(frozen=True, slots=True)
class Plan:
    """Membership and state movement of one generation.

    ``resume_step`` is the first step every rank executes in this generation;
    ``sources[r] = s`` means rank ``s`` sends its full state to rank ``r``
    before training resumes.
    """

    gen: int
    world_size: int
    shards: int
    members: dict[int, str]
    resume_step: int
    sources: dict[int, int] = field(default_factory=dict)
    replaced: dict[int, str] = field(default_factory=dict)  # rank -> proc that left
    #: every rank loads the durable snapshot of this step (no live replica held some shard)
    restore: int | None = None
    #: the host of each rank's process ({} when the topology is not known: one host)
    hosts: dict[int, str] = field(default_factory=dict)
    #: the processes of lost ranks that no spare took, or of ranks a smaller job let go: the job
    #: went on without them (``shrink_plan``, ``resize_plan``)
    dropped: list[str] = field(default_factory=list)
    #: the ranks a spare took that no process held before: the job grew (``resize_plan``)
    grown: list[int] = field(default_factory=list)
    #: spares that catch up in the background (``catch_up``), each from the rank named: process ->
    #: source rank; they are not members of this generation
    followers: dict[str, int] = field(default_factory=dict)
    #: the ranks of ``grown`` whose spare caught up: their source (``sources``) sends only what the
    #: catch-up does not bring, and the two compare digests
    caught_up: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(
            {
                "gen": self.gen,
                "world_size": self.world_size,
                "shards": self.shards,
                "members": {str(k): v for k, v in self.members.items()},
                "resume_step": self.resume_step,
                "sources": {str(k): v for k, v in self.sources.items()},
                "replaced": {str(k): v for k, v in self.replaced.items()},
                "restore": self.restore,
                "hosts": {str(k): v for k, v in self.hosts.items()},
                "dropped": self.dropped,
                "grown": self.grown,
                "followers": self.followers,
                "caught_up": self.caught_up,
            }
        )

    @staticmethod
    def from_json(text: str | bytes) -> Plan:
        d = json.loads(text)
        return Plan(
            gen=int(d["gen"]),
            world_size=int(d["world_size"]),
            shards=int(d["shards"]),
            members={int(k): str(v) for k, v in d["members"].items()},
            resume_step=int(d["resume_step"]),
            sources={int(k): int(v) for k, v in d["sources"].items()},
            replaced={int(k): str(v) for k, v in d["replaced"].items()},
            restore=None if d.get("restore") is None else int(d["restore"]),
            hosts={int(k): str(v) for k, v in d.get("hosts", {}).items()},
            dropped=[str(p) for p in d.get("dropped", [])],
            grown=[int(r) for r in d.get("grown", [])],
            followers={str(k): int(v) for k, v in d.get("followers", {}).items()},
            caught_up=[int(r) for r in d.get("caught_up", [])],
        )

    def newcomer(self, rank: int) -> bool:
        """Whether a spare took ``rank`` in this generation (in a lost rank's place, or a new one)."""
        return rank in self.replaced or rank in self.grown

    def rank_of(self, proc: str) -> int | None:
        for r, p in self.members.items():
            if p == proc:
                return r
        return None


def initial_plan(world_size: int, shards: int, procs: list[str], hosts: dict[str, str] | None = None) -> Plan:
    """Generation 0: rank ``r`` is ``procs[r]``; ``hosts`` gives each process's host."""
    assert len(procs) == world_size
    return Plan(
        gen=0, world_size=world_size, shards=shards, members=dict(enumerate(procs)), resume_step=0,
        hosts={r: hosts[p] for r, p in enumerate(procs) if p in hosts} if hosts else {},
    )  # fmt: skip


def shared_hosts(members: dict[int, str], hosts: dict[str, str], shards: int) -> dict[int, list[str]]:
    """The shards some of whose replicas share a host (a failure of that host loses several
    copies of the shard, and all of them if no other host holds one): shard -> those hosts."""
    layout = ReplicaMap(len(members), shards)
    out: dict[int, list[str]] = {}
    for shard in range(shards):
        on = Counter(hosts.get(members[r], "") for r in layout.replica_group(shard))
        crowded = sorted(h for h, n in on.items() if n > 1)
        if crowded:
            out[shard] = crowded
    return out


def assign_spares(
    members: dict[int, str], dead: list[int], spares: list[str], hosts: dict[str, str] | None = None
) -> dict[int, str]:
    """Which ready spare takes each dead rank (``spares`` in the pool's order; as many as ``dead``).

    Without a topology the pool's order. With one (``hosts``: every process's host): a host whose
    every rank is dead is replaced by its own ready spares if it has enough (then it lives: its
    processes failed, not the host), else by one spare host, the smallest that has enough ready spares
    (a host running no rank), largest lost host first; a rank lost on a host that lives on takes
    a spare of its own host first, then the pool's order; a lost host that no single spare host
    can take is filled in the pool's order too.
    """
    if not hosts:
        return dict(zip(dead, spares, strict=False))
    pool = list(spares)
    where = {r: hosts.get(p, "") for r, p in members.items()}
    live_hosts = {where[r] for r in members if r not in dead}
    lost: dict[str, list[int]] = {}
    for r in dead:
        lost.setdefault(where[r], []).append(r)
    out: dict[int, str] = {}

    def take(ranks: list[int], candidates: list[str]) -> None:
        for r, s in zip(ranks, candidates, strict=False):
            out[r] = s
            pool.remove(s)

    for host, ranks in sorted(lost.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if host in live_hosts:
            continue  # a process fault: below
        by_host: dict[str, list[str]] = {}
        for s in pool:
            by_host.setdefault(hosts.get(s, ""), []).append(s)
        if len(by_host.get(host, [])) >= len(ranks):
            # its own ready spares live: the host does (a process fault on a host whose ranks all
            # died, e.g. one rank per host): they take the ranks, where the state's devices are
            take(ranks, by_host[host])
            continue
        fits = [h for h, ss in by_host.items() if h not in live_hosts and len(ss) >= len(ranks)]
        if fits:
            best = min(fits, key=lambda h: (len(by_host[h]), pool.index(by_host[h][0])))
            take(ranks, by_host[best])
    for r in dead:
        if r in out:
            continue
        local = [s for s in pool if hosts.get(s, "") == where[r]]
        take([r], local or pool)
    return out


def _spread(ranks: list[int], hosts: dict[int, str]) -> list[int]:
    """``ranks`` (in rank order) interleaved over their hosts: one from each host in turn, so that
    consecutive receivers pull from different hosts (one host: unchanged)."""
    by_host: dict[str, list[int]] = {}
    for r in ranks:
        by_host.setdefault(hosts.get(r, ""), []).append(r)
    queues = list(by_host.values())
    out: list[int] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def make_plan(
    prev: Plan,
    committed: dict[int, int],
    spares: list[str],
    holders: set[int] | None = None,
    *,
    durable_on: bool = False,
    durable_step: int | None = None,
    hosts: dict[str, str] | None = None,
) -> Plan:
    """The next generation after a failure in ``prev``.

    ``committed`` maps every surviving rank to its last committed step (-1 if
    none); ranks of ``prev`` missing from it are dead and get a spare, taken in
    order from ``spares``. ``holders`` are the survivors that hold the job's
    state (default: all of them); a survivor that never held it (a spare that
    was still receiving when its source died) is never a source and
    receives like a replacement. Training resumes after the highest step that
    every shard still holds on some holder; each replacement and each lagging
    survivor receives state from an up-to-date holder of its own shard, the
    load spread round-robin over the sources. No holder of some shard is a
    ``PlanError``: the job never silently restarts from scratch.

    ``durable_on``: whether the durable tier is configured; ``durable_step``: the step of its
    newest complete snapshot (``durable_snapshots.latest_complete``), None if none. When some shard has no
    holder and there is a snapshot, every rank rolls back to it: a plan with ``restore`` set,
    resuming after the snapshot's step, with no transfers.

    ``hosts``: the host of every process (members and spares); spares are placed by
    ``assign_spares`` and sources spread over hosts (module docstring). None: one host.
    """
    layout = ReplicaMap(prev.world_size, prev.shards)
    holders = set(committed) if holders is None else holders & set(committed)
    dead = sorted(set(prev.members) - set(committed))
    if len(dead) > len(spares):
        raise PlanError(
            f"{len(dead)} rank(s) lost ({', '.join(map(str, dead))}) but only {len(spares)} spare(s) ready"
        )
    best: dict[int, int] = {}
    for shard in range(prev.shards):
        alive = [r for r in layout.replica_group(shard) if r in holders]
        if not alive:
            if durable_on and durable_step is not None:
                return _restore_plan(prev, dead, spares, durable_step, hosts)
            what = "the state" if prev.shards == 1 else f"shard {shard} of the state"
            why = (
                "the durable tier holds no complete snapshot yet"
                if durable_on
                else "no durable copy exists (recovery.durable_every is off)"
            )
            raise PlanError(f"every live copy of {what} is lost: no surviving rank holds it, and {why}")
        best[shard] = max(committed[r] for r in alive)
    resume = min(best.values()) + 1
    ahead = [r for r, c in committed.items() if c >= resume]
    if ahead:
        raise PlanError(f"ranks {ahead} committed past step {resume - 1}, which another shard cannot reach")
    members, replaced, where = _replace(prev, dead, spares, hosts)
    sources: dict[int, int] = {}
    for shard in range(prev.shards):
        group = layout.replica_group(shard)
        up_to_date = _spread([r for r in group if r in holders and committed[r] == resume - 1], where)
        receivers = [
            r for r in group if r in replaced or r not in holders or committed.get(r, -1) < resume - 1
        ]
        for i, r in enumerate(receivers):
            sources[r] = up_to_date[i % len(up_to_date)]
    return Plan(
        gen=prev.gen + 1,
        world_size=prev.world_size,
        shards=prev.shards,
        members=members,
        resume_step=resume,
        sources=sources,
        replaced=replaced,
        hosts=where,
    )


def _replace(
    prev: Plan, dead: list[int], spares: list[str], hosts: dict[str, str] | None
) -> tuple[dict[int, str], dict[int, str], dict[int, str]]:
    """The next generation's members, the processes replaced (rank -> old) and every rank's host."""
    members = dict(prev.members)
    replaced: dict[int, str] = {}
    for rank, proc in assign_spares(prev.members, dead, spares, hosts).items():
        replaced[rank] = members[rank]
        members[rank] = proc
    where = {r: hosts[p] for r, p in members.items() if p in hosts} if hosts else {}
    return members, replaced, where


def _restore_plan(
    prev: Plan, dead: list[int], spares: list[str], step: int, hosts: dict[str, str] | None
) -> Plan:
    """Every rank rolls back to the durable snapshot of ``step``; dead ranks get spares."""
    members, replaced, where = _replace(prev, dead, spares, hosts)
    return Plan(
        gen=prev.gen + 1,
        world_size=prev.world_size,
        shards=prev.shards,
        members=members,
        resume_step=step + 1,
        replaced=replaced,
        restore=step,
        hosts=where,
    )
