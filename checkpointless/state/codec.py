"""The state's wire and snapshot encoding: its skeleton as JSON metadata, its tensors apart.

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
  ``["tensor", index, dtype, [shape], on_accelerator]`` (``index``: the tensor's
  place in the list ``encode_state`` returns; the transfer, ``state/transfer.py``,
  sends the tensors' bytes in that order after the metadata, in pieces of at most
  4 MiB, one message each, and a durable snapshot stores the tensor as
  ``t<index>``). Dict keys ``K`` are values without tensors.

Decoding builds only these types, never looks a name up anywhere but in fixed
tables, and raises ``IntegrityError`` on anything else. Encoding raises
``TypeError`` naming the path of a value of any other type (say a lambda in a
scheduler's state).
"""

from __future__ import annotations

import base64
import json
import math
import reprlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from checkpointless.errors import IntegrityError

_META_VERSION = 2  # the metadata's JSON encoding (also in durable snapshots); it did not change in 3
MAX_META_BYTES = 64 * 2**20  # the metadata of a state; its tensors are not counted
_MAX_DEPTH = 100  # nesting of the metadata (a state dict is a handful of levels deep)
_MAX_DIMS = 64
_FORMAT = "checkpointless-state"

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
class TensorRef:
    """A tensor in a decoded skeleton (``decode_meta``): what the metadata declares of it, so
    that the receiver (or a durable snapshot's reader) allocates it before its bytes arrive.

    ``index``: its place in the list of tensors ``encode_state`` returned;
    ``dtype`` and ``shape``: checked against the dtypes a tensor may have and the size limits;
    ``on_accelerator``: the source held it off the CPU (the receiver places it on its own
    accelerator, if it has one)."""

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


def encode_state(state: dict[str, Any]) -> tuple[bytes, list[torch.Tensor]]:
    """The metadata of ``state`` (UTF-8 JSON, the module docstring's encoding) and its tensors
    (detached, not copied), in index order: what the transfer sends and a durable snapshot
    writes. ``decode_meta`` reads the metadata back, ``unflatten`` puts the tensors in place.

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
    """Builds a state from decoded JSON: only the types of the encoding, tensors as ``TensorRef``."""

    def __init__(self, n_tensors: int) -> None:
        self.refs: list[TensorRef | None] = [None] * n_tensors

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
            ref = TensorRef(index, _TORCH_DTYPES[args[1]], _shape(args[2]), args[3])
            self.refs[index] = ref
            return ref
        raise IntegrityError(f"unexpected value {reprlib.repr(v)}")


def decode_meta(meta: bytes) -> tuple[dict[str, Any], list[TensorRef]]:
    """The state skeleton in ``meta`` (``encode_state``'s metadata; tensors as ``TensorRef``)
    and its refs in index order, every index referenced exactly once.

    Safe on untrusted bytes: builds nothing but the types of the encoding, looks no name up
    but in fixed tables, bounds the nesting and the tensor count by the metadata's size, and
    raises ``IntegrityError`` on anything malformed.
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


def unflatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The state of ``decode_meta``'s skeleton ``obj`` with ``tensors[ref.index]`` in place of
    each ``TensorRef`` (the tensors themselves, not copies); dicts keep their type and an
    ``OrderedDict`` its ``_metadata``. ``obj`` is not changed."""
    t = type(obj)
    if t is TensorRef:
        return tensors[obj.index]
    if t is dict or t is OrderedDict:
        out = t((k, unflatten(v, tensors)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # type: ignore[attr-defined]
        return out
    if t is list:
        return [unflatten(v, tensors) for v in obj]
    if t is tuple:
        return tuple(unflatten(v, tensors) for v in obj)
    return obj
