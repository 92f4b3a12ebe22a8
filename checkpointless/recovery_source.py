"""Where a recovery takes a member's state from: a peer (sent in place, the frozen tensors the
receiver already holds alike left out: ``state/frozen.py``) or, when every copy of a shard is lost,
the durable tier's newest snapshot that every rank can load."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import torch

from checkpointless.comm import Group
from checkpointless.control.client import ControlClient
from checkpointless.control.plan import Plan
from checkpointless.durable import DurableWriter
from checkpointless.durable_snapshots import load as load_durable
from checkpointless.errors import IntegrityError, Unrecoverable
from checkpointless.model_holder import ModelHolder
from checkpointless.protocol.vocab import Event
from checkpointless.state import TransferStats, frozen, recv_state, send_state

log = logging.getLogger(__name__)


def transfer_in(
    group: Group, src: int, model: ModelHolder, secret: bytes, between: Callable[[], None]
) -> tuple[TransferStats, int, int | None]:
    """Receive this rank's state from ``src`` into the model's own tensors and load it: the
    transfer's figures, the bytes of frozen tensors kept instead of received, and the lineage the
    state says it descends from (None if it says none)."""
    mine = model.registry.state_dict()
    offered = frozen.offer(mine, model.model)
    frozen.send_offer(group, src, offered)
    received, stats = recv_state(group, src, between=between, key=secret, into={"state": mine})
    state, kept = frozen.fill_in(received, mine, offered)
    del mine, received
    model.registry.load_state_dict(state)
    sent = state.get("progress", {}).get("lineage")
    return stats, kept, None if sent is None else int(sent)


def transfer_out(group: Group, dst: int, model: ModelHolder, secret: bytes, *, gen: int, rank: int) -> None:
    """Send this rank's state to ``dst``, leaving out the frozen tensors it holds alike."""
    offered = frozen.recv_offer(group, dst)
    sent, kept = frozen.leave_out(model.registry.state_dict(), model.model, offered)
    stats = send_state(group, dst, sent, key=secret)
    del sent
    log.info(
        "[gen %d rank %d] sent %d bytes to rank %d in %.3fs (%d bytes of frozen parameters it held alike "
        "not sent)", gen, rank, stats.bytes, dst, stats.seconds, kept,
    )  # fmt: skip


def restore_durable(
    plan: Plan, group: Group, writer: DurableWriter, model: ModelHolder, client: ControlClient, *,
    rank: int, shard: int, replica: int,
) -> Plan:  # fmt: skip
    """Every rank rolls back to its run's newest durable snapshot, at or before the plan's step,
    that every rank can load; returns the plan as followed (resuming after that snapshot).

    Each rank loads the newest snapshot of its shard that verifies at or before the bound
    (``durable_snapshots.load``: a flipped byte, a file gone or another run's are skipped, with a warning
    line and, from dp-rank 0 of the shard, a ``durable_failed`` event); one all-gather of the
    steps loaded, and the smallest becomes the bound, until every rank loaded the same step.
    None left: ``Unrecoverable``.
    """
    assert plan.restore is not None
    writer.wait()  # this process's own save may still be writing
    bound, mine, bad, why = plan.restore, -1, set(), []
    while True:
        if mine != bound:
            mine = -1
            for step in writer.candidates(plan.shards, at_most=bound):
                if step in bad:
                    continue
                try:
                    state = load_durable(writer.root, step, shard, writer.run)
                except IntegrityError as e:
                    bad.add(step)
                    why.append(str(e))
                    log.warning("[gen %d rank %d] durable snapshot not used, trying an older one: %s",
                                plan.gen, rank, e)  # fmt: skip
                    if replica == 0:
                        client.emit(Event.DURABLE_FAILED, sync=True, rank=rank, gen=plan.gen, step=step,
                                    shard=shard, during="restore", error=str(e)[:300])  # fmt: skip
                    continue
                model.registry.load_state_dict(state)
                mine = step
                break
        steps = [int(t) for t in group.control.allgather(torch.tensor([mine], dtype=torch.int64))]
        if min(steps) < 0:
            skipped = ", ".join(map(str, sorted(bad, reverse=True))) or "none here"
            raise Unrecoverable(
                f"cannot roll back to a durable snapshot: none of this run at or before step {plan.restore} "
                f"verifies on every rank (skipped on this rank: {skipped}{'; ' + why[0][:250] if why else ''})"
            )
        if len(set(steps)) == 1:
            break
        bound = min(steps)
    client.emit(Event.DURABLE_RESTORED, sync=True, rank=rank, gen=plan.gen, step=mine)
    return plan if mine == plan.restore else replace(plan, restore=mine, resume_step=mine + 1)
