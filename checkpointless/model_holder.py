"""The model a session trains, in one of two kinds: ``ReplicatedModel`` (installed once, its
gradients reduced by the session's own buckets) and ``ShardedModel`` (FSDP2: built anew on every
generation's mesh, the state carried between generations as plain tensors). Both hold the model,
its optimizer, the more state the user registered and the registry of everything that moves; they
undo a failed attempt, leave a generation and reduce a step's gradients each in their own way.
The group and the mesh are the member's (``member.py``): they come in as arguments."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from checkpointless._compat import reshard_failed
from checkpointless.comm import Group
from checkpointless.ddp import GradientReducer, reduce_unbucketed
from checkpointless.errors import CollectiveError, Unrecoverable
from checkpointless.fsdp import Build, Generation, ShardedState, forget_dtensor_caches, fsdp_modules
from checkpointless.module_state import BufferSync, Trainable
from checkpointless.progress import Progress
from checkpointless.state import (
    Stateful,
    StateRegistry,
    combined_digest,
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


def _broadcast(tensors: list[torch.Tensor], broadcast: Callable[[list[torch.Tensor]], None]) -> None:
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


def _registry_of(entries: dict[str, Any], state: dict[str, Stateful], progress: Progress) -> StateRegistry:
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
        self.registry = _registry_of(entries, state, progress)
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
            _broadcast(
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


class ShardedModel:
    """A model sharded by FSDP2: ``build(mesh)`` is called on every generation's mesh (FSDP2 binds
    a module to its process groups for good); between generations this rank's shard of the state
    is kept as plain tensors and loaded into the next build."""

    sharded = True

    def __init__(self, build: Build, progress: Progress, *, broadcast_buffers: bool) -> None:
        self._build, self._progress = build, progress
        self._broadcast_buffers = broadcast_buffers
        self._saved: dict[str, Any] | None = None  # the state carried between generations
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.state: dict[str, Stateful] = {}
        self.registry = StateRegistry()
        self.buffers = BufferSync(torch.nn.Module())
        self._summed = False

    def _module(self) -> torch.nn.Module:
        assert self.model is not None
        return self.model

    def enter(self, mesh: Any) -> None:
        """Build this generation's model on its mesh and give it the state carried over."""
        built = self._build(mesh)
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            raise Unrecoverable(
                "Session(build=...): build(mesh) must return (model, optimizer) or (model, optimizer, state)"
            )
        model, optimizer = built[0], built[1]
        extra: dict[str, Stateful] = dict(built[2]) if len(built) == 3 else {}  # type: ignore[misc]
        if not fsdp_modules(model):
            raise Unrecoverable(
                "Session(build=...): build(mesh) returned a model without fully_shard(..., mesh=mesh)"
            )
        self.model, self.optimizer, self.state = model, optimizer, extra
        self._summed = False  # FSDP2's own division by the group's size, until begin_attempt
        self.registry = _registry_of({"model": ShardedState(model, optimizer)}, extra, self._progress)
        self.buffers = BufferSync(model)
        if self._saved is not None:
            self.registry.load_state_dict(self._saved)
            self._saved = None
            self.buffers.commit()

    def start_from_replica_0(self, group: Group, replicas: Any, gen: int) -> None:
        """Each shard starts from replica 0's copy of it, over the replicate dimension (``replicas``:
        its process group), and the buffers from rank 0's."""

        def over_replicas(ts: list[torch.Tensor]) -> None:
            try:
                for t in ts:
                    dist.broadcast(t, group=replicas, group_src=0)
            except RuntimeError as e:  # gloo, NCCL (DistError is one): a peer failed
                raise CollectiveError(f"gen {gen}: broadcast of the start failed: {e}") from None

        with torch.no_grad():
            _broadcast(
                list(ShardedState(self._module(), None).state_dict()["params"].values()), over_replicas
            )
        self.buffers.sync(group)
        self.buffers.commit()

    def begin_attempt(
        self, group: Group | None, step: int, agree: Agree, divisor: int | None = None,
        owners: list[range] | None = None,
    ) -> None:  # fmt: skip
        """FSDP2 reduces inside ``backward()``, dividing by the group's size. Where the job's
        ``divisor`` (its shares) differs from it (an elastic job smaller or larger than at its
        start), FSDP2 sums instead (reduce-scatter over the shard, all-reduce over the replicas)
        and divides the sum by ``divisor``: the sum over the job's shares divided by their number.
        Any hold a failed attempt left is let go. No exact sum: ``JobConfig`` refuses it."""
        if self.model is None:
            return
        world = group.world_size if group is not None else 1
        if divisor is not None and divisor != world and not self._summed:
            for m in fsdp_modules(self.model):  # a generation's size is fixed: its model's once
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(float(divisor))
            self._summed = True
        self.hold(False)

    def hold(self, on: bool) -> None:
        """While ``on``, backward passes accumulate this rank's unsharded gradients without any
        reduction (FSDP2's ``set_requires_gradient_sync(False)``); the next pass after reduces."""
        for m in fsdp_modules(self.model) if self.model is not None else ():
            m.set_requires_gradient_sync(not on, recurse=False)

    def share_done(self, share: int) -> None:
        """Reduced by FSDP2: nothing to keep."""

    def reduce(self, group: Group | None, step: int, agree: Agree) -> None:
        # FSDP2 reduced the gradients inside backward(), group by group, so a failure there may
        # have spared some ranks. Every rank passes this point or none does: a step then commits
        # everywhere or nowhere (as a DDP reduction makes it), and only the ranks that lost their
        # state receive any (gradient clipping's norm all-reduce, after this, is the one collective
        # left that can split a step). The barrier is a one-number all-reduce that also tells
        # whether any rank's buffers moved since the last commit: rank 0's are broadcast then (and
        # at a generation's first step), not for a model whose buffers are constant (a
        # transformer's rotary table), every rank agreeing either way.
        if group is None or group.world_size < 2:
            return
        buffers = self.buffers
        moved = self._broadcast_buffers and bool(buffers) and (not buffers.synced or buffers.changed())
        flag = torch.tensor([1.0 if moved else 0.0])
        group.control.allreduce_([flag])
        if flag.item() > 0:
            buffers.sync(group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP2's ``set_requires_gradient_sync(False)``."""
        model = self._module()
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def commit(self) -> None:
        self.buffers.commit()

    def undo_attempt(self) -> None:
        """The whole model is left with its generation (``leave``)."""

    def leave(self, keep: bool) -> None:
        """Keep this rank's state as plain tensors (``keep``: it holds valid state) and drop the
        model, whose FSDP2 groups are the generation's."""
        if self.model is None:
            return
        for m in fsdp_modules(self.model):
            reshard_failed(m)  # a failed forward or backward may have left parameters gathered
        self.buffers.restore()
        if keep:
            self._saved = self.registry.state_dict()
        self.model = self.optimizer = None
        self.state = {}
        self.registry = StateRegistry()

    def received(self, step: int) -> None:
        self.buffers.commit()

    def relayout(self, step: int) -> bool:
        """FSDP2 lays out its own reduction: nothing to redo."""
        return False

    def prepare_spare(self, device_type: str) -> None:
        """A sharded spare builds the model once on a local 1 x 1 mesh while it waits: the first
        build in a process (imports, model classes, FSDP2's first use) takes seconds that a
        recovery would otherwise wait for; a build after that is fast."""
        warm = Generation(
            dist.HashStore(), gen=-1, prefix="prewarm/", rank=0, world=1, shards=1, device_type=device_type
        )
        try:
            built = self._build(warm.mesh)
            del built
        finally:
            warm.close()
            # DTensor's caches hold the warm-up mesh and with it its groups, whose gloo event loops
            # wake up 100 times a second each: an idle spare must not take the CPU from the workers
            forget_dtensor_caches()

    def entries(self) -> list[tuple[str, str]]:
        return compared_entries(self.registry)

    def digest(self, committed: int) -> str:
        """SHA-256 of this rank's shard and the committed step (equal on every replica of the shard)."""
        entries = entry_digests(
            {k: v for k, v in self.registry.compared_state_dict().items() if k != "progress"}
        )
        return hashlib.sha256(
            combined_digest(entries) + committed.to_bytes(8, "little", signed=True)
        ).hexdigest()

    def flip_bit(self) -> None:
        """The ``corrupt`` fault: flip the lowest bit of the first element of this rank's shard."""
        p = next(t for t in self.registry.state_dict()["model"]["params"].values() if t.numel())
        with torch.no_grad():
            p.view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)
