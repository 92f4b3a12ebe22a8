"""Frozen parameters a receiver holds alike are not sent (state/frozen.py), over a real gloo group.

The exchange is the one ``Member._enter`` runs: the receiver's offer, the source leaving out what
matches, the receiver checking and completing the state before it loads it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from checkpointless.comm import Group
from checkpointless.errors import IntegrityError
from checkpointless.state import StateRegistry, digest_state, frozen, recv_state, send_state
from tests.unit.test_state import run_pair

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32


class Adapted(nn.Module):
    """A frozen base (an embedding tied to the head, a linear layer) and a trainable adapter."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)  # the base: the same in every process ("pretrained")
        self.embed = nn.Embedding(16, 8)
        self.base = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        with torch.no_grad():
            for p in (self.embed.weight, self.base.weight, self.base.bias):
                p.copy_(torch.randn(p.shape, generator=g))
        self.head.weight = self.embed.weight  # tied: one frozen tensor under two names
        torch.manual_seed(seed)  # the adapter: differs until a transfer
        self.adapter = nn.Linear(8, 8, bias=False)
        for p in (self.embed.weight, self.base.weight, self.base.bias):
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.base(h) + self.adapter(h))


def trained(seed: int) -> tuple[Adapted, torch.optim.Optimizer, StateRegistry]:
    model = Adapted(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.arange(16).reshape(2, 8)).sum().backward()
    opt.step()
    registry = StateRegistry()
    registry.register("model", model)
    registry.register("optimizer", opt)
    return model, opt, registry


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def exchange(source: StateRegistry, src_model: nn.Module, receiver: StateRegistry, dst_model: nn.Module,
             forge: bool = False) -> list[Any]:  # fmt: skip
    """Rank 0 sends, rank 1 receives, as ``Member._enter`` does. ``forge``: the source ignores the
    receiver's offer and leaves out every frozen tensor it holds. Rank 1: (loaded state's kept bytes,
    TransferStats) or the exception; rank 0: the bytes it left out."""

    def fn(group: Group) -> Any:
        if group.rank == 0:
            offered = frozen.recv_offer(group, 1)
            state = source.state_dict()
            if forge:
                offered = frozen.offer(state, src_model)
            sent, kept = frozen.leave_out(state, src_model, offered)
            send_state(group, 1, sent, key=KEY)
            return kept
        mine = receiver.state_dict()
        offered = frozen.offer(mine, dst_model)
        frozen.send_offer(group, 0, offered)
        received, stats = recv_state(group, 0, key=KEY, into={"state": mine})
        state, kept = frozen.fill_in(received, mine, offered)
        receiver.load_state_dict(state)
        return kept, stats

    return run_pair(fn, timeout_s=15)


def test_only_the_adapter_and_its_optimizer_state_move_when_the_base_is_alike() -> None:
    src_model, src_opt, source = trained(1)
    dst_model, dst_opt, receiver = trained(2)
    assert digest_state(src_model, src_opt, 0) != digest_state(dst_model, dst_opt, 0)
    base_ptrs = [p.data_ptr() for p in (dst_model.embed.weight, dst_model.base.weight, dst_model.base.bias)]
    left_out, (kept, stats) = exchange(source, src_model, receiver, dst_model)
    assert digest_state(src_model, src_opt, 0) == digest_state(dst_model, dst_opt, 0)
    # the base, the tied weight under both its names: kept, not sent
    base = nbytes(src_model.embed.weight, src_model.head.weight, src_model.base.weight, src_model.base.bias)
    assert kept == left_out == base
    adapter = nbytes(src_model.adapter.weight)
    assert 3 * adapter <= stats.bytes < 3 * adapter + 64  # weight, exp_avg, exp_avg_sq (+ the step)
    assert base_ptrs == [
        p.data_ptr() for p in (dst_model.embed.weight, dst_model.base.weight, dst_model.base.bias)
    ]


def test_a_frozen_tensor_that_differs_or_trains_on_the_source_is_sent() -> None:
    src_model, src_opt, source = trained(1)
    dst_model, dst_opt, receiver = trained(2)
    with torch.no_grad():
        dst_model.base.bias[0] += 1  # the receiver's copy differs: it must get the source's
    src_model.base.weight.requires_grad_(True)  # the source trains it (unfrozen): sent whatever it holds
    _, (kept, _) = exchange(source, src_model, receiver, dst_model)
    assert kept == nbytes(src_model.embed.weight, src_model.head.weight)
    assert torch.equal(dst_model.base.bias, src_model.base.bias)
    assert digest_state(src_model, src_opt, 0) == digest_state(dst_model, dst_opt, 0)


def test_nothing_frozen_offers_nothing_and_sends_everything() -> None:
    src_model, _, source = trained(1)
    dst_model, _, receiver = trained(2)
    for m in (src_model, dst_model):
        for p in m.parameters():
            p.requires_grad_(True)
    assert frozen.offer(receiver.state_dict(), dst_model) == {}
    left_out, (kept, _) = exchange(source, src_model, receiver, dst_model)
    assert left_out == kept == 0 and torch.equal(dst_model.adapter.weight, src_model.adapter.weight)


def test_a_source_that_leaves_out_what_the_receiver_does_not_hold_alike_is_refused() -> None:
    src_model, _, source = trained(1)
    dst_model, _, receiver = trained(2)
    with torch.no_grad():
        dst_model.base.bias[0] += 1
    _, got = exchange(source, src_model, receiver, dst_model, forge=True)
    # refused before the state is loaded (Member._enter then holds none: it recovers again)
    assert isinstance(got, IntegrityError) and "base.bias" in str(got)
    assert not torch.equal(dst_model.base.bias, src_model.base.bias)


def test_a_malformed_offer_is_an_integrity_error() -> None:
    def fn(group: Group) -> Any:
        if group.rank == 0:
            return frozen.recv_offer(group, 1)
        data = b'[["model", "x"]]'  # a path that is not a list of strings
        group.control.send(torch.tensor([len(data)], dtype=torch.int64), 0)
        group.control.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0)
        return None

    got, _ = run_pair(fn, timeout_s=10)
    assert isinstance(got, IntegrityError) and "malformed" in str(got)
