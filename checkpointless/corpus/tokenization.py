"""Tokenizers: documents (UTF-8 bytes) to one flat array of token ids plus document start offsets.

``"byte"`` (default): the UTF-8 bytes themselves, ids 0..255, plus an end-of-document token
:data:`EOD_ID` = 256 appended after every document, so ``vocab_size`` is :data:`BYTE_VOCAB_SIZE` = 257.
``"bpe"``: a byte-level BPE trained locally with the ``tokenizers`` library (imported lazily) on the
corpus itself; its special token ``<|endoftext|>`` is the end-of-document token. Token ids are stored
as ``uint16`` when the vocabulary has at most 65536 entries, ``uint32`` otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["BPE_EOD", "BYTE_VOCAB_SIZE", "EOD_ID", "tokenize_bpe", "tokenize_bytes", "train_bpe"]

EOD_ID = 256
"""End-of-document token id of the byte tokenizer (appended after every document)."""
BYTE_VOCAB_SIZE = 257
"""Vocabulary size of the byte tokenizer: 256 byte values plus :data:`EOD_ID`."""
BPE_EOD = "<|endoftext|>"
"""The end-of-document special token of the trained BPE."""


def _token_dtype(vocab_size: int) -> np.dtype[Any]:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def tokenize_bytes(docs: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Byte tokens of ``docs`` with :data:`EOD_ID` after each, and the document start offsets."""
    lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
    starts = np.zeros(len(docs), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    tokens = np.empty(int(lengths.sum()), dtype=np.uint16)
    for start, doc in zip(starts.tolist(), docs, strict=True):
        end = start + len(doc)
        tokens[start:end] = np.frombuffer(doc, dtype=np.uint8)
        tokens[end] = EOD_ID
    return tokens, starts


def train_bpe(docs: Sequence[bytes], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` tokens trained on ``docs``."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("tokenizer='bpe' needs the 'tokenizers' package (pip install tokenizers)") from exc
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.decode("utf-8", "replace") for d in docs), trainer=trainer)
    return tok


def tokenize_bpe(tok: Any, docs: Sequence[bytes], eod: int) -> tuple[np.ndarray, np.ndarray]:
    """``docs`` encoded by ``tok`` with ``eod`` after each, and the document start offsets."""
    dtype = _token_dtype(int(tok.get_vocab_size()))
    parts: list[np.ndarray] = []
    starts = np.zeros(len(docs), dtype=np.int64)
    offset = 0
    chunk = 256
    for first in range(0, len(docs), chunk):
        texts = [d.decode("utf-8", "replace") for d in docs[first : first + chunk]]
        for i, enc in enumerate(tok.encode_batch(texts, add_special_tokens=False)):
            ids = np.asarray([*enc.ids, eod], dtype=dtype)
            starts[first + i] = offset
            offset += len(ids)
            parts.append(ids)
    return np.concatenate(parts), starts
