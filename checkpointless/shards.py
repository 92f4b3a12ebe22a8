"""Work cut into contiguous shards, one per rank, whose results every rank then holds: an
evaluation's batches (``integrations/hf_eval.py``).

``shard(n, world, rank)`` is rank ``rank``'s part of ``n`` items: contiguous and balanced, so the
shards in rank order are the items in order. ``exchange`` gives every rank every rank's results
over the group's control (gloo) group, as plain data: tensors (any dtype, on any device: moved to
the CPU) inside ``None``, bools, numbers, strings, lists, tuples and dicts with string keys.
Nothing received is unpickled. A rank whose results cannot be sent that way says so in the
exchange, and then no rank gets any: every rank falls back alike (``ExchangeRefused``).

A failed exchange (a peer died, hung or is late beyond the group's timeout; ranks that are not
in the same exchange: the first message carries a magic number and a sequence number) raises
``CollectiveError`` after releasing the group, so that no later collective of this rank or its
peers pairs with a message of this one: the next step's reduction fails and recovers.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from checkpointless.comm import Group
from checkpointless.errors import CollectiveError, ExchangeRefused

_MAGIC = 0x5348415244  # "SHARD": the first word of every exchange's header


def shard(n: int, world: int, rank: int) -> range:
    """Rank ``rank``'s contiguous part of ``n`` items cut into ``world`` balanced shards."""
    return range(rank * n // world, (rank + 1) * n // world)


def plan_digest(parts: Any) -> int:
    """A 63-bit digest of ``parts`` (JSON data: how the work is cut), for ``exchange``'s ``plan``."""
    raw = hashlib.blake2b(json.dumps(parts, separators=(",", ":")).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 1


def pack(obj: Any) -> bytes:
    """``obj`` as bytes: a JSON skeleton (its length first, 8 bytes) and the tensors' raw bytes."""
    tensors: list[torch.Tensor] = []

    def skeleton(o: Any) -> Any:
        if o is None or type(o) in (bool, int, float, str):
            return {"v": o}
        if isinstance(o, torch.Tensor):
            tensors.append(o.detach().cpu().contiguous())
            return {"t": len(tensors) - 1}
        if type(o) in (list, tuple):
            return {"list" if type(o) is list else "tuple": [skeleton(v) for v in o]}
        if type(o) is dict and all(type(k) is str for k in o):
            return {"dict": {k: skeleton(v) for k, v in o.items()}}
        raise TypeError(f"{type(o).__name__} is not a tensor, number, string or container of them")

    meta = {"skeleton": skeleton(obj), "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                                  for t in tensors]}  # fmt: skip
    head = json.dumps(meta).encode()
    body = [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    return len(head).to_bytes(8, "little") + head + b"".join(body)


def unpack(data: bytes) -> Any:
    """The object ``pack`` made ``data`` of (its tensors on the CPU)."""
    size = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + size])
    offset, tensors = 8 + size, []
    for dtype_name, shape in meta["tensors"]:
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a dtype: {dtype_name}")
        count = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        raw = torch.frombuffer(bytearray(data[offset : offset + count]), dtype=torch.uint8) if count else (
            torch.empty(0, dtype=torch.uint8))  # fmt: skip
        tensors.append(raw.view(dtype).reshape(shape))
        offset += count

    def build(s: dict[str, Any]) -> Any:
        if "v" in s:
            return s["v"]
        if "t" in s:
            return tensors[s["t"]]
        if "list" in s:
            return [build(v) for v in s["list"]]
        if "tuple" in s:
            return tuple(build(v) for v in s["tuple"])
        return {k: build(v) for k, v in s["dict"].items()}

    return build(meta["skeleton"])


def exchange(group: Group, seq: int, mine: Any, plan: int = 0) -> list[Any]:
    """Every rank's ``mine``, in rank order (this rank's as it is, the others' unpacked).

    Every rank of ``group`` calls it with the same ``seq`` (a count of the exchanges so far); a
    failure releases the group and raises ``CollectiveError`` (module doc). ``plan``: a digest of
    how the work was cut (which items, in which order); ranks whose plans differ would put together
    results that do not belong together, so every rank raises ``ExchangeRefused`` instead."""
    try:
        data: bytes | None = pack(mine)
    except TypeError:
        data = None
    ctl = group.control
    try:
        header = torch.tensor([_MAGIC, seq, -1 if data is None else len(data), plan], dtype=torch.int64)
        headers = torch.stack(ctl.allgather(header))
        if not (bool((headers[:, 0] == _MAGIC).all()) and bool((headers[:, 1] == seq).all())):
            raise CollectiveError(
                f"gen {group.gen}: the ranks are not in the same exchange ({headers.tolist()})"
            )
        sizes = headers[:, 2].tolist()
        if not bool((headers[:, 3] == plan).all()):
            raise ExchangeRefused("the ranks cut the work differently (their batches differ)")
        if min(sizes) < 0:
            raise ExchangeRefused(f"rank {sizes.index(-1)}'s results are not plain data")
        assert data is not None
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # never empty: a header
        bufs = ctl.allgather(buf)
    except CollectiveError:
        group.release()
        raise
    return [mine if r == group.rank else unpack(bufs[r][: sizes[r]].numpy().tobytes())
            for r in range(group.world_size)]  # fmt: skip
