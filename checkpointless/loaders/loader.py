"""A map-style dataset read as a function of the step: ``StepLoader`` (``session.loader(...)``; an
``IterableDataset`` is read by ``iterable_loader.py``).

What a ``DataLoader`` with a ``DistributedSampler`` gives a DDP script, made re-executable:

- step ``s`` reads the global batch ``s``: epoch ``s // steps_per_epoch``, position
  ``s % steps_per_epoch`` in that epoch's order (a permutation drawn from ``(seed, epoch)`` when
  ``shuffle``; the dataset's order otherwise; or ``order(epoch)``, a permutation of the dataset's
  indices that the caller computes as a function of the epoch alone, the same in every process:
  a length-grouped order, a curriculum; or, with ``epoch_samples``, that many indices of the
  dataset, repeats allowed: a sampler's epoch, ``sampler_order.py``), ``global_batch_size`` samples;
- the global batch does not depend on how many ranks share it: it is cut into ``dp_size`` equal
  contiguous parts, in order, and data-parallel rank ``r`` reads part ``r``;
- the position is a function of the step, never state of the rank: a replacement, or a step
  re-executed after a failure, reads exactly what the failed attempt read;
- the iterator is kept from step to step (the ``DataLoader``'s worker processes keep prefetching
  the next steps); it starts again at the step asked for only when a step other than the next one
  is asked for (after a recovery, or at a resumed start), with the same worker processes;
- a sample's random transforms (what the dataset's ``__getitem__`` draws from ``torch``,
  ``random`` or NumPy) are seeded from its place in the job, ``(seed, step, position)``
  (``sample_seeds.py``): the same in a recovered run, with any number of worker processes;
- worker processes (``num_workers > 0``) are started with ``forkserver``, not ``fork``: the
  process already runs threads (the heartbeat, gloo's), which a fork would copy mid-operation.
  A ``worker_init_fn`` runs in each of them after the loader's own.

``drop_last`` (the default) leaves out the tail of each epoch that does not fill a global batch;
without it the epoch's last batch is shorter (and must still split evenly over the ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from checkpointless.loaders.options import LoaderOptions
from checkpointless.loaders.sample_seeds import Part, SeededSamples


def worker_processes(num_workers: int, worker_init_fn: Callable[[int], None] | None = None) -> dict[str, Any]:
    """A ``DataLoader``'s keyword arguments for ``num_workers`` worker processes: started from a
    ``forkserver`` (never ``fork``: the process runs threads) and dying with the training process
    (``orphans.py``), then running ``worker_init_fn`` (the script's own); none for ``num_workers == 0``."""
    if num_workers == 0:
        return {}
    import multiprocessing

    from checkpointless.loaders.orphans import die_with_parent

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["checkpointless.loaders._forkserver_preload"])  # orphans.py
    return {
        "multiprocessing_context": context,
        "persistent_workers": False,
        "worker_init_fn": die_with_parent if worker_init_fn is None else _Then(worker_init_fn),
    }


class _Then:
    """``die_with_parent``, then the script's ``worker_init_fn`` (a class: it is pickled to the workers)."""

    def __init__(self, fn: Callable[[int], None]) -> None:
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        from checkpointless.loaders.orphans import die_with_parent

        die_with_parent()
        self.fn(worker_id)


def own_generator(step: int) -> torch.Generator:
    """The generator a ``DataLoader`` made at ``step`` draws its workers' base seed from. Without
    one, ``iter(DataLoader)`` draws it from the global generator: a loader made again inside a
    re-executed step (after a recovery) would then shift the dropout and every other draw of that
    step away from the uninterrupted run's, which made no loader there."""
    return torch.Generator().manual_seed(step)


KEPT = 4
"""Parts whose loaders (and worker processes) a ``StepLoader`` keeps: a replica of an elastic job
that shrank holds two shares, rarely more."""


class _StepBatches:
    """A batch sampler: data-parallel part ``shape = (rank, size)`` of steps ``start, start + 1, ...``
    (read by ``SeededSamples``)."""

    def __init__(self, loader: StepLoader, start: int, shape: tuple[int, int]) -> None:
        self.loader, self.start, self.shape = loader, start, shape

    def __iter__(self) -> Iterator[Part]:
        step = self.start
        while True:
            yield self.loader.part(step, *self.shape)
            step += 1


class StepLoader:
    """This data-parallel rank's part of each step's global batch (see the module docstring).

    ``rank`` and ``size`` are callables (the session's ``dp_rank`` and ``dp_size``: they are read
    when a step is loaded, so a loader made before a recovery stays right after it);
    ``default_seed``: the seed when ``options.seed`` is None (the session's).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        global_batch_size: int,
        options: LoaderOptions | None = None,
        *,
        rank: Callable[[], int],
        size: Callable[[], int],
        default_seed: int = 0,
    ) -> None:
        options = LoaderOptions() if options is None else options
        if isinstance(dataset, IterableDataset):
            raise TypeError(
                "StepLoader needs a map-style dataset (with __len__ and __getitem__); an "
                "IterableDataset is read by IterableStepLoader (session.loader() picks it)"
            )
        try:
            n = len(dataset)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                "session.loader() needs a map-style dataset (with __len__ and __getitem__) or a "
                "torch.utils.data.IterableDataset"
            ) from None
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be at least 1, got {global_batch_size}")
        epoch_samples, drop_last = options.epoch_samples, options.drop_last
        samples = n if epoch_samples is None else epoch_samples
        if samples < global_batch_size and drop_last:
            what = "the dataset has" if epoch_samples is None else "an epoch of its sampler has"
            raise ValueError(
                f"{what} {samples} samples, fewer than one global batch of {global_batch_size} "
                "(drop_last=True leaves no step)"
            )
        self.dataset, self.global_batch_size, self.n = dataset, global_batch_size, n
        # the samples of an epoch's order: the dataset's (a permutation), or a sampler's (repeats allowed)
        self.epoch_samples, self._repeats = samples, epoch_samples is not None
        self._rank, self._size = rank, size
        self.options = options
        self.shuffle = True if options.shuffle is None else options.shuffle
        self.seed = default_seed if options.seed is None else options.seed
        self.steps_per_epoch = samples // global_batch_size if drop_last else -(-samples // global_batch_size)
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its sample order)
        self._iter: Iterator[Any] | None = None
        # with worker processes, the loaders of the last parts read, by (rank, size) (``_restart``)
        self._kept: dict[tuple[int, int], tuple[DataLoader[Any], _StepBatches]] = {}
        self._next = -1  # the step the kept iterator yields next
        self._shape = (-1, -1)  # (rank, size) the kept iterator was made for

    def check_split(self, size: int) -> None:
        """A ``ValueError`` now, rather than at the first step that ``size`` ranks cannot share: the
        global batch, and the epoch's short last batch without ``drop_last``, must split evenly."""
        tail = 0 if self.options.drop_last else self.epoch_samples % self.global_batch_size
        for what, samples in (("the global batch", self.global_batch_size), ("an epoch's last batch", tail)):
            if samples % size:
                raise ValueError(
                    f"{what} has {samples} samples, which {size} data-parallel ranks (the job's shares) cannot "
                    "share evenly (make global_batch_size a multiple of the ranks, or of --shares"
                    + ("" if what == "the global batch" else ", or set drop_last=True")
                    + ")"
                )

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            if self.options.order is not None:
                what = getattr(self.options.order, "what", None)
                name = (
                    f"session.loader(order=...): order({epoch})"
                    if what is None
                    else f"{what}, epoch {epoch},"
                )
                samples = self.epoch_samples if self._repeats else None
                order = _checked_order(self.options.order(epoch), self.n, name, samples)
                if not torch.equal(order, _checked_order(self.options.order(epoch), self.n, name, samples)):
                    raise ValueError(
                        f"{name} returned two different orders: it must be a function of the epoch alone "
                        "(draw from a generator seeded by the epoch), or a replacement and a re-executed "
                        "step would read other samples"
                    )
            elif self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(self.n, generator=g)
            else:
                order = torch.arange(self.n)
            self._order = (epoch, order)
        return self._order[1]

    def global_indices(self, step: int) -> list[int]:
        """The sample indices of step ``step``'s global batch, in order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        order = self._epoch_order(self.epoch(step))
        at = (step % self.steps_per_epoch) * self.global_batch_size
        return order[at : at + self.global_batch_size].tolist()

    def indices(self, step: int, rank: int | None = None, size: int | None = None) -> list[int]:
        """Data-parallel rank ``rank``'s part (of ``size``) of step ``step``'s global batch."""
        return self.part(step, rank, size).indices

    def part(self, step: int, rank: int | None = None, size: int | None = None) -> Part:
        """``indices``, with the step and the position of the part in the global batch."""
        rank = self._rank() if rank is None else rank
        size = self._size() if size is None else size
        batch = self.global_indices(step)
        if len(batch) % size:
            raise ValueError(
                f"step {step}'s global batch has {len(batch)} samples, which {size} data-parallel ranks "
                "cannot share evenly (make global_batch_size a multiple of the ranks; with "
                "drop_last=False the epoch's last batch must split evenly too)"
            )
        n = len(batch) // size
        return Part(step, rank * n, batch[rank * n : (rank + 1) * n])

    def batch(self, step: int, share: int | None = None) -> Any:
        """This rank's part of step ``step``'s global batch, collated (``collate_fn``); ``share``:
        another data-parallel part than the current one (``session.dp_rank``), read ahead of its
        share's pass (the Hugging Face ``Trainer`` counts a step's items before its first pass)."""
        shape = (self._rank() if share is None else share, self._size())
        if self._iter is None or step != self._next or shape != self._shape:
            self._restart(step, shape)
        assert self._iter is not None
        try:
            out = next(self._iter)
        except BaseException:
            self.close()  # the iterator is past this step: executed again, it restarts here
            raise
        self._next = step + 1
        return out

    def _restart(self, step: int, shape: tuple[int, int]) -> None:
        """Read part ``shape`` on from ``step``. Worker processes are kept (``persistent_workers``):
        a step read again after a recovery resets them to it (what they prefetched is dropped)
        instead of starting new ones, which took a second of the recovery; so are those of the
        last ``KEPT`` parts read (a replica holding several shares reads each in turn)."""
        self._iter = None
        kept = self._kept.pop(shape, None)
        if kept is not None:
            loader, batches = kept
            batches.start = step
            try:
                self._iter = iter(loader)  # the persistent workers' iterator, reset
                self._kept[shape] = kept  # the most recent last
            except Exception:  # a worker died, say: start afresh
                pass
        if self._iter is None:
            batches = _StepBatches(self, step, shape)
            options = self.options
            workers = worker_processes(options.num_workers, options.worker_init_fn)
            loader = DataLoader(
                SeededSamples(self.dataset, self.seed),
                batch_sampler=batches,  # type: ignore[arg-type]  # Parts: SeededSamples reads them
                collate_fn=options.collate_fn,
                num_workers=options.num_workers,
                pin_memory=options.pin_memory,
                generator=own_generator(step),
                **{**workers, "persistent_workers": True} if workers else {},
            )
            self._iter = iter(loader)
            if workers:
                self._kept[shape] = (loader, batches)
                while len(self._kept) > KEPT:  # the least recent ends, its workers with it
                    del self._kept[next(iter(self._kept))]
        self._next, self._shape = step, shape

    def close(self) -> None:
        """Drop the kept iterator and loaders: their worker processes end with them (the
        DataLoader's own cleanup)."""
        self._iter = None
        self._kept.clear()

    def __len__(self) -> int:
        """Steps per epoch."""
        return self.steps_per_epoch


def _checked_order(given: Sequence[int], n: int, name: str, samples: int | None) -> torch.Tensor:
    """An epoch's order as a tensor; a ``ValueError`` starting with ``name`` if it is not a
    permutation of the dataset's ``n`` indices (``samples`` None) or not ``samples`` indices of it."""
    try:
        order = torch.as_tensor(list(given), dtype=torch.long)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} must return sample indices ({e})") from None
    if samples is None:
        if order.dim() != 1 or len(order) != n or not torch.equal(torch.sort(order).values, torch.arange(n)):
            raise ValueError(
                f"{name} must return a permutation of the dataset's {n} indices (each of 0..{n - 1} "
                f"once), got {len(order)} values"
            )
    elif order.dim() != 1 or len(order) != samples:
        raise ValueError(f"{name} gave {len(order)} indices, not the {samples} of every epoch")
    else:
        outside = order[(order < 0) | (order >= n)]
        if len(outside):
            raise ValueError(f"{name} gave index {int(outside[0])}, outside the dataset's {n} samples")
    return order
