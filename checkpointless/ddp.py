"""Data-parallel gradient reduction with a fixed, history-independent layout.

Gradients live in flat buckets laid out in parameter order, so the summation
order of every element depends only on the bucket layout and the world size,
never on what happened before: a re-executed step after a recovery reduces
exactly as the fault-free step would have, bit for bit.
"""

from __future__ import annotations

import torch

from checkpointless.comm import Group


class GradientReducer:
    """Averages ``.grad`` of ``params`` across a ``Group`` (every member calls ``reduce``)."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_bytes: int = 25 * 2**20) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._buckets: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in self.params:
            by_dtype.setdefault((p.dtype, p.device), []).append(p)
        slots: dict[int, torch.Tensor] = {}
        for (dtype, device), params_of_dtype in by_dtype.items():
            limit = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
            buckets: list[list[torch.nn.Parameter]] = [[]]
            for p in params_of_dtype:
                if buckets[-1] and sum(q.numel() for q in buckets[-1]) + p.numel() > limit:
                    buckets.append([])
                buckets[-1].append(p)
            for members in buckets:
                buf = torch.zeros(sum(q.numel() for q in members), dtype=dtype, device=device)
                off = 0
                for q in members:
                    slots[id(q)] = buf[off : off + q.numel()].view_as(q)
                    off += q.numel()
                self._buckets.append(buf)
        self._views = [slots[id(p)] for p in self.params]
        self.bytes = sum(b.numel() * b.element_size() for b in self._buckets)

    def _gather(self) -> None:
        """Make every ``p.grad`` a view into the buckets (copying if autograd made a new one)."""
        for p, view in zip(self.params, self._views, strict=True):
            g = p.grad
            if g is view:
                continue
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            p.grad = view

    def reduce(self, group: Group | None) -> None:
        """Average gradients over ``group``; a ``None`` group (one process) only gathers."""
        self._gather()
        if group is None or group.world_size == 1:
            return
        group.allreduce_(self._buckets)
        for b in self._buckets:
            b.div_(group.world_size)

    def zero_(self) -> None:
        """Forget a partial step's gradients (after a failed reduction)."""
        for b in self._buckets:
            b.zero_()
        for p, view in zip(self.params, self._views, strict=True):
            if p.grad is not None and p.grad is not view:
                p.grad = None
