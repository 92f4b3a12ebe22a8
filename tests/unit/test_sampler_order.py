"""A sampler of the script's own read as each epoch's order (``checkpointless.loaders.sampler_order``)
and that order read by ``StepLoader`` as a function of the step: the same in every process and
after a recovery, another each epoch, the training's randomness untouched; what cannot be read so
is one line naming the sampler."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import RandomSampler, Sampler, SubsetRandomSampler, TensorDataset, WeightedRandomSampler

from checkpointless.loaders.loader import StepLoader
from checkpointless.loaders.options import LoaderOptions
from checkpointless.loaders.sampler_order import SamplerOrder, refusal, sampler_order

pytestmark = pytest.mark.timeout(120)

DATA = TensorDataset(torch.arange(40))


def _loader(sampler: object, batch: int, rank: int = 0, size: int = 1, seed: int = 0) -> StepLoader:
    order, samples = sampler_order(sampler, seed)
    options = LoaderOptions(order=order, epoch_samples=samples)
    return StepLoader(DATA, batch, options, rank=lambda: rank, size=lambda: size)


class Shuffled(Sampler[int]):
    """A script's sampler drawing from Python's ``random`` after ``set_epoch``."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        idx = list(range(self.n))
        random.shuffle(idx)
        return iter(idx[: self.n // 2] * 2)  # the first half, twice

    def __len__(self) -> int:
        return self.n


def test_a_weighted_sampler_draws_from_the_seed_and_the_epoch_with_replacement() -> None:
    w = [9.0 if i < 4 else 1.0 for i in range(40)]
    a, b = _loader(WeightedRandomSampler(w, 32), 8, seed=3), _loader(WeightedRandomSampler(w, 32), 8, seed=3)
    assert len(a) == 4 and a.epoch_samples == 32  # 32 draws an epoch, in global batches of 8
    for step in (0, 3, 4, 9, 1):  # across epochs and back: a function of the step alone
        assert a.global_indices(step) == b.global_indices(step)
    epoch0 = [i for s in range(4) for i in a.global_indices(s)]
    assert len(set(epoch0)) < 32  # with replacement: repeats
    assert sum(i < 4 for i in epoch0) > 8  # weighted: the first 4 of 40 samples drawn far above 1/10
    assert epoch0 != [i for s in range(4, 8) for i in a.global_indices(s)]  # another epoch, other draws
    assert a.global_indices(0) != _loader(WeightedRandomSampler(w, 32), 8, seed=4).global_indices(0)


def test_the_ranks_parts_make_the_global_batch() -> None:
    sampler = SubsetRandomSampler(range(10, 30))
    parts = [_loader(sampler, 4, rank=r, size=2, seed=1) for r in (0, 1)]
    whole = _loader(sampler, 4, seed=1)
    for step in range(7):
        assert parts[0].indices(step) + parts[1].indices(step) == whole.global_indices(step)
        assert all(10 <= i < 30 for i in whole.global_indices(step))
    assert [int(x) for x in parts[1].batch(2)[0]] == parts[1].indices(2)


def test_reading_an_order_leaves_the_trainings_randomness_and_the_samplers_generator_as_they_were() -> None:
    own = torch.Generator().manual_seed(42)
    sampler = RandomSampler(range(40), generator=own)
    order = SamplerOrder(sampler, 0)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = torch.rand(3), random.random(), np.random.rand()
    own_next = torch.rand(2, generator=torch.Generator().manual_seed(42))
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    first = order(0)
    got = torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert torch.equal(torch.rand(2, generator=own), own_next)  # its generator put back as it was
    assert order(0) == first and order(1) != first  # its own generator seeded by the epoch too
    shuffled = Shuffled(40)
    assert SamplerOrder(shuffled, 5)(2) == SamplerOrder(Shuffled(40), 5)(2) and shuffled.epoch == 2


class Counting(Sampler[int]):
    """State of its own that iterating moves on: each pass starts one further."""

    def __init__(self) -> None:
        self.passes = 0

    def __iter__(self) -> Iterator[int]:
        self.passes += 1
        return iter([(i + self.passes) % 40 for i in range(40)])

    def __len__(self) -> int:
        return 40


class Share(Sampler[int]):
    num_replicas, rank = 2, 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(1, 40, 2))

    def __len__(self) -> int:
        return 20


class NoLength(Sampler[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(40))


class Growing(Sampler[int]):
    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(10 + self.epoch))

    def __len__(self) -> int:
        return 10


def test_what_cannot_be_read_as_an_epochs_order_is_one_line_naming_the_sampler() -> None:
    with pytest.raises(ValueError, match=r"a Counting\), epoch 0, returned two different orders"):
        _loader(Counting(), 4).global_indices(0)
    with pytest.raises(ValueError, match="a Share, gives one rank's share"):
        sampler_order(Share(), 0)
    with pytest.raises(ValueError, match="a NoLength, has no __len__"):
        sampler_order(NoLength(), 0)
    with pytest.raises(ValueError, match=r"epoch 1, gave 11 indices, not the 10 of every epoch"):
        _loader(Growing(), 5).global_indices(2)
    with pytest.raises(ValueError, match="gave index 40, outside the dataset's 40 samples"):
        _loader(list(range(35, 45)), 5).global_indices(0)
    with pytest.raises(
        ValueError, match="an epoch of its sampler has 3 samples, fewer than one global batch of 4"
    ):
        _loader([0, 1, 2], 4)
    assert refusal(WeightedRandomSampler([1.0], 3)) is None and refusal([3, 1, 2]) is None


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 30), draws=st.integers(1, 60), batch=st.integers(1, 8), seed=st.integers(0, 2**40),
    step=st.integers(0, 50),
)  # fmt: skip
def test_any_weighted_draw_is_a_function_of_the_step(
    n: int, draws: int, batch: int, seed: int, step: int
) -> None:
    if draws < batch:
        return
    w = torch.rand(n, generator=torch.Generator().manual_seed(n)).add(0.1).tolist()
    data = TensorDataset(torch.arange(n))
    made = []
    for _ in range(2):
        order, samples = sampler_order(WeightedRandomSampler(w, draws), seed)
        made.append(
            StepLoader(
                data, batch, LoaderOptions(order=order, epoch_samples=samples), rank=lambda: 0, size=lambda: 1
            )
        )
    a, b = made
    assert len(a) == draws // batch
    assert a.global_indices(step) == b.global_indices(step)
    assert all(0 <= i < n for i in a.global_indices(step)) and len(a.global_indices(step)) == batch
