"""Digests of a state: per entry (what replicas compare, naming the entry that differs), of a
model and optimizer (``final_state_sha256``), of a durable snapshot's tensors; tensors are hashed
in a thread pool (BLAKE3 and hashlib release the GIL)."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import numpy as np
import torch


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t``, a contiguous CPU tensor, as a view (no copy: valid while ``t``
    lives); a bool tensor's as one byte per value, an empty tensor's empty."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")  # type: ignore[arg-type]


_POOL: ThreadPoolExecutor | None = None


def hash_pool() -> ThreadPoolExecutor:
    """The process's threads that hash tensors (BLAKE3, hashlib and GMAC release the GIL), so
    digests run beside the transfer's wire: created on first use, between 2 and 8 threads,
    shared by every caller and never shut down."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(
            max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="cl-hash"
        )
    return _POOL


def _tensor_digest(t: torch.Tensor) -> bytes:
    """BLAKE3 of one contiguous tensor's bytes (32 bytes)."""
    return blake3.blake3(tensor_bytes(t if t.device.type == "cpu" else t.cpu())).digest()


def snapshot_digest(tensors: list[torch.Tensor]) -> str:
    """SHA-256 over the BLAKE3 digests of each tensor's bytes, in order, in hex: a durable
    snapshot's digest, the same on any machine for the same tensors (no key, no salt: the
    transfer seals its tensors under the job's key instead). Hashed in ``hash_pool``."""
    digests = list(hash_pool().map(_tensor_digest, [t.contiguous() for t in tensors]))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def leaf_digest(value: Any) -> str:
    """BLAKE3 of one leaf of a state, in hex: a tensor's dtype, shape and bytes (copied to the
    CPU), a numpy array's likewise, anything else its ``repr``: what replicas compare
    (``entry_digests``) and what a frozen parameter is offered by (``state.frozen``)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous().cpu()
        h = blake3.blake3(f"{t.dtype}{list(t.shape)}".encode())
        h.update(tensor_bytes(t))
        return h.hexdigest()
    if isinstance(value, np.ndarray):
        return blake3.blake3(f"{value.dtype}{list(value.shape)}".encode() + value.tobytes()).hexdigest()
    return blake3.blake3(repr(value).encode()).hexdigest()


def entry_digests(state: dict[str, Any]) -> list[tuple[str, str]]:
    """``(path, digest)`` of every leaf of ``state``, in order: what replicas compare.

    Paths join the keys with ``/`` (``model/bn1.running_mean``, ``optimizer/state/0/exp_avg``),
    so a difference can be named. Tensors are hashed in the thread pool (BLAKE3 releases the GIL).
    """
    leaves: list[tuple[str, Any]] = []

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}/{k}" if path else str(k))
        elif isinstance(obj, list | tuple) and any(
            isinstance(v, dict | list | tuple | torch.Tensor) for v in obj
        ):
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
        else:
            leaves.append((path, obj))

    walk(state, "")
    digests = hash_pool().map(leaf_digest, [v for _, v in leaves])
    return [(path, d) for (path, _), d in zip(leaves, digests, strict=True)]


def combined_digest(entries: list[tuple[str, str]]) -> bytes:
    """One 32-byte digest of ``entry_digests``' output (paths included)."""
    h = blake3.blake3()
    for path, d in entries:
        h.update(f"{len(path)}:{path}={d};".encode())
    return h.digest()


def digest_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> str:
    """SHA-256 over every parameter and buffer, every optimizer state tensor and the step.

    Canonical order, identical on any run and any rank: the model's
    ``state_dict`` order, then optimizer state by parameter index with keys
    sorted, then the step as a little-endian int64.
    """
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor_bytes(t.detach().contiguous().cpu()))
    if optimizer is not None:
        opt_state = optimizer.state_dict()["state"]
        for idx in sorted(opt_state):
            for key in sorted(opt_state[idx]):
                v = opt_state[idx][key]
                h.update(f"{idx}/{key}".encode())
                if isinstance(v, torch.Tensor):
                    h.update(tensor_bytes(v.detach().contiguous().cpu()))
                else:
                    h.update(repr(v).encode())
    h.update(int(step).to_bytes(8, "little", signed=True))
    return h.hexdigest()


def first_difference(a: list[tuple[str, str]], b: list[tuple[str, str]]) -> str | None:
    """The path of the first entry that differs between two ``entry_digests`` (None if none does)."""
    db = dict(b)
    for path, d in a:
        if db.get(path) != d:
            return path
    extra = [p for p, _ in b if p not in dict(a)]
    return extra[0] if extra else None
