"""The exact sum over shares for a sharded (HSDP) model (``--exact-resize``): a step's gradient
summed in share order, so that its bits do not depend on how many replicas computed it.

FSDP2 reduces a gradient in two stages: a reduce-scatter over one replica's ranks (the shard
group, whose size and order never change) and an all-reduce over the replicas (whose number
does). The first stage is kept; the second is replaced:

1. every share's pass reduce-scatters on its own (no hold), and the reduce-scatter
   (``set_custom_reduce_scatter``) keeps a copy of each output, per FSDP2 reduction of the pass;
2. the passes before the replica's last skip the all-reduce (``set_requires_all_reduce(False)``):
   nothing of theirs reaches ``.grad``;
3. in the last pass, after FSDP2's all-reduce of each reduction, its hook
   (``set_all_reduce_hook``) replaces the result with the exact sum over every share's copy, in
   share order, over this shard's replicas (``exact_sum.share_sum``); FSDP2 then divides it by
   the job's shares and writes it to ``.grad``. A negative zero comes out as a positive one
   (``.grad`` may be added to a zero gradient or assigned, depending on the script).

Cost: FSDP2's own all-reduce still runs in the last pass (its result is dropped), so the replicas
exchange the gradient twice; memory: one reduce-scattered gradient per share held.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from checkpointless.errors import Unrecoverable
from checkpointless.exact_sum import share_sum
from checkpointless.share_loop import assign


class _Replicas:
    """A ``torch.distributed`` group as ``share_sum`` uses it (``comm.Group``'s calls)."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self._pg = pg
        self.world_size, self.rank = pg.size(), pg.rank()

    def alltoall(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> None:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self._pg)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self._pg)
        return out


class _KeptReduceScatter:
    """FSDP2's reduce-scatter, each output kept (``ExactShardSum.kept``): the public interface of
    ``set_custom_reduce_scatter`` (``allocate`` and the call of its ``ReduceScatter``)."""

    def __init__(self, owner: ExactShardSum) -> None:
        self._owner = owner

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:  # fmt: skip
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
        self._owner.kept(output_tensor)
        return None


class ExactShardSum:
    """The exact sum over shares of one generation's sharded model (module docstring):
    ``install`` on its FSDP2 modules; per attempt ``begin(shares)``, then ``check()`` before the
    update; per pass ``last(on)`` before it and ``done()`` after it."""

    def __init__(self, replicas: dist.ProcessGroup, shards: int) -> None:
        self._replicas, self._shards = _Replicas(replicas), shards
        self._modules: list[Any] = []
        self._mine: list[int] = []  # this replica's shares, in the order of its passes
        self._pass = 0  # the pass under way: share ``_mine[_pass]``
        self._last = True  # whether the pass under way is the replica's last
        self._owners: list[range] = []
        self._stashed: dict[int, list[torch.Tensor]] = {}  # per share: its reductions' outputs
        self._summed = 0  # the last pass's reductions replaced so far

    def install(self, modules: list[Any], shares: int) -> None:
        """Take over the replica stage of ``modules``' reduction, dividing by ``shares``."""
        self._modules = modules
        hook = _KeptReduceScatter(self)
        for m in modules:
            m.set_custom_reduce_scatter(hook)
            m.set_all_reduce_hook(self._replace)
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(float(shares))

    def begin(self, shares: int) -> None:
        """A new attempt: the job's ``shares`` (ranks' parts; replica shares of ``shards`` each, the
        replicas holding contiguous blocks of them in replica order, ``share_loop.held_by``)."""
        self._owners = assign(shares // self._shards, self._replicas.world_size)
        self._mine = list(self._owners[self._replicas.rank])
        self._pass, self._summed = 0, 0
        self._stashed = {}
        self.last(True)

    def last(self, on: bool) -> None:
        """Whether the pass that follows is the replica's last (it all-reduces)."""
        self._last = on
        for m in self._modules:
            m.set_requires_all_reduce(on, recurse=False)

    def done(self) -> None:
        """The pass under way ended."""
        self._pass += 1

    def check(self) -> None:
        """Before the update: every share's pass made the same reductions (one synchronised
        backward pass per share), else the sums paired the wrong ones."""
        counts = {s: len(kept) for s, kept in self._stashed.items()}
        if len(set(counts.values())) > 1 or any(n != self._summed for n in counts.values()):
            raise Unrecoverable(
                "--exact-resize with a sharded model: the shares' passes made different numbers of "
                f"gradient reductions ({counts}, {self._summed} summed): run one backward pass per share "
                "outside session.no_sync()"
            )

    def kept(self, output: torch.Tensor) -> None:
        """A reduction of the pass under way: keep its reduce-scattered output."""
        self._stashed.setdefault(self._mine[self._pass], []).append(output.clone())

    def _replace(self, output: torch.Tensor) -> None:
        """FSDP2's all-reduce of a reduction of the last pass is done: the exact sum instead."""
        if not self._last:  # (a 1-D mesh has no all-reduce to skip: nothing of the pass reaches .grad)
            output.zero_()
            return
        b = self._summed
        self._summed += 1
        stashed = {s: [kept[b]] for s, kept in self._stashed.items()}
        share_sum(self._replicas, self._owners, stashed, [output])  # type: ignore[arg-type]
        output.add_(0.0)  # -0.0 -> +0.0 (module docstring)
