"""Sharded state (FSDP2 / HSDP): one ``torch.distributed`` world and device mesh per generation.

A sharded job runs PyTorch's own FSDP2 (``fully_shard``) on a 2-D device mesh, ``replicate x
shard`` (HSDP): rank ``r`` holds shard ``r % shards`` of the state and is replica
``r // shards`` of it, the layout ``control.plan.ReplicaMap`` plans recoveries with. FSDP2
keeps its process groups inside the module, its parameters (DTensors) and DTensor's caches, and
cannot be applied to a module twice, so a generation is built from scratch and torn down
whole (measured in docs/spikes/fsdp2/REPORT.md):

- ``Generation`` forms the generation's default process group on its own store prefix, one
  sub-group per mesh row and column (explicit timeouts: ``init_device_mesh`` would give gloo's
  30-minute default) and the ``DeviceMesh``; the session then calls the user's ``build(mesh)``
  for a fresh model and optimizer and loads the state into them.
- ``Generation.close`` releases the peers: gloo closes a group's connections only when the last
  reference to it goes, and the user's loop may still hold the old model or a loss whose
  autograd graph does (measured: a peer blocked on such a rank waits out the full timeout). So
  the connections of this generation's groups are shut down at the socket level
  (``shutdown(2)``), which fails every pending collective on them at once, here and on the
  peers; NCCL groups are aborted. They are told apart from what other threads opened meanwhile
  (a logger's, a data loader's connection) by their endpoints: accepted by one of the listeners
  the formation opened, or connected to a peer's, which every rank publishes on the
  generation's store prefix (``group_connections``); never a listener, never the store's. Then the default
  group is destroyed and the old model's garbage collected. DTensor's caches are kept when the
  next generation has the same layout (``_reuse_or_clear_caches``).
- ``ShardedState`` is the transferable state of one rank: its shard of every parameter and of
  the optimizer state as plain tensors (no DTensor on the wire), so ``send_state``/
  ``recv_state`` and the durable tier move it unchanged, and a replacement receives only its own
  shard from a survivor of the same shard.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkpointless import _compat
from checkpointless.comm import Group
from checkpointless.errors import CollectiveError
from checkpointless.sockets import (
    exchange_listeners,
    group_connections,
    listeners,
    shutdown_sockets,
    sockets,
    sockets_since,
)

log = logging.getLogger(__name__)

MESH_DIMS = ("replicate", "shard")

#: what ``Session(build=...)`` calls once per generation: the model (``fully_shard`` applied on
#: ``mesh``), its optimizer and, optionally, more named state built on them (an LR scheduler)
Build = Callable[
    [Any], "tuple[nn.Module, torch.optim.Optimizer] | tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]"
]


def clear_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation and redistribution caches (they hold meshes and groups;
    private torch APIs, behind ``_compat``'s version gate)."""
    _compat.clear_dtensor_caches()


_cache_signature: tuple[Any, ...] | None = None


def _reuse_or_clear_caches(signature: tuple[Any, ...]) -> None:
    """Keep DTensor's caches across generations of the same layout, clear them otherwise.

    Their entries hold ``DeviceMesh`` objects of the generation that filled them. A mesh names its
    groups and resolves them at each use (``DeviceMesh.get_group``), and a generation of the same
    layout recreates the same groups under the same names (the group counter restarts with each
    default group), so an old entry resolves to the new groups: reusing the caches is exact
    (tested bitwise) and spares the first step after a recovery re-deriving every DTensor
    operation's sharding, which made that step several times a normal one (inside the kill stall
    ``bench/hsdp.py`` measures). Any other layout, or other group names, clears them.
    """
    global _cache_signature
    if signature != _cache_signature:
        clear_dtensor_caches()
        _cache_signature = signature


def forget_dtensor_caches() -> None:
    """Clear DTensor's caches and forget their layout (the next generation starts them afresh)."""
    global _cache_signature
    clear_dtensor_caches()
    _cache_signature = None
    gc.collect()


class Generation:
    """The ``torch.distributed`` world of one generation: default group, mesh groups, ``DeviceMesh``.

    Collective over all ``world`` ranks (each calls it with its rank). Its connections are told
    apart from those other threads open meanwhile (``group_connections``): each rank publishes its
    group listeners under the generation's prefix and reads the peers'; ``close`` shuts down only
    the connections to or from them, never the store's.
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        gen: int,
        prefix: str,
        rank: int,
        world: int,
        shards: int,
        backend: str = "gloo",
        device_type: str | None = None,
        timeout: timedelta = timedelta(seconds=60),
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed default group already exists in this process")
        # Imported for the first time while a group exists, torch.distributed.tensor.debug (which
        # clear_dtensor_caches uses) keeps that group alive for good (found with the spare's
        # warm-up: one gloo group, whose event loop wakes 100 times a second, left in a process
        # that should sleep). Import it before there is any.
        import torch.distributed.tensor.debug

        self.gen, self.rank, self.world, self.shards = gen, rank, world, shards
        self.backend = backend
        self._closed = self._released = False
        before = sockets()
        # Group names come from a process-wide counter that destroying the default group resets,
        # but a formation that failed before its default group existed (a peer died, the
        # coordinator aborted it) leaves it advanced: this rank would then name every group one
        # higher than a fresh spare does, and their rendezvous keys would never meet
        _compat.reset_group_count()
        pstore = dist.PrefixStore(prefix, store)
        try:
            dist.init_process_group(backend, store=pstore, rank=rank, world_size=world, timeout=timeout)
            grid = torch.arange(world).reshape(world // shards, shards)
            mine: dict[int, Any] = {}
            # every rank creates every sub-group, in the same order (new_group's rule)
            for dim, lines in ((0, grid.T.tolist()), (1, grid.tolist())):
                for ranks in lines:
                    pg = dist.new_group(ranks, timeout=timeout)
                    if rank in ranks:
                        mine[dim] = pg
            from torch.distributed.device_mesh import DeviceMesh

            device = device_type or ("cuda" if backend == "nccl" else "cpu")  # CUDA over gloo too
            self.mesh: Any = DeviceMesh.from_group(
                [mine[0], mine[1]], device, mesh=grid, mesh_dim_names=MESH_DIMS
            )
            self._layout = (world, shards, backend, mine[0].group_name, mine[1].group_name)
            new = sockets_since(before)
            peers = exchange_listeners(pstore, rank, world, listeners(new), timeout)
            self._fds = group_connections(new, peers=peers)
        except RuntimeError as e:  # gloo, NCCL and store errors (DistError is one)
            self._fds = group_connections(sockets_since(before))  # those its listeners accepted
            self.close()
            raise CollectiveError(f"gen {gen}: group formation failed: {e}") from None
        self.group = Group.wrap(dist.group.WORLD, gen, rank, world, backend=backend,
                                released=lambda: self._released)  # fmt: skip

    def use_caches(self) -> None:
        """Keep or clear DTensor's caches for this generation (``_reuse_or_clear_caches``), on the
        thread that calls it: they are per thread (``threading.local``, in Python and in C++), and
        the generation forms on a helper thread while the model trains on the caller's. Cleared
        on the formation's thread, the training thread kept entries whose meshes held the groups
        of an earlier generation of the same shape: after a change of size, parameters built on
        the new mesh came out of the cache on a mesh whose groups no longer exist."""
        _reuse_or_clear_caches(self._layout)

    def release(self) -> None:
        """Fail every pending collective of the generation, here and on the peers (fast: no cleanup)."""
        if self._released:
            return
        self._released = True
        if self.backend == "nccl" and dist.is_initialized():
            for pg in _compat.process_groups():
                with contextlib.suppress(Exception):
                    pg.abort()
        n = shutdown_sockets(self._fds)
        log.debug("gen %d rank %d: shut down %d connections", self.gen, self.rank, n)

    def close(self) -> None:
        """Leave the generation: ``release``, then drop its groups and collect its garbage (the
        model's cycles: a tenth of a second or more; the session reports its failure first)."""
        self.release()
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.mesh = None
        gc.collect()


def fsdp_modules(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (a view of its storage), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return (t.to_local() if isinstance(t, DTensor) else t).detach()


class ShardedState:
    """One rank's state of an FSDP2 model and its optimizer, as plain tensors (``Stateful``).

    ``state_dict()`` returns views of the live shards (receiving into it writes the model in
    place): ``params`` and ``buffers`` by name, ``optim`` (per parameter name, every state
    value; ``sharded`` lists which are shards of a DTensor) and the optimizer's ``param_groups``
    hyper-parameters. ``load_state_dict`` copies parameters and buffers into the model and
    installs the optimizer state (wrapping shards back into DTensors on the current mesh).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer

    def _params(self) -> dict[str, nn.Parameter]:
        return dict(self.model.named_parameters())

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        params = self._params()
        out: dict[str, Any] = {
            "params": {n: _local(p) for n, p in params.items()},
            "buffers": {n: b.detach() for n, b in self.model.named_buffers()},
        }
        if self.optimizer is not None:
            optim: dict[str, dict[str, Any]] = {}
            sharded: dict[str, list[str]] = {}
            for n, p in params.items():
                st = self.optimizer.state.get(p)
                if not st:
                    continue
                optim[n] = {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                keys = sorted(k for k, v in st.items() if isinstance(v, DTensor))
                if keys:
                    sharded[n] = keys
            out["optim"] = optim
            out["sharded"] = sharded
            out["param_groups"] = [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
            ]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        params = self._params()
        if set(state["params"]) != set(params):
            raise ValueError(f"parameter names differ: {sorted(set(state['params']) ^ set(params))[:3]}")
        with torch.no_grad():
            for n, t in state["params"].items():
                mine = _local(params[n])
                if mine.data_ptr() != t.data_ptr():
                    mine.copy_(t)
            buffers = dict(self.model.named_buffers())
            for n, t in state["buffers"].items():
                if buffers[n].data_ptr() != t.data_ptr():
                    buffers[n].copy_(t)
        if self.optimizer is None:
            return
        for n, st in state["optim"].items():
            p = params[n]
            keys = set(state["sharded"].get(n, ()))
            new: dict[str, Any] = {}
            for k, v in st.items():
                if k in keys:
                    assert isinstance(p, DTensor)
                    new[k] = DTensor.from_local(
                        v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
                    )
                else:
                    new[k] = v
            self.optimizer.state[p] = new
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            group.update(saved)
