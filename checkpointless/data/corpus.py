"""Real-text corpus, tokenized once into a memory-mapped cache, with stateless batch sampling.

The public entry point of the real-text data pipeline; each stage lives in its own module:

* :mod:`checkpointless.data.documents`: which files of a directory (by default the Python standard
  library's ``*.py`` sources) are documents, in a machine-independent order, and their content
  fingerprint (:func:`default_corpus_dir`);
* :mod:`checkpointless.data.tokenization`: the byte tokenizer (:data:`EOD_ID`, :data:`BYTE_VOCAB_SIZE`)
  and the locally trained byte-level BPE;
* :mod:`checkpointless.data.token_cache`: the verified on-disk cache of tokenized corpora
  (:func:`load_corpus`, :class:`TokenizedCorpus`);
* :mod:`checkpointless.data.sampling`: train/validation splits and batches that are a pure function of
  ``(seed, step, dp_rank, dp_size, split)`` (:class:`TokenDataset`).

Import from here; the names below are re-exported unchanged.
"""

from __future__ import annotations

from checkpointless.data.documents import default_corpus_dir
from checkpointless.data.sampling import TokenDataset

# The sample-order permutation, re-exported for the tests that pin it.
from checkpointless.data.sampling import _permute as _permute
from checkpointless.data.sampling import _round_keys as _round_keys
from checkpointless.data.token_cache import TokenizedCorpus, load_corpus
from checkpointless.data.tokenization import BYTE_VOCAB_SIZE, EOD_ID

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOD_ID",
    "TokenDataset",
    "TokenizedCorpus",
    "default_corpus_dir",
    "load_corpus",
]
