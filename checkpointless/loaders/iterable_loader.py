"""An iterable dataset read as a function of the step: ``IterableStepLoader`` (``session.loader(...)``
picks it for a ``torch.utils.data.IterableDataset``; ``loader.py`` reads a map-style one).

What the dataset must keep (the contract; the loader cannot check it, and a dataset that breaks it
trains on data that differs between ranks or between a step and its re-execution):

- **One global stream.** ``iter(dataset)`` yields the same samples in the same order each time it
  is called, in every process: every rank, a replacement, a DataLoader worker process. Its
  randomness (a shuffle buffer, augmentation) comes from its own generator, seeded from its
  construction and its epoch, never from the global RNG (the session reseeds that per rank and per
  step). It does not shard itself by rank: every rank reads the same stream and keeps its share.
- **Passes, if finite.** ``len(dataset)``, if defined, is the number of samples of one pass, and
  passes follow one another: before it opens pass ``e`` (0, 1, ...) the loader calls
  ``dataset.set_epoch(e)`` if the dataset has it, then ``iter(dataset)`` again. A pass that yields
  another number of samples than ``len(dataset)`` is an error when the loader reaches its end.
  Without ``__len__`` the stream is read once (it may be infinite) and ``set_epoch(0)`` is the only
  call.
- **Optional fast positioning.** ``dataset.iter_from(index)``, if defined, returns an iterator over
  the current pass from sample ``index`` on: exactly what ``iter(dataset)`` yields after its first
  ``index`` samples (``itertools.islice(iter(dataset), index, None)``, only faster: a file seek, a
  shard skipped). Without it the loader reads and discards the first ``index`` samples.
- The loader owns ``set_epoch``: the training script must not call it.

What the loader does with it (``B`` is ``global_batch_size``, ``L`` is ``len(dataset)``):

- step ``s`` reads global batch ``s``: samples ``[i, i + B)`` of pass ``e``. Without ``__len__``,
  ``e = 0`` and ``i = s * B``. With it, a pass has ``steps_per_epoch = L // B`` steps
  (``drop_last``, the default: the pass's last ``L % B`` samples are read but not used) or
  ``ceil(L / B)`` (without ``drop_last``: the pass's last batch is shorter, and must still split
  evenly over the ranks), ``e = s //
  steps_per_epoch`` and ``i = (s % steps_per_epoch) * B``. A stream that ends before step ``s``'s
  batch is complete is an error (``ValueError``) at that step, not a shorter batch;
- the global batch does not depend on how many ranks share it: it is cut into ``dp_size`` equal
  contiguous parts, in order, and data-parallel rank ``r`` gets part ``r``. Every rank reads the
  whole global batch from its own copy of the stream and collates only its part, so per-sample work
  that is not cheap belongs in ``collate_fn`` (it runs on the rank's part only);
- the position is a function of the step, never state of the rank (nothing is registered with
  the session): a replacement, or a step re-executed after a failure, reads exactly what the failed
  attempt read;
- the iterator is kept from step to step. When a step other than the next one is asked for (after
  a recovery, or at a resumed start) it is rebuilt at that step: ``set_epoch(e)``, then
  ``iter_from(i)``, or ``iter(dataset)`` and ``i`` samples read and discarded: ``O(i)`` reads, once
  per recovery (at most one pass when the dataset has ``__len__``, all the steps so far without);
- ``num_workers``: 0 reads the stream in the training process; 1 reads it in one worker process
  (started with ``forkserver`` and dying with the rank, as ``loader.py``'s), which prefetches the
  next steps while the current one trains (the dataset must pickle; one that shards itself by
  ``get_worker_info()`` reads all of it, being the only worker). More is refused: each worker
  process would iterate its own copy of the stream (or its own shard of it, as datasets that follow
  PyTorch's ``get_worker_info()`` convention do), so the global order could not be kept;
- there is no ``shuffle`` and no seed: the order is the dataset's (shuffle inside it, from its own
  seed and ``set_epoch``).

Wrong use ends in one ``ValueError`` line, never a hang: ``shuffle=True``, ``num_workers > 1``, a
global batch the ranks cannot share evenly (when a step is asked for), a stream that ends early or a
pass of another length than ``len(dataset)`` (at the step that meets it; a worker process's read
ahead past the end raises nothing until that step is asked for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from torch.utils.data import DataLoader, IterableDataset, default_collate

from checkpointless.loaders.loader import KEPT, own_generator, worker_processes
from checkpointless.loaders.options import LoaderOptions

_END = object()


class StreamHooks(Protocol):
    """The optional methods of an iterable dataset that ``IterableStepLoader`` uses (duck-typed,
    looked up by name: a dataset may have either, both or none; the module docstring's contract)."""

    def set_epoch(self, epoch: int) -> None:
        """Called by the loader, in the process that reads the stream, before it opens pass
        ``epoch``; the pass's order may depend on it, deterministically."""

    def iter_from(self, index: int) -> Iterator[Any]:
        """The current pass's samples from sample ``index`` on, as ``iter(self)`` yields them after
        its first ``index``; called by the loader (after ``set_epoch``) only when it positions."""


@dataclass(frozen=True, slots=True)
class _Failure:
    """A user's mistake met while reading (an exhausted stream, an uneven share): yielded rather
    than raised, so a worker process's prefetch past the end of a stream raises nothing until that
    step is asked for, and the error reaches the training loop as one line."""

    message: str


@dataclass(frozen=True, slots=True)
class _Collate:
    """The user's ``collate_fn`` applied to a step's part, passing a ``_Failure`` through."""

    collate_fn: Callable[[list[Any]], Any]

    def __call__(self, item: Any) -> Any:
        return item if isinstance(item, _Failure) else self.collate_fn(item)


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where each step's global batch lies in the stream, and this rank's part of it."""

    global_batch_size: int
    samples_per_pass: int | None
    steps_per_epoch: int | None
    rank: int
    size: int

    def span(self, step: int) -> tuple[int, int, int]:
        """``(pass, start, stop)``: step ``step``'s global batch is samples ``[start, stop)`` of that
        pass."""
        b, n = self.global_batch_size, self.samples_per_pass
        if n is None or self.steps_per_epoch is None:
            return 0, step * b, (step + 1) * b
        start = (step % self.steps_per_epoch) * b
        return step // self.steps_per_epoch, start, min(start + b, n)


def _close(it: Iterator[Any]) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


def _finish_pass(it: Iterator[Any], epoch: int, at: int, n: int) -> _Failure | None:
    """Read pass ``epoch`` from sample ``at`` to its end, which must be sample ``n``
    (``len(dataset)``): a ``_Failure`` if it ends elsewhere."""
    for i in range(at, n):
        if next(it, _END) is _END:
            return _Failure(f"pass {epoch} of the iterable dataset ended after {i} samples, but "
                            f"len(dataset) is {n}")  # fmt: skip
    if next(it, _END) is not _END:
        return _Failure(f"pass {epoch} of the iterable dataset yields more samples than len(dataset), "
                        f"{n}: __len__ must be the number of samples of one pass")  # fmt: skip
    return None


class _Steps(IterableDataset[Any]):
    """This rank's parts of steps ``start, start + 1, ...`` (each a list of samples) or a
    ``_Failure``: the stream that the ``DataLoader`` (at most one worker process) iterates."""

    def __init__(self, dataset: IterableDataset[Any], layout: _Layout, start: int) -> None:
        self.dataset, self.layout, self.start = dataset, layout, start

    def __iter__(self) -> Iterator[list[Any] | _Failure]:
        layout, n = self.layout, self.layout.samples_per_pass
        step, opened, at = self.start, -1, 0  # the pass open, the samples read from it
        it: Iterator[Any] = iter(())
        try:
            while True:
                epoch, start, stop = layout.span(step)
                if epoch != opened:
                    if opened >= 0:  # the pass just read must end at len(dataset)
                        assert n is not None
                        failure = _finish_pass(it, opened, at, n)
                        if failure is not None:
                            yield failure
                            return
                    _close(it)
                    it, at = self._open(epoch, start)
                    opened = epoch
                samples = []
                while at < stop:
                    sample = next(it, _END)
                    if sample is _END:
                        yield _Failure(self._ended(step, epoch, at, start, stop))
                        return
                    if at >= start:
                        samples.append(sample)
                    at += 1
                if len(samples) % layout.size:
                    yield _Failure(f"step {step}'s global batch has {len(samples)} samples, which "
                                   f"{layout.size} data-parallel ranks cannot share evenly (with "
                                   "drop_last=False a pass's last batch must split evenly too)")  # fmt: skip
                    return
                part = len(samples) // layout.size
                yield samples[layout.rank * part : (layout.rank + 1) * part]
                step += 1
        finally:
            _close(it)  # the dataset's iterator (a file it reads) ends with this one

    def _open(self, epoch: int, start: int) -> tuple[Iterator[Any], int]:
        """Pass ``epoch``'s iterator, at sample ``start`` if the dataset can seek (``iter_from``),
        else at 0; and the sample it is at."""
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        iter_from = getattr(self.dataset, "iter_from", None)
        if iter_from is not None:
            return iter(iter_from(start)), start
        return iter(self.dataset), 0

    def _ended(self, step: int, epoch: int, at: int, start: int, stop: int) -> str:
        n = self.layout.samples_per_pass
        if n is not None:
            return f"pass {epoch} of the iterable dataset ended after {at} samples, but len(dataset) is {n}"
        return (
            f"the iterable dataset's stream ended after {at} samples, before step {step}'s global "
            f"batch (samples [{start}, {stop})) was complete; a stream without __len__ is read once: "
            "define __len__ (the samples of one pass) to read it pass after pass, or train fewer steps"
        )


class IterableStepLoader:
    """This data-parallel rank's part of each step's global batch of an iterable dataset (see the
    module docstring for the dataset's contract).

    ``rank`` and ``size`` are callables (the session's ``dp_rank`` and ``dp_size``: they are read
    when a step is loaded, so a loader made before a recovery stays right after it).
    """

    def __init__(
        self,
        dataset: IterableDataset[Any],
        global_batch_size: int,
        options: LoaderOptions | None = None,
        *,
        rank: Callable[[], int],
        size: Callable[[], int],
    ) -> None:
        options = LoaderOptions() if options is None else options
        num_workers, drop_last = options.num_workers, options.drop_last
        if not isinstance(dataset, IterableDataset):
            raise TypeError("IterableStepLoader reads a torch.utils.data.IterableDataset; a map-style "
                            "dataset is read by StepLoader (session.loader() picks it)")  # fmt: skip
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}")
        if options.shuffle:
            raise ValueError("shuffle=True with an iterable dataset: its order is its own (shuffle "
                             "inside it, from its own seed and set_epoch(epoch))")  # fmt: skip
        if num_workers not in (0, 1):
            raise ValueError(
                f"num_workers={num_workers} with an iterable dataset: each worker process would "
                "read its own copy (or shard) of the stream and the global order would be lost; "
                "use num_workers=0 or 1 (one process that reads ahead)"
            )
        try:
            n: int | None = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            n = None
        if n is not None and n < global_batch_size and drop_last:
            raise ValueError(
                f"len(dataset) is {n} samples a pass, fewer than one global batch of {global_batch_size} "
                "(drop_last=True leaves no step)"
            )
        if n == 0:
            raise ValueError("len(dataset) is 0: the iterable dataset has no samples")
        self.dataset, self.global_batch_size, self.samples_per_pass = dataset, global_batch_size, n
        self._rank, self._size = rank, size
        self.options = options
        self._collate = _Collate(default_collate if options.collate_fn is None else options.collate_fn)
        self.steps_per_epoch: int | None = None
        if n is not None:
            self.steps_per_epoch = n // global_batch_size if drop_last else -(-n // global_batch_size)
        # the iterators of the last parts read, by (rank, size): (the iterator, the step it yields next)
        self._kept: dict[tuple[int, int], tuple[Iterator[Any], int]] = {}

    def _layout(self, rank: int, size: int) -> _Layout:
        return _Layout(self.global_batch_size, self.samples_per_pass, self.steps_per_epoch, rank, size)

    def epoch(self, step: int) -> int:
        """The pass step ``step`` reads (0 for a stream without ``__len__``)."""
        return self.span(step)[0]

    def span(self, step: int) -> tuple[int, int, int]:
        """``(pass, start, stop)``: step ``step``'s global batch is samples ``[start, stop)`` of that
        pass of the stream."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self._layout(0, 1).span(step)

    def batch(self, step: int, share: int | None = None) -> Any:
        """This rank's part of step ``step``'s global batch, collated (``collate_fn``); ``share``:
        another data-parallel part than the current one (``StepLoader.batch``)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        shape = (self._rank() if share is None else share, self._size())
        if self.global_batch_size % shape[1]:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} cannot be shared evenly by {shape[1]} "
                "data-parallel ranks (make it a multiple of the ranks)"
            )
        kept = self._kept.pop(shape, None)
        it = kept[0] if kept is not None and kept[1] == step else self._restart(step, shape)
        try:
            out = next(it)
        except BaseException:
            self.close()  # the step executed again (the dataset's exception is the attempt's) restarts
            raise
        if isinstance(out, _Failure):
            self.close()
            raise ValueError(out.message)
        self._kept[shape] = (it, step + 1)  # the most recent last
        while len(self._kept) > KEPT:  # the least recent ends (its worker process with it)
            del self._kept[next(iter(self._kept))]
        return out

    def _restart(self, step: int, shape: tuple[int, int]) -> Iterator[Any]:
        """Part ``shape``'s iterator from ``step`` (a replica holding several shares keeps one per
        share it reads: a stream read again from a step may have to be read from its pass's start)."""
        loader = DataLoader(
            _Steps(self.dataset, self._layout(*shape), step),
            batch_size=None,
            collate_fn=self._collate,
            num_workers=self.options.num_workers,
            pin_memory=self.options.pin_memory,
            generator=own_generator(step),
            **worker_processes(self.options.num_workers, self.options.worker_init_fn),
        )
        return iter(loader)

    def close(self) -> None:
        """Drop the kept iterators (and their worker processes, or the dataset's iterators with them)."""
        self._kept.clear()

    def __len__(self) -> int:
        """Steps per epoch (a pass); a ``TypeError`` for a stream without ``__len__``."""
        if self.steps_per_epoch is None:
            raise TypeError("an iterable dataset without __len__ has no epochs (one pass, read once)")
        return self.steps_per_epoch
