"""``IterableStepLoader`` (``session.loader`` of an ``IterableDataset``): step ``s`` reads samples
``[s * B, (s + 1) * B)`` of the dataset's one global stream (pass after pass when it has
``__len__``), whatever the number of ranks, and again the same after later steps."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

import checkpointless as cl
from checkpointless.loaders.iterable_loader import IterableStepLoader
from checkpointless.loaders.loader import StepLoader
from checkpointless.loaders.options import LoaderOptions

pytestmark = pytest.mark.timeout(120)


class Stream(IterableDataset[int]):
    """Sample ``k`` of pass ``e`` is ``1000 * e + perm_e[k]`` (a permutation of ``range(n)`` drawn
    from ``(seed, e)``), or ``k`` for ever without ``n``; counts the samples its iterators yield
    (in this process) and records its ``set_epoch`` calls."""

    def __init__(self, n: int | None = None, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0
        self.reads = 0
        self.epochs: list[int] = []

    def __len__(self) -> int:
        if self.n is None:
            raise TypeError("endless")
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs.append(epoch)

    def pass_samples(self, epoch: int) -> list[int]:
        assert self.n is not None
        g = torch.Generator().manual_seed(self.seed * 1009 + epoch)
        return [1000 * epoch + int(i) for i in torch.randperm(self.n, generator=g)]

    def __iter__(self) -> Iterator[int]:
        samples = itertools.count() if self.n is None else iter(self.pass_samples(self.epoch))
        for x in samples:
            self.reads += 1
            yield x


class Seekable(Stream):
    """``Stream`` with the fast positioning hook; records where it was asked to start."""

    def __init__(self, n: int | None = None, seed: int = 0) -> None:
        super().__init__(n, seed)
        self.seeks: list[int] = []

    def iter_from(self, index: int) -> Iterator[int]:
        self.seeks.append(index)
        samples = itertools.count(index) if self.n is None else iter(self.pass_samples(self.epoch)[index:])
        for x in samples:
            self.reads += 1
            yield x


class Finite(IterableDataset[int]):
    """``range(n)`` once; ``length`` is what ``__len__`` says (a wrong one for the error tests)."""

    def __init__(self, n: int, length: int | None = None) -> None:
        self.n, self.length = n, length

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("no length")
        return self.length

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def _loader(dataset: Any, g: int, rank: int = 0, size: int = 1, **kw: Any) -> IterableStepLoader:
    return IterableStepLoader(dataset, g, LoaderOptions(**kw), rank=lambda: rank, size=lambda: size)


def _global(dataset: Stream, g: int, step: int) -> list[int]:
    """Step ``step``'s global batch as the contract defines it, from the dataset's own passes."""
    if dataset.n is None:
        return list(range(step * g, (step + 1) * g))
    per_pass = dataset.n // g
    epoch, at = divmod(step, per_pass)
    return dataset.pass_samples(epoch)[at * g : (at + 1) * g]


def test_a_step_is_its_slice_of_the_stream_and_the_ranks_parts_concatenate_to_it() -> None:
    for make in (lambda: Stream(), lambda: Stream(20, seed=3), lambda: Seekable(20, seed=3)):
        for step in (0, 1, 2, 5, 6, 11):
            expected = _global(make(), 4, step)
            for size in (1, 2, 4):
                parts = [_loader(make(), 4, r, size).batch(step).tolist() for r in range(size)]
                assert [x for p in parts for x in p] == expected, (step, size)
                assert all(len(p) == 4 // size for p in parts)


def test_a_share_asked_by_name_is_that_ranks_part_whatever_the_current_rank() -> None:
    """``batch(step, share=p)``: part ``p`` of the step, read by a loader whose current rank is 0
    (a replica reading its shares ahead of their passes), in turn with its own part."""
    loader = _loader(Stream(20, seed=3), 4, 0, 2)
    for step in (0, 1, 5):
        for share in (1, 0):
            expected = _loader(Stream(20, seed=3), 4, share, 2).batch(step).tolist()
            assert loader.batch(step, share=share).tolist() == expected, (step, share)


def test_a_replica_reading_two_shares_in_turn_keeps_an_iterator_for_each() -> None:
    """Shares 0 and 1 read in turn, step after step, from an endless stream that cannot seek: each
    part's iterator is kept, so the stream is read once per part, not again from its start at
    every switch."""
    ds = Stream()
    loader = _loader(ds, 4, 0, 2)
    for step in range(6):
        for share in (0, 1):
            loader.batch(step, share=share)
    assert ds.reads <= 2 * (6 * 4 + 4), ds.reads  # each part's iterator read on (a batch ahead at most)


def test_consecutive_steps_keep_the_iterator_and_a_step_asked_again_is_the_same() -> None:
    ds = Stream()
    loader = _loader(ds, 8, 1, 2)
    first = [loader.batch(s).tolist() for s in range(3)]
    assert first == [list(range(8 * s + 4, 8 * s + 8)) for s in range(3)]
    assert ds.reads == 3 * 8  # each sample once: every rank reads the global batch, keeps its part
    assert loader.batch(1).tolist() == first[1]  # re-executed after a recovery
    assert ds.reads == 3 * 8 + 2 * 8  # positioned by reading and discarding step 0's samples
    assert loader.batch(2).tolist() == first[2] and ds.reads == 3 * 8 + 3 * 8  # and on from there
    assert ds.epochs == [0, 0]  # one pass, opened twice


def test_positioning_uses_iter_from_when_the_dataset_has_it() -> None:
    ds = Seekable()
    loader = _loader(ds, 8)
    assert loader.batch(1000).tolist() == list(range(8000, 8008))
    assert ds.seeks == [8000] and ds.reads == 8  # nothing read and discarded
    assert loader.batch(1001).tolist() == list(range(8008, 8016)) and ds.seeks == [8000]  # kept
    finite = Seekable(20, seed=1)
    assert _loader(finite, 4).batch(12).tolist() == _global(finite, 4, 12)  # pass 2, its 3rd step
    assert finite.seeks == [8] and finite.epochs == [2]


def test_passes_follow_one_another_with_set_epoch_and_the_tail_left_out() -> None:
    ds = Stream(10, seed=5)
    loader = _loader(ds, 4)  # 2 steps a pass, samples 8 and 9 of each pass unused
    assert len(loader) == loader.steps_per_epoch == 2
    got = [loader.batch(s).tolist() for s in range(6)]
    assert got == [_global(ds, 4, s) for s in range(6)]
    assert ds.epochs == [0, 1, 2] and [loader.epoch(s) for s in range(6)] == [0, 0, 1, 1, 2, 2]
    assert ds.pass_samples(1) != ds.pass_samples(0)  # set_epoch reorders, deterministically
    assert loader.span(3) == (1, 4, 8)
    # positioned in a later pass: the same batches as the pass read through
    for make in (lambda: Stream(10, seed=5), lambda: Seekable(10, seed=5)):
        assert _loader(make(), 4).batch(5).tolist() == got[5]


def test_without_drop_last_a_pass_ends_with_a_shorter_batch() -> None:
    loader = _loader(Finite(10, length=10), 4, drop_last=False)
    assert len(loader) == 3 and loader.span(2) == (0, 8, 10) and loader.span(3) == (1, 0, 4)
    assert [loader.batch(s).tolist() for s in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]
    assert _loader(Finite(10, length=10), 4, 1, 2, drop_last=False).batch(2).tolist() == [9]
    with pytest.raises(ValueError, match="step 2's global batch has 2 samples, which 4 data-parallel"):
        _loader(Finite(10, length=10), 4, 0, 4, drop_last=False).batch(2)


def test_a_stream_that_ends_is_one_error_line_at_the_step_it_cannot_fill() -> None:
    loader = _loader(Finite(10), 4)
    assert loader.batch(1).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"ended after 10 samples, before step 2's global batch") as e:
        loader.batch(2)
    assert "\n" not in str(e.value) and "define __len__" in str(e.value)
    with pytest.raises(ValueError, match="before step 7's"):  # positioned past the end
        _loader(Finite(10), 4).batch(7)
    with pytest.raises(TypeError, match="no epochs"):
        len(loader)
    assert loader.steps_per_epoch is None and loader.epoch(99) == 0


def test_a_pass_whose_length_is_not_len_dataset_is_named() -> None:
    shorter = _loader(Finite(9, length=12), 4)
    assert shorter.batch(1).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"pass 0 of the iterable dataset ended after 9 samples, but len"):
        shorter.batch(2)
    longer = _loader(Finite(20, length=10), 4)  # steps 0, 1 in pass 0; pass 1 begins at step 2
    assert [longer.batch(s).tolist() for s in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"pass 0 .* yields more samples than len\(dataset\), 10"):
        longer.batch(2)


class Flaky(IterableDataset[int]):
    """``count()``, but reading sample 5 raises the first time (a transient read error)."""

    def __init__(self) -> None:
        self.failed = False

    def __iter__(self) -> Iterator[int]:
        for x in itertools.count():
            if x == 5 and not self.failed:
                self.failed = True
                raise OSError("transient read error")
            yield x


def test_an_error_of_the_dataset_inside_a_step_restarts_the_step_it_is_executed_again() -> None:
    loader = _loader(Flaky(), 4)
    assert loader.batch(0).tolist() == [0, 1, 2, 3]
    with pytest.raises(OSError, match="transient"):
        loader.batch(1)
    assert loader.batch(1).tolist() == [4, 5, 6, 7]  # the attempt again: the same step, read anew


class FlakyMap(torch.utils.data.Dataset[int]):
    """``range(40)``, but reading sample 5 raises the first time."""

    def __init__(self) -> None:
        self.failed = False

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> int:
        if i == 5 and not self.failed:
            self.failed = True
            raise OSError("transient read error")
        return i


def test_the_map_style_loader_too_reads_a_step_anew_after_an_error_of_the_dataset() -> None:
    """(StepLoader's kept iterator had moved past the failed step: it gave step 2's samples.)"""
    loader = StepLoader(FlakyMap(), 4, LoaderOptions(shuffle=False), rank=lambda: 0, size=lambda: 1)
    assert loader.batch(0).tolist() == [0, 1, 2, 3]
    with pytest.raises(OSError, match="transient"):
        loader.batch(1)
    assert loader.batch(1).tolist() == [4, 5, 6, 7]


def test_wrong_use_is_one_clear_error() -> None:
    ds = Stream()
    with pytest.raises(ValueError, match="shuffle=True with an iterable dataset"):
        _loader(ds, 4, shuffle=True)
    with pytest.raises(ValueError, match="num_workers=2 with an iterable dataset"):
        _loader(ds, 4, num_workers=2)
    with pytest.raises(ValueError, match="global_batch_size 6 cannot be shared evenly by 4"):
        _loader(ds, 6, 0, 4).batch(0)
    with pytest.raises(ValueError, match="at least 1"):
        _loader(ds, 0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _loader(Finite(3, length=3), 4)
    with pytest.raises(ValueError, match="step must be >= 0"):
        _loader(ds, 4).batch(-1)
    with pytest.raises(TypeError, match=r"IterableStepLoader reads a torch\.utils\.data\.IterableDataset"):
        _loader(TensorDataset(torch.arange(8)), 4)
    with pytest.raises(TypeError, match="IterableStepLoader"):
        StepLoader(ds, 4, rank=lambda: 0, size=lambda: 1)  # type: ignore[arg-type]


def test_a_worker_process_reads_ahead_the_same_batches_and_errors_stay_one_line() -> None:
    inline = _loader(Stream(10, seed=2), 4, 1, 2)
    worker = _loader(Stream(10, seed=2), 4, 1, 2, num_workers=1)
    try:
        for step in (0, 1, 2, 5, 6, 3, 4):
            assert torch.equal(worker.batch(step), inline.batch(step)), step
    finally:
        worker.close()
    ended = _loader(Finite(10), 4, num_workers=1)
    try:
        assert ended.batch(0).tolist() == [0, 1, 2, 3]  # the worker prefetched past the end already
        assert ended.batch(1).tolist() == [4, 5, 6, 7]
        with pytest.raises(ValueError, match=r"^the iterable dataset's stream ended after 10 samples"):
            ended.batch(2)
    finally:
        ended.close()


def test_session_loader_picks_the_loader_by_the_kind_of_dataset() -> None:
    session = cl.Session(torch.nn.Linear(1, 1))
    assert isinstance(session.loader(Stream(), 4), IterableStepLoader)  # the default shuffle is no request
    assert isinstance(session.loader(TensorDataset(torch.arange(8)), 4), StepLoader)
    with pytest.raises(ValueError, match="shuffle=True"):
        session.loader(Stream(), 4, shuffle=True)
    with pytest.warns(UserWarning, match="seed=...\\) is ignored for an iterable dataset"):
        session.loader(Stream(), 4, seed=3)
    loader = session.loader(Stream(), 4)
    for step in session.steps(3):
        with session.attempt():
            assert loader.batch(step).tolist() == list(range(4 * step, 4 * step + 4))
            session.reduce_gradients()
    session.finish()
