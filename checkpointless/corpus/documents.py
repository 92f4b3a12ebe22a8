"""Reading a corpus: which files are documents, in which order, and their content fingerprint.

By default the corpus is the Python standard library's own ``*.py`` sources
(``sysconfig.get_paths()["stdlib"]``, ``site-packages`` and ``__pycache__`` skipped, ~1800 files / ~34 MB
on CPython 3.11). Alternatively a user directory (or a single file): every ``.txt``, ``.md`` and ``.py``
file is one document, and every line of a ``.jsonl`` file is one document taken from its ``"text"``
field. Files are found recursively (hidden directories skipped) and ordered by their relative POSIX
path, so the document order is the same on every machine.

Alongside the documents, :func:`read_documents` returns a SHA-256 fingerprint over every file's
relative path and a SHA-256 of its *contents* (hashing is as fast as reading; size+mtime can miss a
same-size rewrite within one timestamp tick); :mod:`checkpointless.corpus.token_cache` keys its entries
on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DEFAULT_EXCLUDE", "TEXT_SUFFIXES", "default_corpus_dir", "read_documents"]

TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
"""The suffixes of a directory's files read as documents (a corpus of the Python sources reads ``.py`` alone)."""
DEFAULT_EXCLUDE = ("site-packages", "__pycache__")
"""Directories whose files are never documents."""


def default_corpus_dir() -> Path:
    """Directory of the running interpreter's standard library (the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


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


def read_documents(
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
