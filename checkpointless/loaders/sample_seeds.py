"""A sample's random transforms as a function of where it sits in the job, not of who reads it.

A dataset's ``__getitem__`` often draws (random crops and flips, masking, noise) from the global
generators: ``torch``'s, Python's ``random``, NumPy's. In a ``DataLoader`` worker process those are
seeded from the base seed the loader drew when its iterator was made, plus the worker's index, and
then run on from sample to sample. A loader restarted after a recovery (or with another number of
workers) would therefore transform the same samples differently: the recovered run would no longer
equal the uninterrupted one, silently.

``SeededSamples`` wraps the dataset a ``StepLoader`` reads: before each sample it seeds the three
generators from ``(seed, step, position of the sample in the step's global batch)``. So sample ``k``
of step ``s`` draws the same numbers whichever rank reads it, with any number of worker
processes, and when the step is read again after a recovery. In the training process itself
(``num_workers=0``) the generators' states are put back after the batch: reading data leaves the
training's own draws (dropout) as they were. A dataset that reads a batch at once (its own
``__getitems__``, as a Hugging Face ``datasets.Dataset`` has) is seeded once per rank's part, from
the part's first position: the same whatever the workers and after a recovery, not when the number
of ranks changes.

Seeding three generators for every sample is not free (Python's ``random`` the dearest of them), and
is felt in a step that reads its samples by indexing tensors. Most datasets draw nothing, so a part is first
read under one seeding (its first sample's seed), and the generators are looked at afterwards: if
none moved, no sample drew, and per-sample seeds would have given the same samples. If one moved,
the part is read again, each sample under its own seed, and so is every later part of this reader
(a process's; each worker process finds it out on its own first part). A dataset whose draws undo
themselves (it puts a generator's state back after drawing from it) looks like one that draws
nothing: its samples then depend on the part's seed, the same after a recovery and with any workers
but not when the number of ranks changes.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sys
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset, get_worker_info


class Part(NamedTuple):
    """What a ``StepLoader``'s batch sampler yields: a rank's part of one step's global batch."""

    step: int
    offset: int  # the position of its first sample in the global batch
    indices: list[int]


def sample_seed(seed: int, step: int, position: int) -> int:
    """A 63-bit seed for sample ``position`` of step ``step``'s global batch (``seed`` the loader's)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_all(value: int) -> None:
    """Seed the CPU generator, Python's ``random`` and (where imported) NumPy's with ``value``."""
    torch.default_generator.manual_seed(value)  # not torch.manual_seed: it seeds every device too
    random.seed(value)
    np = sys.modules.get("numpy")  # seeded only where something imported it
    if np is not None:
        np.random.seed(value % 2**32)


def _seeded_once(value: int) -> tuple[torch.Tensor, int, float | None]:
    """Seed the three generators with ``value``; what ``_untouched`` compares them with: the CPU
    generator's state, and the first draws of Python's and NumPy's (drawn, then seeded again)."""
    random.seed(value)
    first = random.getrandbits(64)
    np = sys.modules.get("numpy")
    first_np = None
    if np is not None:
        np.random.seed(value % 2**32)
        first_np = float(np.random.random_sample())
    seed_all(value)
    return torch.default_generator.get_state(), first, first_np


def _untouched(seeded: tuple[torch.Tensor, int, float | None]) -> bool:
    """Whether nothing drew from the three generators since ``_seeded_once`` (it draws from them)."""
    state, first, first_np = seeded
    if not torch.equal(torch.default_generator.get_state(), state) or random.getrandbits(64) != first:
        return False
    np = sys.modules.get("numpy")
    return first_np is None or np is None or float(np.random.random_sample()) == first_np


def generator_states() -> tuple[Any, ...]:
    """The three generators' states, for ``restore_generators``."""
    np = sys.modules.get("numpy")
    return torch.get_rng_state(), random.getstate(), None if np is None else np.random.get_state()


def restore_generators(states: tuple[Any, ...]) -> None:
    """Put back the states ``generator_states`` saved."""
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np = sys.modules.get("numpy")
    if np is not None and states[2] is not None:
        np.random.set_state(states[2])


_kept = threading.local()  # ``generators_kept``: the caller puts the generators back itself


@contextlib.contextmanager
def generators_kept() -> Iterator[None]:
    """Reads inside leave the three generators where their samples left them: the caller saved
    their states (``generator_states``) and puts them back itself (``restore_generators``), so
    ``SeededSamples`` does not do it a second time (NumPy's state is by far the dearest to save and
    to put back)."""
    before = getattr(_kept, "on", False)
    _kept.on = True
    try:
        yield
    finally:
        _kept.on = before


class SeededSamples(Dataset[Any]):
    """``dataset`` read by ``Part``s, each sample under its own seed (see the module docstring)."""

    def __init__(self, dataset: Dataset[Any], seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self._batched = callable(getattr(dataset, "__getitems__", None))
        self._draws = False  # seen drawing from a global generator: each sample seeded (module doc)

    def __getitem__(self, index: int) -> Any:  # not used by StepLoader, which reads Parts
        return self.dataset[index]

    def __getitems__(self, part: Part) -> list[Any]:
        saved = generator_states() if get_worker_info() is None and not getattr(_kept, "on", False) else None
        try:
            if self._batched:
                seed_all(sample_seed(self.seed, part.step, part.offset))
                return list(self.dataset.__getitems__(part.indices))  # type: ignore[attr-defined]
            if not self._draws:
                seeded = _seeded_once(sample_seed(self.seed, part.step, part.offset))
                out = [self.dataset[i] for i in part.indices]
                if _untouched(seeded):
                    return out  # no sample drew: their own seeds would have changed nothing
                self._draws = True
            out = []
            for k, i in enumerate(part.indices):
                seed_all(sample_seed(self.seed, part.step, part.offset + k))
                out.append(self.dataset[i])
            return out
        finally:
            if saved is not None:
                restore_generators(saved)
