"""Transferable training state: registry, canonical digest, peer-to-peer transfer.

Anything registered must follow the ``Stateful`` protocol (``state_dict`` and
``load_state_dict``, as ``nn.Module``, ``Optimizer`` and LR schedulers do).
Registered state is *replicated*: every rank of a replica group holds the same
bytes, so any of them can serve as the source for a replacement.

Transfer protocol (``send_state`` / ``recv_state``), point to point on the
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
   were 0.79-0.84x raw gloo at 100 MB here, 64 MiB ones 0.71-0.77x, 1 MiB ones
   0.69-0.73x). GMAC (AES-128-GCM
   with the bytes as associated data, from ``cryptography``, i.e. OpenSSL) is a
   MAC: its key is ``F(ctx || b"G" || salt)[:16]``, fresh for every transfer,
   and its nonce is the (tensor index, piece index), unique under that key, so
   without the job's secret nobody can alter a tensor byte and keep its tag.
   It is faster than BLAKE3 on one core here (AES-NI and carry-less multiply)
   and releases the GIL: on a host whose cores the wire already keeps busy, the
   check is what costs (``docs/benchmarks.md``, transfer throughput, the check
   columns).

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

Metadata encoding (``meta``): a JSON object ``{"format": "checkpointless-state",
"version": 2, "tensors": n, "state": V}`` where a value ``V`` is one of

- ``null``, ``true``, ``false``, an integer, a finite float, a string: itself;
- a JSON array whose first element names its type:
  ``["list", V...]``, ``["tuple", V...]``, ``["dict", K, V, K, V...]``,
  ``["odict", M, K, V...]`` (an ``OrderedDict``, ``M`` its ``_metadata`` or
  ``null``, as ``nn.Module.state_dict`` returns), ``["float", hex]`` (a
  non-finite float, its 8 IEEE bytes big-endian), ``["bytes", base64]``,
  ``["ndarray", dtype, [shape], base64]`` and ``["npscalar", dtype, base64]``
  (numeric numpy dtypes only, by their ``dtype.str``), ``["dtype", name]`` (a
  ``torch.dtype``), ``["size", ints...]`` (a ``torch.Size``), and
  ``["tensor", index, dtype, [shape], on_accelerator]`` (the tensor sent as
  message ``index + 1``). Dict keys ``K`` are values without tensors.

Decoding builds only these types, never looks a name up anywhere but in fixed
tables, and raises ``IntegrityError`` on anything else. Encoding raises
``TypeError`` naming the path of a value of any other type (say a lambda in a
scheduler's state).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import reprlib
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import blake3
import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from checkpointless.comm import Group
from checkpointless.control.plan import first_difference as first_difference  # re-exported
from checkpointless.errors import IntegrityError


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


WIRE_VERSION = 4  # 4: a message and a GMAC per 4 MiB piece (3: per tensor, GMAC per 64 MiB;
# 2: BLAKE3 per tensor; 1: SHA-256)
_META_VERSION = 2  # the metadata's JSON encoding (also in durable snapshots); it did not change in 3
MAX_META_BYTES = 64 * 2**20  # the metadata of a state; its tensors are not counted
MIN_KEY_BYTES = 16
_MAX_DEPTH = 100  # nesting of the metadata (a state dict is a handful of levels deep)
_MAX_DIMS = 64
_FORMAT = "checkpointless-state"
_CTX = b"checkpointless/state/v3\0"
_KEY_LABEL = b"checkpointless/state/v3 transfer key"
_TAG_BYTES = 32
_SALT_BYTES = 16
_MAC_PIECE = 4 * 2**20  # bytes of one message and one GMAC tag (AES-GCM takes at most 2**31 - 1)
_LOOKAHEAD = 2  # pieces the source checks ahead of the one it posts

_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
_TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {d: name for name, d in _TORCH_DTYPES.items()}
# dtypes a transferred tensor may have (plain numeric data the receiver can allocate and fill)
_TENSOR_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32}
    | {torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64}
    | {torch.complex128, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}
)
# numpy dtypes by ``dtype.str``, both byte orders: bools and numbers only, never objects
_NP_DTYPES: dict[str, np.dtype[Any]] = {
    d.str: d
    for t in {np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64}
    | {np.float16, np.float32, np.float64, np.complex64, np.complex128}
    for d in (np.dtype(t).newbyteorder("<"), np.dtype(t).newbyteorder(">"))
}


@dataclass(frozen=True, slots=True)
class _TensorRef:
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    on_accelerator: bool = False


# -- metadata encoding (see the module docstring) ---------------------------------------

# a path into the state, built as a linked tuple and formatted only for an error message
_Path = tuple[Any, str, Any] | None


def _fmt_path(path: _Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, fmt, item = path
        parts.append(fmt.format(item))
    return "state" + "".join(reversed(parts))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class _Encoder:
    """Turns a state into JSON-ready values, collecting its tensors in order."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def value(self, obj: Any, path: _Path, depth: int, in_key: bool = False) -> Any:
        if depth > _MAX_DEPTH:
            raise ValueError(
                f"{_fmt_path(path)}: nested deeper than {_MAX_DEPTH} levels (a reference cycle?)"
            )
        t = type(obj)
        if obj is None or t is bool or t is int or t is str:
            return obj
        if t is float:
            return obj if math.isfinite(obj) else ["float", struct.pack(">d", obj).hex()]
        if t is dict or t is OrderedDict:
            out: list[Any] = ["dict"]
            if t is OrderedDict:
                md = getattr(obj, "_metadata", None)
                mpath = (path, "._metadata", None)
                out = ["odict", None if md is None else self.value(md, mpath, depth + 1, in_key)]
            for k, v in obj.items():
                out.append(self.value(k, path, depth + 1, in_key=True))
                out.append(self.value(v, (path, "[{!r}]", k), depth + 1, in_key))
            return out
        if t is list or t is tuple:
            items = [self.value(v, (path, "[{}]", i), depth + 1, in_key) for i, v in enumerate(obj)]
            return ["list" if t is list else "tuple", *items]
        if t is torch.Size:
            return ["size", *(int(d) for d in obj)]
        if t is bytes:
            return ["bytes", _b64(obj)]
        if t is torch.dtype:
            return ["dtype", _TORCH_DTYPE_NAMES[obj]]
        if isinstance(obj, np.generic) and obj.dtype.str in _NP_DTYPES:
            return ["npscalar", obj.dtype.str, _b64(obj.tobytes())]
        what = "dict key" if in_key else "object"
        if t is np.ndarray and not in_key:
            if obj.dtype.str not in _NP_DTYPES:
                raise TypeError(f"{_fmt_path(path)}: cannot transfer a numpy array of dtype {obj.dtype}")
            return ["ndarray", obj.dtype.str, list(obj.shape), _b64(obj.tobytes(order="C"))]
        if isinstance(obj, torch.Tensor) and not in_key:
            if obj.layout != torch.strided or obj.dtype not in _TENSOR_DTYPES or obj.is_meta:
                raise TypeError(
                    f"{_fmt_path(path)}: cannot transfer a {obj.layout} tensor of dtype {obj.dtype} "
                    f"on device {obj.device}"
                )
            self.tensors.append(obj.detach())
            on_accelerator = obj.device.type != "cpu"
            return [
                "tensor",
                len(self.tensors) - 1,
                _TORCH_DTYPE_NAMES[obj.dtype],
                list(obj.shape),
                on_accelerator,
            ]
        raise TypeError(f"{_fmt_path(path)}: cannot transfer {what} of type {t.__name__}")


def _encode_state(state: dict[str, Any]) -> tuple[bytes, list[torch.Tensor]]:
    """The metadata of ``state`` (UTF-8 JSON) and its tensors, in index order.

    Raises ``TypeError`` (naming the path) for a value of a type the metadata
    cannot carry, ``ValueError`` for metadata above ``MAX_META_BYTES``.
    """
    enc = _Encoder()
    value = enc.value(state, None, 0)
    doc = {"format": _FORMAT, "version": _META_VERSION, "tensors": len(enc.tensors), "state": value}
    meta = json.dumps(doc, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
    if len(meta) > MAX_META_BYTES:
        raise ValueError(f"state metadata is {len(meta)} bytes, above the limit of {MAX_META_BYTES}")
    return meta, enc.tensors


class _JSONObject:
    """A JSON object as the decoder saw it: its pairs, duplicates kept (never a dict)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs


def _reject_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name} is not allowed")


def _int(v: Any, what: str, lo: int = 0, hi: int = 2**62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise IntegrityError(f"{what}: expected an integer in [{lo}, {hi}], got {reprlib.repr(v)}")
    return v


def _shape(v: Any) -> tuple[int, ...]:
    if type(v) is not list or len(v) > _MAX_DIMS:
        raise IntegrityError(f"bad shape {reprlib.repr(v)}")
    shape = tuple(_int(d, "shape") for d in v)
    if math.prod(shape) > 2**62:
        raise IntegrityError(f"shape {shape} is too large")
    return shape


def _unb64(v: Any) -> bytes:
    if type(v) is not str:
        raise IntegrityError(f"expected base64 text, got {type(v).__name__}")
    return base64.b64decode(v, validate=True)


class _Decoder:
    """Builds a state from decoded JSON: only the types of the encoding, tensors as ``_TensorRef``."""

    def __init__(self, n_tensors: int) -> None:
        self.refs: list[_TensorRef | None] = [None] * n_tensors

    def value(self, v: Any, depth: int, in_key: bool = False) -> Any:
        if depth > _MAX_DEPTH:
            raise IntegrityError(f"nested deeper than {_MAX_DEPTH} levels")
        t = type(v)
        if v is None or t is bool or t is int or t is str or t is float:
            return v
        if t is not list or not v or type(v[0]) is not str:
            raise IntegrityError(f"unexpected JSON value {reprlib.repr(v)}")
        tag, args = v[0], v[1:]
        if tag == "list":
            return [self.value(x, depth + 1, in_key) for x in args]
        if tag == "tuple":
            return tuple(self.value(x, depth + 1, in_key) for x in args)
        if tag in ("dict", "odict"):
            out: dict[Any, Any] = {}
            if tag == "odict":
                if not args:
                    raise IntegrityError("odict without its metadata slot")
                out = OrderedDict()
                if args[0] is not None:
                    out._metadata = self.value(args[0], depth + 1, in_key)  # type: ignore[attr-defined]
                args = args[1:]
            if len(args) % 2:
                raise IntegrityError(f"{tag} with an odd number of keys and values")
            for i in range(0, len(args), 2):
                k = self.value(args[i], depth + 1, in_key=True)
                try:
                    hash(k)
                except TypeError:
                    raise IntegrityError(f"unhashable dict key {reprlib.repr(k)}") from None
                if k in out:
                    raise IntegrityError(f"duplicate dict key {reprlib.repr(k)}")
                out[k] = self.value(args[i + 1], depth + 1, in_key)
            return out
        if tag == "float" and len(args) == 1 and type(args[0]) is str and len(args[0]) == 16:
            return struct.unpack(">d", bytes.fromhex(args[0]))[0]
        if tag == "bytes" and len(args) == 1:
            return _unb64(args[0])
        if tag == "dtype" and len(args) == 1 and type(args[0]) is str and args[0] in _TORCH_DTYPES:
            return _TORCH_DTYPES[args[0]]
        if tag == "size":
            return torch.Size([_int(d, "torch.Size", -(2**62)) for d in args])
        if tag == "npscalar" and len(args) == 2 and type(args[0]) is str and args[0] in _NP_DTYPES:
            dtype, raw = _NP_DTYPES[args[0]], _unb64(args[1])
            if len(raw) != dtype.itemsize:
                raise IntegrityError(f"numpy {dtype} scalar of {len(raw)} bytes")
            return np.frombuffer(raw, dtype=dtype)[0]
        if tag == "ndarray" and len(args) == 3 and type(args[0]) is str and args[0] in _NP_DTYPES:
            dtype, shape, raw = _NP_DTYPES[args[0]], _shape(args[1]), _unb64(args[2])
            if len(raw) != math.prod(shape) * dtype.itemsize:
                raise IntegrityError(f"numpy array {dtype}{list(shape)} of {len(raw)} bytes")
            return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        if tag == "tensor" and not in_key and len(args) == 4:
            index = _int(args[0], "tensor index", 0, len(self.refs) - 1)
            if type(args[1]) is not str or _TORCH_DTYPES.get(args[1]) not in _TENSOR_DTYPES:
                raise IntegrityError(f"tensor {index}: bad dtype {reprlib.repr(args[1])}")
            if type(args[3]) is not bool:
                raise IntegrityError(f"tensor {index}: bad device flag {reprlib.repr(args[3])}")
            if self.refs[index] is not None:
                raise IntegrityError(f"tensor {index} appears twice")
            ref = _TensorRef(index, _TORCH_DTYPES[args[1]], _shape(args[2]), args[3])
            self.refs[index] = ref
            return ref
        raise IntegrityError(f"unexpected value {reprlib.repr(v)}")


def _decode_meta(meta: bytes) -> tuple[dict[str, Any], list[_TensorRef]]:
    """The state skeleton in ``meta`` (tensors as ``_TensorRef``) and its refs in index order.

    Builds nothing but the types of the encoding; raises ``IntegrityError`` on
    anything malformed.
    """
    try:
        doc = json.loads(meta.decode("utf-8"), object_pairs_hook=_JSONObject, parse_constant=_reject_constant)
        if type(doc) is not _JSONObject:
            raise IntegrityError("metadata is not a JSON object")
        fields = dict(doc.pairs)
        if len(doc.pairs) != 4 or fields.keys() != {"format", "version", "tensors", "state"}:
            raise IntegrityError(f"metadata fields {reprlib.repr([k for k, _ in doc.pairs])}")
        if (
            fields["format"] != _FORMAT
            or type(fields["version"]) is not int
            or fields["version"] != _META_VERSION
        ):
            raise IntegrityError(
                f"metadata format {reprlib.repr(fields['format'])} version {reprlib.repr(fields['version'])}"
            )
        # each tensor reference takes more than 16 bytes of metadata: bounds the list below
        dec = _Decoder(_int(fields["tensors"], "tensor count", 0, len(meta) // 16))
        state = dec.value(fields["state"], 0)
        if type(state) is not dict:
            raise IntegrityError(f"state is a {type(state).__name__}, not a dict")
        refs = [r for r in dec.refs if r is not None]
        if len(refs) != len(dec.refs):
            raise IntegrityError(f"{len(dec.refs) - len(refs)} of {len(dec.refs)} tensors are not referenced")
        return state, refs
    except IntegrityError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, struct.error) as e:
        # ValueError covers bad UTF-8, bad JSON, bad hex and bad base64 (binascii.Error)
        raise IntegrityError(f"malformed metadata: {type(e).__name__}: {e}"[:300]) from None


def _unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Put the received tensors in place of the skeleton's ``_TensorRef``s."""
    t = type(obj)
    if t is _TensorRef:
        return tensors[obj.index]
    if t is dict or t is OrderedDict:
        out = t((k, _unflatten(v, tensors)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if t is list:
        return [_unflatten(v, tensors) for v in obj]
    if t is tuple:
        return tuple(_unflatten(v, tensors) for v in obj)
    return obj


# -- hashing ------------------------------------------------------------------------------


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


def _tensor_digest(t: torch.Tensor) -> bytes:
    """BLAKE3 of one contiguous tensor's bytes (32 bytes)."""
    return blake3.blake3(_bytes_of(t if t.device.type == "cpu" else t.cpu())).digest()


def _hash_tensors(tensors: list[torch.Tensor]) -> str:
    """SHA-256 over the tensors' BLAKE3 digests, in hex: a durable snapshot's digest (it must
    not depend on a key or a salt, so the transfer uses ``_seal_tensors`` instead)."""
    digests = list(_pool().map(_tensor_digest, [t.contiguous() for t in tensors]))
    return hashlib.sha256(b"".join(digests)).hexdigest()


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
        struct.pack(">IQ", index, piece), b"", _bytes_of(data if data.device.type == "cpu" else data.cpu())
    )


def _mac(key: bytes | None, ctx: bytes, salt: bytes) -> AESGCM:
    """The transfer's GMAC: AES-128 under a key fresh for this (context, salt)."""
    return AESGCM(_seal(key, ctx + b"G" + salt)[:16])


def _seal_tensors(key: bytes | None, ctx: bytes, salt: bytes, tensors: list[torch.Tensor]) -> bytes:
    """``D`` of the module docstring for ``tensors`` (contiguous), computed in the pool."""
    mac = _mac(key, ctx, salt)
    return hashlib.sha256(b"".join(_pool().map(lambda p: _piece_tag(mac, *p), _pieces(tensors)))).digest()


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
    meta, tensors = _encode_state(state)
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
            return _pool().submit(_outgoing, mac, *pieces[k], channels[k].device)

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

    ``between`` runs after the metadata arrived and before the tensors do (the
    fault-injection point for a receiver killed mid-transfer).

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
        skeleton, refs = _decode_meta(meta)
    except IntegrityError as e:
        raise IntegrityError(f"state from rank {src}: {e}") from None
    if between is not None:
        between()
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
            i, j, data = pieces[k]
            tags.append(_pool().submit(_piece_tag, mac, i, j, wires[k]))
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
    return _unflatten(skeleton, tensors), stats


# -- replica consistency ----------------------------------------------------------------


def _leaf_digest(value: Any) -> str:
    """BLAKE3 of one leaf: a tensor's dtype, shape and bytes; anything else by its ``repr``."""
    if isinstance(value, torch.Tensor):
        t = value.detach().contiguous().cpu()
        h = blake3.blake3(f"{t.dtype}{list(t.shape)}".encode())
        h.update(_bytes_of(t))
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
    digests = _pool().map(_leaf_digest, [v for _, v in leaves])
    return [(path, d) for (path, _), d in zip(leaves, digests, strict=True)]


def combined_digest(entries: list[tuple[str, str]]) -> bytes:
    """One 32-byte digest of ``entry_digests``' output (paths included)."""
    h = blake3.blake3()
    for path, d in entries:
        h.update(f"{len(path)}:{path}={d};".encode())
    return h.digest()


def _receive_buffers(skeleton: Any, into: Any, n: int) -> list[torch.Tensor | None]:
    """For each tensor of ``skeleton``, the tensor at the same path of ``into`` that can receive it."""
    out: list[torch.Tensor | None] = [None] * n
    seen: set[int] = set()

    def walk(sk: Any, mine: Any) -> None:
        if type(sk) is _TensorRef:
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
