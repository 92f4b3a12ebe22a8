"""A sampler of one's own (weighted, a subset, a curriculum, a class written for the script) read as
each epoch's order: what ``StepLoader`` needs to read it as a function of the step.

A sampler yields an epoch's sample indices when iterated. Under DDP each rank iterates its own
copy, and the sampler's position (and its generator's state) is per-rank state that a replacement
does not have. Read here instead, epoch ``e``'s order is ``list(sampler)`` taken in a fixed state:

- ``sampler.set_epoch(e)`` first, when it has one (the ``DistributedSampler`` convention);
- torch's CPU generator, ``random`` and NumPy seeded from ``(seed, e)`` while it iterates (a
  ``WeightedRandomSampler`` or a ``RandomSampler`` without a generator draws from torch's), then put
  back as they were: the training's randomness is untouched;
- a ``torch.Generator`` of its own (``sampler.generator``) seeded from ``(seed, e)`` too, then put
  back: under DDP it runs on from epoch to epoch, which no replacement could reproduce.

So the orders differ from the ones the same sampler gives under ``torchrun`` (as the session's
shuffle differs from ``DistributedSampler``'s), and they are the same in every process, in every
run of the job, and after any recovery. An epoch has ``len(sampler)`` samples (with replacement
some come twice, others not at all). ``StepLoader`` asks for each epoch's order twice and refuses
a sampler that gave two different ones (state of its own that iterating moves on).

Refused in one line, naming the sampler: one without ``__len__``; one that gives one rank's share
(it has ``num_replicas`` and ``rank``: the ranks are the session's, and its order of the whole
dataset cannot be read back from one share); indices that are not in the dataset.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def refusal(sampler: object) -> str | None:
    """Why ``sampler`` cannot be read as each epoch's order (a clause naming it), or None."""
    name = type(sampler).__name__
    if hasattr(sampler, "num_replicas") and hasattr(sampler, "rank"):
        return (
            f"its sampler, a {name}, gives one rank's share of the samples (it has num_replicas and "
            "rank): give a sampler over the whole dataset (the session splits each batch over its ranks)"
        )
    try:
        len(sampler)  # type: ignore[arg-type]
    except TypeError:
        return f"its sampler, a {name}, has no __len__ (an epoch's length must be known)"
    if not hasattr(sampler, "__iter__"):
        return f"its sampler, a {name}, cannot be iterated"
    return None


class SamplerOrder:
    """``order(epoch)`` for ``StepLoader``: ``sampler``'s indices for ``epoch`` (the module doc)."""

    def __init__(self, sampler: Any, seed: int) -> None:
        reason = refusal(sampler)
        if reason is not None:
            raise ValueError(reason)
        self.sampler, self.seed = sampler, seed
        self.samples = len(sampler)
        self.what = f"the DataLoader's sampler (a {type(sampler).__name__})"

    def __call__(self, epoch: int) -> list[int]:
        s = (self.seed * 1_000_003 + epoch) % 2**63
        sampler = self.sampler
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        own = getattr(sampler, "generator", None)
        own = own if isinstance(own, torch.Generator) else None
        saved = own.get_state() if own is not None else None
        with torch.random.fork_rng(devices=[]):
            py, npy = random.getstate(), np.random.get_state()
            try:
                torch.default_generator.manual_seed(s)
                random.seed(s)
                np.random.seed(s % 2**32)
                if own is not None:
                    own.manual_seed(s)
                return [int(i) for i in sampler]
            finally:
                random.setstate(py)
                np.random.set_state(npy)
                if own is not None and saved is not None:
                    own.set_state(saved)


def sampler_order(sampler: Any, seed: int) -> tuple[Callable[[int], list[int]], int]:
    """``(order, samples per epoch)`` for ``StepLoader(order=..., epoch_samples=...)``; a
    ``ValueError`` (``refusal``'s clause) for a sampler that cannot be read so."""
    order = SamplerOrder(sampler, seed)
    return order, order.samples
