"""The model over generations: installed once (replicated) or built on every generation's mesh
(sharded), prepared by a spare while it waits, left and closed when a generation ends."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from checkpointless._compat import reshard_failed
from checkpointless.ddp import BufferSync, GradientReducer, Trainable
from checkpointless.errors import CollectiveError
from checkpointless.fsdp import (
    Generation,
    ShardedState,
    forget_dtensor_caches,
    fsdp_modules,
)
from checkpointless.session_base import SessionBase, _Progress
from checkpointless.state import (
    Stateful,
    StateRegistry,
)

log = logging.getLogger(__name__)


def _broadcast(tensors: list[torch.Tensor], broadcast: Callable[[list[torch.Tensor]], None]) -> None:
    """``broadcast`` the non-empty ``tensors`` in place, as bytes (any dtype, bit for bit; a
    non-contiguous one through a copy)."""
    items = [(t, t if t.is_contiguous() else t.contiguous()) for t in tensors if t.numel()]
    broadcast([wire.reshape(-1).view(torch.uint8) for _, wire in items])
    for t, wire in items:
        if wire is not t:
            t.copy_(wire)


class ModelLifecycle(SessionBase):
    def _start_from_replica_0(self) -> None:
        """Generation 0: every replica starts from replica 0's parameters and buffers, as
        ``DistributedDataParallel`` does at construction, so a model built without a seed trains
        as one model (sharded: each shard from replica 0's copy of it, over the replicate
        dimension). A seeded model is unchanged, bit for bit."""
        assert self.model is not None and self._group is not None
        group = self._group
        with torch.no_grad():
            if self._generation_state is None:
                _broadcast(
                    [p.detach() for p in self.model.parameters()], lambda ts: group.broadcast_(ts, root=0)
                )
            else:
                pg = self._generation_state.mesh.get_group("replicate")

                def over_replicas(ts: list[torch.Tensor]) -> None:
                    try:
                        for t in ts:
                            dist.broadcast(t, group=pg, group_src=0)
                    except RuntimeError as e:  # gloo, NCCL (DistError is one): a peer failed
                        raise CollectiveError(
                            f"gen {self.generation}: broadcast of the start failed: {e}"
                        ) from None

                _broadcast(
                    list(ShardedState(self.model, None).state_dict()["params"].values()), over_replicas
                )
        self._buffers.sync(group)
        self._buffers.commit()  # a failed first attempt restores these, not the rank's own

    def _install(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Stateful]
    ) -> None:
        """Make ``model``/``optimizer``/``state`` the session's (once; per generation when sharded)."""
        self.model, self.optimizer, self.state = model, optimizer, state
        self._registry = StateRegistry()
        if self._build is None:
            self._registry.register("model", model)
            if optimizer is not None:
                self._registry.register("optimizer", optimizer)
            self._trainable = Trainable(model)
            self._registry.register("trainable", self._trainable)
            self._reducer = GradientReducer(list(model.parameters()), overlap=self._overlap)
        else:
            self._registry.register("model", ShardedState(model, optimizer))
            self._reducer = None  # FSDP2 reduces inside backward()
        for name, obj in state.items():
            self._registry.register(name, obj)
        self._registry.register("progress", _Progress(self))
        self._buffers = BufferSync(model)

    def _build_generation(self) -> None:
        """Sharded: build this generation's model on its mesh and give it the state carried over."""
        assert self._build is not None and self._generation_state is not None
        built = self._build(self._generation_state.mesh)
        if not isinstance(built, tuple) or len(built) not in (2, 3):
            self._fatal(
                "Session(build=...): build(mesh) must return (model, optimizer) or (model, optimizer, state)"
            )
        model, optimizer = built[0], built[1]
        extra: dict[str, Stateful] = dict(built[2]) if len(built) == 3 else {}  # type: ignore[misc]
        if not fsdp_modules(model):
            self._fatal(
                "Session(build=...): build(mesh) returned a model without fully_shard(..., mesh=mesh)"
            )
        self._install(model, optimizer, extra)
        if self._saved is not None:
            self._registry.load_state_dict(self._saved)
            self._saved = None
            self._buffers.commit()

    def _materialize_optimizer(self) -> None:
        """A spare, while it waits: allocate the optimizer's state (AdamW's moments exist only
        after a first step), so that a recovery's transfer lands in existing tensors instead of
        allocating each one on arrival (which ran the transfer at 0.43x raw gloo). One step on
        zero gradients does it; everything it touched is overwritten by the transfer."""
        if self.optimizer is None or self.optimizer.state or self.model is None:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for p in params:
            p.grad = None

    def _prewarm(self) -> None:
        """A sharded spare builds the model once on a local 1 x 1 mesh while it waits: the first
        build in a process (imports, model classes, FSDP2's first use) takes seconds that a
        recovery would otherwise wait for (measured 2.8-5.6 s for llama-tiny on 2 busy cores,
        0.1 s for a build after that)."""
        assert self._build is not None
        warm = Generation(
            dist.HashStore(), gen=-1, prefix="prewarm/", rank=0, world=1, shards=1,
            device_type=self.device.type,
        )  # fmt: skip
        try:
            built = self._build(warm.mesh)
            del built
        finally:
            warm.close()
            # DTensor's caches hold the warm-up mesh and with it its groups, whose gloo event loops
            # wake up 100 times a second each: an idle spare must not take the CPU from the workers
            forget_dtensor_caches()

    def _leave_generation(self) -> None:
        """Sharded: release the peers, keep this rank's state as plain tensors, drop the model.

        The generation's groups are closed later (``_close_generation``), after the failure is
        reported, so that their cleanup overlaps the coordinator's planning.
        """
        if self._generation_state is not None:
            self._generation_state.release()
        if self.model is not None:
            for m in fsdp_modules(self.model):
                reshard_failed(m)  # a failed forward or backward may have left parameters gathered
            self._buffers.restore()
            if self._has_state:
                self._saved = self._registry.state_dict()
            self.model = self.optimizer = None
            self.state = {}
            self._registry = StateRegistry()
        if self._group is not None:
            self._group.abort()  # the generation's own groups stay for close(); a control group goes
        self._group = None

    def _close_generation(self) -> None:
        if self._generation_state is not None:
            self._generation_state.close()
            self._generation_state = None
