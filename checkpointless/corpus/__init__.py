"""The recipes' corpus pipeline: real text tokenized once into a memory-mapped cache, batches as a
pure function of ``(seed, step, dp_rank, dp_size, split)``, and the node's cache of them.

``session.loader`` and the integrations read ``checkpointless.loaders``, never this folder; the
recipes, the demo and the benchmarks read it. Each stage lives in its own module:

* :mod:`checkpointless.corpus.documents`: which files of a directory (by default the Python standard
  library's ``*.py`` sources) are documents, in a machine-independent order, and their content
  fingerprint (:func:`default_corpus_dir`);
* :mod:`checkpointless.corpus.tokenization`: the byte tokenizer (:data:`EOD_ID`, :data:`BYTE_VOCAB_SIZE`)
  and the locally trained byte-level BPE;
* :mod:`checkpointless.corpus.token_cache`: the verified on-disk cache of tokenized corpora
  (:func:`load_corpus`, :class:`TokenizedCorpus`);
* :mod:`checkpointless.corpus.sampling`: train/validation splits and batches that are a pure function of
  ``(seed, step, dp_rank, dp_size, split)`` (:class:`TokenDataset`);
* :mod:`checkpointless.corpus.shm_cache`: the node's shared-memory cache of batches, which a
  replacement reads first (one file per batch: :mod:`checkpointless.corpus.batch_files`), and
  :mod:`checkpointless.corpus.cached_dataset`: a dataset served from it first;
* :mod:`checkpointless.corpus.synthetic`: synthetic token batches (the demo's and the benchmarks').

Import from here; the names below are re-exported unchanged.
"""

from __future__ import annotations

from checkpointless.corpus.documents import default_corpus_dir
from checkpointless.corpus.sampling import TokenDataset
from checkpointless.corpus.token_cache import TokenizedCorpus, load_corpus
from checkpointless.corpus.tokenization import BYTE_VOCAB_SIZE, EOD_ID

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOD_ID",
    "TokenDataset",
    "TokenizedCorpus",
    "default_corpus_dir",
    "load_corpus",
]
