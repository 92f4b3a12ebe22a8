"""Stateless batch sampling: each batch is a pure function of ``(seed, step, dp_rank, dp_size, split)``.

Splits
    The validation split is the tail of the token stream: it starts at the document boundary closest to
    ``(1 - val_fraction) * n_tokens``, or exactly there when no boundary lies within half the intended
    validation size of it (a corpus of one or a few long documents). Train and validation windows never
    cross that point, so the splits are disjoint.

Batches
    See :class:`TokenDataset`: each batch is a pure function of ``(seed, step, dp_rank, dp_size, split)``
    and the corpus, computed with integer arithmetic only (no RNG state, no history): an epoch's sample
    order is a keyed pseudo-random permutation of window indices (:func:`_permute`, a Feistel network
    keyed by :func:`_round_keys`), so any step's batch can be computed directly.
"""

from __future__ import annotations

import hashlib
import os
from typing import Literal

import numpy as np
import torch

from checkpointless.corpus.token_cache import TokenizedCorpus, load_corpus

__all__ = ["TokenDataset"]

_SPLIT_IDS: dict[str, int] = {"train": 0, "val": 1}


# --------------------------------------------------------------------------------------------------
# Stateless sampling: a keyed pseudo-random permutation of window indices, per epoch
# --------------------------------------------------------------------------------------------------

_M64 = (1 << 64) - 1
_ROUNDS = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on a uint64 array (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, split: str, epoch: int) -> list[int]:
    material = f"{seed}\0{split}\0{epoch}".encode()
    digest = hashlib.blake2b(material, digest_size=8 * _ROUNDS).digest()
    return [int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(_ROUNDS)]


def _permute(x: np.ndarray, n: int, keys: list[int]) -> np.ndarray:
    """Keyed bijection of ``[0, n)`` applied to ``x`` (balanced Feistel network + cycle walking).

    Pure integer arithmetic: identical on every platform and numpy version, O(len(x)) work, no
    permutation table.
    """
    if n <= 1:
        return np.zeros_like(x)
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    ukeys = [np.uint64(k & _M64) for k in keys]

    def feistel(v: np.ndarray) -> np.ndarray:
        left, right = v >> half, v & mask
        for k in ukeys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << half) | right

    out = feistel(x.astype(np.uint64))
    pending = out >= np.uint64(n)
    while pending.any():  # cycle walking: expected < 4 passes since 2**bits < 4n
        out[pending] = feistel(out[pending])
        pending = out >= np.uint64(n)
    return out.astype(np.int64)


class TokenDataset:
    """Fixed-length training windows over a :class:`TokenizedCorpus`, addressed by step, not by state.

    Windows: split ``s`` is cut into non-overlapping windows of ``seq_len + 1`` tokens starting every
    ``seq_len`` tokens (``inputs = w[:-1]``, ``targets = w[1:]``; windows may span document
    boundaries, which are marked by the end-of-document token). An epoch is a keyed pseudo-random
    permutation of all windows of the split; the global sample stream is epoch 0, epoch 1, ...
    (each with its own permutation).

    Batch geometry: at ``step`` the *global batch* is samples ``step * global_batch ... + global_batch - 1``
    of that stream. It is divided evenly over ``dp_size`` data-parallel ranks: ``micro_batch =
    global_batch // dp_size`` and rank ``r`` gets rows ``r * micro_batch .. (r + 1) * micro_batch - 1``.
    Hence ``global_batch`` must be divisible by ``dp_size``, and the concatenation of all ranks' batches
    (in rank order) is the same global batch for every ``dp_size``: changing the data-parallel width
    after a failure changes nobody's samples. (Gradient accumulation, if any, splits a rank's
    ``micro_batch`` rows further; that is the trainer's business.)

    Purity: :meth:`batch` depends only on ``(seed, step, dp_rank, dp_size, split)``, the corpus and
    the constructor's geometry; it keeps no state, so a replacement process computes exactly the
    batch a failed one would have, at any step, without replaying history. Thread-safe.
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | TokenizedCorpus | None = None,
        *,
        seq_len: int,
        global_batch: int,
        seed: int = 0,
        val_fraction: float = 0.05,
        tokenizer: Literal["byte", "bpe"] = "byte",
        vocab_size: int = 8192,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """Load (tokenizing if needed) the corpus and fix the batch geometry.

        Args:
            source: a corpus directory/file, an already loaded :class:`TokenizedCorpus`, or ``None`` for
                the standard library (see :func:`load_corpus`).
            seq_len: tokens per sample (inputs and targets each have ``seq_len`` columns).
            global_batch: samples per step summed over all data-parallel ranks.
            seed: selects the sample order; the only source of randomness.
            val_fraction: share of the tokens (moved to a nearby document boundary) held out for
                validation, in ``[0, 1)``; 0 disables the ``"val"`` split.
            tokenizer, vocab_size, cache_dir: passed to :func:`load_corpus`.

        Raises:
            ValueError: for non-positive sizes, a ``val_fraction`` outside ``[0, 1)``, a corpus too small
                for one window in a split, or any :func:`load_corpus` error (naming the path).
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if isinstance(source, TokenizedCorpus):
            self.corpus = source
        else:
            self.corpus = load_corpus(source, tokenizer=tokenizer, vocab_size=vocab_size, cache_dir=cache_dir)
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = int(seed)
        self.val_fraction = val_fraction
        self.val_start = self._split_point(val_fraction)
        n = len(self.corpus)
        self._bounds: dict[str, tuple[int, int]] = {"train": (0, self.val_start)}
        if val_fraction > 0:
            self._bounds["val"] = (self.val_start, n)
        for name, (lo, hi) in self._bounds.items():
            if self.num_windows(name) < 1:
                where = self.corpus.source if self.corpus.source is not None else self.corpus.path
                raise ValueError(
                    f"corpus {where} is too short: its {name} split has {hi - lo} of its {n} tokens "
                    f"(val_fraction={val_fraction}), fewer than one window of seq_len + 1 = {seq_len + 1}; "
                    f"use a larger corpus, a smaller seq_len or another val_fraction"
                )

    def _split_point(self, val_fraction: float) -> int:
        n = len(self.corpus)
        if val_fraction == 0:
            return n
        target = (1.0 - val_fraction) * n
        boundaries = self.corpus.doc_starts[1:]
        if len(boundaries) > 0:
            best = int(boundaries[int(np.argmin(np.abs(boundaries - target)))])
            if abs(best - target) <= 0.5 * val_fraction * n:
                return best
        return int(target)  # no boundary near the target (few, long documents): split mid-document

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the corpus tokenizer (the model's embedding size must be at least this)."""
        return self.corpus.vocab_size

    def micro_batch(self, dp_size: int) -> int:
        """Rows each rank receives per step: ``global_batch // dp_size`` (ValueError if not divisible)."""
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if self.global_batch % dp_size:
            raise ValueError(f"global_batch={self.global_batch} is not divisible by dp_size={dp_size}")
        return self.global_batch // dp_size

    def num_windows(self, split: str = "train") -> int:
        """Number of distinct samples (windows) in ``split``; one epoch of it."""
        lo, hi = self._split_bounds(split)
        return max(0, (hi - lo - 1) // self.seq_len)

    def _split_bounds(self, split: str) -> tuple[int, int]:
        if split not in _SPLIT_IDS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if split not in self._bounds:
            raise ValueError("no 'val' split: the dataset was built with val_fraction=0")
        return self._bounds[split]

    def batch(
        self, step: int, dp_rank: int, dp_size: int, *, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the global batch at ``step``.

        Returns:
            ``(inputs, targets)``, both int64 CPU tensors of shape ``(micro_batch(dp_size), seq_len)``,
            with ``targets[:, t] == inputs[:, t + 1]`` for ``t < seq_len - 1``. A pure function of
            ``(seed, step, dp_rank, dp_size, split)`` and the corpus.

        Raises:
            ValueError: for ``step < 0``, ``dp_rank`` outside ``[0, dp_size)``, ``global_batch`` not
                divisible by ``dp_size``, or an unknown/disabled split.
        """
        mb = self.micro_batch(dp_size)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        lo, _ = self._split_bounds(split)
        n = self.num_windows(split)
        first = step * self.global_batch + dp_rank * mb
        sample = np.arange(first, first + mb, dtype=np.int64)
        epoch, pos = np.divmod(sample, n)
        window = np.empty(mb, dtype=np.int64)
        for e in np.unique(epoch).tolist():
            sel = epoch == e
            window[sel] = _permute(pos[sel], n, _round_keys(self.seed, split, int(e)))
        starts = lo + window * self.seq_len
        rows = self.corpus.tokens[starts[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)]
        rows = rows.astype(np.int64)
        inputs = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
        targets = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
        return inputs, targets

    def eval_batches(
        self, n: int, dp_rank: int = 0, dp_size: int = 1
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed held-out evaluation set: ``[batch(i, dp_rank, dp_size, split="val") for i < n]``.

        The same ``n`` batches on every call, in every process (with the same seed and geometry).
        If ``n * global_batch`` exceeds :meth:`num_windows` of ``"val"``, windows repeat.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return [self.batch(i, dp_rank, dp_size, split="val") for i in range(n)]

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.corpus!r}, seq_len={self.seq_len}, global_batch={self.global_batch}, "
            f"seed={self.seed}, val_start={self.val_start})"
        )
