"""The model of a sharded session (``Session(build=...)``): FSDP2, built anew on every generation's
mesh, the state carried between generations as plain tensors. It is a ``ModelHolder``
(``model_holder.py``), as ``ReplicatedModel`` is: the group and the mesh are the member's and come in
as arguments."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from checkpointless._compat import reshard_failed
from checkpointless.comm import Group
from checkpointless.errors import CollectiveError, Unrecoverable
from checkpointless.fsdp import Build, Generation, ShardedState, forget_dtensor_caches, fsdp_modules
from checkpointless.model_holder import Agree, broadcast_bytes, compared_entries, registry_of
from checkpointless.module_state import BufferSync
from checkpointless.progress import Progress
from checkpointless.sharded_exact import ExactShardSum
from checkpointless.state import Stateful, StateRegistry, combined_digest, entry_digests


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
        self._sharded: list[Any] = []  # the model's FSDP2 modules (found once per generation)
        self._mesh: Any = None
        self._exact: ExactShardSum | None = None  # --exact-resize: the replica stage of the reduction

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
        sharded = fsdp_modules(model)
        if not sharded:
            raise Unrecoverable(
                "Session(build=...): build(mesh) returned a model without fully_shard(..., mesh=mesh)"
            )
        self.model, self.optimizer, self.state, self._sharded = model, optimizer, extra, sharded
        self._mesh, self._exact = mesh, None
        self._summed = False  # FSDP2's own division by the group's size, until begin_attempt
        self.registry = registry_of({"model": ShardedState(model, optimizer)}, extra, self._progress)
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
            broadcast_bytes(
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
        Any hold a failed attempt left is let go. ``owners`` (``--exact-resize``): the replicas'
        stage of the reduction is the exact sum over shares instead (``sharded_exact``)."""
        if self.model is None:
            return
        if owners is not None and divisor is not None:
            if self._exact is None:
                if self._mesh.size(1) == 1:
                    raise Unrecoverable("--exact-resize with a sharded model needs --shards above 1")
                self._exact = ExactShardSum(self._mesh.get_group("replicate"), self._mesh.size(1))
                self._exact.install(self._sharded, divisor)
            self._exact.begin(divisor)
            return
        world = group.world_size if group is not None else 1
        if divisor is not None and divisor != world and not self._summed:
            for m in self._sharded:  # a generation's size is fixed: its model's once
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(float(divisor))
            self._summed = True
        self.hold(False)

    def hold(self, on: bool) -> None:
        """While ``on``, backward passes accumulate this rank's unsharded gradients without any
        reduction (FSDP2's ``set_requires_gradient_sync(False)``); the next pass after reduces.
        With the exact sum every pass reduce-scatters, and only the last all-reduces."""
        if self._exact is not None:
            self._exact.last(not on)
            return
        for m in self._sharded:
            m.set_requires_gradient_sync(not on, recurse=False)

    def share_done(self, share: int) -> None:
        """Reduced by FSDP2: nothing to keep (the exact sum keeps each pass's reduce-scatter)."""
        if self._exact is not None:
            self._exact.done()

    def reduce(self, group: Group | None, step: int, agree: Agree) -> None:
        # FSDP2 reduced the gradients inside backward(), group by group, so a failure there may
        # have spared some ranks. Every rank passes this point or none does: a step then commits
        # everywhere or nowhere (as a DDP reduction makes it), and only the ranks that lost their
        # state receive any (gradient clipping's norm all-reduce, after this, is the one collective
        # left that can split a step). The barrier is a one-number all-reduce that also tells
        # whether any rank's buffers moved since the last commit: rank 0's are broadcast then (and
        # at a generation's first step), not for a model whose buffers are constant (a
        # transformer's rotary table), every rank agreeing either way.
        if self._exact is not None:
            self._exact.check()
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
        for m in self._sharded:
            reshard_failed(m)  # a failed forward or backward may have left parameters gathered
        self.buffers.restore()
        if keep:
            self._saved = self.registry.state_dict()
        self.model = self.optimizer = None
        self._sharded, self._mesh, self._exact = [], None, None
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
