"""The RNG of a step, derived and never transferred: every attempt, and every share inside it,
reseeds torch's, NumPy's and ``random``'s generators from ``(seed, step, draw)`` (``Session(...,
reseed_rng=True)``), so that a re-executed step draws the same numbers in any process."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of one (step, rank): per-rank RNG is derived, never transferred."""
    h = hashlib.sha256(f"{seed}/{step}/{rank}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def seed_rng(s: int) -> None:
    """Every generator a step draws from, seeded with ``s``."""
    # the CPU generator and CUDA's (torch.manual_seed also looks for other accelerators'
    # at a far higher cost, every step)
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(s)
    np.random.seed(s % 2**32)
    random.seed(s)


class Seeds:
    """The session's reseeding: ``seed`` and whether to reseed at all (``reseed_rng``)."""

    def __init__(self, seed: int, on: bool) -> None:
        self.seed, self.on = seed, on

    def reseed(self, step: int, draw: int) -> None:
        """The generators seeded from ``(seed, step, draw)`` when reseeding is on: ``draw`` is the
        share being computed, or what the attempt's draws outside the share loop are seeded from."""
        if self.on:
            seed_rng(step_seed(self.seed, step, draw))
