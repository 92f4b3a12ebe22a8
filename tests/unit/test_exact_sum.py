"""The exact sum's pieces alone: chunks that cover a bucket, and the sum of one replica holding
every share, in share order (``GradientReducer`` with ``owners``: what several replicas must
reproduce, which tests/integration/test_exact_resize.py checks with real processes)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from checkpointless.ddp import GradientReducer
from checkpointless.exact_sum import chunk_sizes, share_sum
from checkpointless.share_loop import assign

pytestmark = pytest.mark.timeout(30)


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_chunks_cover_the_bucket_and_differ_by_one_at_most(n: int, parts: int) -> None:
    sizes = chunk_sizes(n, parts)
    assert len(sizes) == parts and sum(sizes) == n and max(sizes) - min(sizes) <= 1


def test_one_replica_sums_its_shares_in_share_order() -> None:
    g = torch.Generator().manual_seed(0)
    stashed = {s: [torch.randn(7, generator=g) * 10**s, torch.randn(3, generator=g)] for s in (2, 0, 1)}
    out = [torch.empty(7), torch.empty(3)]
    share_sum(None, assign(3, 1), stashed, out)
    for b in range(2):
        expected = stashed[0][b].clone()
        expected += stashed[1][b]
        expected += stashed[2][b]
        assert torch.equal(out[b], expected)


def test_the_reducer_keeps_each_shares_gradient_apart_and_divides_their_ordered_sum() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    reducer = GradientReducer(list(model.parameters()))
    reducer.begin(None, divisor=3, owners=assign(3, 1))
    grads = []
    for share in range(3):
        reducer.hold(share < 2)
        model(torch.randn(5, 4) * (share + 1)).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        reducer.stash(share)
        assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())  # the next starts at zero
    reducer.reduce(None)
    for i, p in enumerate(model.parameters()):
        expected = grads[0][i].clone()
        expected += grads[1][i]
        expected += grads[2][i]
        assert torch.equal(p.grad, expected / 3)
