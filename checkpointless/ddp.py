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
