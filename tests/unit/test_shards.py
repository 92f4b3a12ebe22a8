"""``shards``: contiguous balanced shards, results packed as plain data (never pickled) and exchanged
over a real gloo group (ranks are threads with their own store connection and group)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed import TCPStore

from checkpointless.comm import Group
from checkpointless.errors import CollectiveError, ExchangeRefused
from checkpointless.shards import exchange, pack, plan_digest, shard, unpack
from tests.unit.test_reducer import run_ranks

pytestmark = pytest.mark.timeout(60)


@given(st.integers(0, 500), st.integers(1, 17))
def test_the_shards_are_the_items_in_order_balanced(n: int, world: int) -> None:
    parts = [shard(n, world, r) for r in range(world)]
    assert [i for p in parts for i in p] == list(range(n))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def test_results_come_back_as_they_were_sent() -> None:
    g = torch.Generator().manual_seed(0)
    obj = {
        "rows": 4,
        "loss": torch.tensor(2.5),  # 0-dim
        "logits": (
            torch.randn(4, 3, 7, generator=g).to(torch.bfloat16),
            torch.randn(4, 2, generator=g)[:, 1],
        ),
        "labels": [torch.tensor([[1, -100], [3, 4]]), torch.zeros(0, 5, dtype=torch.float16)],
        "mask": torch.tensor([True, False]),
        "none": None,
        "name": "x",
        "ratio": 0.25,
        "flag": False,
    }
    assert _same(unpack(pack(obj)), obj)


@pytest.mark.parametrize("bad", [object(), {1: torch.ones(1)}, {"a": {3}}, torch.nn.Linear(1, 1)])
def test_what_is_not_plain_data_is_refused(bad: Any) -> None:
    with pytest.raises(TypeError):
        pack(bad)


def _ranks(world: int, fn: Any) -> list[Any]:
    def rank_fn(rank: int, store: TCPStore) -> Any:
        group = Group(store, 0, rank, world, prefix="shards/", timeout=timedelta(seconds=10))
        try:
            return fn(rank, group)
        finally:
            group.abort()

    return run_ranks(world, rank_fn)


def test_every_rank_gets_every_ranks_results_in_rank_order() -> None:
    def fn(rank: int, group: Group) -> Any:
        mine = [{"loss": torch.full((rank + 1,), float(rank)), "rows": rank}]  # sizes differ by rank
        return exchange(group, 7, mine)

    results = _ranks(3, fn)
    want = [[{"loss": torch.full((r + 1,), float(r)), "rows": r}] for r in range(3)]
    assert all(_same(got, want) for got in results)


def test_a_rank_whose_results_are_not_plain_data_makes_every_rank_fall_back() -> None:
    def fn(rank: int, group: Group) -> Any:
        with pytest.raises(ExchangeRefused):
            exchange(group, 0, object() if rank == 1 else [torch.ones(1)])
        return exchange(group, 1, rank)  # the group still works

    assert _ranks(2, fn) == [[0, 1], [0, 1]]


def test_ranks_in_different_exchanges_fail_and_release_the_group() -> None:
    """A rank one exchange behind its peer (it missed one): both fail, neither takes the other's
    results, and the group is released (nothing later pairs with this exchange's messages)."""

    def fn(rank: int, group: Group) -> Any:
        with pytest.raises(CollectiveError):
            exchange(group, 3 + rank, [torch.ones(2)])
        with pytest.raises(CollectiveError):
            group.allreduce_([torch.ones(1)])
        return True

    assert _ranks(2, fn) == [True, True]


def test_ranks_that_cut_the_work_differently_all_fall_back() -> None:
    """Rank 1's batches are not rank 0's (a sampler of its own order): putting their outputs together
    would give wrong metrics without a word; every rank refuses, and the group still works."""

    def fn(rank: int, group: Group) -> Any:
        batches = [[0, 1], [2, 3]] if rank == 0 else [[2, 3], [0, 1]]
        with pytest.raises(ExchangeRefused):
            exchange(group, 0, [torch.ones(1)], plan_digest(batches))
        return exchange(group, 1, rank, plan_digest([[0, 1]]))

    assert _ranks(2, fn) == [[0, 1], [0, 1]]
