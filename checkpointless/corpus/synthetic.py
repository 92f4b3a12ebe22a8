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
        """(inputs, targets), each ``(global_batch // dp_size, seq_len)`` int64.

        The global batch of a step is a pure function of (seed, step) alone: ranks take
        consecutive slices of it, so the samples of a step do not depend on how many
        ranks share it (2 workers see exactly the rows 4 workers see, split differently).
        """
        if self.global_batch % dp_size:
            raise ValueError(f"global_batch={self.global_batch} is not divisible by dp_size={dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1}")
        n = self.global_batch
        g = torch.Generator().manual_seed(_key(self.seed, step))
        seq = torch.empty(n, self.seq_len + 1, dtype=torch.int64)
        seq[:, 0] = torch.randint(0, self.vocab_size, (n,), generator=g)
        choice = torch.randint(0, 2, (n, self.seq_len), generator=g)
        noise = torch.rand(n, self.seq_len, generator=g) < 0.05
        rand_tok = torch.randint(0, self.vocab_size, (n, self.seq_len), generator=g)
        for i in range(self.seq_len):
            nxt = self._succ[seq[:, i], choice[:, i]]
            seq[:, i + 1] = torch.where(noise[:, i], rand_tok[:, i], nxt)
        b = n // dp_size
        rows = seq[dp_rank * b : (dp_rank + 1) * b]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
