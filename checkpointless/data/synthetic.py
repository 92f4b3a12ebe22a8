"""Deterministic synthetic token data: a fixed random Markov chain, learnable and exact.

A batch is a pure function of (seed, step, dp_rank, dp_size): a replacement
process computes exactly the batch the failed one would have, without replaying
anything.
"""

from __future__ import annotations

import hashlib

import torch


def _key(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") & (
        2**63 - 1
    )


class SyntheticTokens:
    """Sequences from a sparse Markov chain over ``vocab_size`` tokens (each token has 2 likely successors)."""

    def __init__(self, *, seed: int, vocab_size: int, seq_len: int, global_batch: int) -> None:
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        self.seed, self.vocab_size, self.seq_len, self.global_batch = seed, vocab_size, seq_len, global_batch
        g = torch.Generator().manual_seed(_key(seed, 0xC0FFEE))
        self._succ = torch.randint(0, vocab_size, (vocab_size, 2), generator=g)

    def batch(self, step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``(global_batch // dp_size, seq_len)`` int64."""
        if self.global_batch % dp_size:
            raise ValueError(f"global_batch={self.global_batch} is not divisible by dp_size={dp_size}")
        b = self.global_batch // dp_size
        g = torch.Generator().manual_seed(_key(self.seed, step, dp_rank, dp_size))
        seq = torch.empty(b, self.seq_len + 1, dtype=torch.int64)
        seq[:, 0] = torch.randint(0, self.vocab_size, (b,), generator=g)
        choice = torch.randint(0, 2, (b, self.seq_len), generator=g)
        noise = torch.rand(b, self.seq_len, generator=g) < 0.05
        rand_tok = torch.randint(0, self.vocab_size, (b, self.seq_len), generator=g)
        for i in range(self.seq_len):
            nxt = self._succ[seq[:, i], choice[:, i]]
            seq[:, i + 1] = torch.where(noise[:, i], rand_tok[:, i], nxt)
        return seq[:, :-1], seq[:, 1:]
