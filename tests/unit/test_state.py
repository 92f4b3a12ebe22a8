"""State transfer, digests and gradient reduction over real gloo groups (two threads, one process)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import struct
import threading
import traceback
import types
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import TCPStore

from checkpointless.comm import CollectiveError, Group
from checkpointless.ddp import GradientReducer
from checkpointless.errors import IntegrityError
from checkpointless.models.tiny_gpt import GPTConfig, TinyGPT
from checkpointless.progress import Progress, StepState
from checkpointless.state import (
    StateRegistry,
    codec,
    digest_state,
    digests,
    recv_state,
    send_state,
)
from checkpointless.state import transfer as wire

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32  # a job's secret
OTHER_KEY = b"o" * 32


def run_pair(fn: Callable[[Group], Any], gen: int = 0, timeout_s: float = 20) -> list[Any]:
    """Run ``fn(group)`` on ranks 0 and 1 of a fresh gloo group, in two threads.

    A rank that raises aborts the group. Where the receiver refuses a transfer, the
    sender may stay blocked on messages nobody will receive until ``timeout_s``."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    results: list[Any] = [None, None]
    done = [threading.Event(), threading.Event()]

    def target(rank: int) -> None:
        store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))
        group = Group(store, gen, rank, 2, timeout=timedelta(seconds=timeout_s))
        try:
            results[rank] = fn(group)
        except Exception as e:
            traceback.clear_frames(e.__traceback__)  # a live Work in a frame keeps the sockets open
            results[rank] = e
            done[rank].set()
            group.abort()  # destroys the group: the peer's pending transfer fails at once
        else:
            done[rank].set()
            done[1 - rank].wait(timeout_s)  # the peer may still be reading what this rank sent
            group.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results


def transfer(
    state: dict[str, Any],
    *,
    send_key: bytes | None = None,
    recv_key: bytes | None = None,
    timeout_s: float = 20,
) -> Any:
    """Send ``state`` from rank 0 to rank 1; rank 1's result: (state, stats) or the exception it raised."""

    def fn(group: Group) -> Any:
        if group.rank == 0:
            return send_state(group, 1, state, key=send_key)
        return recv_state(group, 0, key=recv_key)

    return run_pair(fn, timeout_s=timeout_s)[1]


REFUSED = 15  # group timeout where the receiver refuses (its abort normally releases the sender at once)


def assert_same(a: Any, b: Any, path: str = "state") -> None:
    """``a`` and ``b`` are equal, with the same types all the way down (dict keys included)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        assert [type(k) for k in a] == [type(k) for k in b], f"{path}: key types differ"
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{path}: _metadata differs"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert bytes(digests.tensor_bytes(a.contiguous())) == bytes(digests.tensor_bytes(b.contiguous())), (
            f"{path}: data"
        )
    elif isinstance(a, np.ndarray | np.generic):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: data"
    elif isinstance(a, float):
        assert struct.pack(">d", a) == struct.pack(">d", b), f"{path}: {a!r} != {b!r}"  # nan, -0.0
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """Encode and decode ``state`` without a network (the received tensors are the sent ones)."""
    meta, tensors = codec.encode_state(state)
    skeleton, refs = codec.decode_meta(meta)
    assert [r.index for r in refs] == list(range(len(tensors)))
    got: dict[str, Any] = codec.unflatten(skeleton, tensors)
    return got


def trained_pair() -> tuple[TinyGPT, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_layer=1, n_head=2))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 16, (2, 8))
    model(x, x).backward()
    opt.step()
    return model, opt


def every_type() -> dict[str, Any]:
    """One of every kind of value the metadata must carry, nested like real state."""
    return {
        "scalars": {
            "none": None,
            "true": True,
            "false": False,
            "zero": 0,
            "int": -(2**70),
            "float": 0.1,
            "neg_zero": -0.0,
            "nan": float("nan"),
            "inf": math.inf,
            "ninf": -math.inf,
            "tiny": 5e-324,
            "str": "é\x00\U0001f600",
            "bytes": b"\x00\xff\x80",
            "empty_bytes": b"",
        },
        "containers": {
            "tuple": (1, (2.0, [3, None]), ()),
            "list": [[], [True], ("a",)],
            "empty": {},
            7: "int key",
            -1: "negative int key",
            (1, "a"): "tuple key",
            None: "none key",
            True: "bool key",
            2.5: "float key",
            b"k": "bytes key",
        },
        "odict": OrderedDict([("b", 1), ("a", 2)]),
        "numpy": {
            "u32": np.arange(624, dtype=np.uint32),
            "f64_2d": np.linspace(0, 1, 6).reshape(2, 3),
            "bool": np.array([True, False]),
            "big_endian": np.arange(3, dtype=">i4"),
            "empty": np.zeros((0, 3), dtype=np.int16),
            "zero_d": np.array(3.5, dtype=np.float32),
            "c128": np.array([1 + 2j]),
            "scalar_f64": np.float64(2.5),
            "scalar_i64": np.int64(-3),
            "scalar_bool": np.bool_(True),
            "scalar_u8": np.uint8(255),
            "scalar_f16": np.float16(0.5),
        },
        "torch": {
            "dtype": torch.bfloat16,
            "size": torch.Size([2, 3]),
            "scalar": torch.tensor(1.5),
            "int64": torch.arange(5),
            "bool": torch.tensor([True, False, True]),
            "bf16": torch.randn(3, 2).to(torch.bfloat16),
            "empty": torch.zeros(0, 4),
            "noncontig": torch.arange(12.0).reshape(3, 4).t(),
            "in_tuple": (torch.ones(2), 3),
        },
    }


def test_send_recv_moves_model_and_optimizer_exactly() -> None:
    src_model, src_opt = trained_pair()
    torch.manual_seed(1)
    dst_model = TinyGPT(GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_layer=1, n_head=2))
    dst_opt = torch.optim.AdamW(dst_model.parameters())
    assert digest_state(dst_model, dst_opt, 0) != digest_state(src_model, src_opt, 0)
    registry = {0: StateRegistry(), 1: StateRegistry()}
    registry[0].register("model", src_model)
    registry[0].register("optimizer", src_opt)
    registry[1].register("model", dst_model)
    registry[1].register("optimizer", dst_opt)

    def fn(group: Group) -> Any:
        if group.rank == 0:
            return send_state(group, 1, registry[0].state_dict(), key=KEY)
        state, stats = recv_state(group, 0, key=KEY)
        registry[1].load_state_dict(state)
        return stats

    sent, received = run_pair(fn)
    assert sent.sha256 == received.sha256 and sent.bytes == received.bytes > 0
    assert digest_state(dst_model, dst_opt, 0) == digest_state(src_model, src_opt, 0)


def test_recv_into_own_tensors_receives_in_place_and_loads_exactly() -> None:
    """A replacement receives straight into its built model and optimizer: no new tensors."""
    src_model, src_opt = trained_pair()
    dst_model, dst_opt = trained_pair()
    with torch.no_grad():
        for p in dst_model.parameters():
            p.mul_(-1)  # same structure, other values
    src_model.head.weight = src_model.tok.weight  # tied weights: one tensor under two names
    dst_model.head.weight = dst_model.tok.weight
    registry = {0: StateRegistry(), 1: StateRegistry()}
    for r, (m, o) in enumerate([(src_model, src_opt), (dst_model, dst_opt)]):
        registry[r].register("model", m)
        registry[r].register("optimizer", o)
    mine = registry[1].state_dict()
    ptrs = {name: t.data_ptr() for name, t in mine["model"].items()}
    ptrs_opt = {i: s["exp_avg"].data_ptr() for i, s in mine["optimizer"]["state"].items()}

    def fn(group: Group) -> Any:
        if group.rank == 0:
            return send_state(group, 1, registry[0].state_dict(), key=KEY)
        state, _ = recv_state(group, 0, key=KEY, into=mine)
        return state

    _, got = run_pair(fn)
    in_place = [n for n, t in got["model"].items() if t.data_ptr() == ptrs[n]]
    assert len(in_place) == len(ptrs) - 1  # the second name of the tied tensor got its own buffer
    assert all(s["exp_avg"].data_ptr() == ptrs_opt[i] for i, s in got["optimizer"]["state"].items())
    registry[1].load_state_dict(got)
    assert digest_state(dst_model, dst_opt, 0) == digest_state(src_model, src_opt, 0)


def test_recv_into_a_different_structure_allocates() -> None:
    sent = {"a": torch.arange(6.0), "b": [torch.ones(2, 2)], "c": torch.zeros(3, dtype=torch.int64)}
    mine = {"a": torch.zeros(2, 3), "b": [torch.zeros(2, 2)], "c": torch.zeros(3)}  # shape, dtype differ
    before = {k: (v[0] if isinstance(v, list) else v).data_ptr() for k, v in mine.items()}

    def fn(group: Group) -> Any:
        if group.rank == 0:
            return send_state(group, 1, sent)
        return recv_state(group, 0, into=mine)[0]

    _, got = run_pair(fn)
    assert got["a"].data_ptr() != before["a"] and got["c"].data_ptr() != before["c"]
    assert got["b"][0].data_ptr() == before["b"]  # same path, dtype and shape: received in place
    assert torch.equal(got["a"], sent["a"]) and torch.equal(got["b"][0], sent["b"][0])
    assert torch.equal(got["c"], sent["c"])


@pytest.mark.parametrize("key", [None, KEY])
def test_every_supported_type_crosses_the_wire_exactly(key: bytes | None) -> None:
    state = every_type()
    got, stats = transfer(state, send_key=key, recv_key=key)
    state["torch"]["noncontig"] = state["torch"]["noncontig"].contiguous()  # sent as its values
    assert_same(state, got)
    assert stats.bytes == sum(t.numel() * t.element_size() for t in codec.encode_state(state)[1])


def test_model_optimizers_and_scheduler_round_trip_and_keep_training_identically() -> None:
    def build(seed: int) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], Any]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        adamw = torch.optim.AdamW(model[0].parameters(), lr=1e-2, betas=(0.8, 0.95), eps=1e-7)
        sgd = torch.optim.SGD(
            [{"params": model[1].parameters(), "momentum": 0.9, "nesterov": True},
             {"params": model[2].parameters(), "momentum": 0.0}],
            lr=0.1,
        )  # fmt: skip
        sched = torch.optim.lr_scheduler.LambdaLR(adamw, lambda step: 0.5**step)
        return model, [adamw, sgd], sched

    def train(model: torch.nn.Module, opts: list[torch.optim.Optimizer], sched: Any, seed: int) -> None:
        torch.manual_seed(seed)
        model(torch.randn(4, 4)).square().sum().backward()
        for o in opts:
            o.step()
            o.zero_grad()
        sched.step()

    src = build(0)
    for i in range(2):
        train(*src, seed=10 + i)
    dst = build(1)
    state = {
        "model": src[0].state_dict(),
        "adamw": src[1][0].state_dict(),
        "sgd": src[1][1].state_dict(),
        "scheduler": src[2].state_dict(),
    }
    assert state["scheduler"]["lr_lambdas"] == [None]  # a function is not part of the state
    got, _ = transfer(state, send_key=KEY, recv_key=KEY)
    assert_same(state, got)
    assert list(got["adamw"]["state"]) == [0, 1]  # int keys, not "0", "1"
    assert got["adamw"]["param_groups"][0]["betas"] == (0.8, 0.95)
    dst[0].load_state_dict(got["model"])
    dst[1][0].load_state_dict(got["adamw"])
    dst[1][1].load_state_dict(got["sgd"])
    dst[2].load_state_dict(got["scheduler"])
    assert_same(dst[0].state_dict(), src[0].state_dict())
    for a, b in zip(dst[1], src[1], strict=True):
        assert_same(a.state_dict(), b.state_dict())
    assert_same(dst[2].state_dict(), src[2].state_dict())
    train(*src, seed=20)
    train(*dst, seed=20)
    assert_same(dst[0].state_dict(), src[0].state_dict())


def test_rng_states_round_trip_and_continue_the_same_streams() -> None:
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    torch.rand(7), np.random.rand(7), random.random()  # somewhere mid-stream
    steps = StepState()
    steps.commit(41)
    progress = Progress(steps)
    state = {"progress": progress.state_dict()}
    expected = (torch.rand(5), np.random.rand(5), [random.random() for _ in range(5)])

    got, _ = transfer(state, send_key=KEY, recv_key=KEY)
    assert_same(state, got)
    torch.manual_seed(99), np.random.seed(99), random.seed(99)  # the receiver's streams differ
    steps.load(-1, 0)
    progress.load_state_dict(got["progress"])
    assert (steps.committed, steps.next) == (41, 42)
    assert torch.equal(torch.rand(5), expected[0])
    assert np.array_equal(np.random.rand(5), expected[1])
    assert [random.random() for _ in range(5)] == expected[2]


class _NoNetwork:
    """A group that fails the test if anything is sent."""

    gen, rank = 0, 0

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"Group.{name} called: the sender must fail before sending")


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            {"scheduler": {"lr_lambdas": [lambda step: 1.0]}},
            "state['scheduler']['lr_lambdas'][0]: cannot transfer object of type function",
        ),
        ({"opt": {"state": {0: {"fn": print}}}}, "state['opt']['state'][0]['fn']: cannot transfer object"),
        ({"x": [1, (2, {"y": object()})]}, "state['x'][1][1]['y']: cannot transfer object of type object"),
        ({"x": {Path("p"): 1}}, "state['x']: cannot transfer dict key of type PosixPath"),
        ({"x": {"a": np.array(["s"])}}, "state['x']['a']: cannot transfer a numpy array of dtype <U1"),
        ({"x": {"a": np.array([None], dtype=object)}}, "state['x']['a']: cannot transfer a numpy array"),
        ({"x": 1 + 2j}, "state['x']: cannot transfer object of type complex"),
        ({"x": bytearray(b"a")}, "state['x']: cannot transfer object of type bytearray"),
        ({"x": types.SimpleNamespace()}, "state['x']: cannot transfer object of type SimpleNamespace"),
        ({"m": OrderedDict(a=set())}, "state['m']['a']: cannot transfer object of type set"),
    ],
)
def test_unsupported_value_fails_on_the_sender_naming_its_path(state: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError) as err:
        send_state(cast(Group, _NoNetwork()), 1, state, key=KEY)
    assert message in str(err.value)


def test_sender_refuses_cycles_and_oversized_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="nested deeper than"):
        send_state(cast(Group, _NoNetwork()), 1, {"c": cycle})
    monkeypatch.setattr(codec, "MAX_META_BYTES", 1000)
    with pytest.raises(ValueError, match="above the limit of 1000"):
        send_state(cast(Group, _NoNetwork()), 1, {"x": "a" * 2000})


def test_key_must_be_long_enough_bytes() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        send_state(cast(Group, _NoNetwork()), 1, {}, key=b"short")
    with pytest.raises(TypeError, match="must be bytes"):
        recv_state(cast(Group, _NoNetwork()), 1, key="k" * 32)  # type: ignore[arg-type]


# -- hostile senders: they speak the wire protocol by hand -----------------------------------


def send_raw(
    group: Group,
    meta: bytes,
    tensors: list[torch.Tensor],
    *,
    key: bytes | None = None,
    sealed_meta: bytes | None = None,
    sealed_tensors: list[torch.Tensor] | None = None,
    gen: int | None = None,
) -> None:
    """Send ``meta`` and ``tensors`` to rank 1, sealed (under ``key``) as if they were the
    ``sealed_*`` ones: a sender that alters what it sends after computing its tags."""
    ctx = wire._context(group.gen if gen is None else gen, group.rank, 1)
    meta_digest = hashlib.sha256(meta if sealed_meta is None else sealed_meta).digest()
    sealed = tensors if sealed_tensors is None else sealed_tensors
    salt = os.urandom(16)
    group.send(torch.tensor([wire.WIRE_VERSION, len(meta)], dtype=torch.int64), 1)
    group.send(wire._u8(meta + salt + wire._meta_tag(key, ctx, salt, meta_digest)), 1)
    for w in [group.isend(data, 1, tag=k + 1) for k, (_, _, data) in enumerate(wire._pieces(tensors))]:
        group.wait(w)
    group.send(
        wire._u8(wire._trailer(key, ctx, meta_digest, wire._seal_tensors(key, ctx, salt, sealed))),
        1,
    )


class _CreateFile:
    """Unpickling this creates a file: the attack the old pickled metadata allowed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


@pytest.mark.parametrize("key", [None, KEY])
def test_pickle_payload_in_the_metadata_is_never_run(tmp_path: Path, key: bytes | None) -> None:
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_CreateFile(control))).close()  # the payload is live
    assert control.exists()
    target = tmp_path / "pwned"
    payload = pickle.dumps({"skeleton": _CreateFile(target)}, protocol=pickle.HIGHEST_PROTOCOL)

    def fn(group: Group) -> Any:
        if group.rank == 0:
            # without the key the attacker cannot seal its payload: it tries with one of its own
            return send_raw(group, payload, [], key=None if key is None else OTHER_KEY)
        return recv_state(group, 0, key=key)

    err = run_pair(fn, timeout_s=REFUSED)[1]
    assert isinstance(err, IntegrityError)
    # with a key the tag is refused before the metadata is parsed; without, the parser refuses it
    assert ("not parsed" if key else "malformed metadata") in str(err)
    assert not target.exists()


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ([wire.WIRE_VERSION, 2**40], "metadata length 1099511627776 is outside"),
        ([wire.WIRE_VERSION, codec.MAX_META_BYTES + 1], "is outside"),
        ([wire.WIRE_VERSION, -8], "is outside"),
        ([wire.WIRE_VERSION, 0], "is outside"),
        ([7, 100], "wire version 7"),
    ],
)
def test_hostile_header_is_refused_before_any_allocation(
    header: list[int], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    allocated: list[int] = []
    real_empty = torch.empty

    def recording_empty(*size: Any, **kw: Any) -> torch.Tensor:
        t = real_empty(*size, **kw)
        allocated.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(torch, "empty", recording_empty)

    def fn(group: Group) -> Any:
        if group.rank == 0:
            group.send(torch.tensor(header, dtype=torch.int64), 1)
            return None
        return recv_state(group, 0, key=KEY)

    err = run_pair(fn, timeout_s=REFUSED)[1]
    assert isinstance(err, IntegrityError) and match in str(err)
    assert sum(allocated) < 1024


@pytest.mark.parametrize(("send_key", "recv_key"), [(KEY, OTHER_KEY), (KEY, None), (None, KEY)])
def test_wrong_or_missing_key_is_refused_before_parsing(
    send_key: bytes | None, recv_key: bytes | None
) -> None:
    err = transfer({"w": torch.ones(4), "step": 3}, send_key=send_key, recv_key=recv_key, timeout_s=REFUSED)
    assert isinstance(err, IntegrityError) and "not parsed" in str(err)


def test_transfer_sealed_for_another_generation_is_refused() -> None:
    meta, tensors = codec.encode_state({"w": torch.ones(4)})

    def fn(group: Group) -> Any:
        if group.rank == 0:
            return send_raw(group, meta, tensors, key=KEY, gen=group.gen + 1)  # a replayed transfer
        return recv_state(group, 0, key=KEY)

    err = run_pair(fn, timeout_s=REFUSED)[1]
    assert isinstance(err, IntegrityError) and "authentication" in str(err)


@pytest.mark.parametrize("key", [None, KEY])
def test_corrupted_tensor_is_caught(key: bytes | None) -> None:
    meta, tensors = codec.encode_state({"w": torch.ones(4), "b": torch.zeros(3)})
    corrupted = [tensors[0].clone(), tensors[1]]
    corrupted[0][2] = 1.0000001

    def fn(group: Group) -> Any:
        if group.rank == 0:
            return send_raw(group, meta, corrupted, key=key, sealed_tensors=tensors)
        return recv_state(group, 0, key=key)

    err = run_pair(fn, timeout_s=REFUSED)[1]
    assert isinstance(err, IntegrityError) and "tensors or metadata failed" in str(err)


@pytest.mark.parametrize("key", [None, KEY])
def test_every_mac_piece_of_a_large_tensor_is_checked(
    monkeypatch: pytest.MonkeyPatch, key: bytes | None
) -> None:
    """A tensor larger than one GMAC piece gets one tag per piece: a flipped bit in a later piece
    and two swapped pieces (same bytes, other order) are both refused; the intact one arrives."""
    monkeypatch.setattr(wire, "_MAC_PIECE", 256)
    w = torch.arange(1000, dtype=torch.float32)  # 4000 bytes: 16 pieces
    meta, tensors = codec.encode_state({"w": w})
    flipped = tensors[0].clone()
    flipped.view(torch.uint8)[3 * 256 + 17] ^= 0x10
    swapped = tensors[0].clone()
    swapped.view(torch.uint8)[:512] = torch.cat(
        [tensors[0].view(torch.uint8)[256:512], tensors[0].view(torch.uint8)[:256]]
    )
    assert len(wire._pieces([w])) == 16
    assert wire._seal_tensors(key, b"c", b"s" * 16, [w]) != wire._seal_tensors(
        key, b"c", b"s" * 16, [swapped]
    )
    for altered in (flipped, swapped):

        def fn(group: Group, altered: torch.Tensor = altered) -> Any:
            if group.rank == 0:
                return send_raw(group, meta, [altered], key=key, sealed_tensors=tensors)
            return recv_state(group, 0, key=key)

        err = run_pair(fn, timeout_s=REFUSED)[1]
        assert isinstance(err, IntegrityError) and "tensors or metadata failed" in str(err)

    def honest(group: Group) -> Any:
        if group.rank == 0:
            return send_state(group, 1, {"w": w}, key=key)
        return recv_state(group, 0, key=key)

    (sent, (got, received)) = run_pair(honest)
    assert torch.equal(got["w"], w) and sent.sha256 == received.sha256


def test_trailer_covers_the_metadata() -> None:
    """Without a key anyone can reseal forged metadata, but not the trailer the source computed."""
    meta, tensors = codec.encode_state({"lr": 0.1, "w": torch.ones(4)})
    forged = meta.replace(b'"lr",0.1', b'"lr",9.9')
    assert forged != meta

    def fn(group: Group) -> Any:
        if group.rank == 0:
            # the metadata tag is recomputed for the forgery, the trailer is the honest one
            ctx = wire._context(group.gen, 0, 1)
            honest = hashlib.sha256(meta).digest()
            salt = os.urandom(16)
            group.send(torch.tensor([wire.WIRE_VERSION, len(forged)], dtype=torch.int64), 1)
            group.send(
                wire._u8(forged + salt + wire._meta_tag(None, ctx, salt, hashlib.sha256(forged).digest())),
                1,
            )
            group.wait(group.isend(tensors[0], 1, tag=1))
            trailer = wire._trailer(None, ctx, honest, wire._seal_tensors(None, ctx, salt, tensors))
            group.send(wire._u8(trailer), 1)
            return None
        return recv_state(group, 0)

    err = run_pair(fn, timeout_s=REFUSED)[1]
    assert isinstance(err, IntegrityError) and "tensors or metadata failed" in str(err)


def _doc(state: Any, tensors: int = 0, **fields: Any) -> bytes:
    doc = {
        "format": "checkpointless-state",
        "version": codec._META_VERSION,
        "tensors": tensors,
        "state": state,
        **fields,
    }
    return json.dumps(doc).encode()


def _nested(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = ["list", v]
    return ["dict", "x", v]


TENSOR = ["tensor", 0, "float32", [2], False]


@pytest.mark.parametrize(
    "meta",
    [
        b"\x80\x04\x95",  # a pickle
        b"\xff\xfe{}",  # not UTF-8
        b"not json",
        b"[]",
        b'{"format": "checkpointless-state"}',
        _doc(["dict"], extra=1),
        _doc(["dict"]).replace(b'"version": 2', b'"version": 1'),  # the SHA-256 wire format: refused
        _doc(["dict"]).replace(b'"version": 2', b'"version": true'),
        _doc(["dict"]).replace(b'"version": 2, ', b'"version": 2, "version": 2, '),
        _doc(["list"]),  # the state is not a dict
        _doc(["dict", "x", {"a": 1}]),  # a JSON object inside the state
        _doc(["dict", "x", "@"]).replace(b'"@"', b"NaN"),  # not JSON (nan is tagged)
        _doc(["dict", "x", ["module", "os.system", "id"]]),  # an unknown tag
        _doc(["dict", "x", []]),
        _doc(["dict", "x", [1, 2]]),
        _doc(["dict", "x"]),  # odd pairs
        _doc(["dict", "x", 1, "x", 2]),  # duplicate key
        _doc(["dict", ["list"], 1]),  # unhashable key
        _doc(["dict", TENSOR, 1], tensors=1),  # tensor as a key
        _doc(["odict"]),
        _doc(["dict", "x", ["float", "zz"]]),
        _doc(["dict", "x", ["float", "7ff8"]]),
        _doc(["dict", "x", ["bytes", "not base64!"]]),
        _doc(["dict", "x", ["bytes", 3]]),
        _doc(["dict", "x", ["dtype", "Tensor"]]),
        _doc(["dict", "x", ["dtype", "__class__"]]),
        _doc(["dict", "x", ["size", 1.5]]),
        _doc(["dict", "x", ["npscalar", "|O", "AAAAAAAAAAA="]]),
        _doc(["dict", "x", ["npscalar", "<f8", "AAAA"]]),  # wrong length
        _doc(["dict", "x", ["ndarray", "|O", [1], "AAAAAAAAAAA="]]),
        _doc(["dict", "x", ["ndarray", "<V8", [1], "AAAAAAAAAAA="]]),
        _doc(["dict", "x", ["ndarray", "<f8", [2], "AAAAAAAAAAA="]]),  # 8 bytes for 16
        _doc(["dict", "x", ["ndarray", "<f8", [-1], ""]]),
        _doc(["dict", "x", ["ndarray", "<f8", [2**40, 2**40], ""]]),
        _doc(["dict", "x", ["ndarray", "<f8", [True], "AAAAAAAAAAA="]]),
        _doc(["dict", "x", ["ndarray", "<f8", [1] * 65, "AAAAAAAAAAA="]]),
        _doc(["dict", "x", TENSOR], tensors=0),  # index out of range
        _doc(["dict", "x", TENSOR, "y", TENSOR], tensors=2),  # twice, and tensor 1 missing
        _doc(["dict", "x", TENSOR], tensors=2),  # tensor 1 missing
        _doc(["dict", "x", TENSOR], tensors=10**12),  # a hostile count
        _doc(["dict", "x", ["tensor", True, "float32", [2], False]], tensors=1),
        _doc(["dict", "x", ["tensor", 0, "qint8", [2], False]], tensors=1),
        _doc(["dict", "x", ["tensor", 0, "float32", [2], 1]], tensors=1),
        _doc(["dict", "x", ["tensor", 0, "float32", [2**62, 2**62], False]], tensors=1),
        _doc(_nested(200)),
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_malformed_metadata_raises_integrity_error(meta: bytes) -> None:
    with pytest.raises(IntegrityError):
        codec.decode_meta(meta)


def test_decoder_accepts_what_it_should() -> None:
    """The strict decoder is not too strict: the documented forms decode to the right types."""
    state, refs = codec.decode_meta(_doc(["dict", "x", TENSOR, "n", _nested(50)], tensors=1))
    assert state["x"] == codec.TensorRef(0, torch.float32, (2,), False) and refs == [state["x"]]
    assert codec.decode_meta(_doc(["dict", "f", ["float", "fff0000000000000"]]))[0] == {"f": -math.inf}


_keys = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8))
_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(), st.binary(max_size=16))
_values = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.one_of(_keys, st.tuples(_keys, _keys)), inner, max_size=4),
    ),
    max_leaves=25,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _values, max_size=5))
def test_encoding_round_trips_any_nesting_of_plain_values(state: dict[str, Any]) -> None:
    assert_same(state, round_trip(state))


def test_round_trip_without_network_matches_the_wire() -> None:
    state = every_type()
    got = round_trip(state)
    state["torch"]["noncontig"] = state["torch"]["noncontig"].contiguous()
    got["torch"]["noncontig"] = got["torch"]["noncontig"].contiguous()
    assert_same(state, got)


def test_allreduce_fails_when_peer_aborts() -> None:
    def fn(group: Group) -> Any:
        if group.rank == 1:
            group.abort()
            return "aborted"
        with pytest.raises(CollectiveError):
            group.allreduce_([torch.ones(1000)])
        return "raised"

    assert run_pair(fn) == ["raised", "aborted"]


def test_reducer_averages_and_handles_set_to_none() -> None:
    def fn(group: Group) -> Any:
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 3)
        red = GradientReducer(list(lin.parameters()), bucket_bytes=32)  # several buckets
        for _ in range(2):
            lin.zero_grad(set_to_none=True)
            (lin(torch.full((1, 4), float(group.rank + 1))).sum()).backward()
            red.reduce(group)
        return [p.grad.clone() for p in lin.parameters() if p.grad is not None]

    g0, g1 = run_pair(fn)
    for a, b in zip(g0, g1, strict=True):
        assert torch.equal(a, b)
    assert torch.allclose(g0[0], torch.full((3, 4), 1.5))  # mean of inputs 1 and 2


def _mlp() -> torch.nn.Module:
    """The same small network in every thread (run_pair's ranks share the global RNG)."""
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return net


def _reduced_grads(group: Group, *, overlap: bool, passes: int, set_to_none: bool) -> list[torch.Tensor]:
    """Three steps of ``passes`` backward passes each, reduced; every gradient after each step."""
    net = _mlp()
    red = GradientReducer(list(net.parameters()), bucket_bytes=300, overlap=overlap)
    assert len(red._buckets) == 5
    out: list[torch.Tensor] = []
    for step in range(3):
        net.zero_grad(set_to_none=set_to_none)
        red.begin(group)
        for k in range(passes):
            x = torch.linspace(-1, 1, 24).reshape(3, 8) * (group.rank + 1 + step + k)
            net(x).square().sum().backward()
        red.reduce(group)
        out += [p.grad.clone() for p in net.parameters() if p.grad is not None]
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.01 * p.grad  # type: ignore[operator]
    return out


@pytest.mark.parametrize("set_to_none", [False, True])
def test_overlapped_reduction_is_bitwise_the_plain_one(set_to_none: bool) -> None:
    plain = run_pair(lambda g: _reduced_grads(g, overlap=False, passes=1, set_to_none=set_to_none))
    overlapped = run_pair(lambda g: _reduced_grads(g, overlap=True, passes=1, set_to_none=set_to_none))
    assert len(plain[0]) == 3 * 6
    for a, b, c in zip(plain[0], overlapped[0], overlapped[1], strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_overlapped_reduction_with_gradient_accumulation() -> None:
    """Two backward passes per attempt: every bucket is reduced once per pass (DDP's arithmetic),
    the same bits with the overlap on and off."""
    plain = run_pair(lambda g: _reduced_grads(g, overlap=False, passes=2, set_to_none=False))
    overlapped = run_pair(lambda g: _reduced_grads(g, overlap=True, passes=2, set_to_none=False))
    for a, b, c in zip(plain[0], overlapped[0], overlapped[1], strict=True):
        assert torch.equal(b, c)  # the replicas agree bit for bit
        assert torch.equal(a, b)  # overlap on and off: the same arithmetic


def test_overlapped_reduction_leaves_the_last_bucket_to_reduce() -> None:
    """A rank that fails between backward() and the reduction must leave its peers waiting: the
    step then commits on every rank or on none (the backward pass started every other bucket)."""

    def fn(group: Group) -> Any:
        net = _mlp()
        red = GradientReducer(list(net.parameters()), bucket_bytes=300)
        red.begin(group)
        net(torch.ones(3, 8)).sum().backward()
        if group.rank == 1:
            raise RuntimeError("the user's step fails after backward()")
        red.reduce(group)
        return "committed"

    result = run_pair(fn, timeout_s=5)
    assert isinstance(result[0], CollectiveError)


def test_digest_is_canonical_and_covers_step() -> None:
    m1, o1 = trained_pair()
    m2, o2 = trained_pair()
    assert digest_state(m1, o1, 5) == digest_state(m2, o2, 5)
    assert digest_state(m1, o1, 5) != digest_state(m1, o1, 6)
    with torch.no_grad():
        next(m2.parameters()).view(-1)[0] += 1e-7
    assert digest_state(m1, o1, 5) != digest_state(m2, o2, 5)


class _OwnMetrics:
    """A rank's own state (``per_rank``): moved to a replacement, never compared."""

    per_rank = True

    def __init__(self, value: float) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"loss": torch.tensor(self.value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["loss"])


def test_per_rank_state_moves_with_the_rest_but_the_replicas_do_not_compare_it() -> None:
    from checkpointless.model_holder import compared_entries

    model = torch.nn.Linear(2, 2)
    entries = []
    for value in (1.0, 2.0):  # two replicas, equal but for their own metrics
        registry = StateRegistry()
        registry.register("model", model)
        registry.register("metrics", _OwnMetrics(value))
        assert set(registry.state_dict()) == {"model", "metrics"}
        assert set(registry.compared_state_dict()) == {"model"}
        entries.append(compared_entries(registry))
    assert entries[0] == entries[1] and not any(path.startswith("metrics") for path, _ in entries[0])
