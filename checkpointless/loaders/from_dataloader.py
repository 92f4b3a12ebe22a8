"""``session.loader(dataloader)``: a DDP script's existing ``DataLoader`` read as a function of the step.

A DDP script already says how it reads its data: ``DataLoader(dataset, batch_size=B,
sampler=DistributedSampler(dataset, shuffle=..., seed=...), collate_fn=..., num_workers=...)``.
Rather than have its author restate that as ``session.loader(dataset, global_batch_size, ...)``, the
session takes the ``DataLoader`` and reads its settings:

- the global batch is ``batch_size x`` the data-parallel ranks when the loader is made (``B`` per
  rank, as the ``DistributedSampler`` gave each rank), fixed from then on;
- the order: a ``DistributedSampler``'s ``shuffle`` and ``seed``; a ``RandomSampler`` shuffles from
  the session's seed (a generator of its own has no seed to read); a ``SequentialSampler`` keeps the
  dataset's order; an ``IterableDataset`` keeps its own; a sampler of another kind (weighted, with
  replacement, a subset, a list of indices, a class of the script's) gives each epoch's order,
  iterated with its randomness seeded from the session's seed and the epoch (``sampler_order.py``);
- ``collate_fn``, ``num_workers``, ``pin_memory``, ``worker_init_fn``, and ``drop_last`` (the
  ``DataLoader``'s or the ``DistributedSampler``'s); the worker processes are the session's kind
  (``forkserver``, started again only after a recovery), whatever ``multiprocessing_context`` and
  ``persistent_workers`` say, and ``prefetch_factor`` and ``timeout`` are the defaults;
- the ranks and the rank: the session's, never the sampler's (which may have been built for a
  world the job no longer has).

The ``DataLoader`` itself is never iterated (its sampler's position is per-rank state; the step is
the position). What cannot be translated into a function of the step is refused in one line: a
``batch_sampler`` of one's own (batches of varying sizes), a subclass of a sampler above that
iterates its own way (read as its base class its order would silently be another), a sampler that
gives one rank's share; the error points at ``session.loader(dataset, global_batch_size,
order=...)`` (the epoch's order as a function of the epoch, computed by the script).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from checkpointless.loaders.options import LoaderOptions

if TYPE_CHECKING:
    from checkpointless.loaders.iterable_loader import IterableStepLoader
    from checkpointless.loaders.loader import StepLoader


def loader_settings(
    dataloader: DataLoader[Any], dp_size: int, default_seed: int
) -> tuple[Any, int, LoaderOptions]:
    """``session.loader``'s arguments (``dataset``, ``global_batch_size`` and the options) for the
    ``DataLoader`` a DDP script built; a ``ValueError`` naming what cannot be translated."""
    if dataloader.batch_size is None:
        raise ValueError(
            "session.loader(dataloader): the DataLoader has a batch_sampler of its own (or "
            "batch_size=None), which cannot be read as a function of the step; pass the dataset "
            "instead: session.loader(dataset, global_batch_size, ...)"
        )
    dataset, sampler = dataloader.dataset, dataloader.sampler
    stream = isinstance(dataset, IterableDataset)
    drop_last = dataloader.drop_last
    shuffle, seed = False, None
    own: dict[str, Any] = {}  # a sampler of another kind: its epochs' orders (sampler_order.py)
    if stream:
        pass  # its order is its own (the DataLoader's sampler is a placeholder)
    elif _own_iter(sampler):
        raise ValueError(
            f"session.loader(dataloader): its sampler, a {type(sampler).__name__}, orders the samples its "
            "own way, which cannot be read as a function of the step; pass the dataset and each "
            "epoch's order: session.loader(dataset, global_batch_size, order=lambda epoch: [...])"
        )
    elif isinstance(sampler, DistributedSampler):
        shuffle, seed = sampler.shuffle, sampler.seed
        drop_last = drop_last or sampler.drop_last
    elif isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None:
        shuffle, seed = True, default_seed
    elif not isinstance(sampler, SequentialSampler):
        from checkpointless.loaders.sampler_order import sampler_order

        try:
            order, samples = sampler_order(sampler, default_seed)
        except ValueError as e:
            raise ValueError(f"session.loader(dataloader): {e}") from None
        own = {"order": order, "epoch_samples": samples}
    options = LoaderOptions(
        shuffle=shuffle, seed=seed, collate_fn=dataloader.collate_fn, num_workers=dataloader.num_workers,
        drop_last=drop_last, pin_memory=dataloader.pin_memory, worker_init_fn=dataloader.worker_init_fn, **own,
    )  # fmt: skip
    return dataset, dataloader.batch_size * dp_size, options


def make_loader(
    dataset: Any,
    global_batch_size: int,
    options: LoaderOptions,
    *,
    rank: Callable[[], int],
    size: Callable[[], int],
    default_seed: int,
) -> StepLoader | IterableStepLoader:
    """``session.loader(dataset, global_batch_size, ...)``'s loader, for the data-parallel rank and
    size that ``rank()`` and ``size()`` give when a step is read (a ``StepLoader`` for a map-style
    dataset, an ``IterableStepLoader`` for a stream); ``default_seed``: the shuffle's seed when
    ``options.seed`` is None."""
    if isinstance(dataset, IterableDataset):
        from checkpointless.loaders.iterable_loader import IterableStepLoader

        if options.order is not None:
            raise TypeError(
                "session.loader(order=...) orders a map-style dataset: an iterable one's order is its own"
            )
        if options.seed is not None:
            warnings.warn("session.loader(seed=...) is ignored for an iterable dataset: its order "
                          "is its own", stacklevel=3)  # fmt: skip
        return IterableStepLoader(dataset, global_batch_size, options, rank=rank, size=size)
    from checkpointless.loaders.loader import StepLoader

    return StepLoader(dataset, global_batch_size, options, rank=rank, size=size, default_seed=default_seed)


def _own_iter(sampler: object) -> bool:
    """A subclass of a sampler this module translates that iterates its own way (HF's
    ``DistributedLengthGroupedSampler`` is a ``DistributedSampler``): read as its base class, its
    order would silently be another."""
    for base in (DistributedSampler, RandomSampler, SequentialSampler):
        if isinstance(sampler, base):
            return type(sampler).__iter__ is not base.__iter__
    return False
