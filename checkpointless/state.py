"""Transferable training state: registry, canonical digest, peer-to-peer transfer.

Anything registered must follow the ``Stateful`` protocol (``state_dict`` and
``load_state_dict``, as ``nn.Module``, ``Optimizer`` and LR schedulers do).
Registered state is *replicated*: every rank of a replica group holds the same
bytes, so any of them can serve as the source for a replacement.

Transfer protocol (``send_state`` / ``recv_state``), point to point on the
generation's group, source to receiver, in this order:

1. an int64 header ``[len(meta)]``;
2. ``meta``: the pickled skeleton of the state (tensors replaced by their
   dtype, shape and index);
3. every tensor, one message each (tag = index + 1), all posted at once;
4. a trailer: the SHA-256 over the per-tensor SHA-256s in skeleton order,
   which both sides compute in a thread pool while the tensors are on the wire.

The receiver allocates, receives, checks the hash, then loads: nothing is read
from or written to disk.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from checkpointless.comm import Group


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class IntegrityError(RuntimeError):
    """Received state does not match the hash the source computed."""


@dataclass(frozen=True, slots=True)
class _TensorRef:
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    on_accelerator: bool = False


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace every tensor in a nested dict/list/tuple by a ``_TensorRef``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _TensorRef(len(tensors) - 1, obj.dtype, tuple(obj.shape), obj.device.type != "cpu")
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_flatten(v, tensors) for v in obj)
    return obj


def _unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorRef):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_unflatten(v, tensors) for v in obj)
    return obj


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")  # type: ignore[arg-type]


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    """Threads that hash tensors while the transfer runs (hashlib releases the GIL)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(
            max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="cl-hash"
        )
    return _POOL


def _sha256(t: torch.Tensor) -> bytes:
    return hashlib.sha256(_bytes_of(t if t.device.type == "cpu" else t.cpu())).digest()


def _combine(digests: list[bytes]) -> str:
    """The transfer digest: SHA-256 over the per-tensor SHA-256s, in skeleton order."""
    return hashlib.sha256(b"".join(digests)).hexdigest()


def _hash_tensors(tensors: list[torch.Tensor]) -> str:
    """The transfer digest of ``tensors`` (what ``send_state`` sends as its trailer)."""
    return _combine(list(_pool().map(_sha256, [t.contiguous() for t in tensors])))


class StateRegistry:
    """Named ``Stateful`` objects that make up one rank's transferable state."""

    def __init__(self) -> None:
        self._items: dict[str, Stateful] = {}

    def register(self, name: str, obj: Stateful) -> None:
        if name in self._items:
            raise ValueError(f"state {name!r} is already registered")
        if not isinstance(obj, Stateful):
            raise TypeError(f"state {name!r} has no state_dict/load_state_dict")
        self._items[name] = obj

    def names(self) -> list[str]:
        return list(self._items)

    def state_dict(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self._items.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self._items) ^ set(state)
        if missing:
            raise ValueError(f"state names differ between source and receiver: {sorted(missing)}")
        for name, obj in self._items.items():
            obj.load_state_dict(state[name])


@dataclass(frozen=True, slots=True)
class TransferStats:
    bytes: int
    seconds: float
    sha256: str


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def send_state(group: Group, dst: int, state: dict[str, Any]) -> TransferStats:
    """Send ``state`` to rank ``dst`` of ``group`` (``dst`` must call ``recv_state``).

    All tensor messages are posted at once and hashed while they are on the
    wire; the SHA-256 follows them as a trailer.
    """
    t0 = time.perf_counter()
    tensors: list[torch.Tensor] = []
    skeleton = _flatten(state, tensors)
    tensors = [t.contiguous() for t in tensors]
    meta = pickle.dumps({"skeleton": skeleton}, protocol=pickle.HIGHEST_PROTOCOL)
    group.send(torch.tensor([len(meta)], dtype=torch.int64), dst)
    group.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst)
    works = [group.isend(_wire(t), dst, tag=i + 1) for i, t in enumerate(tensors) if t.numel()]
    hashes = [_pool().submit(_sha256, t) for t in tensors]
    for w in works:
        group.wait(w)
    digest = _combine([f.result() for f in hashes])
    group.send(torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8), dst)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return TransferStats(nbytes, time.perf_counter() - t0, digest)


def _refs(obj: Any) -> Iterator[_TensorRef]:
    if isinstance(obj, _TensorRef):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _refs(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _refs(v)


def recv_state(
    group: Group, src: int, *, between: Callable[[], None] | None = None
) -> tuple[dict[str, Any], TransferStats]:
    """Receive a state sent by ``send_state`` from rank ``src``; verify its hash.

    ``between`` runs after the metadata arrived and before the tensors do (the
    fault-injection point for a receiver killed mid-transfer).
    """
    t0 = time.perf_counter()
    n = torch.zeros(1, dtype=torch.int64)
    group.recv(n, src)
    raw = torch.empty(int(n.item()), dtype=torch.uint8)
    group.recv(raw, src)
    meta = pickle.loads(raw.numpy().tobytes())
    refs = sorted(_refs(meta["skeleton"]), key=lambda r: r.index)
    if between is not None:
        between()
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    tensors = [
        torch.empty(ref.shape, dtype=ref.dtype, device=accel if ref.on_accelerator and accel else "cpu")
        for ref in refs
    ]
    works = {i: group.irecv(_wire(t), src, tag=i + 1) for i, t in enumerate(tensors) if t.numel()}
    hashes = []
    for i, t in enumerate(tensors):  # hash each tensor once it arrived, while the rest is on the wire
        if i in works:
            group.wait(works[i])
        hashes.append(_pool().submit(_sha256, t))
    trailer = torch.empty(32, dtype=torch.uint8)
    group.recv(trailer, src)
    expected = bytes(trailer.tolist()).hex()
    digest = _combine([f.result() for f in hashes])
    if digest != expected:
        raise IntegrityError(f"state from rank {src}: sha256 {digest[:12]} != {expected[:12]}")
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return _unflatten(meta["skeleton"], tensors), TransferStats(nbytes, time.perf_counter() - t0, digest)


def digest_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> str:
    """SHA-256 over every parameter and buffer, every optimizer state tensor and the step.

    Canonical order, identical on any run and any rank: the model's
    ``state_dict`` order, then optimizer state by parameter index with keys
    sorted, then the step as a little-endian int64.
    """
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(_bytes_of(t.detach().contiguous().cpu()))
    if optimizer is not None:
        opt_state = optimizer.state_dict()["state"]
        for idx in sorted(opt_state):
            for key in sorted(opt_state[idx]):
                v = opt_state[idx][key]
                h.update(f"{idx}/{key}".encode())
                if isinstance(v, torch.Tensor):
                    h.update(_bytes_of(v.detach().contiguous().cpu()))
                else:
                    h.update(repr(v).encode())
    h.update(int(step).to_bytes(8, "little", signed=True))
    return h.hexdigest()
