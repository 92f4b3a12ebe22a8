"""The model a session trains, in one of two kinds: ``ReplicatedModel`` (installed once, its
gradients reduced by the session's own buckets) and ``ShardedModel`` (FSDP2, ``sharded_model.py``:
built anew on every generation's mesh, the state carried between generations as plain tensors).
Both hold the model, its optimizer, the more state the user registered and the registry of
everything that moves; they undo a failed attempt, leave a generation and reduce a step's gradients
each in their own way (``ModelHolder``). The group and the mesh are the member's (``member.py``):
they come in as arguments."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from checkpointless.comm import Group
from checkpointless.ddp import GradientReducer, reduce_unbucketed
from checkpointless.module_state import BufferSync, Trainable
from checkpointless.progress import Progress
from checkpointless.state import (
    Stateful,
    StateRegistry,
    digest_state,
    entry_digests,
)

log = logging.getLogger(__name__)

Agree = Callable[[int, list[str]], None]
"""``agree(step, names)``: every rank of the generation changed its trainable parameters alike at
``step`` (the member compares them over the store, and ends the job where they differ)."""


class ModelHolder(Protocol):
    """What the session and the member ask of the model, whichever its kind."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    state: dict[str, Stateful]
    registry: StateRegistry
    buffers: BufferSync
    sharded: bool

    def enter(self, mesh: Any) -> None: ...
    def start_from_replica_0(self, group: Group, replicas: Any, gen: int) -> None: ...
    def begin_attempt(
        self, group: Group | None, step: int, agree: Agree, divisor: int | None = None,
        owners: list[range] | None = None,
    ) -> None: ...  # fmt: skip
    def reduce(self, group: Group | None, step: int, agree: Agree) -> None: ...
    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...
    def hold(self, on: bool) -> None: ...
    def share_done(self, share: int) -> None: ...
    def commit(self) -> None: ...
    def undo_attempt(self) -> None: ...
    def leave(self, keep: bool) -> None: ...
    def received(self, step: int) -> None: ...
    def relayout(self, step: int) -> bool: ...
    def prepare_spare(self, device_type: str) -> None: ...
    def entries(self) -> list[tuple[str, str]]: ...
    def digest(self, committed: int) -> str: ...
    def flip_bit(self) -> None: ...


def broadcast_bytes(tensors: list[torch.Tensor], broadcast: Callable[[list[torch.Tensor]], None]) -> None:
    """``broadcast`` the non-empty ``tensors`` in place, as bytes (any dtype, bit for bit; a
    non-contiguous one through a copy)."""
    items = [(t, t if t.is_contiguous() else t.contiguous()) for t in tensors if t.numel()]
    broadcast([wire.reshape(-1).view(torch.uint8) for _, wire in items])
    for t, wire in items:
        if wire is not t:
            t.copy_(wire)


def compared_state(registry: StateRegistry) -> dict[str, Any]:
    """Everything registered (model with buffers, optimizer with its ``param_groups``, user state,
    step and data position) but the per-rank RNG states, the lineage and ``per_rank`` objects:
    what every replica of a shard must hold alike."""
    state = registry.compared_state_dict()
    if "progress" in state:
        state["progress"] = {k: v for k, v in state["progress"].items() if k not in ("rng", "lineage")}
    return state


def compared_entries(registry: StateRegistry) -> list[tuple[str, str]]:
    """Per-entry digests of ``compared_state``: what replicas compare."""
    return entry_digests(compared_state(registry))


def registry_of(entries: dict[str, Any], state: dict[str, Stateful], progress: Progress) -> StateRegistry:
    registry = StateRegistry()
    for name, obj in entries.items():
        registry.register(name, obj)
    for name, obj in state.items():
        registry.register(name, obj)
    registry.register("progress", progress)
    return registry


class ReplicatedModel:
    """A model every rank holds whole: installed once, its gradients averaged in fixed buckets
    (``ddp.GradientReducer``), overlapping the backward pass where ``overlap``."""

    sharded = False

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        state: dict[str, Stateful],
        progress: Progress,
        *,
        overlap: bool,
        broadcast_buffers: bool,
    ) -> None:
        self.model: torch.nn.Module | None = model
        self.optimizer, self.state = optimizer, state
        self._overlap, self._broadcast_buffers = overlap, broadcast_buffers
        self.trainable = Trainable(model)
        entries: dict[str, Any] = {"model": model}
        if optimizer is not None:
            entries["optimizer"] = optimizer
        entries["trainable"] = self.trainable
        self.registry = registry_of(entries, state, progress)
        self.reducer = GradientReducer(list(model.parameters()), overlap=overlap)
        self.buffers = BufferSync(model)

    def _module(self) -> torch.nn.Module:
        assert self.model is not None
        return self.model

    def trainable_names(self) -> list[str]:
        return [n for n, p in self._module().named_parameters() if p.requires_grad]

    def _rebuild_reducer(self, step: int) -> None:
        """Lay the gradient buckets out anew for the parameters that train now."""
        self.reducer.close()
        self.reducer = GradientReducer(list(self._module().parameters()), overlap=self._overlap)
        log.info(
            "[step %d] %d trainable parameters: gradient buckets laid out anew",
            step,
            len(self.reducer.params),
        )

    def enter(self, mesh: Any) -> None:
        """Installed once: a generation changes nothing of it."""

    def start_from_replica_0(self, group: Group, replicas: Any, gen: int) -> None:
        """Every replica starts from rank 0's parameters and buffers, as ``DistributedDataParallel``
        does at construction (a seeded model is unchanged, bit for bit)."""
        with torch.no_grad():
            broadcast_bytes(
                [p.detach() for p in self._module().parameters()], lambda ts: group.broadcast_(ts, root=0)
            )
        self.buffers.sync(group)
        self.buffers.commit()  # a failed first attempt restores these, not the rank's own

    def begin_attempt(
        self, group: Group | None, step: int, agree: Agree, divisor: int | None = None,
        owners: list[range] | None = None,
    ) -> None:  # fmt: skip
        """The backward pass starts reducing bucket by bucket (the buckets laid out anew first if
        the loop froze or unfroze a parameter since the last step, every rank alike); the sum is
        divided by ``divisor`` (the job's shares; None: the group's size). ``owners``: the exact
        sum over shares instead (``exact_sum``)."""
        if self.reducer.stale():
            agree(step, self.trainable_names())
            self._rebuild_reducer(step)
        self.reducer.begin(group, divisor, owners)

    def hold(self, on: bool) -> None:
        """The passes that follow accumulate without reducing (a replica's shares before its last)."""
        self.reducer.hold(on)

    def share_done(self, share: int) -> None:
        """The passes of ``share`` are over (the exact sum keeps its gradient apart)."""
        self.reducer.stash(share)

    def reduce(self, group: Group | None, step: int, agree: Agree) -> None:
        # on CPU, whether any rank's buffers moved since the last commit rides in the reduction:
        # rank 0's are broadcast then (BatchNorm's statistics, every step), not for a model whose
        # buffers are constant (a transformer's rotary table), every rank agreeing either way; on
        # an accelerator at every step (BufferSync's docstring)
        buffers = self.buffers
        sync = self._broadcast_buffers and bool(buffers) and group is not None and group.world_size > 1
        if sync and self.reducer.flag_on_host:
            moved = not buffers.synced or buffers.changed()
            sync = bool(self.reducer.reduce(group, 1.0 if moved else 0.0))
        else:
            self.reducer.reduce(group)
        if self.reducer.stale():  # unfrozen inside this attempt: reduced apart, this once
            agree(step, self.trainable_names())
            known = {id(p) for p in self.reducer.params}
            extra = [p for p in self._module().parameters() if p.requires_grad and id(p) not in known]
            reduce_unbucketed(extra, group, self.reducer.divisor(group) if group is not None else None)
        if sync:
            buffers.sync(group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.reducer.local():
            yield

    def commit(self) -> None:
        self.buffers.commit()
        self.trainable.commit()

    def undo_attempt(self) -> None:
        """A failed attempt: its reduction abandoned (collectives still in flight write into
        dropped buckets), the buffers and trainable flags as at the last commit."""
        self.reducer.abandon()
        self.buffers.restore()  # the failed attempt's forward pass updated them in place
        self.trainable.restore()

    def no_overlap(self) -> None:
        """Buckets reduce only at the reduction (``takeover``: a failed check before it leaves
        every gradient local)."""
        self._overlap = False
        self.reducer.set_overlap(False)

    def park_attempt(self) -> list[torch.Tensor] | None:
        """The attempt in flight set aside while its member changes generation (``takeover``): the
        buffers its passes moved returned (None without buffers), the committed ones in place
        (``carriable``: whether it can go on)."""
        saved = self.buffers.snapshot() if self.buffers else None
        self.buffers.restore()
        return saved

    def carriable(self) -> bool:
        """Whether the attempt in flight can go on in another generation: it reduced nothing and
        its trainable parameters are those its buckets were laid out for."""
        return not self.reducer.overlap and not self.reducer.stale()

    def resume_attempt(
        self, parked: list[torch.Tensor] | None, group: Group | None, owners: list[range]
    ) -> None:
        """The parked attempt goes on over ``group``, whose replicas hold ``owners``' shares: its
        buffers back, its gradients as they were."""
        if parked is not None:
            self.buffers.load(parked)
        self.reducer.rebind(group, owners)

    def leave(self, keep: bool) -> None:
        """Kept across generations: the failed attempt was undone already."""

    def received(self, step: int) -> None:
        """State was loaded from a peer: its buffers are the committed ones."""
        self.buffers.commit()

    def relayout(self, step: int) -> bool:
        """The gradient buckets laid out for the trainable flags as they are now (they came with a
        peer's state, or a failed attempt's change was undone); whether they had to be."""
        if not self.reducer.stale():
            return False
        self._rebuild_reducer(step)
        return True

    def prepare_spare(self, device_type: str) -> None:
        """A spare, while it waits: allocate the optimizer's state (AdamW's moments exist only
        after a first step), so that a recovery's transfer lands in existing tensors instead of
        allocating each one on arrival (``bench/spare_transfer.py`` measures the difference). One
        step on zero gradients does it; everything it touched is overwritten by the transfer."""
        if self.optimizer is None or self.optimizer.state:
            return
        params = [p for p in self._module().parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for p in params:
            p.grad = None

    def entries(self) -> list[tuple[str, str]]:
        return compared_entries(self.registry)

    def digest(self, committed: int) -> str:
        """SHA-256 of model, optimizer state and committed step (``digest_state``)."""
        return digest_state(self._module(), self.optimizer, committed)

    def flip_bit(self) -> None:
        """The ``corrupt`` fault: flip the lowest bit of the first element of the first parameter."""
        p = next(p for p in self._module().parameters() if p.numel())
        with torch.no_grad():
            p.view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)
