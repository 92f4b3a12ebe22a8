"""Frozen state a receiver already holds is not sent again: what a LoRA recovery moves.

A model whose base is frozen (``requires_grad=False``: a LoRA fine-tune) trains only a small
adapter; the base stays what every process built from the same checkpoint (or seed). A
replacement has built that base too, so a recovery need not move it: only the trainable
parameters, the optimizer state and the rest of the registered state travel. Nothing is taken
on trust; the receiver proves it holds the same bytes, and the source proves what it left out:

1. the receiver sends its source an **offer** (``send_offer``, on the group's control group:
   an int64 length, then UTF-8 JSON): for every tensor of its registered state that is a frozen
   parameter of its model (found by storage, so a tied weight under two names is offered twice),
   the path into the state and the BLAKE3 digest of its dtype, shape and bytes (``offer``);
2. the source (``recv_offer``, then ``leave_out``) leaves out of the state it sends every offered
   path that is a frozen parameter on its side too and whose digest it computes equal, and lists
   those paths with its digests under ``kept``. That list travels inside the transfer, so the
   transfer's MAC covers it (``transfer.py``);
3. the receiver (``fill_in``) refuses the state (``IntegrityError``, before anything is loaded)
   unless every left-out path is one it offered, with the digest it offered, and then completes
   the state with its own tensors at those paths.

A path whose digests differ, that the receiver did not offer, or that the source trains is sent
as before, so the rule never loads anything but bytes equal to the source's. The cost is hashing
the frozen tensors once on each side per transfer (BLAKE3 in the digest pool, GIL released) and
one small message from the receiver to the source. A state with nothing frozen offers nothing
and sends everything.

Both sides call these in a fixed order (``Member._enter``): the receiver ``offer``,
``send_offer``, ``recv_state`` (into ``{"state": its own state}``), ``fill_in``; the source
``recv_offer``, ``leave_out``, ``send_state``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from checkpointless.comm import Group
from checkpointless.errors import IntegrityError
from checkpointless.state.codec import MAX_META_BYTES
from checkpointless.state.digests import hash_pool, leaf_digest

EntryPath = tuple[str, ...]


def _frozen_storages(model: nn.Module | None) -> set[int]:
    """``data_ptr`` of every frozen parameter's local data (a DTensor's shard: FSDP2)."""
    if model is None:
        return set()
    out: set[int] = set()
    for p in model.parameters():
        if p.requires_grad:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p  # DTensor (FSDP2): this rank's shard
        if local.numel():
            out.add(local.data_ptr())
    return out


def _frozen_leaves(
    state: dict[str, Any], model: nn.Module | None
) -> Iterator[tuple[EntryPath, torch.Tensor]]:
    """``(path, tensor)`` of every tensor of ``state`` (reached through string keys) that is the
    storage of a frozen parameter of ``model``."""
    frozen = _frozen_storages(model)
    if not frozen:
        return

    def walk(obj: dict[str, Any], path: EntryPath) -> Iterator[tuple[EntryPath, torch.Tensor]]:
        for k, v in obj.items():
            if not isinstance(k, str):
                continue
            if isinstance(v, dict):
                yield from walk(v, (*path, k))
            elif isinstance(v, torch.Tensor) and v.numel() and v.data_ptr() in frozen:
                yield (*path, k), v

    yield from walk(state, ())


def _digests(leaves: list[tuple[EntryPath, torch.Tensor]]) -> dict[EntryPath, str]:
    return dict(
        zip((p for p, _ in leaves), hash_pool().map(leaf_digest, [t for _, t in leaves]), strict=True)
    )


def offer(state: dict[str, Any], model: nn.Module | None) -> dict[EntryPath, str]:
    """The receiver's offer: path and digest of every frozen parameter in its ``state``
    (``StateRegistry.state_dict()``, whose tensors are the model's own)."""
    return _digests(list(_frozen_leaves(state, model)))


def send_offer(group: Group, dst: int, offered: dict[EntryPath, str]) -> None:
    """Send ``offered`` to the source ``dst`` (which calls ``recv_offer``), on the control group."""
    data = json.dumps([[list(p), d] for p, d in offered.items()]).encode()
    group.control.send(torch.tensor([len(data)], dtype=torch.int64), dst)
    group.control.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst)


def recv_offer(group: Group, src: int) -> dict[EntryPath, str]:
    """The offer of the receiver ``src``; a malformed one raises ``IntegrityError``. It is not
    authenticated: a forged offer can only make the source leave a tensor out, which the receiver
    then refuses (``fill_in`` compares with its own digests)."""
    n = torch.zeros(1, dtype=torch.int64)
    group.control.recv(n, src)
    size = int(n.item())
    if not 0 < size <= MAX_META_BYTES:
        raise IntegrityError(f"offer from rank {src}: length {size} is outside 1..{MAX_META_BYTES} bytes")
    raw = torch.empty(size, dtype=torch.uint8)
    group.control.recv(raw, src)
    try:
        items = json.loads(raw.numpy().tobytes())
        return {tuple(_strings(p)): _string(d) for p, d in items}
    except (ValueError, TypeError) as e:
        raise IntegrityError(f"offer from rank {src} is malformed: {e}") from None


def _string(v: object) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _strings(v: object) -> list[str]:
    if not isinstance(v, list) or not v:
        raise TypeError("a path must be a non-empty list")
    return [_string(x) for x in v]


def leave_out(
    state: dict[str, Any], model: nn.Module | None, offered: dict[EntryPath, str]
) -> tuple[dict[str, Any], int]:
    """The source's side: ``{"state": state without what the receiver holds alike, "kept": [[path,
    digest], ...]}`` and the bytes left out. ``state`` is a fresh ``StateRegistry.state_dict()``
    (its dicts are changed in place; its tensors are not)."""
    mine = [(p, t) for p, t in _frozen_leaves(state, model) if p in offered]
    digests = _digests(mine)
    kept: list[list[Any]] = []
    nbytes = 0
    for path, t in mine:
        if digests[path] != offered[path]:
            continue  # the receiver's copy differs: it gets the source's
        parent = state
        for k in path[:-1]:
            parent = parent[k]
        del parent[path[-1]]
        kept.append([list(path), digests[path]])
        nbytes += t.numel() * t.element_size()
    return {"state": state, "kept": kept}, nbytes


def fill_in(
    received: dict[str, Any], mine: dict[str, Any], offered: dict[EntryPath, str]
) -> tuple[dict[str, Any], int]:
    """The receiver's side: the state ``leave_out`` sent, completed with the receiver's own tensors
    at the paths left out, and the bytes so kept. Raises ``IntegrityError`` if the source left out
    a path the receiver did not offer, or with another digest than it offered."""
    state, kept = received["state"], received["kept"]
    nbytes = 0
    for path_list, digest in kept:
        path = tuple(path_list)
        if offered.get(path) != digest:
            raise IntegrityError(
                f"the source left out {'/'.join(path)!r}, which this rank does not hold alike; refused"
            )
        src, dst = mine, state
        for k in path[:-1]:
            src, dst = src[k], dst[k]
        t = src[path[-1]]
        dst[path[-1]] = t
        nbytes += t.numel() * t.element_size()
    return state, nbytes
