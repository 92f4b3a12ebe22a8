"""The on-disk token cache: each corpus is tokenized once per node and memory-mapped thereafter.

Layout
    ``<cache_dir>/<key>/`` holds ``tokens.bin`` (raw token ids, one flat array), ``docs.npy`` (int64 start
    offset of every document), ``meta.json`` (dtype, counts, tokenizer, the SHA-256 of every other file;
    written last) and, for BPE, ``tokenizer.json``. ``key`` is a SHA-256 over the format version, the
    tokenizer settings and the content fingerprint of the corpus files
    (:mod:`checkpointless.corpus.documents`). ``cache_dir`` defaults to ``$CHECKPOINTLESS_TOKEN_CACHE`` or
    ``~/.cache/checkpointless/tokens``.

Building
    An entry is built in a private temporary directory and published with one ``rename``, so readers
    only ever see complete entries; a per-key ``flock`` makes concurrent processes on one node wait for
    the first builder instead of duplicating the work. Temporary directories left by crashed builders
    are removed after an hour.

Verification
    Opening an entry verifies it: every file against the SHA-256 recorded when it was built (about
    0.06 s for the ~63 MB of the standard-library corpus), the document offsets for consistency, and
    every token id against ``[0, vocab_size)`` (one vectorised ``max``). :func:`load_corpus` rebuilds an
    entry that fails from the source; opening one directly (:class:`TokenizedCorpus`, unpickling)
    raises ``ValueError`` naming the file and, for an out-of-vocabulary id, the id and its position.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from checkpointless.corpus.documents import (
    DEFAULT_EXCLUDE,
    TEXT_SUFFIXES,
    default_corpus_dir,
    read_documents,
)
from checkpointless.corpus.tokenization import (
    BPE_EOD,
    BYTE_VOCAB_SIZE,
    EOD_ID,
    tokenize_bpe,
    tokenize_bytes,
    train_bpe,
)

__all__ = ["TokenizedCorpus", "load_corpus"]

log = logging.getLogger(__name__)

_FORMAT_VERSION = "checkpointless-tokens-v2"  # v2: meta.json records file hashes


def _default_cache_dir() -> Path:
    env = os.environ.get("CHECKPOINTLESS_TOKEN_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "checkpointless" / "tokens"


class TokenizedCorpus:
    """A tokenized corpus backed by a read-only memory map inside a cache entry.

    Attributes:
        path: the cache entry directory ``<cache_dir>/<key>``.
        key: the content hash naming the entry.
        tokens: flat 1-D read-only ``np.memmap`` of token ids (``uint16`` or ``uint32``).
        doc_starts: int64 start offset of every document in ``tokens`` (ascending, first is 0).
        vocab_size: number of token ids (byte: 257; BPE: the trained vocabulary size).
        eod_id: the end-of-document token id (appended after every document).
        tokenizer: ``"byte"`` or ``"bpe"``.
        from_cache: True when this process found the entry already built (nothing was tokenized).
        source: the corpus directory or file it was built from, when known (set by :func:`load_corpus`).

    Opening verifies the entry (see the module doc) and raises ``ValueError`` naming the file at fault.
    Pickling sends the entry path only; the memory map is reopened (and verified) on the receiving side.
    """

    def __init__(self, path: Path, *, from_cache: bool, source: Path | None = None) -> None:
        path = Path(path)
        try:
            meta = json.loads((path / "meta.json").read_text())
        except FileNotFoundError:
            raise ValueError(f"not a token cache entry (no meta.json): {path}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"corrupt token cache: {path / 'meta.json'} is not valid JSON ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT_VERSION:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise ValueError(f"unsupported token cache format in {path}: {found!r}")
        try:
            self.key: str = str(meta["key"])
            self.vocab_size: int = int(meta["vocab_size"])
            self.eod_id: int = int(meta["eod_id"])
            self.tokenizer: str = str(meta["tokenizer"])
            self._dtype = np.dtype(meta["dtype"])
            self._n_tokens = int(meta["n_tokens"])
            digests = {str(k): str(v) for k, v in meta["sha256"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"corrupt token cache: {path / 'meta.json'} is malformed ({exc!r})") from None
        self.path = path
        self.from_cache = from_cache
        self.source = source
        self._bpe: Any = None
        token_file = path / "tokens.bin"
        expected = self._n_tokens * self._dtype.itemsize
        actual = token_file.stat().st_size
        if actual != expected or self._n_tokens < 1:
            raise ValueError(f"corrupt token cache: {token_file} has {actual} bytes, expected {expected}")
        self.tokens: np.ndarray = np.memmap(token_file, dtype=self._dtype, mode="r", shape=(self._n_tokens,))
        # Hash what is mapped, so the verified bytes are the ones used (no second read of the file).
        _check_digest(token_file, _sha256_array(self.tokens), digests)
        docs_file = path / "docs.npy"
        docs_raw = docs_file.read_bytes()
        _check_digest(docs_file, hashlib.sha256(docs_raw).hexdigest(), digests)
        if self.tokenizer == "bpe":
            tok_file = path / "tokenizer.json"
            _check_digest(tok_file, hashlib.sha256(tok_file.read_bytes()).hexdigest(), digests)
        try:
            self.doc_starts: np.ndarray = np.load(io.BytesIO(docs_raw), allow_pickle=False)
        except (ValueError, EOFError, OSError) as exc:
            raise ValueError(f"corrupt token cache: {docs_file} is unreadable ({exc})") from None
        _check_contents(self.tokens, self.doc_starts, self.vocab_size, self.eod_id, token_file, docs_file)

    def __len__(self) -> int:
        return self._n_tokens

    @property
    def n_docs(self) -> int:
        """Number of documents."""
        return len(self.doc_starts)

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of ``ids``; end-of-document tokens become a blank line. Invalid UTF-8 is replaced."""
        arr = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64).ravel()
        pieces: list[str] = []
        bounds = np.flatnonzero(arr == self.eod_id)
        prev = 0
        for cut in [*bounds.tolist(), len(arr)]:
            pieces.append(self._decode_plain(arr[prev:cut]))
            prev = cut + 1
        return "\n\n".join(pieces)

    def _decode_plain(self, arr: np.ndarray) -> str:
        if self.tokenizer == "byte":
            return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", "replace")
        if self._bpe is None:
            from tokenizers import Tokenizer

            self._bpe = Tokenizer.from_file(str(self.path / "tokenizer.json"))
        return str(self._bpe.decode(arr.tolist()))

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "from_cache": self.from_cache, "source": self.source}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["path"], from_cache=state["from_cache"], source=state.get("source")
        )

    def __repr__(self) -> str:
        return (
            f"TokenizedCorpus(key={self.key[:12]}, tokenizer={self.tokenizer}, vocab={self.vocab_size}, "
            f"tokens={len(self)}, docs={self.n_docs}, from_cache={self.from_cache})"
        )


def _sha256_array(arr: np.ndarray) -> str:
    """SHA-256 of an array's bytes, hashed in place (no copy of a contiguous array or memmap)."""
    return hashlib.sha256(np.ascontiguousarray(arr).data).hexdigest()


def _check_digest(file: Path, actual: str, recorded: dict[str, str]) -> None:
    expected = recorded.get(file.name)
    if expected is None:
        raise ValueError(f"corrupt token cache: no SHA-256 recorded for {file}")
    if actual != expected:
        raise ValueError(
            f"corrupt token cache: {file} does not match the SHA-256 recorded when it was built "
            f"(modified or damaged since); delete {file.parent} to rebuild it"
        )


def _check_contents(
    tokens: np.ndarray, starts: np.ndarray, vocab_size: int, eod_id: int, token_file: Path, docs_file: Path
) -> None:
    """Every token id in ``[0, vocab_size)`` and consistent document offsets, or ValueError naming the file.

    Vectorised: one ``max`` over the tokens (a few ms for the standard-library corpus).
    """
    if not 0 <= eod_id < vocab_size:
        raise ValueError(f"bad token cache {token_file.parent}: eod_id {eod_id} outside [0, {vocab_size})")
    n = len(tokens)
    if n:
        hi = int(tokens.max())
        lo = int(tokens.min()) if tokens.dtype.kind == "i" else 0
        if hi >= vocab_size or lo < 0:
            bad_pos = int(np.argmax((tokens >= vocab_size) | (tokens < 0)))
            raise ValueError(
                f"bad token data in {token_file}: token id {int(tokens[bad_pos])} at position {bad_pos} "
                f"is outside the vocabulary [0, {vocab_size})"
            )
    if (
        starts.ndim != 1
        or starts.dtype.kind not in "iu"
        or len(starts) < 1
        or int(starts[0]) != 0
        or int(starts[-1]) >= n
        or (len(starts) > 1 and bool((np.diff(starts) < 0).any()))
    ):
        raise ValueError(f"bad token cache {docs_file}: document offsets are not ascending within [0, {n})")


# --------------------------------------------------------------------------------------------------
# Building an entry
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on ``path`` (no-op where ``fcntl`` is unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _write_entry(
    tmp: Path,
    key: str,
    tokenizer: str,
    tokens: np.ndarray,
    starts: np.ndarray,
    vocab_size: int,
    eod_id: int,
    n_docs_files: int,
    bpe: Any,
) -> None:
    tokens = np.ascontiguousarray(tokens)
    tokens.tofile(tmp / "tokens.bin")
    np.save(tmp / "docs.npy", starts)
    digests = {
        "tokens.bin": _sha256_array(tokens),
        "docs.npy": hashlib.sha256((tmp / "docs.npy").read_bytes()).hexdigest(),
    }
    if bpe is not None:
        bpe.save(str(tmp / "tokenizer.json"))
        digests["tokenizer.json"] = hashlib.sha256((tmp / "tokenizer.json").read_bytes()).hexdigest()
    meta = {
        "format": _FORMAT_VERSION,
        "key": key,
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "eod_id": eod_id,
        "dtype": tokens.dtype.str,
        "n_tokens": len(tokens),
        "n_docs": len(starts),
        "n_files": n_docs_files,
        "created": time.time(),
        "sha256": digests,
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


def _discard_entry(cache: Path, key: str, entry: Path) -> None:
    """Move a bad entry aside (one rename, so no reader sees it half deleted), then delete it."""
    aside = cache / f".{key}.tmp-bad-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(entry, aside)
    except OSError:
        aside = entry
    shutil.rmtree(aside, ignore_errors=True)


def _remove_stale_builds(cache: Path, key: str, max_age_s: float = 3600.0) -> None:
    """Delete temporary build directories of ``key`` left by crashed builders (older than an hour)."""
    now = time.time()
    for tmp in cache.glob(f".{key}.tmp-*"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)


def load_corpus(
    source: str | os.PathLike[str] | None = None,
    *,
    tokenizer: Literal["byte", "bpe"] = "byte",
    vocab_size: int = 8192,
    cache_dir: str | os.PathLike[str] | None = None,
    exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE,
) -> TokenizedCorpus:
    """Tokenize ``source`` once (or reuse the cached result) and memory-map it.

    Args:
        source: a directory (or a single file) of ``.txt``/``.md``/``.py``/``.jsonl`` documents; ``None``
            means the standard library's ``*.py`` files (:func:`default_corpus_dir`).
        tokenizer: ``"byte"`` (vocabulary 257) or ``"bpe"``; see :mod:`checkpointless.corpus.tokenization`.
        vocab_size: target vocabulary size of the BPE tokenizer (ignored for ``"byte"``).
        cache_dir: where token files live; default ``$CHECKPOINTLESS_TOKEN_CACHE`` or
            ``~/.cache/checkpointless/tokens``.
        exclude_dirs: directory names skipped anywhere in the tree (hidden directories always are).

    Returns:
        The corpus; ``from_cache`` says whether this call reused an existing entry.

    A cache entry that fails verification (see module doc) is rebuilt from ``source``.

    Raises:
        ValueError: naming the path when ``source`` is missing, unreadable or holds no documents, on
            bad ``tokenizer``/``vocab_size`` values, on a malformed JSONL line (``file:line``), or when
            freshly tokenized data fails verification.
    """
    if tokenizer not in ("byte", "bpe"):
        raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {tokenizer!r}")
    if tokenizer == "bpe" and not 257 <= vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in [257, 2**32] for BPE, got {vocab_size}")
    root = Path(source).expanduser() if source is not None else default_corpus_dir()
    suffixes = (".py",) if source is None else TEXT_SUFFIXES
    docs, content_hash = read_documents(root, suffixes, exclude_dirs)
    spec = {"tokenizer": tokenizer, "vocab_size": vocab_size if tokenizer == "bpe" else BYTE_VOCAB_SIZE}
    key = hashlib.sha256(
        f"{_FORMAT_VERSION}\0{json.dumps(spec, sort_keys=True)}\0{content_hash}".encode()
    ).hexdigest()[:32]

    cache = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / key
    if (final / "meta.json").exists():
        with contextlib.suppress(ValueError, OSError):
            return TokenizedCorpus(final, from_cache=True, source=root)

    with _file_lock(cache / f"{key}.lock"):
        if (final / "meta.json").exists():  # another process built (or rebuilt) it while we waited
            try:
                return TokenizedCorpus(final, from_cache=True, source=root)
            except (ValueError, OSError) as exc:
                log.warning("rebuilding token cache entry from %s: %s", root, exc)
                _discard_entry(cache, key, final)
        elif final.exists():  # a directory without meta.json is not ours to trust
            _discard_entry(cache, key, final)
        _remove_stale_builds(cache, key)
        t0 = time.perf_counter()
        bpe: Any = None
        if tokenizer == "byte":
            tokens, starts = tokenize_bytes(docs)
            vocab, eod = BYTE_VOCAB_SIZE, EOD_ID
        else:
            bpe = train_bpe(docs, vocab_size)
            vocab, eod = int(bpe.get_vocab_size()), int(bpe.token_to_id(BPE_EOD))
            tokens, starts = tokenize_bpe(bpe, docs, eod)
        _check_contents(tokens, starts, vocab, eod, root, root)  # never publish ids the model cannot embed
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-", dir=cache))
        try:
            _write_entry(tmp, key, tokenizer, tokens, starts, vocab, eod, len(docs), bpe)
            os.chmod(tmp, 0o755)
            try:
                os.rename(tmp, final)
            except OSError:
                # Lost a race with a builder that does not share our lock (e.g. another node on a
                # shared filesystem): its entry is equivalent, keep it.
                if not (final / "meta.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info(
            "tokenized %d documents from %s into %d %s tokens in %.2fs (%s)",
            len(docs),
            root,
            len(tokens),
            tokenizer,
            time.perf_counter() - t0,
            final,
        )
        return TokenizedCorpus(final, from_cache=False, source=root)
