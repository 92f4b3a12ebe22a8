"""Real-text corpus, tokenized once into a memory-mapped cache, with stateless batch sampling.

Corpus
    By default the Python standard library's own ``*.py`` sources (``sysconfig.get_paths()["stdlib"]``,
    ``site-packages`` and ``__pycache__`` skipped, ~1800 files / ~34 MB on CPython 3.11). Alternatively a
    user directory (or a single file): every ``.txt``, ``.md`` and ``.py`` file is one document, and every
    line of a ``.jsonl`` file is one document taken from its ``"text"`` field. Files are found recursively
    (hidden directories skipped) and ordered by their relative POSIX path, so the document order is the
    same on every machine.

Tokenization
    ``"byte"`` (default): the UTF-8 bytes themselves, ids 0..255, plus an end-of-document token
    :data:`EOD_ID` = 256 appended after every document, so ``vocab_size`` is :data:`BYTE_VOCAB_SIZE` = 257.
    ``"bpe"``: a byte-level BPE trained locally with the ``tokenizers`` library (imported lazily) on the
    corpus itself; its special token ``<|endoftext|>`` is the end-of-document token. Token ids are stored
    as ``uint16`` when the vocabulary has at most 65536 entries, ``uint32`` otherwise.

Token cache
    ``<cache_dir>/<key>/`` holds ``tokens.bin`` (raw token ids, one flat array), ``docs.npy`` (int64 start
    offset of every document), ``meta.json`` (dtype, counts, tokenizer, the SHA-256 of every other file;
    written last) and, for BPE, ``tokenizer.json``. ``key`` is a SHA-256 over the format version, the
    tokenizer settings and, for every file, its relative path and a SHA-256 of its *contents* (hashing
    is as fast as reading; size+mtime can miss a same-size rewrite within one timestamp tick). An entry is built in a private temporary
    directory and published with one ``rename``, so readers only ever see complete entries; a per-key
    ``flock`` makes concurrent processes on one node wait for the first builder instead of duplicating
    the work. ``cache_dir`` defaults to ``$CHECKPOINTLESS_TOKEN_CACHE`` or ``~/.cache/checkpointless/tokens``.

    Opening an entry verifies it: every file against the SHA-256 recorded when it was built (about
    0.06 s for the ~63 MB of the standard-library corpus), the document offsets for consistency, and
    every token id against ``[0, vocab_size)`` (one vectorised ``max``). :func:`load_corpus` rebuilds an
    entry that fails from the source; opening one directly (:class:`TokenizedCorpus`, unpickling)
    raises ``ValueError`` naming the file and, for an out-of-vocabulary id, the id and its position.

Splits
    The validation split is the tail of the token stream: it starts at the document boundary closest to
    ``(1 - val_fraction) * n_tokens``, or exactly there when no boundary lies within half the intended
    validation size of it (a corpus of one or a few long documents). Train and validation windows never
    cross that point, so the splits are disjoint.

Batches
    See :class:`TokenDataset`: each batch is a pure function of ``(seed, step, dp_rank, dp_size, split)``
    and the corpus, computed with integer arithmetic only (no RNG state, no history).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOD_ID",
    "TokenDataset",
    "TokenizedCorpus",
    "default_corpus_dir",
    "load_corpus",
]

log = logging.getLogger(__name__)

EOD_ID = 256
"""End-of-document token id of the byte tokenizer (appended after every document)."""
BYTE_VOCAB_SIZE = 257
"""Vocabulary size of the byte tokenizer: 256 byte values plus :data:`EOD_ID`."""

_FORMAT_VERSION = "checkpointless-tokens-v2"  # v2: meta.json records file hashes
_TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
_DEFAULT_EXCLUDE = ("site-packages", "__pycache__")
_BPE_EOD = "<|endoftext|>"
_SPLIT_IDS: dict[str, int] = {"train": 0, "val": 1}


def default_corpus_dir() -> Path:
    """Directory of the running interpreter's standard library (the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _default_cache_dir() -> Path:
    env = os.environ.get("CHECKPOINTLESS_TOKEN_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "checkpointless" / "tokens"


# --------------------------------------------------------------------------------------------------
# Reading documents
# --------------------------------------------------------------------------------------------------


def _list_files(root: Path, suffixes: Sequence[str], exclude_dirs: Sequence[str]) -> list[Path]:
    """Files under ``root`` with one of ``suffixes``, sorted by relative POSIX path."""
    if root.is_file():
        return [root] if root.suffix in suffixes else []
    found: list[tuple[str, Path]] = []
    excluded = set(exclude_dirs)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded and not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or Path(name).suffix not in suffixes:
                continue
            path = Path(dirpath) / name
            found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def _jsonl_documents(path: Path, raw: bytes) -> list[bytes]:
    docs: list[bytes] = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: invalid UTF-8 ({exc.reason})") from None
        except RecursionError:
            raise ValueError(f"{path}:{lineno}: invalid JSON (nested too deeply)") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f'{path}:{lineno}: expected an object with a string "text" field')
        docs.append(text.encode("utf-8", "replace"))  # lone surrogates ("\ud800") become "?"
    return docs


def _read_documents(
    root: Path, suffixes: Sequence[str], exclude_dirs: Sequence[str]
) -> tuple[list[bytes], str]:
    """All documents (UTF-8 bytes) under ``root`` and the content fingerprint of the file set.

    Raises:
        ValueError: naming ``root`` when it does not exist or holds no documents.
    """
    if not root.exists():
        raise ValueError(f"corpus path does not exist: {root}")
    files = _list_files(root, suffixes, exclude_dirs)
    if not files:
        raise ValueError(f"corpus path contains no {'/'.join(suffixes)} files: {root}")
    base = root if root.is_dir() else root.parent
    digest = hashlib.sha256()
    docs: list[bytes] = []
    for path in files:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read corpus file {path}: {exc.strerror or exc}") from None
        rel = path.relative_to(base).as_posix()
        digest.update(f"{rel}\0{len(raw)}\0".encode())
        digest.update(hashlib.sha256(raw).digest())
        if path.suffix == ".jsonl":
            docs.extend(_jsonl_documents(path, raw))
        else:
            docs.append(raw)
    if not docs:
        raise ValueError(f"corpus path contains no documents: {root}")
    return docs, digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def _token_dtype(vocab_size: int) -> np.dtype[Any]:
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.uint32)


def _tokenize_bytes(docs: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
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


def _train_bpe(docs: Sequence[bytes], vocab_size: int) -> Any:
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("tokenizer='bpe' needs the 'tokenizers' package (pip install tokenizers)") from exc
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[_BPE_EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.decode("utf-8", "replace") for d in docs), trainer=trainer)
    return tok


def _tokenize_bpe(tok: Any, docs: Sequence[bytes], eod: int) -> tuple[np.ndarray, np.ndarray]:
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


# --------------------------------------------------------------------------------------------------
# The cached, memory-mapped token file
# --------------------------------------------------------------------------------------------------


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
    exclude_dirs: Sequence[str] = _DEFAULT_EXCLUDE,
) -> TokenizedCorpus:
    """Tokenize ``source`` once (or reuse the cached result) and memory-map it.

    Args:
        source: a directory (or a single file) of ``.txt``/``.md``/``.py``/``.jsonl`` documents; ``None``
            means the standard library's ``*.py`` files (:func:`default_corpus_dir`).
        tokenizer: ``"byte"`` (vocabulary 257, see module doc) or ``"bpe"``.
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
    suffixes = (".py",) if source is None else _TEXT_SUFFIXES
    docs, content_hash = _read_documents(root, suffixes, exclude_dirs)
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
            tokens, starts = _tokenize_bytes(docs)
            vocab, eod = BYTE_VOCAB_SIZE, EOD_ID
        else:
            bpe = _train_bpe(docs, vocab_size)
            vocab, eod = int(bpe.get_vocab_size()), int(bpe.token_to_id(_BPE_EOD))
            tokens, starts = _tokenize_bpe(bpe, docs, eod)
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
