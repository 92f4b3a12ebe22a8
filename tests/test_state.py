"""State transfer, digests and gradient reduction over real gloo groups (two threads, one process)."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from checkpointless.comm import CollectiveError, Group
from checkpointless.ddp import GradientReducer
from checkpointless.models.tiny_gpt import GPTConfig, TinyGPT
from checkpointless.state import (
    IntegrityError,
    StateRegistry,
    _flatten,
    digest_state,
    recv_state,
    send_state,
)

pytestmark = pytest.mark.timeout(60)


def run_pair(fn: Callable[[Group], Any], gen: int = 0) -> list[Any]:
    """Run ``fn(group)`` on ranks 0 and 1 of a fresh gloo group, in two threads."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    results: list[Any] = [None, None]

    def target(rank: int) -> None:
        store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))
        group = Group(store, gen, rank, 2, timeout=timedelta(seconds=20))
        try:
            results[rank] = fn(group)
        except Exception as e:
            results[rank] = e
            group.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results


def trained_pair() -> tuple[TinyGPT, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_layer=1, n_head=2))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 16, (2, 8))
    model(x, x).backward()
    opt.step()
    return model, opt


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
            return send_state(group, 1, registry[0].state_dict())
        state, stats = recv_state(group, 0)
        registry[1].load_state_dict(state)
        return stats

    sent, received = run_pair(fn)
    assert sent.sha256 == received.sha256 and sent.bytes == received.bytes > 0
    assert digest_state(dst_model, dst_opt, 0) == digest_state(src_model, src_opt, 0)


def test_corrupted_payload_is_refused() -> None:
    def fn(group: Group) -> Any:
        if group.rank == 0:
            # a sender whose trailer does not match the bytes it sent
            flat: list[torch.Tensor] = []
            meta = pickle.dumps({"skeleton": _flatten({"w": torch.ones(4)}, flat)})
            group.send(torch.tensor([len(meta)], dtype=torch.int64), 1)
            group.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), 1)
            group.wait(group.isend(flat[0], 1, tag=1))
            group.send(torch.zeros(32, dtype=torch.uint8), 1)
            return None
        return recv_state(group, 0)

    _, err = run_pair(fn)
    assert isinstance(err, IntegrityError)


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
        return [p.grad.clone() for p in lin.parameters()]

    g0, g1 = run_pair(fn)
    for a, b in zip(g0, g1, strict=True):
        assert torch.equal(a, b)
    assert torch.allclose(g0[0], torch.full((3, 4), 1.5))  # mean of inputs 1 and 2


def test_digest_is_canonical_and_covers_step() -> None:
    m1, o1 = trained_pair()
    m2, o2 = trained_pair()
    assert digest_state(m1, o1, 5) == digest_state(m2, o2, 5)
    assert digest_state(m1, o1, 5) != digest_state(m1, o1, 6)
    with torch.no_grad():
        next(m2.parameters()).view(-1)[0] += 1e-7
    assert digest_state(m1, o1, 5) != digest_state(m2, o2, 5)
