"""``GenerationEntry``, held by the member: the state's part of entering a generation. Where a
recovery copies state, the holders hash theirs while the group forms (``hash_ahead``); once it is
formed (``move``), every rank's layout is checked, a rollback restores the durable tier, the
holders compare their state (the majority is the source), this rank receives or sends state as
the plan says, and with nothing committed yet every replica starts from rank 0's.

The member keeps its place in the job (rank, group, generation) and passes the generation in;
what a load brings is its ``StateArrival``'s (``arrival.py``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from checkpointless.arrival import StateArrival
from checkpointless.consistency import compare_holders, holders_can_disagree, layouts_differ
from checkpointless.control.client import ControlClient
from checkpointless.control.plan import Plan
from checkpointless.errors import Unrecoverable
from checkpointless.following import send_light
from checkpointless.fsdp import Generation
from checkpointless.model_holder import ModelHolder
from checkpointless.progress import StepState
from checkpointless.recovery_source import transfer_out
from checkpointless.state import combined_digest

if TYPE_CHECKING:
    from checkpointless.member import Member

Ahead = tuple[bool, bool, dict[str, bytes], threading.Thread | None]
"""What ``hash_ahead`` started: whether the holders compare, whether this rank is one, its digest
(``"d"``) once hashed, and the thread hashing it."""


class GenerationEntry:
    """The state moved as a member enters a generation (see the module docstring)."""

    def __init__(
        self,
        member: Member,
        client: ControlClient,
        model: ModelHolder,
        steps: StepState,
        arrival: StateArrival,
        secret: bytes,
    ) -> None:
        self._member, self._client = member, client
        self._model, self._steps, self._arrival, self._secret = model, steps, arrival, secret

    def hash_ahead(self, plan: Plan, rank: int) -> Ahead:
        """Before the group forms: where a recovery copies state, the holders compare theirs first
        (corruption since the last check must not be copied); a replicated holder's digest is
        hashed here, overlapping the group's formation."""
        compare = (
            plan.gen > 0 and bool(plan.sources) and plan.restore is None and plan.world_size > 1
            and self._member.job.recovery.consistency_every > 0 and holders_can_disagree(plan)
        )  # fmt: skip
        holder = self._member.has_state and rank not in plan.sources
        hashing: dict[str, bytes] = {}
        hasher = None
        if compare and holder and not self._model.sharded:
            hasher = threading.Thread(target=lambda: hashing.update(d=combined_digest(self._model.entries())),
                                      daemon=True)  # fmt: skip
            hasher.start()
        return compare, holder, hashing, hasher

    def move(self, plan: Plan, rank: int, ahead: Ahead, generation: Generation | None) -> Plan:
        """Once the group is formed (and a sharded model built on ``generation``'s mesh): layouts,
        the rollback, the holders' comparison, the transfers; the plan as followed (a rollback
        changes its resume step)."""
        m = self._member
        assert m.group is not None
        compare, holder, hashing, hasher = ahead
        if plan.world_size > 1:
            self._check_layout(plan)
        if plan.restore is not None:
            plan = self._restore_durable(plan)
        sources = dict(plan.sources)
        if compare:
            if hasher is not None:
                hasher.join()
            elif holder:
                hashing["d"] = combined_digest(self._model.entries())
            sources, lineages = compare_holders(m, plan, hashing.get("d"), holder, self._steps)
            self._arrival.exchanged(lineages)
        if rank in sources:
            self._receive(plan, sources[rank], light=rank in plan.caught_up)
        for dst in sorted(r for r, s in sources.items() if s == rank):
            if m.faults is not None:
                m.faults.at_recovery(rank, plan.resume_step, m.fault_fired, at="source")
            if dst in plan.caught_up:
                assert m.catch_ups is not None
                send_light(m.group, dst, self._model, self._secret, m.catch_ups.digest(fresh=rank in sources))
                continue
            transfer_out(m.group, dst, self._model, self._secret, gen=plan.gen, rank=rank)
        self._arrival.relayout(plan.resume_step)
        if plan.world_size > 1 and self._steps.committed < 0 and plan.restore is None:
            # nothing committed yet (generation 0, or a recovery before the first commit): every
            # replica starts from rank 0's parameters and buffers, as DDP's do
            replicas = generation.mesh.get_group("replicate") if generation is not None else None
            self._model.start_from_replica_0(m.group, replicas, plan.gen)
        return plan

    def _receive(self, plan: Plan, src: int, *, light: bool = False) -> None:
        """This rank's state from ``src`` (``StateArrival.receive``)."""
        m = self._member
        assert m.group is not None
        rank = m.rank

        def hook() -> None:
            # kill:spare@recovery hits a spare taking a rank only, never a lagging survivor that receives
            if m.faults is not None and plan.newcomer(rank):
                m.faults.at_recovery(rank, plan.resume_step, m.fault_fired)

        self._arrival.receive(m.group, self._client, plan, rank, src, light=light, hook=hook)

    def _restore_durable(self, plan: Plan) -> Plan:
        """The rollback to the durable tier (``StateArrival.restore_durable``); the plan as followed."""
        m = self._member
        assert m.group is not None and m.durable is not None  # a rollback is planned only with the tier on
        try:
            return self._arrival.restore_durable(plan, m.group, m.durable, self._client, rank=m.rank,
                                                 shard=m.shard, replica=m.replica)  # fmt: skip
        except Unrecoverable as e:
            m.fatal(str(e))

    def _check_layout(self, plan: Plan) -> None:
        """Every rank's parameters must have the same names, shapes and dtypes (``layouts_differ``)."""
        m = self._member
        assert m.group is not None and self._model.model is not None
        difference = layouts_differ(m.group, self._client, self._model.model, plan.gen, m.rank)
        if difference is not None:
            m.fatal(difference)
