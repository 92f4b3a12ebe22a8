"""What the catch-up (``catch_up.py``) takes from a source and gives a follower: a copy of the
state that leaves the optimizer's own tensors by reference (``copy_state``, ``optimizer_storages``),
what the optimizer's ``step`` is given at each call, recorded by a pre-hook into pooled buffers
(``StepLog``, ``GradBuffers``), and that call made again on another optimizer (``apply_step``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from checkpointless.errors import CatchUpFailed


def copy_state(obj: Any, keep: frozenset[int] = frozenset()) -> Any:
    """A deep copy of a state dict: tensors cloned (but those whose storage is in ``keep``, taken as
    they are), containers rebuilt, the rest as it is (plain values: numbers, strings)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach() if obj.untyped_storage().data_ptr() in keep else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: copy_state(v, keep) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_state(v, keep) for v in obj]
    if isinstance(obj, tuple):
        return tuple(copy_state(v, keep) for v in obj)
    return obj


def optimizer_storages(optimizer: torch.optim.Optimizer | None) -> frozenset[int]:
    """The storages that only the optimizer's step changes: its parameters and its state."""
    if optimizer is None:
        return frozenset()
    out = {p.untyped_storage().data_ptr() for g in optimizer.param_groups for p in g["params"]}
    for per_param in optimizer.state.values():
        out.update(t.untyped_storage().data_ptr() for t in per_param.values() if isinstance(t, torch.Tensor))
    return frozenset(out)


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: copy_state(v) for k, v in group.items() if k != "params"}


Buffers = dict[tuple[torch.dtype, torch.device], torch.Tensor]
"""One set of ``GradBuffers``: a flat tensor per (dtype, device)."""


class GradBuffers:
    """Flat buffers a step's gradients are copied into, one per dtype and device (each parameter a
    slice at a fixed offset), reused once the step is sent: a record is a copy into pages touched
    before, not a fresh allocation, whose page faults cost more than the copy itself (at
    ``bench/never_wait.py``'s 1.5 GB state, on every step). The training thread takes a set, the
    sender gives it back."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        self._slots: list[tuple[tuple[torch.dtype, torch.device], int]] = []  # per parameter
        for p in params:
            key = (p.dtype, p.device)
            self._slots.append((key, self._sizes.get(key, 0)))
            self._sizes[key] = self._sizes.get(key, 0) + p.numel()
        self._shapes = [p.shape for p in params]
        self.count = len(params)
        self._free: list[Buffers] = []
        self._lock = threading.Lock()

    def _new(self) -> Buffers:
        return {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in self._sizes.items()}

    def touch(self) -> None:
        """One set allocated and written ahead (a thread of its own as the catch-up starts, so that
        the first record is no fresh allocation either)."""
        bufs = self._new()
        for t in bufs.values():
            t.zero_()
        self.release(bufs)

    def copy(self, grads: list[torch.Tensor | None]) -> tuple[list[torch.Tensor | None], Buffers]:
        """``grads`` (one per parameter, in order) copied into a set: the copies and the set to give
        back once they are sent. A gradient unlike its parameter (another dtype or shape) is cloned."""
        with self._lock:
            bufs = self._free.pop() if self._free else None
        if bufs is None:
            bufs = self._new()
        out: list[torch.Tensor | None] = []
        with torch.no_grad():
            for grad, (key, at), shape in zip(grads, self._slots, self._shapes, strict=True):
                if grad is None:
                    out.append(None)
                elif (grad.dtype, grad.device) != key or grad.shape != shape:
                    out.append(grad.detach().clone())
                else:
                    out.append(bufs[key][at : at + grad.numel()].view(shape).copy_(grad.detach()))
        return out, bufs

    def release(self, bufs: Buffers) -> None:
        """A set given back (one of another layout, from before a parameter group was added: dropped)."""
        if {key: t.numel() for key, t in bufs.items()} != self._sizes:
            return
        with self._lock:
            self._free.append(bufs)


class StepLog:
    """What an optimizer's ``step`` is given, recorded at each call (a pre-hook), kept per
    committed step."""

    def __init__(
        self, optimizer: torch.optim.Optimizer | None, before: Callable[[], None] = lambda: None,
        on_call: Callable[[dict[str, Any], Buffers], None] | None = None,
    ) -> None:  # fmt: skip
        """``before()`` runs first at each step (the source: until its state is sent); ``on_call``
        takes each call's record as it is made (the source: sent at once, while the optimizer
        steps), instead of ``take`` at the commit."""
        self._before, self._on_call = before, on_call
        self._pending: list[tuple[dict[str, Any], Buffers]] = []
        self.calls = 0  # calls recorded since the last commit or failure
        self.closure = False  # a step was called with a closure: it cannot be followed
        params = [] if optimizer is None else [p for g in optimizer.param_groups for p in g["params"]]
        self.buffers = GradBuffers(params)
        self._hook = None if optimizer is None else optimizer.register_step_pre_hook(self._before_step)

    def _before_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self._before()
        closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
        if closure is not None:  # (accelerate's wrapper passes its closure on, None, by position)
            self.closure = True
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if len(params) != self.buffers.count:
            self.buffers = GradBuffers(params)  # a parameter group was added
        grads, bufs = self.buffers.copy([p.grad for p in params])
        call = {"grads": grads, "groups": [_settings(g) for g in optimizer.param_groups]}
        self.calls += 1
        if self._on_call is not None:
            self._on_call(call, bufs)
        else:
            self._pending.append((call, bufs))

    def take(self) -> tuple[list[dict[str, Any]], list[Buffers]]:
        """The records of the step that just committed, and the buffers they are in (``buffers``
        takes them back once sent)."""
        out, self._pending, self.calls = self._pending, [], 0
        return [call for call, _ in out], [bufs for _, bufs in out]

    def drop(self) -> None:
        """The step failed: its records go, their buffers back."""
        for _, bufs in self._pending:
            self.buffers.release(bufs)
        self._pending, self.calls = [], 0

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._pending = []


def apply_step(optimizer: torch.optim.Optimizer | None, calls: list[dict[str, Any]]) -> None:
    """A followed step: the optimizer's ``step`` called as the source's was, on the same values."""
    if optimizer is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for call in calls:
        if len(call["grads"]) != len(params) or len(call["groups"]) != len(optimizer.param_groups):
            raise CatchUpFailed("the source's optimizer has other parameters than this one's")
        for group, settings in zip(optimizer.param_groups, call["groups"], strict=True):
            group.update(settings)
        for p, grad in zip(params, call["grads"], strict=True):
            p.grad = None if grad is None else grad.to(p.device)
        optimizer.step()
    for p in params:
        p.grad = None
