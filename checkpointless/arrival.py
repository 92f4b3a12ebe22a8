"""The state a member takes as it enters a generation: from a peer (a replacement's whole state, or
a caught-up spare's rest), from the durable tier (a rollback), or from the majority of its shard
(the consistency check), and what follows a load (the committed buffers, the trainable flags, the
lineage the computation descends from).

``StateArrival`` is the only writer of whether the process holds valid job state (``has_state``)
and of the lineages the holders last exchanged; ``Member`` holds it and keeps the process's place
in the job (rank, group, generation), which it passes in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from checkpointless.comm import Group
from checkpointless.consistency import TrainableAgreement
from checkpointless.control.client import ControlClient
from checkpointless.control.plan import Plan
from checkpointless.durable import DurableWriter
from checkpointless.errors import IntegrityError
from checkpointless.following import JoinCheck, recv_light
from checkpointless.model_holder import ModelHolder
from checkpointless.progress import StepState
from checkpointless.protocol.vocab import Event
from checkpointless.recovery_source import restore_durable, transfer_in
from checkpointless.replicas import own_lineage
from checkpointless.state import TransferStats, recv_state, send_state

log = logging.getLogger(__name__)


class StateArrival:
    """Moves state into (and, for the consistency check, out of) this process's model holder."""

    def __init__(
        self, model: ModelHolder, steps: StepState, trainable: TrainableAgreement, secret: bytes, *,
        has_state: bool,
    ) -> None:  # fmt: skip
        self._model, self._steps, self._trainable, self._secret = model, steps, trainable, secret
        self.has_state = has_state  # whether this process holds valid job state (a spare does not yet)
        self._lineages: dict[int, int] = {}  # every member's, as last exchanged in a recovery
        # a caught-up spare's check of its state against its source's, pending since its join
        self._join: tuple[JoinCheck, dict[str, object]] | None = None

    def exchanged(self, lineages: dict[int, int]) -> None:
        """The members' lineages as the holders exchanged them entering this generation."""
        self._lineages = lineages

    def receive(
        self, group: Group, client: ControlClient, plan: Plan, rank: int, src: int, *, light: bool,
        hook: Callable[[], None],
    ) -> None:  # fmt: skip
        """This rank's state from ``src`` (a replacement's, or a survivor's that lost it); ``light``:
        a spare that caught up receives what the catch-up did not bring, and checks the whole
        against its source's digest beside its first step (``verify``). ``hook`` runs as the first
        piece arrives (the fault injector's)."""
        client.emit(Event.TRANSFER_BEGUN, rank=rank, gen=plan.gen, step=plan.resume_step, src=src)
        # received in place, into this process's own tensors: it holds no valid state until loaded
        self.has_state = False
        if light:
            hook()
            stats, check, sent_lineage = recv_light(group, src, self._model, self._secret)
            self._loaded(plan, src, sent_lineage)
            self._join = check, {"rank": rank, "gen": plan.gen, "step": plan.resume_step, "src": src,
                                 "bytes": stats.bytes, "seconds": round(stats.seconds, 4)}  # fmt: skip
            return
        stats, kept, sent_lineage = transfer_in(group, src, self._model, self._secret, hook)
        self._loaded(plan, src, sent_lineage)
        client.emit(
            Event.TRANSFER_ENDED, rank=rank, gen=plan.gen, step=plan.resume_step, src=src,
            bytes=stats.bytes, seconds=stats.seconds, waited_s=round(stats.waited_s, 4), sha256_ok=True,
            kept_bytes=kept,
        )  # fmt: skip

    def verify(self, client: ControlClient) -> None:
        """A caught-up spare, before any gradient of its first step leaves it: its state against its
        source's digest. If they differ it holds no valid state and ``IntegrityError`` fails the
        attempt: the recovery sends it everything. Nothing pending: nothing to do."""
        if self._join is None:
            return
        check, fields = self._join
        self._join = None
        same = check.same()
        client.emit(Event.CATCH_UP_ENDED, sync=True, ok=same, **fields)  # type: ignore[arg-type]
        if not same:
            self.has_state = False
            raise IntegrityError(
                f"the state this rank caught up to differs from rank {fields['src']}'s (a script that changes "
                "its parameters outside the optimizer's step?): it receives all of it in the recovery"
            )

    def _loaded(self, plan: Plan, src: int, sent_lineage: int | None) -> None:
        """The state from ``src`` is loaded: it descends from the source's lineage (as the holders
        exchanged it, else as its state says)."""
        self.has_state = True
        self._took_state(plan.resume_step)
        lineage = own_lineage(plan.gen, src) if sent_lineage is None else sent_lineage
        self._steps.descend(self._lineages.get(src, lineage))

    def _took_state(self, step: int) -> None:
        """State was loaded into the model: its buffers committed, its trainable flags (which came
        with it) the ones the ranks agree on."""
        self._model.received(step)
        self.relayout(step, took=True)

    def relayout(self, step: int, *, took: bool = False) -> None:
        """The gradient buckets follow the trainable flags as they are now, which every rank holds
        alike (a peer's state brought them, ``took``; or each undid its failed attempt's change)."""
        if (self._model.relayout(step) or took) and self._model.model is not None and not self._model.sharded:
            self._trainable.took([n for n, p in self._model.model.named_parameters() if p.requires_grad])

    def resync_to(self, group: Group, dst: int) -> None:
        """The consistency check: send this rank's state to a replica that differs from the majority."""
        send_state(group, dst, self._model.registry.state_dict(), key=self._secret)

    def resync_from(self, group: Group, ref: int, lineage: int, step: int) -> TransferStats:
        """The consistency check: this replica differs from its shard's majority: it takes ``ref``'s
        state (whose computation descends from ``lineage``)."""
        self.has_state = False
        state, stats = recv_state(group, ref, key=self._secret, into=self._model.registry.state_dict())
        self._model.registry.load_state_dict(state)
        self.has_state = True
        self._steps.descend(lineage)
        self._took_state(step)
        return stats

    def restore_durable(
        self, plan: Plan, group: Group, durable: DurableWriter, client: ControlClient, *, rank: int, shard: int,
        replica: int,
    ) -> Plan:  # fmt: skip
        """Every rank rolls back to its run's newest durable snapshot at or before the plan's step
        that every rank can load (``recovery_source.restore_durable``); the plan as followed.
        ``Unrecoverable`` where none can be."""
        self.has_state = False
        followed = restore_durable(plan, group, durable, self._model, client, rank=rank, shard=shard,
                                   replica=replica)  # fmt: skip
        self._model.buffers.commit()
        self.has_state = True
        return followed
