"""``share_loop``: which shares a replica holds, what each share's pass is given (seed, buffers,
the reducer held back until the last), and the reducer's sum over all shares divided by S."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from checkpointless.comm import Group
from checkpointless.ddp import GradientReducer
from checkpointless.module_state import BufferSync
from checkpointless.share_loop import ShareLoop, assign, held_by
from tests.unit.test_reducer import run_ranks

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("shares", [1, 2, 3, 4, 7, 8, 16])
def test_every_share_is_held_once_in_contiguous_blocks_that_differ_by_at_most_one(shares: int) -> None:
    for replicas in range(1, shares + 1):
        blocks = assign(shares, replicas)
        assert [s for b in blocks for s in b] == list(range(shares))
        sizes = {len(b) for b in blocks}
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, (replicas, blocks)
    assert assign(shares, shares) == [range(s, s + 1) for s in range(shares)]  # one each: the rank


@pytest.mark.parametrize(
    ("shares", "shards", "world"), [(4, 2, 4), (4, 2, 2), (8, 2, 6), (6, 3, 3), (4, 1, 3)]
)
def test_sharded_each_rank_computes_its_own_part_of_its_replicas_shares(
    shares: int, shards: int, world: int
) -> None:
    """Every share is computed once; a rank computes only parts of its own shard index, and the
    ranks of one replica run as many passes each (FSDP2 gathers over them at every pass)."""
    held = {r: held_by(shares, r, world, shards) for r in range(world)}
    assert sorted(s for h in held.values() for s in h) == list(range(shares))
    assert all(s % shards == r % shards for r, h in held.items() for s in h)
    for replica in range(world // shards):
        assert len({len(held[replica * shards + i]) for i in range(shards)}) == 1
    if world == shares:  # the starting size: each rank its own share, as without the loop
        assert held == {r: [r] for r in range(world)}


@pytest.mark.parametrize(("shares", "replicas"), [(4, 0), (4, 5), (1, 2)])
def test_more_replicas_than_shares_or_none_is_an_error(shares: int, replicas: int) -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        assign(shares, replicas)


def test_a_replica_holding_two_shares_reseeds_each_restores_the_buffers_and_holds_the_first_back() -> None:
    bn = torch.nn.BatchNorm1d(3)
    buffers = BufferSync(bn)  # committed: zeros / ones
    calls: list[tuple[Any, ...]] = []
    loop = ShareLoop(4, hold=lambda on: calls.append(("hold", on)),
                     reseed=lambda step, share: calls.append(("seed", step, share)), buffers=lambda: buffers)  # fmt: skip
    loop.begin_attempt()
    seen = []
    for share in loop.run(step=7, rank=1, world=2):  # shares 2 and 3
        seen.append((share, loop.current, bn.running_mean.clone()))
        bn(torch.randn(5, 3) + share)  # a training-mode forward moves the statistics
        if share == 2:
            after_first = bn.running_mean.clone()
    assert [s for s, _, _ in seen] == [2, 3] and [c for _, c, _ in seen] == [2, 3]
    assert all(torch.equal(m, torch.zeros(3)) for _, _, m in seen)  # each share starts from the committed
    assert torch.equal(bn.running_mean, after_first)  # the replica's first share's statistics stay
    assert calls == [("seed", 7, 2), ("hold", True), ("seed", 7, 3), ("hold", False), ("hold", False)]
    assert loop.current is None and loop.used
    with pytest.raises(RuntimeError, match="once per attempt"):
        next(iter(loop.run(step=7, rank=1, world=2)))


def test_the_reducer_held_back_until_the_last_share_sums_every_share_and_divides_by_s() -> None:
    """Two ranks, two shares each (S = 4): the first share's backward under ``hold`` reduces nothing,
    the second's reduces the sum of both, and the result is the sum of the four shares' gradients / 4,
    on both ranks alike."""
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    xs = [torch.randn(3, 4) for _ in range(4)]
    expected = []
    for p in net.parameters():
        grads = []
        for x in xs:
            p.grad = None
            net(x).square().sum().backward()
            grads.append(p.grad.clone())
        expected.append(torch.stack(grads).sum(0) / 4)

    def rank_fn(rank: int, store: TCPStore) -> Any:
        model = torch.nn.Linear(4, 2)
        model.load_state_dict(net.state_dict())
        group = Group(store, 0, rank, 2, prefix="shares/", timeout=timedelta(seconds=30))
        reducer = GradientReducer(list(model.parameters()))
        reducer.begin(group, divisor=4)
        for i, share in enumerate((2 * rank, 2 * rank + 1)):
            reducer.hold(i == 0)
            model(xs[share]).square().sum().backward()
        reducer.hold(False)
        reducer.reduce(group)
        out = [p.grad.clone() for p in model.parameters()]
        reducer.close()
        group.abort()
        return out

    for grads in run_ranks(2, rank_fn):
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("workers", "shards", "shares", "message"),
    [
        (4, 1, 3, "must be at least workers=4"),
        (4, 2, 7, "must be a multiple of shards=2"),
        (2, 1, -1, "shares must be >= 0"),
    ],
)
def test_shares_the_job_cannot_use_are_named(workers: int, shards: int, shares: int, message: str) -> None:
    from checkpointless.config import JobConfig, RecoveryConfig

    with pytest.raises(ValueError, match=message):
        JobConfig(workers=workers, shards=shards, recovery=RecoveryConfig(shares=shares))
    assert JobConfig(workers=4, recovery=RecoveryConfig(shares=6)).share_count == 6
    assert JobConfig(workers=4).share_count == 4


@pytest.mark.parametrize(
    ("workers", "shards", "low", "message"),
    [
        (4, 1, 5, "between 1 and workers=4"),
        (4, 2, 3, "must be a multiple of shards=2: a sharded job changes size by whole replicas"),
        (4, 1, -1, "min_workers must be >= 0"),
    ],
)
def test_a_minimum_the_job_cannot_keep_is_named(workers: int, shards: int, low: int, message: str) -> None:
    from checkpointless.config import JobConfig, RecoveryConfig

    with pytest.raises(ValueError, match=message):
        JobConfig(workers=workers, shards=shards, recovery=RecoveryConfig(min_workers=low))
    assert JobConfig(workers=4, recovery=RecoveryConfig(min_workers=2)).elastic
    assert not JobConfig(workers=4, recovery=RecoveryConfig(min_workers=4)).elastic
    assert not JobConfig(workers=4).elastic
