"""One cached batch as a file: where it goes, its name, its contents, the space it takes, a
directory's listing.

Each batch is one ``.npy`` file in the job's directory::

    <split>-s<step:012d>-r<dp_rank>-of<dp_size>.npy      e.g. train-s000000000042-r1-of4.npy

Each file is a ``(2, rows, cols)`` array: ``[inputs, targets]``, stored as ``uint16`` (or ``uint32``)
when the ids fit, else ``int64`` (:func:`compact`). Files are written to a hidden temporary name
(:data:`TMP_PREFIX`) in the same directory and published with ``os.replace``, so a reader sees a
whole batch or none. A file is charged what tmpfs really allocates for it (:func:`disk_bytes`).
:class:`~checkpointless.corpus.shm_cache.ShmBatchCache` keeps the directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "TMP_PREFIX",
    "Batch",
    "BatchEntry",
    "Stream",
    "batch_filename",
    "compact",
    "default_root",
    "disk_bytes",
    "pages",
    "parse_entry",
    "scan_directory",
]

_NAME_RE = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-s(?P<step>\d+)-r(?P<rank>\d+)-of(?P<size>\d+)\.npy$")
TMP_PREFIX = ".tmp-"
"""The name a batch file is written under before ``os.replace`` publishes it begins with this."""
_PAGE = 4096
"""Allocation unit of tmpfs (and of most local filesystems)."""
_STALE_TMP_S = 600.0
"""A temporary file this old was left by a writer that died mid-write; a rescan removes it."""

Batch = tuple[torch.Tensor, torch.Tensor]
Stream = tuple[str, int, int]  # (split, dp_rank, dp_size)


def default_root() -> Path:
    """Where the job directories go by default: ``/dev/shm``, else the system temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def batch_filename(step: int, dp_rank: int, dp_size: int, split: str = "train") -> str:
    """File name of one batch (without directory)."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", split):
        raise ValueError(f"split must match [A-Za-z0-9_]+, got {split!r}")
    if step < 0 or dp_rank < 0 or dp_size < 1:
        raise ValueError(f"invalid batch address step={step} dp_rank={dp_rank} dp_size={dp_size}")
    return f"{split}-s{step:012d}-r{dp_rank}-of{dp_size}.npy"


def compact(arr: np.ndarray) -> np.ndarray:
    if arr.size == 0:
        return arr.astype(np.uint16)
    lo, hi = int(arr.min()), int(arr.max())
    if lo >= 0 and hi < 2**16:
        return arr.astype(np.uint16)
    if lo >= 0 and hi < 2**32:
        return arr.astype(np.uint32)
    return arr.astype(np.int64)


def pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole 4 KiB pages."""
    return -(-nbytes // _PAGE) * _PAGE


def disk_bytes(st: os.stat_result) -> int:
    """Space a file really occupies: its size in whole pages, or its allocated blocks if more."""
    return max(pages(st.st_size), getattr(st, "st_blocks", 0) * 512)


@dataclass(frozen=True)
class BatchEntry:
    split: str
    step: int
    rank: int
    size: int
    disk: int
    added: float  # time.monotonic() when this handle learned of the file

    @property
    def stream(self) -> Stream:
        return (self.split, self.rank, self.size)


def parse_entry(name: str, st: os.stat_result, added: float | None = None) -> BatchEntry | None:
    m = _NAME_RE.match(name)
    if m is None:
        return None
    when = time.monotonic() if added is None else added
    return BatchEntry(m["split"], int(m["step"]), int(m["rank"]), int(m["size"]), disk_bytes(st), when)


def scan_directory(path: Path, added: float) -> tuple[dict[str, BatchEntry], bool]:
    """Every batch file in the directory ``path`` (one ``scandir``), and whether the directory was
    there; removes stale temporary files."""
    entries: dict[str, BatchEntry] = {}
    now = time.time()
    try:
        with os.scandir(path) as it:
            for item in it:
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if item.name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > _STALE_TMP_S:  # its writer died mid-write
                        with contextlib.suppress(OSError):
                            os.unlink(item.path)
                    continue
                entry = parse_entry(item.name, st, added)
                if entry is not None:
                    entries[item.name] = entry
        found = True
    except FileNotFoundError:
        found = False
    return entries, found
