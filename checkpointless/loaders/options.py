"""``LoaderOptions``: how ``session.loader`` reads a dataset, written once.

``Session.loader(dataset, global_batch_size, shuffle=..., ...)`` builds it from its keywords;
``from_dataloader.loader_settings`` builds it from a script's ``DataLoader``; ``make_loader`` hands
it to ``StepLoader`` or ``IterableStepLoader``, which read it. The Lightning strategy reads its
train ``DataLoader`` the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True, slots=True)
class LoaderOptions:
    """The settings of a loader besides its dataset and global batch size; the defaults are
    ``session.loader``'s. A ``ValueError`` naming the field for a value no loader can take."""

    shuffle: bool | None = None
    """Draw each epoch's order from ``seed``; ``None``: ``True`` for a map-style dataset, ``False``
    for an iterable one (whose order is its own: ``True`` is an error there)."""
    seed: int | None = None
    """The shuffle's seed and the samples' (``sample_seeds.py``); ``None``: the session's. Ignored,
    with a warning, for an iterable dataset."""
    collate_fn: Callable[[list[Any]], Any] | None = None
    """Turns a rank's part of a step (a list of samples) into its batch; ``None``: torch's
    ``default_collate``."""
    num_workers: int = 0
    """Worker processes reading ahead (``forkserver``, dying with the training process); 0 reads in
    the training process. At most 1 for an iterable dataset."""
    drop_last: bool = True
    """Leave out the tail of each epoch that does not fill a global batch; without it the epoch's
    last batch is shorter (and must still split evenly over the ranks)."""
    pin_memory: bool = False
    """Batches in page-locked memory (as ``DataLoader(pin_memory=True)``)."""
    worker_init_fn: Callable[[int], None] | None = None
    """Runs in each worker process, after the loader's own setup."""
    order: Callable[[int], Sequence[int]] | None = None
    """``order(epoch)``: the epoch's order instead of the shuffle, a permutation of the dataset's
    indices computed from the epoch alone, the same in every process. Map-style datasets only."""
    epoch_samples: int | None = None
    """With ``order``: each ``order(epoch)`` is that many indices of the dataset, repeats allowed
    (a weighted draw, a subset: a sampler's epoch, ``sampler_order.py``)."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be at least 0, got {self.num_workers}")
        if self.epoch_samples is not None and (self.order is None or self.epoch_samples < 1):
            raise ValueError(
                f"epoch_samples={self.epoch_samples} needs an order of that many samples an epoch"
            )
