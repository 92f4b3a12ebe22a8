"""Data-parallel gradient reduction with a fixed, history-independent layout.

Gradients live in flat buckets laid out in reverse parameter order (the order backward
produces them), so the summation order of every element depends only on the bucket layout
and the world size, never on what happened before: a re-executed step after a recovery
reduces exactly as the fault-free step would have, bit for bit.

The reduction overlaps the backward pass, as ``DistributedDataParallel``'s does: a bucket's
all-reduce starts once every parameter in it has its gradient (a post-accumulate-grad hook
counts them), buckets start in layout order on every rank, and ``reduce`` waits for them. The
*last* bucket starts only in ``reduce``: a rank that fails between ``backward()`` and
``reduce_gradients()`` (an exception, a kill) leaves its peers waiting in that collective, so a
step still commits on every rank or on none.
"""

from __future__ import annotations

from typing import Any

import torch

from checkpointless.comm import Group

_FIRST_BUCKET_BYTES = 2**20  # as DistributedDataParallel: a small first bucket starts early


class GradientReducer:
    """Averages ``.grad`` of ``params`` across a ``Group`` (every member calls ``reduce``).

    With ``overlap`` (the default) every bucket but the last is all-reduced during the backward
    pass of an attempt ``begin`` opened. Several backward passes in one attempt (gradient
    accumulation) stay correct: a bucket already in flight when the next pass reaches it is
    waited for and averaged, and the new gradients are added to the average and reduced again,
    so every rank ends with the average of its sums (as ``DistributedDataParallel`` without
    ``no_sync``).
    """

    def __init__(
        self, params: list[torch.nn.Parameter], bucket_bytes: int = 25 * 2**20, *, overlap: bool = True
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._buckets: list[torch.Tensor] = []
        members: list[list[torch.nn.Parameter]] = []
        for p in reversed(self.params):
            cap = min(_FIRST_BUCKET_BYTES, bucket_bytes) if len(members) <= 1 else bucket_bytes
            if members:
                last = members[-1]
                size = (sum(q.numel() for q in last) + p.numel()) * p.element_size()
                if (last[0].dtype, last[0].device) == (p.dtype, p.device) and size <= cap:
                    last.append(p)
                    continue
            members.append([p])
        slots: dict[int, tuple[int, torch.Tensor]] = {}  # id(param) -> (bucket, view)
        for i, ps in enumerate(members):
            buf = torch.zeros(sum(q.numel() for q in ps), dtype=ps[0].dtype, device=ps[0].device)
            off = 0
            for q in ps:
                slots[id(q)] = (i, buf[off : off + q.numel()].view_as(q))
                off += q.numel()
            self._buckets.append(buf)
        self._bucket_of = [slots[id(p)][0] for p in self.params]  # by parameter index
        self._views = [slots[id(p)][1] for p in self.params]
        self._size = [len(ps) for ps in members]
        self.bytes = sum(b.numel() * b.element_size() for b in self._buckets)
        # the attempt in progress: its group, what is pending, what is in flight
        self._group: Group | None = None
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._pending = list(self._size)  # per bucket: parameters still without their gradient
        self._seen = [False] * len(self.params)  # accumulated in this round
        self._started = 0  # buckets [0, _started) are in flight or reduced in this round
        self._works: list[Any] = []
        if overlap:
            for p in self.params:
                p.register_hook(self._before_accumulate(p))
                p.register_post_accumulate_grad_hook(self._after_accumulate)

    def begin(self, group: Group | None) -> None:
        """Open an attempt: its backward pass reduces over ``group`` (no overlap when ``None``)."""
        self._drop()
        self._group = group if group is not None and group.world_size > 1 else None

    def _drop(self) -> None:
        self._works.clear()  # a live Work keeps a failed group's sockets open (comm's module doc)
        self._pending = list(self._size)
        self._seen = [False] * len(self.params)
        self._started = 0

    def _before_accumulate(self, p: torch.nn.Parameter) -> Any:
        index = self._index[id(p)]

        def hook(grad: torch.Tensor) -> None:
            if self._group is not None and self._seen[index]:
                self._settle()  # another backward pass (gradient accumulation) in this attempt
            return None

        return hook

    def _after_accumulate(self, p: torch.Tensor) -> None:
        if self._group is None:
            return
        index = self._index[id(p)]
        view = self._views[index]
        grad = p.grad
        if grad is not view and grad is not None:  # first step, or zero_grad(set_to_none=True)
            view.copy_(grad)  # autograd made a new tensor
            p.grad = view
        self._seen[index] = True
        self._pending[self._bucket_of[index]] -= 1
        # in layout order on every rank; the last bucket waits for ``reduce`` (see the module doc)
        while self._started < len(self._buckets) - 1 and self._pending[self._started] == 0:
            self._works.append(self._group.allreduce_start(self._buckets[self._started]))
            self._started += 1

    def _settle(self) -> None:
        """A new backward pass reaches a parameter: average the buckets already reduced, start a
        new round (the new gradients add to those averages, and to the local sums of the rest)."""
        assert self._group is not None
        self._group.wait_all(self._works)
        for b in self._buckets[: self._started]:
            b.div_(self._group.world_size)
        self._drop()

    def _gather(self) -> None:
        """Make every ``p.grad`` of a bucket not yet started a view into it (copying if autograd
        made a new one; zeros for a parameter that got no gradient)."""
        for p, view, bucket in zip(self.params, self._views, self._bucket_of, strict=True):
            if bucket < self._started:
                continue
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
        overlapped = group is not None and group is self._group
        if not overlapped:
            self._drop()
        self._gather()
        if group is None or group.world_size == 1:
            return
        try:
            for b in self._buckets[self._started :]:
                self._works.append(group.allreduce_start(b))
            self._started = len(self._buckets)
            group.wait_all(self._works)
        finally:
            self._drop()
            self._group = None  # until the next ``begin``
        for b in self._buckets:
            b.div_(group.world_size)

    def zero_(self) -> None:
        """Forget a partial step's gradients (after a failed reduction)."""
        self._drop()
        self._group = None
        for b in self._buckets:
            b.zero_()
        for p, view in zip(self.params, self._views, strict=True):
            if p.grad is not None and p.grad is not view:
                p.grad = None


class BufferSync:
    """A module's buffers (BatchNorm running statistics, counters) across replicas and failed attempts.

    - ``sync``: every replica takes rank 0's buffers. ``DistributedDataParallel(broadcast_buffers=True)``,
      its default, broadcasts rank 0's buffers before every forward pass, so every rank's forward sees
      rank 0's statistics. ``sync`` does the same once per step, after the forward and backward passes
      (from ``reduce_gradients``): every forward still sees rank 0's buffers of the step before, and,
      unlike with DDP, every replica also *holds* them when the step commits, so any replica can be
      the source of a recovery. One broadcast per dtype (buffers packed into flat buckets).
    - ``commit`` / ``restore``: a failed attempt's forward pass has already updated the buffers
      (BatchNorm does so in place); ``restore`` puts back the copy ``commit`` took at the last
      committed step, so that the step re-executes from exactly the committed state.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.buffers = [b for _, b in module.named_buffers()]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in self.buffers:
            by_dtype.setdefault((b.dtype, b.device), []).append(b)
        self._groups = [
            (torch.zeros(sum(b.numel() for b in members), dtype=dtype, device=device), members)
            for (dtype, device), members in by_dtype.items()
        ]
        self._saved = [torch.zeros_like(flat) for flat, _ in self._groups]
        self.synced = False  # whether ``sync`` ran since this object was made (a generation's first)
        self.commit()

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def _pack(self, into: list[torch.Tensor]) -> None:
        for (_, members), flat in zip(self._groups, into, strict=True):
            if members:
                torch.cat([b.detach().reshape(-1) for b in members], out=flat)

    def _unpack(self, source: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for (_, members), flat in zip(self._groups, source, strict=True):
                off = 0
                for b in members:
                    b.copy_(flat[off : off + b.numel()].view_as(b))
                    off += b.numel()

    def sync(self, group: Group | None, root: int = 0) -> None:
        """Overwrite every member's buffers with ``root``'s (no-op alone)."""
        if group is None or group.world_size == 1 or not self.buffers:
            return
        flats = [flat for flat, _ in self._groups]
        self._pack(flats)
        group.broadcast_(flats, root)
        self._unpack(flats)
        self.synced = True

    def changed(self) -> bool:
        """Whether any buffer differs, bit for bit, from the copy ``commit`` took (a forward pass in
        training mode moved BatchNorm's statistics; a constant buffer such as a rotary table never)."""
        flats = [flat for flat, _ in self._groups]
        self._pack(flats)
        return any(
            not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(flats, self._saved, strict=True)
        )

    def commit(self) -> None:
        """Remember the buffers as they are (at a committed step)."""
        self._pack(self._saved)

    def restore(self) -> None:
        """Put back the buffers ``commit`` remembered (after a failed attempt)."""
        self._unpack(self._saved)
