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

Arithmetic (the same bits with and without the overlap): every backward pass of an attempt
reduces every bucket once, as ``DistributedDataParallel`` without ``no_sync`` does. When a second
pass starts (gradient accumulation), every bucket is reduced and averaged (those in flight are
waited for, the rest are started then), and the new pass adds its local gradients to those
averages: after two passes a bucket holds ``sum_r(avg(g1) + g2_r) / W``. Passes inside
``local()`` (``Session.no_sync``) reduce nothing; the next pass reduces their sum with its own.

An abandoned attempt (``abandon``) leaves no trace in the next one: the buckets its collectives
may still write into (an all-reduce in flight on a live peer completes after the failure) are
dropped, and the next attempt gets fresh ones, unless by its ``begin`` every collective has ended
(the failed group aborted): then it keeps them. Host memory is the point: fresh buckets are pages
the kernel must fault in and zero, inside the survivors' stall (``bench/recovery_stall.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from checkpointless._compat import queue_end_of_backward
from checkpointless.comm import Group
from checkpointless.exact_sum import share_sum

_FIRST_BUCKET_BYTES = 2**20  # as DistributedDataParallel: a small first bucket starts early


class GradientReducer:
    """Averages ``.grad`` of ``params`` across a ``Group`` (every member calls ``reduce``).

    With ``overlap`` (the default) every bucket but the last is all-reduced during the backward
    pass of an attempt ``begin`` opened. Several backward passes in one attempt (gradient
    accumulation) reduce as ``DistributedDataParallel`` without ``no_sync`` does (the module doc);
    the result is the same bit for bit with the overlap off.
    """

    def __init__(
        self, params: list[torch.nn.Parameter], bucket_bytes: int = 25 * 2**20, *, overlap: bool = True
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.overlap = overlap
        self._members: list[list[int]] = []  # per bucket: parameter indices, in layout order
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            cap = min(_FIRST_BUCKET_BYTES, bucket_bytes) if len(self._members) <= 1 else bucket_bytes
            if self._members:
                last = [self.params[j] for j in self._members[-1]]
                size = (sum(q.numel() for q in last) + p.numel()) * p.element_size()
                if (last[0].dtype, last[0].device) == (p.dtype, p.device) and size <= cap:
                    self._members[-1].append(i)
                    continue
            self._members.append([i])
        self._bucket_of = [0] * len(self.params)  # by parameter index
        for b, members in enumerate(self._members):
            for i in members:
                self._bucket_of[i] = b
        self._size = [len(m) for m in self._members]
        self._buckets: list[torch.Tensor] = []
        self._views: list[torch.Tensor] = []
        self._allocate()
        self._retired = False  # an abandoned attempt's collectives may still write into the buckets
        self._used: Group | None = None  # the group of the last attempt's collectives
        self.bytes = sum(p.numel() * p.element_size() for p in self.params)  # the gradients (not the flag)
        # the attempt in progress: its group, what is pending, what is in flight
        self._group: Group | None = None
        self._local = False  # inside ``local()``: passes accumulate without reducing
        self._hold = False  # a share's passes before the replica's last share (``hold``): the same
        self._divisor: int | None = None  # what the sum is divided by (None: the group's size)
        self._owners: list[range] | None = None  # the exact sum over shares: each replica's shares
        self._stashed: dict[int, list[torch.Tensor]] = {}  # this replica's shares' gradients, apart
        self._stash_pool: list[list[torch.Tensor]] = []  # their buffers, kept from step to step
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._in_pass = False  # a backward pass of this attempt is running
        self._open = False  # a reducing pass ended whose buckets are not all reduced yet
        self._pending = list(self._size)  # per bucket: parameters still without their gradient
        self._started = 0  # buckets [0, _started) are in flight or reduced in this round
        self._works: list[Any] = []
        self._handles = [h for p in self.params for h in self._hooks(p)]
        self.trainable = [p.requires_grad for p in params]  # what ``stale`` compares against
        self._all = list(params)

    def _allocate(self) -> None:
        """Fresh zeroed buckets and the gradient views into them; the last bucket has one element
        more, after its gradients: the flag ``reduce`` sums with them."""
        self._buckets = []
        views: list[torch.Tensor | None] = [None] * len(self.params)
        for b, members in enumerate(self._members):
            ps = [self.params[i] for i in members]
            flag = int(b == len(self._members) - 1)
            buf = torch.zeros(sum(q.numel() for q in ps) + flag, dtype=ps[0].dtype, device=ps[0].device)
            off = 0
            for i, q in zip(members, ps, strict=True):
                views[i] = buf[off : off + q.numel()].view_as(q)
                off += q.numel()
            self._buckets.append(buf)
        self._views = [v for v in views if v is not None]
        assert len(self._views) == len(self.params)

    def _hooks(self, p: torch.nn.Parameter) -> list[Any]:
        return [
            p.register_hook(self._before_accumulate),
            p.register_post_accumulate_grad_hook(self._after_accumulate),
        ]

    def close(self) -> None:
        """Remove the hooks (the session replaces a reducer whose trainable parameters changed)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def stale(self) -> bool:
        """Whether the set of trainable parameters changed since this reducer was built."""
        return any(p.requires_grad != t for p, t in zip(self._all, self.trainable, strict=True))

    def begin(
        self, group: Group | None, divisor: int | None = None, owners: list[range] | None = None
    ) -> None:
        """Open an attempt: its backward passes reduce over ``group`` (nothing to reduce when ``None``),
        the sum divided by ``divisor`` (the job's shares, ``share_loop``; None: the group's size).
        ``owners`` (the shares of each replica): the exact sum over shares instead (``exact_sum``):
        nothing reduces during the backward passes, each share's gradient is kept (``stash``)."""
        self._drop()
        self._renew()
        self._open = self._in_pass = self._hold = False
        self._group = group if group is not None and group.world_size > 1 else None
        self._used = self._group
        self._divisor = divisor
        self._owners, self._stashed = owners, {}

    def set_overlap(self, on: bool) -> None:
        """Whether the buckets reduce during the backward pass (between attempts only)."""
        self.overlap = on

    def rebind(self, group: Group | None, owners: list[range]) -> None:
        """The attempt goes on in another generation (``takeover``): its gradients as they are, every
        pass so far local (no overlap: nothing was started), the next ones adding to them, the
        reduction over ``group``, whose replicas hold ``owners``' shares (the exact sum's; each
        share's gradient stashed so far is kept)."""
        assert not self.overlap, "an attempt carried into another generation reduced nothing yet"
        self._drop()
        self._group = group if group is not None and group.world_size > 1 else None
        self._used = self._group
        self._open = self._in_pass = False
        if self._owners is not None:
            self._owners = owners

    def hold(self, on: bool) -> None:
        """While on, backward passes accumulate without reducing, as in ``local()`` (the passes of a
        replica's shares before its last: ``share_loop``)."""
        self._hold = on

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients without reducing (``no_sync``)."""
        self._local = True
        try:
            yield
        finally:
            self._local = False

    def _renew(self) -> None:
        """After an abandoned attempt: keep the buckets if no collective can write into them any
        more and they are in host memory (the module doc), else fresh ones."""
        if not self._retired:
            return
        self._retired = False
        on_host = all(b.device.type == "cpu" for b in self._buckets)
        if not on_host or (self._used is not None and self._used.writing()):
            self._allocate()
        else:
            for b in self._buckets:
                b.zero_()

    def _drop(self) -> None:
        self._works.clear()  # a live Work keeps a failed group's sockets open (comm's module doc)
        self._pending = list(self._size)
        self._started = 0

    def _pass_ended(self, reducing: bool) -> None:
        self._in_pass = False
        self._open = self._open or reducing

    def _before_accumulate(self, grad: torch.Tensor) -> None:
        if self._group is None or self._in_pass:
            return None
        # the first gradient of a backward pass of this attempt
        self._in_pass = True
        reducing = not (self._local or self._hold or self._owners is not None)
        queue_end_of_backward(lambda: self._pass_ended(reducing))
        if self._open:
            self._settle()  # another pass after a reducing one (gradient accumulation)
        return None

    def _after_accumulate(self, p: torch.Tensor) -> None:
        if self._group is None:
            return
        index = self._index[id(p)]
        view = self._views[index]
        grad = p.grad
        if grad is not view and grad is not None:  # first step, or zero_grad(set_to_none=True)
            view.copy_(grad)  # autograd made a new tensor
            p.grad = view
        if self._local or self._hold or self._owners is not None or not self.overlap:
            return
        self._pending[self._bucket_of[index]] -= 1
        # in layout order on every rank; the last bucket waits for ``reduce`` (see the module doc)
        while self._started < len(self._buckets) - 1 and self._pending[self._started] == 0:
            self._works.append(self._group.allreduce_start(self._buckets[self._started]))
            self._started += 1

    @property
    def flag_on_host(self) -> bool:
        """Whether ``reduce``'s flag is in host memory (gloo on CPU), where reading its sum costs no
        wait for the device."""
        return bool(self._buckets) and self._buckets[-1].device.type == "cpu"

    def _reduce_all(self, group: Group, flag: float | None = None) -> float | None:
        """Start every bucket not yet started, wait for all, average; a new round begins. Returns
        the sum over the group of ``flag`` (carried by the last bucket, which starts here), if given."""
        self._gather()
        if flag is not None:
            self._buckets[-1][-1] = flag
        try:
            for b in self._buckets[self._started :]:
                self._works.append(group.allreduce_start(b))
            self._started = len(self._buckets)
            group.wait_all(self._works)
        finally:
            self._drop()
            self._open = False
        summed = None if flag is None else float(self._buckets[-1][-1])
        for b in self._buckets:
            b.div_(self.divisor(group))
        return summed

    def divisor(self, group: Group) -> int:
        """What this attempt's sum is divided by: the job's shares, else the group's size."""
        return self._divisor if self._divisor is not None else group.world_size

    def _settle(self) -> None:
        """A new backward pass begins: reduce the previous passes' gradients in every bucket (on
        every rank the same collectives in the same order, whatever each rank's backward reached)."""
        assert self._group is not None
        self._reduce_all(self._group)

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

    def stash(self, share: int) -> None:
        """The exact sum: the passes of ``share`` are over; its gradient is kept apart and the next
        share's passes start from zero (nothing without ``owners``)."""
        if self._owners is None:
            return
        self._gather()
        grads = [b[: b.numel() - self._flag(i)] for i, b in enumerate(self._buckets)]
        held = len(self._stashed)
        if held == len(self._stash_pool):  # a replica holding more shares than before: one more set
            self._stash_pool.append([torch.empty_like(g) for g in grads])
        kept = self._stash_pool[held]
        for k, g in zip(kept, grads, strict=True):
            k.copy_(g)
        self._stashed[share] = kept
        for b in self._buckets:
            b.zero_()

    def _flag(self, bucket: int) -> int:
        """How many elements after the gradients ``bucket`` has (the last one: ``reduce``'s flag)."""
        return int(bucket == len(self._buckets) - 1)

    def _exact(self, group: Group | None, flag: float | None) -> float | None:
        """``reduce`` with the exact sum over shares (``exact_sum``); the flag in a collective of its own."""
        assert self._owners is not None
        rank = group.rank if group is not None else 0
        if not self._stashed:  # a step without the share loop: its one share is the rank's
            (share,) = self._owners[rank]
            self.stash(share)
        out = [b[: b.numel() - self._flag(i)] for i, b in enumerate(self._buckets)]
        try:
            share_sum(group, self._owners, self._stashed, out)
        finally:
            self._stashed = {}
        for b in out:
            b.div_(self._divisor or 1)
        if flag is None or group is None or group.world_size == 1:
            return flag
        summed = torch.tensor([flag], dtype=torch.float64)
        group.allreduce_([summed])
        return float(summed)

    def reduce(self, group: Group | None, flag: float | None = None) -> float | None:
        """Average gradients over ``group``; a ``None`` group (one process) only gathers. Given a
        ``flag`` (every member gives one or none does), returns the sum of every member's, which
        rides in the last bucket (no collective of its own: the session's "did any rank's buffers
        move" needs no extra round trip); alone, ``flag`` itself."""
        if group is not self._group:  # no ``begin`` for this group: nothing was started
            self._drop()
            self._renew()
            self._open = False
        if self._owners is not None:
            self._group = None
            return self._exact(group, flag)
        if group is None or group.world_size == 1:
            self._gather()
            if self._divisor is not None and self._divisor > 1:  # one replica computing several shares
                for b in self._buckets:
                    b.div_(self._divisor)
            return flag
        try:
            return self._reduce_all(group, flag)
        finally:
            self._group = None  # until the next ``begin``

    def abandon(self) -> None:
        """Forget an attempt that failed: no write can reach the next attempt's gradients.

        Collectives of the attempt may still be running (an all-reduce a live peer completes
        after this rank failed, or a ring step in progress when a peer died): they write into
        buckets that are dropped here. Their memory lives as long as those collectives hold it;
        the next attempt reduces in fresh, zeroed buckets.
        """
        self._drop()
        self._group = None
        self._open = self._in_pass = self._hold = False
        self._stashed = {}
        self._retired = True  # fresh buckets or these, decided at the next ``begin``
        for p in self.params:
            p.grad = None


def reduce_unbucketed(
    params: list[torch.nn.Parameter], group: Group | None, divisor: int | None = None
) -> None:
    """Average the gradients of ``params`` in one flat synchronous all-reduce (parameters that
    became trainable inside an attempt, after its reducer's layout was fixed); ``divisor`` as
    ``GradientReducer.begin``'s."""
    if group is None or group.world_size == 1 or not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    group.allreduce_([flat])
    flat.div_(divisor if divisor is not None else group.world_size)
    off = 0
    for p in params:
        p.grad = flat[off : off + p.numel()].view_as(p).clone()
        off += p.numel()
