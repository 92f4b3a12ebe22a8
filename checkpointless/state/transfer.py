"""Peer-to-peer transfer of a rank's state, authenticated with the job's secret.

generation's group, source to receiver, in this order:

1. a header, two int64s ``[WIRE_VERSION, len(meta)]``; the receiver refuses a
   version it does not speak and a length above ``MAX_META_BYTES`` (64 MiB)
   before it allocates anything;
2. ``meta || salt || tag``: ``meta`` is the skeleton of the state as UTF-8 JSON
   (below), ``salt`` 16 random bytes the source draws for this transfer, ``tag``
   32 bytes, ``F(ctx || b"M" || salt || sha256(meta))``; the receiver checks the
   tag before it parses a byte of ``meta``;
3. the tensors' bytes in pieces of at most 4 MiB (``_MAC_PIECE``; a tensor's
   last piece may be shorter, an empty tensor has none), one message each, in
   tensor then piece order (tag = piece number + 1), all posted at once;
4. a trailer, 32 bytes, ``F(ctx || b"T" || sha256(meta) || D)`` where ``D`` is
   the SHA-256 over the pieces' GMAC tags (16 bytes each, in wire order), which
   both sides compute in a thread pool while the pieces are on the wire (the
   source checks each piece just before it posts it, the receiver just after it
   arrived, so the check reads bytes the wire left in the cache: 4 MiB pieces
   keep the closest to raw gloo of the sizes tried, ``bench/transfer.py``). GMAC (AES-128-GCM
   with the bytes as associated data, from ``cryptography``, i.e. OpenSSL) is a
   MAC: its key is ``F(ctx || b"G" || salt)[:16]``, fresh for every transfer,
   and its nonce is the (tensor index, piece index), unique under that key, so
   without the job's secret nobody can alter a tensor byte and keep its tag.
   It is faster than BLAKE3 on one core here (AES-NI and carry-less multiply)
   and releases the GIL: on a host whose cores the wire already keeps busy, the
   check is what costs (``bench/transfer.py``, the check columns).

Devices: the header, the metadata and the trailer travel on the group's ``control`` group (gloo,
CPU tensors: ``comm.Group``). A piece of a tensor the source holds off the CPU travels on the data
plane; a CPU tensor's too, unless the data plane takes no CPU tensor (NCCL), when it goes over the
control group. A piece whose tensor is not on its channel's device is staged through a buffer on
that device at both ends (a CUDA tensor over gloo, which sends host memory point to point); an
NCCL piece goes GPU to GPU, and its GMAC is computed from a host copy. Both ends choose from the
same flag (the source's tensor, the receiver's metadata), so their messages match.

``ctx`` is ``b"checkpointless/state/v3\\0"`` followed by the generation, the
source rank and the receiving rank as little-endian int64s, so a transfer is
only valid for the one (generation, source, receiver) it was made for. ``F`` is
HMAC-SHA256 when there is a key, under ``HMAC(key, b"checkpointless/state/v3
transfer key")`` so that no MAC of another use of the same secret can pass for
one of the transfer's; plain SHA-256 otherwise. Both sides compare with
``hmac.compare_digest``. The receiver allocates, receives, checks the trailer,
and only then returns the state: nothing is read from or written to disk, and
a mismatch raises ``IntegrityError`` before the caller can load anything (the
caller then aborts the group, which still holds the refused messages).

The key (``key=`` of ``send_state`` / ``recv_state``) is the per-job secret:
at least 16 random bytes (32 recommended), the same in every process of the job
and known to nothing outside it. It never travels: not over the data plane, and
not through the rendezvous store, which any process that reaches its port can
read. It is never logged, printed or put in an error message or event. With a
key, a process that got into the group without it can neither make a receiver
parse its metadata nor load its tensors. Without a key the transfer is only
checked against corruption: anyone in the group can send a state that passes,
and the receiver allocates the tensor shapes the metadata declares.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from checkpointless.comm import Group
from checkpointless.errors import IntegrityError
from checkpointless.state.codec import MAX_META_BYTES, TensorRef, decode_meta, encode_state, unflatten
from checkpointless.state.digests import hash_pool, tensor_bytes

WIRE_VERSION = 4  # 4: a message and a GMAC per 4 MiB piece (3: per tensor, GMAC per 64 MiB;
# 2: BLAKE3 per tensor; 1: SHA-256)
MIN_KEY_BYTES = 16
_CTX = b"checkpointless/state/v3\0"
_KEY_LABEL = b"checkpointless/state/v3 transfer key"
_TAG_BYTES = 32
_SALT_BYTES = 16
_MAC_PIECE = 4 * 2**20  # bytes of one message and one GMAC tag (AES-GCM takes at most 2**31 - 1)
_LOOKAHEAD = 2  # pieces the source checks ahead of the one it posts


def _pieces(tensors: list[torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    """``(tensor index, piece index, bytes)`` of every ``_MAC_PIECE`` bytes of ``tensors``
    (contiguous), in wire order; each piece is one message and one GMAC tag. The bytes are a
    flat ``uint8`` view: receiving into it fills the tensor in place. Empty tensors have none."""
    out: list[tuple[int, int, torch.Tensor]] = []
    for i, t in enumerate(tensors):
        flat = _wire(t).reshape(-1).view(torch.uint8)
        out.extend((i, j, flat[o : o + _MAC_PIECE]) for j, o in enumerate(range(0, flat.numel(), _MAC_PIECE)))
    return out


def _piece_tag(mac: AESGCM, index: int, piece: int, data: torch.Tensor) -> bytes:
    """The GMAC tag of one piece; the nonce is (tensor index, piece index), unique in a transfer."""
    return mac.encrypt(
        struct.pack(">IQ", index, piece), b"", tensor_bytes(data if data.device.type == "cpu" else data.cpu())
    )


def _mac(key: bytes | None, ctx: bytes, salt: bytes) -> AESGCM:
    """The transfer's GMAC: AES-128 under a key fresh for this (context, salt)."""
    return AESGCM(_seal(key, ctx + b"G" + salt)[:16])


def _seal_tensors(key: bytes | None, ctx: bytes, salt: bytes, tensors: list[torch.Tensor]) -> bytes:
    """``D`` of the module docstring for ``tensors`` (contiguous), computed in the pool."""
    mac = _mac(key, ctx, salt)
    return hashlib.sha256(b"".join(hash_pool().map(lambda p: _piece_tag(mac, *p), _pieces(tensors)))).digest()


def _check_key(key: bytes | None) -> None:
    if key is None:
        return
    if not isinstance(key, bytes):
        raise TypeError(f"the job key must be bytes, not {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the job key must be at least {MIN_KEY_BYTES} bytes")


def _context(gen: int, src: int, dst: int) -> bytes:
    """What a transfer is bound to: the protocol, the generation, the source and the receiver."""
    return _CTX + struct.pack("<qqq", gen, src, dst)


def _seal(key: bytes | None, data: bytes) -> bytes:
    """HMAC-SHA256 under the transfer key derived from ``key``, or plain SHA-256 without one.

    The job's secret also seals other messages (the control store's): the
    transfer uses its own key, ``HMAC(key, _KEY_LABEL)``, so no MAC of one
    protocol can ever pass for one of the other.
    """
    if key is None:
        return hashlib.sha256(data).digest()
    subkey = hmac.new(key, _KEY_LABEL, hashlib.sha256).digest()
    return hmac.new(subkey, data, hashlib.sha256).digest()


def _meta_tag(key: bytes | None, ctx: bytes, salt: bytes, meta_digest: bytes) -> bytes:
    return _seal(key, ctx + b"M" + salt + meta_digest)


def _trailer(key: bytes | None, ctx: bytes, meta_digest: bytes, tensor_digest: bytes) -> bytes:
    return _seal(key, ctx + b"T" + meta_digest + tensor_digest)


def _content_digest(meta_digest: bytes, tensor_digest: bytes) -> str:
    """``TransferStats.sha256``: the transfer's digest, the same on both sides of it."""
    return hashlib.sha256(meta_digest + tensor_digest).hexdigest()


@dataclass(frozen=True, slots=True)
class TransferStats:
    bytes: int
    seconds: float  # the transfer, from the header's arrival (the receiver) or its sending (the sender)
    sha256: str  # SHA-256 over sha256(meta) and D: equal on both sides of one transfer
    waited_s: float = 0.0  # the receiver: how long it waited for the sender to begin


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _channel(group: Group, on_accelerator: bool) -> Group:
    """The group a tensor's bytes travel on (``on_accelerator``: the source holds it off the CPU):
    the data plane, unless the data plane takes no CPU tensor (NCCL) and this is a CPU tensor
    (RNG states, an optimizer's step counts), which goes over the control group. Both ends decide
    from the same flag (the source's tensor, the receiver's metadata), so they agree."""
    if on_accelerator or group.device.type == "cpu":
        return group
    return group.control


def _outgoing(
    mac: AESGCM, index: int, piece: int, data: torch.Tensor, to: torch.device
) -> tuple[torch.Tensor, bytes]:
    """One piece as it goes on the wire (``data``, or a copy staged on the channel's device ``to``:
    a CUDA tensor sent over gloo is staged in host memory) and its GMAC tag."""
    wire = data if data.device.type == to.type else data.to(to)
    return wire, _piece_tag(mac, index, piece, wire)


def send_state(group: Group, dst: int, state: dict[str, Any], *, key: bytes | None = None) -> TransferStats:
    """Send ``state`` to rank ``dst`` of ``group`` (``dst`` must call ``recv_state``).

    All tensor messages are posted at once and hashed while they are on the
    wire; the trailer follows them. ``key`` is the job's secret (see the module
    docstring): with it the metadata tag and the trailer are HMAC-SHA256s, and
    the receiver must hold the same key. A value the metadata cannot carry
    raises ``TypeError`` naming its path, before anything is sent.
    """
    _check_key(key)
    t0 = time.perf_counter()
    meta, tensors = encode_state(state)
    tensors = [t.contiguous() for t in tensors]
    ctx = _context(group.gen, group.rank, dst)
    salt = os.urandom(_SALT_BYTES)
    mac = _mac(key, ctx, salt)
    meta_digest = hashlib.sha256(meta).digest()
    control = group.control  # header, metadata and trailer are CPU tensors: never NCCL's
    control.send(torch.tensor([WIRE_VERSION, len(meta)], dtype=torch.int64), dst)
    control.send(_u8(meta + salt + _meta_tag(key, ctx, salt, meta_digest)), dst)
    works: list[tuple[Group, Any]] = []
    try:
        # piece k is checked just before it is posted, so the kernel then reads it from the cache
        # (one pass over memory instead of two: measurably faster on a host the wire keeps busy)
        pieces = _pieces(tensors)
        channels = [_channel(group, tensors[i].device.type != "cpu") for i, _, _ in pieces]

        def prepare(k: int) -> Any:
            return hash_pool().submit(_outgoing, mac, *pieces[k], channels[k].device)

        tags = [prepare(k) for k in range(min(_LOOKAHEAD, len(pieces)))]
        for k in range(len(pieces)):
            wire, _ = tags[k].result()
            if k + _LOOKAHEAD < len(pieces):
                tags.append(prepare(k + _LOOKAHEAD))
            works.append((channels[k], channels[k].isend(wire, dst, tag=k + 1)))
            del wire
        for i in range(len(works)):  # no local name may keep a Work alive in a traceback
            works[i][0].wait(works[i][1])
    finally:
        works.clear()  # a pending Work keeps the group's sockets open (comm module doc)
    tensor_digest = hashlib.sha256(b"".join(f.result()[1] for f in tags)).digest()
    tags.clear()  # the staged copies
    control.send(_u8(_trailer(key, ctx, meta_digest, tensor_digest)), dst)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return TransferStats(nbytes, time.perf_counter() - t0, _content_digest(meta_digest, tensor_digest))


def _accelerator() -> torch.device | None:
    """The current accelerator (CUDA, XPU, ...), or None on a CPU-only machine."""
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


def _receive_buffers(skeleton: Any, into: Any, n: int) -> list[torch.Tensor | None]:
    """For each tensor of ``skeleton`` (``decode_meta``'s), the tensor at the same path of ``into``
    (``recv_state``'s) that can receive its bytes in place: same dtype, shape and side of the
    CPU, contiguous, no storage given twice; None where there is none."""
    out: list[torch.Tensor | None] = [None] * n
    seen: set[int] = set()

    def walk(sk: Any, mine: Any) -> None:
        if type(sk) is TensorRef:
            if (
                isinstance(mine, torch.Tensor)
                and mine.dtype == sk.dtype
                and tuple(mine.shape) == sk.shape
                and mine.is_contiguous()
                and (mine.device.type != "cpu") == sk.on_accelerator
                and mine.data_ptr() not in seen
            ):
                if mine.numel():
                    seen.add(mine.data_ptr())
                out[sk.index] = mine.detach()
        elif isinstance(sk, dict) and isinstance(mine, dict):
            for k, v in sk.items():
                if k in mine:
                    walk(v, mine[k])
        elif isinstance(sk, list | tuple) and isinstance(mine, list | tuple) and len(sk) == len(mine):
            for a, b in zip(sk, mine, strict=True):
                walk(a, b)

    walk(skeleton, into)
    return out


def recv_state(
    group: Group,
    src: int,
    *,
    between: Callable[[], None] | None = None,
    key: bytes | None = None,
    into: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], TransferStats]:
    """Receive a state sent by ``send_state`` from rank ``src``; verify it before returning it.

    ``key`` must be the sender's (``None`` on both sides, or the job's secret on
    both). Raises ``IntegrityError`` on a bad header, metadata whose tag does not
    match (checked before it is parsed), malformed metadata, or a trailer that
    does not match the metadata and tensors received; the state is returned only
    once everything matched. After an ``IntegrityError`` the group holds
    unconsumed messages: abort it.

    ``between`` runs once the first piece of the tensors arrived, the rest still on the wire (before
    they are posted where there is one piece or none): the fault-injection point for a receiver
    killed or cut off mid-transfer.

    ``into``: the receiver's own state of the same structure (``StateRegistry.state_dict()``,
    whose tensors share storage with the parameters, buffers and optimizer state). A tensor at
    the same path with the same dtype and shape, contiguous, receives its bytes in place: no
    allocation (page faults cost more than the wire here) and nothing to copy when the state is
    loaded. The receiver's state is overwritten even if the transfer then fails its check, so only
    a process that discards its state may pass ``into``.
    """
    _check_key(key)
    t0 = time.perf_counter()
    ctx = _context(group.gen, src, group.rank)
    control = group.control  # header, metadata and trailer are CPU tensors: never NCCL's
    header = torch.zeros(2, dtype=torch.int64)
    control.recv(header, src)
    t_header = time.perf_counter()
    version, n = (int(x) for x in header.tolist())
    if version != WIRE_VERSION:
        raise IntegrityError(f"state from rank {src}: wire version {version}, expected {WIRE_VERSION}")
    if not 0 < n <= MAX_META_BYTES:
        raise IntegrityError(
            f"state from rank {src}: metadata length {n} is outside 1..{MAX_META_BYTES} bytes; refused"
        )
    raw = torch.empty(n + _SALT_BYTES + _TAG_BYTES, dtype=torch.uint8)
    control.recv(raw, src)
    blob = raw.numpy().tobytes()
    del raw
    meta, salt, tag = blob[:n], blob[n : n + _SALT_BYTES], blob[n + _SALT_BYTES :]
    meta_digest = hashlib.sha256(meta).digest()
    if not hmac.compare_digest(tag, _meta_tag(key, ctx, salt, meta_digest)):
        why = "authentication (wrong key, or not sent by a process of this job)" if key else "its checksum"
        raise IntegrityError(f"state from rank {src}: metadata failed {why}; not parsed")
    try:
        skeleton, refs = decode_meta(meta)
    except IntegrityError as e:
        raise IntegrityError(f"state from rank {src}: {e}") from None
    accel = _accelerator()
    reuse = _receive_buffers(skeleton, into, len(refs)) if into is not None else [None] * len(refs)
    tensors = [
        r if r is not None
        else torch.empty(ref.shape, dtype=ref.dtype, device=accel if ref.on_accelerator and accel else "cpu")
        for ref, r in zip(refs, reuse, strict=True)
    ]  # fmt: skip
    mac = _mac(key, ctx, salt)
    works: list[Any] = []
    tags = []
    try:
        pieces = _pieces(tensors)
        if between is not None and len(pieces) < 2:
            between()
        channels = [_channel(group, refs[i].on_accelerator) for i, _, _ in pieces]
        # a piece whose tensor is not on its channel's device arrives in a buffer there (a CUDA
        # tensor over gloo: host memory) and is copied in once checked
        wires = [
            data if data.device.type == ch.device.type else torch.empty_like(data, device=ch.device)
            for (_, _, data), ch in zip(pieces, channels, strict=True)
        ]
        works.extend(
            ch.irecv(w, src, tag=k + 1) for k, (ch, w) in enumerate(zip(channels, wires, strict=True))
        )
        for k in range(len(pieces)):  # check each piece once it arrived, while the rest is on the wire
            channels[k].wait(works[k])
            if k == 0 and between is not None and len(pieces) > 1:
                between()
            i, j, data = pieces[k]
            tags.append(hash_pool().submit(_piece_tag, mac, i, j, wires[k]))
            if wires[k] is not data:
                data.copy_(wires[k])
    finally:
        works.clear()  # a pending Work keeps the group's sockets open (comm module doc)
    del wires
    trailer = torch.empty(_TAG_BYTES, dtype=torch.uint8)
    control.recv(trailer, src)
    tensor_digest = hashlib.sha256(b"".join(f.result() for f in tags)).digest()
    if not hmac.compare_digest(trailer.numpy().tobytes(), _trailer(key, ctx, meta_digest, tensor_digest)):
        why = (
            "authentication (wrong key, or altered in transit)"
            if key
            else "its checksum (corrupted in transit)"
        )
        raise IntegrityError(f"state from rank {src}: tensors or metadata failed {why}")
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    stats = TransferStats(
        nbytes, time.perf_counter() - t_header, _content_digest(meta_digest, tensor_digest), t_header - t0
    )
    return unflatten(skeleton, tensors), stats


# -- replica consistency ----------------------------------------------------------------
