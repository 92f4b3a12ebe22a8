"""What the ranks must hold alike, and the checks that see it: the parameters' layout (at every
formation), the trainable flags (at every change), the holders' states before a recovery copies one,
and the replicas' consistency check: a digest of every replica's registered state compared every
``recovery.consistency_every`` steps; a replica that differs from its shard's majority of
independent copies is re-synced from it, and without a majority the job stops."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from checkpointless.comm import Group
from checkpointless.control.plan import Plan, ReplicaMap
from checkpointless.progress import StepState
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event
from checkpointless.replicas import choose_sources, own_lineage, vote
from checkpointless.state import combined_digest, first_difference

if TYPE_CHECKING:
    from checkpointless.control.client import ControlClient
    from checkpointless.member import Member
    from checkpointless.model_holder import ModelHolder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Exchange:
    """What one all-gather of the members' digests told, by rank."""

    digests: dict[int, bytes]
    lineages: dict[int, int]
    holders: set[int]  # the members that hold their state in this exchange
    starts: dict[int, int]  # every member's ``steps(start=)``


def exchange_digests(group: Group, digest: bytes | None, steps: StepState, *, holder: bool) -> Exchange:
    """One all-gather of every member's state digest (zeros without one), lineage, whether it holds
    its state, and where its loop began."""
    payload = (
        (digest or bytes(32)) + steps.lineage.to_bytes(8, "little") + bytes([1 if holder else 0])
        + steps.first_commit.to_bytes(8, "little")
    )  # fmt: skip
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    rows = [bytes(t.tolist()) for t in group.control.allgather(mine)]
    return Exchange(
        digests={r: row[:32] for r, row in enumerate(rows)},
        lineages={r: int.from_bytes(row[32:40], "little") for r, row in enumerate(rows)},
        holders={r for r, row in enumerate(rows) if row[40]},
        starts={r: int.from_bytes(row[41:49], "little") for r, row in enumerate(rows)},
    )


def holders(ranks: list[int], digests: dict[int, bytes]) -> str:
    """Which of ``ranks`` hold which state: ``ranks 0, 1 hold 3fa2c1d0; rank 2 holds 9be01a44``."""
    by: dict[bytes, list[int]] = {}
    for r in ranks:
        by.setdefault(digests[r], []).append(r)
    parts = []
    for d, rs in by.items():
        who = f"rank {rs[0]} holds" if len(rs) == 1 else f"ranks {', '.join(map(str, rs))} hold"
        parts.append(f"{who} {d.hex()[:8]}")
    return "; ".join(parts)


def layout_of(model: torch.nn.Module) -> list[list[Any]]:
    return [[n, list(p.shape), str(p.dtype)] for n, p in model.named_parameters()] + [
        [n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()
    ]


def layout_difference(rank_a: int, a: list[list[Any]], rank_b: int, b: list[list[Any]]) -> str:
    """The first difference between two ranks' parameter layouts, in words."""
    by_name_b = {n: (shape, dtype) for n, shape, dtype in b}
    for n, shape, dtype in a:
        if n not in by_name_b:
            return f"parameter {n!r} exists on rank {rank_a} but not on rank {rank_b}"
        if [shape, dtype] != list(by_name_b[n]):
            other = by_name_b[n]
            return (
                f"parameter {n!r} is {tuple(shape)} {dtype} on rank {rank_a} "
                f"but {tuple(other[0])} {other[1]} on rank {rank_b}"
            )
    names_a = {n for n, _, _ in a}
    extra = [n for n, _, _ in b if n not in names_a]
    if extra:
        return f"parameter {extra[0]!r} exists on rank {rank_b} but not on rank {rank_a}"
    return f"parameters are registered in a different order on rank {rank_a} and rank {rank_b}"


def layouts_differ(
    group: Group, client: ControlClient, model: torch.nn.Module, gen: int, rank: int
) -> str | None:
    """Every rank's parameters must have the same names, shapes and dtypes: one tiny all-gather of
    their digests; where they differ, the first difference in words (each rank's layout is read
    from the store then), else None."""
    text = json.dumps(layout_of(model))
    client.publish(keys.layout(gen, rank), text)
    digest = torch.frombuffer(bytearray(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8)
    digests = group.control.allgather(digest)
    if all(torch.equal(d, digests[0]) for d in digests):
        return None
    layouts = {r: client.read_json(keys.layout(gen, r)) for r in range(len(digests))}
    odd = next(r for r in range(1, len(digests)) if not torch.equal(digests[r], digests[0]))
    return "model layouts differ between ranks: " + layout_difference(0, layouts[0], odd, layouts[odd])


def holders_can_disagree(plan: Plan) -> bool:
    """Whether some replica group that receives state in ``plan`` keeps two holders or more (the
    members that keep their state, not receiving): only then can their comparison change a source.
    With one holder (two replicas, or HSDP with two per shard) it is the source whatever its digest,
    and the hashing it would cost is skipped."""
    layout = ReplicaMap(plan.world_size, plan.shards)
    for shard in range(plan.shards):
        group = layout.replica_group(shard)
        if any(r in plan.sources for r in group) and sum(r not in plan.sources for r in group) > 1:
            return True
    return False


def compare_holders(
    m: Member, plan: Plan, digest: bytes | None, holder: bool, steps: StepState
) -> tuple[dict[int, int], dict[int, int]]:
    """A recovery's holders of each shard compare their state before any is copied; where they
    disagree, the majority of lineages is the source (and re-syncs the odd holders), and without a
    majority the job stops rather than copy a state that may be corrupt. The sources as followed,
    and every member's lineage as exchanged."""
    client = m.client
    assert m.group is not None and client is not None
    seen = exchange_digests(m.group, digest, steps, holder=holder)
    layout = ReplicaMap(plan.world_size, plan.shards)
    groups = [layout.replica_group(shard) for shard in range(plan.shards)]
    sources, split = choose_sources(plan.sources, groups, seen.holders, seen.digests, seen.lineages)
    step = plan.resume_step - 1
    for ranks, result in split:
        held = sorted(r for r in ranks if r in seen.holders)
        if m.rank == min(held):
            client.emit(Event.STATE_DIVERGED, sync=True, rank=m.rank, gen=plan.gen, step=step,
                        entry="(at recovery)", ranks=result.odd, healthy=result.healthy)  # fmt: skip
        if not result.healthy:
            of = f" of shard {layout.shard_of(ranks[0])}" if plan.shards > 1 else ""
            m.fatal(
                f"at recovery the replicas{of} that kept their state differ (ranks {held}) and no "
                "majority of independent copies tells which is right (silent data corruption?): "
                "stopping rather than copying a state that may be corrupt"
            )
    if sources != plan.sources:
        log.warning("[gen %d rank %d] replicas disagreed at recovery: sources %s instead of %s",
                    plan.gen, m.rank, sources, plan.sources)  # fmt: skip
    return sources, seen.lineages


class ReplicaCheck:
    """Compares the replicas of every shard at the steps the schedule names (``due``)."""

    def __init__(self, member: Member, model: ModelHolder, steps: StepState) -> None:
        self._member, self._model, self._steps = member, model, steps

    def due(self) -> bool:
        """Whether the replicas compare their state before the next step: a function of the
        committed step only, so that every rank of a generation agrees (a replacement too)."""
        m, c = self._member, self._steps.committed
        if m.client is None or m.group is None or m.world_size < 2 or c < 0:
            return False
        every = m.job.recovery.consistency_every
        return c == self._steps.first_commit or (every > 0 and (c + 1) % every == 0)

    def run(self) -> None:
        """Compare a digest of every replica's state (one 32-byte all-gather); act on a difference.

        The state is the registered one (model with its buffers, optimizer, user state) at the
        committed step, without the per-rank RNG state; a sharded job compares the replicas of
        each shard. After the first step a difference is a program error (state each rank
        updates from its own batch): the job stops naming the entry. Later it is corruption: the
        replicas that differ from a strict majority of their shard's replicas receive the state
        of the majority's lowest rank; without a majority the job stops.
        """
        m, steps = self._member, self._steps
        client, group, step = m.client, m.group, steps.committed
        assert client is not None and group is not None
        if m.faults is not None:
            m.faults.at_check(m.rank, step + 1, m.fault_fired)
        entries = self._model.entries()
        seen = exchange_digests(group, combined_digest(entries), steps, holder=True)
        digests, lineages = seen.digests, seen.lineages
        if len(set(seen.starts.values())) > 1:  # ``steps(start=)``: a mistake no recovery can fix
            other = next(r for r in sorted(seen.starts) if seen.starts[r] != steps.first_commit)
            m.fatal(
                f"begins its loop at step {steps.first_commit} but rank {other} at step "
                f"{seen.starts[other]}: every rank must pass the same session.steps(total, start=...)"
            )
        shards = m.job.shards
        layout = ReplicaMap(m.world_size, shards)
        replica_groups = [layout.replica_group(shard) for shard in range(shards)]
        if all(len({digests[r] for r in ranks}) == 1 for ranks in replica_groups):
            steps.descend(own_lineage(m.generation, m.rank))  # verified: independent again
            return
        if m.faults is not None:
            m.faults.at_check(m.rank, step + 1, m.fault_fired, at="digests")
        client.publish(keys.state_digests(m.generation, step, m.rank), json.dumps(entries))
        by_rank = {
            r: [(str(p), str(d)) for p, d in m.wait_peer_json(keys.state_digests(m.generation, step, r))]
            for r in range(m.world_size)
        }
        resyncs: list[tuple[int, list[int], str | None]] = []
        for ranks in replica_groups:
            result = vote(ranks, digests, lineages)  # copies of one source are one vote
            if result.agreed:
                continue
            healthy, odd = result.healthy, result.odd
            ref = healthy[0] if healthy else ranks[0]
            other = next(r for r in ranks if digests[r] != digests[ref])
            entry = first_difference(by_rank[ref], by_rank[other])
            where = f"{entry!r} differs between rank {ref} and rank {other}"
            if shards > 1:
                where += f" (replicas of shard {layout.shard_of(ref)})"
            if m.rank == min(healthy or ranks):
                client.emit(Event.STATE_DIVERGED, sync=True, rank=m.rank, gen=m.generation, step=step,
                            entry=str(entry), ranks=odd, healthy=healthy)  # fmt: skip
            if step == steps.first_commit:
                m.fatal(
                    f"replicas differ after the first step: {where}. Every replica must hold the same "
                    "state; state each rank updates from its own batch (BatchNorm running statistics) "
                    "needs Session(broadcast_buffers=True), the default"
                )
            if not healthy:
                m.fatal(
                    f"replicas differ at step {step} and no majority tells which is right: {where}; "
                    f"{holders(ranks, digests)} (silent data corruption, or a non-deterministic update); "
                    "stopping rather than training on a state that may be corrupt"
                )
            resyncs.append((ref, odd, entry))
        for ref, odd, entry in resyncs:
            if m.rank == ref:
                for dst in odd:
                    m.resync_to(dst)
            elif m.rank in odd:
                stats = m.resync_from(ref, lineages[ref], step + 1)
                client.emit(Event.STATE_RESYNCED, sync=True, rank=m.rank, gen=m.generation, step=step,
                            src=ref, entry=str(entry), bytes=stats.bytes, seconds=stats.seconds)  # fmt: skip
        group.barrier()


class TrainableAgreement:
    """The ranks of a generation freeze and unfreeze the same parameters at the same step: each
    change is compared over the store (``agree``); a transfer brings the source's flags (``took``)."""

    def __init__(self, member: Member) -> None:
        self._member = member
        self._agreed: list[str] | None = None  # the trainable set the ranks last agreed on

    def took(self, names: list[str]) -> None:
        """The state (and its flags) came from a peer that the ranks agreed with."""
        self._agreed = names

    def agree(self, step: int, names: list[str]) -> None:
        """The trainable parameters changed at ``step`` (the loop unfroze or froze one): every rank
        of the generation must have changed them alike; the ranks compare over the store."""
        m = self._member
        if names == self._agreed:
            return
        if m.client is not None and m.world_size > 1:
            client, gen = m.client, m.generation
            client.publish(keys.trainable(gen, step, m.rank), json.dumps(names))
            timeout = timedelta(seconds=m.job.recovery.collective_timeout_s)
            for r in range(m.world_size):
                try:
                    theirs = client.wait_json(keys.trainable(gen, step, r), timeout)
                except TimeoutError:
                    m.fatal(
                        f"the trainable parameters changed at step {step} on rank {m.rank} but not "
                        f"on rank {r} within {timeout.total_seconds():g} s: every rank must freeze "
                        "or unfreeze the same parameters at the same step"
                    )
                if theirs != names:
                    diff = sorted(set(theirs) ^ set(names))
                    m.fatal(
                        f"the trainable parameters at step {step} differ between rank {m.rank} and "
                        f"rank {r} (first difference: {diff[0] if diff else 'their order'!r})"
                    )
        self._agreed = names
