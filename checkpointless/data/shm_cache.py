"""Node-local batch cache in shared memory, so a replacement process starts without the corpus.

Layout: one directory per job, ``<root>/checkpointless-<job_id>/`` (``root`` defaults to ``/dev/shm``,
else the system temp dir), holding one ``.npy`` file per batch::

    <split>-s<step:012d>-r<dp_rank>-of<dp_size>.npy      e.g. train-s000000000042-r1-of4.npy

Each file is a ``(2, rows, cols)`` array: ``[inputs, targets]``, stored as ``uint16`` (or ``uint32``)
when the ids fit, else ``int64``; :meth:`ShmBatchCache.get` always returns int64 tensors. Files are
written to a hidden temporary name in the same directory and published with ``os.replace``, so a
reader sees a whole batch or none. The directory's total size is kept under ``budget_bytes`` by
deleting the files with the lowest step first (consumed batches go before prefetched ones).

One job directory holds batches of one data configuration: the name does not encode the seed,
corpus or geometry, so use a distinct ``job_id`` per data configuration. The directory outlives any
single process on purpose (that is what lets a replacement use it); whoever owns the node-level
lifetime (the launcher or agent) calls :meth:`ShmBatchCache.cleanup`, or uses the cache as a context
manager.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Protocol, runtime_checkable

import numpy as np
import torch

__all__ = ["BatchSource", "CachedDataset", "ShmBatchCache"]

log = logging.getLogger(__name__)

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_NAME_RE = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-s(?P<step>\d+)-r(?P<rank>\d+)-of(?P<size>\d+)\.npy$")
_TMP_PREFIX = ".tmp-"

Batch = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class BatchSource(Protocol):
    """Anything with :meth:`checkpointless.data.corpus.TokenDataset.batch`'s signature and purity."""

    def batch(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> Batch: ...


def _default_root() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _compact(arr: np.ndarray) -> np.ndarray:
    if arr.size == 0:
        return arr.astype(np.uint16)
    lo, hi = int(arr.min()), int(arr.max())
    if lo >= 0 and hi < 2**16:
        return arr.astype(np.uint16)
    if lo >= 0 and hi < 2**32:
        return arr.astype(np.uint32)
    return arr.astype(np.int64)


class ShmBatchCache:
    """Bounded, shared, crash-safe directory of prefetched batches (see module doc for the layout).

    Safe to use from several threads and several processes on one node at once: writes are atomic
    renames, and a batch evicted or removed under a reader is simply a miss.
    """

    def __init__(
        self,
        job_id: str,
        *,
        root: str | os.PathLike[str] | None = None,
        budget_bytes: int = 512 * 2**20,
        cleanup_on_exit: bool = True,
    ) -> None:
        """Open (creating if needed) ``<root>/checkpointless-<job_id>/``.

        Args:
            job_id: names the directory; letters, digits, ``.``, ``_`` and ``-`` only.
            root: parent directory; default ``/dev/shm`` (falls back to the temp dir).
            budget_bytes: upper bound on the total size of cached batch files.
            cleanup_on_exit: whether leaving the ``with`` block removes the directory.

        Raises:
            ValueError: for an empty or unsafe ``job_id`` or a negative budget.
        """
        if not job_id or not _JOB_ID_RE.match(job_id) or job_id in (".", ".."):
            raise ValueError(f"job_id must match [A-Za-z0-9._-]+, got {job_id!r}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.job_id = job_id
        self.budget_bytes = budget_bytes
        self.cleanup_on_exit = cleanup_on_exit
        self.path = Path(root if root is not None else _default_root()) / f"checkpointless-{job_id}"
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._closed = False
        self._evict_lock = threading.Lock()

    @staticmethod
    def filename(step: int, dp_rank: int, dp_size: int, split: str = "train") -> str:
        """File name of one batch (without directory)."""
        if not re.fullmatch(r"[A-Za-z0-9_]+", split):
            raise ValueError(f"split must match [A-Za-z0-9_]+, got {split!r}")
        if step < 0 or dp_rank < 0 or dp_size < 1:
            raise ValueError(f"invalid batch address step={step} dp_rank={dp_rank} dp_size={dp_size}")
        return f"{split}-s{step:012d}-r{dp_rank}-of{dp_size}.npy"

    def get(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> Batch | None:
        """The cached ``(inputs, targets)`` int64 tensors, or ``None`` on a miss."""
        if self._closed:
            return None
        try:
            arr = np.load(self.path / self.filename(step, dp_rank, dp_size, split), allow_pickle=False)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:  # unreadable: treat as a miss, never as data
            log.warning("ignoring unreadable cached batch %s/%s: %s", split, step, exc)
            return None
        data = torch.from_numpy(arr.astype(np.int64))
        return data[0].contiguous(), data[1].contiguous()

    def contains(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> bool:
        """Whether the batch is currently cached (it may be evicted right after)."""
        return (self.path / self.filename(step, dp_rank, dp_size, split)).exists()

    def put(self, step: int, dp_rank: int, dp_size: int, batch: Batch, *, split: str = "train") -> bool:
        """Store ``batch`` atomically, then evict lowest steps until within budget.

        Returns:
            Whether the batch is in the cache afterwards (False if it was itself evicted, exceeds
            the budget alone, or the cache was cleaned up).

        Raises:
            ValueError: if inputs and targets differ in shape.
        """
        inputs, targets = batch
        if tuple(inputs.shape) != tuple(targets.shape):
            raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ")
        if self._closed:
            return False
        name = self.filename(step, dp_rank, dp_size, split)
        arr = _compact(np.stack([inputs.detach().cpu().numpy(), targets.detach().cpu().numpy()]))
        if arr.nbytes > self.budget_bytes:
            return False
        tmp = self.path / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.npy"
        try:
            with open(tmp, "wb") as f:
                np.save(f, arr, allow_pickle=False)
            os.replace(tmp, self.path / name)
        except FileNotFoundError:  # directory removed by cleanup() (here or in another process)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        self._evict()
        return (self.path / name).exists()

    def _entries(self) -> list[tuple[int, str, int]]:
        """``(step, name, size)`` of every cached batch."""
        out: list[tuple[int, str, int]] = []
        try:
            with os.scandir(self.path) as it:
                for entry in it:
                    m = _NAME_RE.match(entry.name)
                    if m is None:
                        continue
                    try:
                        size = entry.stat().st_size
                    except FileNotFoundError:
                        continue
                    out.append((int(m["step"]), entry.name, size))
        except FileNotFoundError:
            return []
        return out

    def nbytes(self) -> int:
        """Total size of the cached batch files."""
        return sum(size for _, _, size in self._entries())

    def _evict(self) -> None:
        with self._evict_lock:
            entries = self._entries()
            total = sum(size for _, _, size in entries)
            if total <= self.budget_bytes:
                return
            for _, name, size in sorted(entries):
                with contextlib.suppress(FileNotFoundError):
                    (self.path / name).unlink()
                total -= size
                if total <= self.budget_bytes:
                    return

    def cleanup(self) -> None:
        """Remove the job directory and everything in it; later ``get``/``put`` are misses/no-ops."""
        self._closed = True
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> ShmBatchCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.cleanup_on_exit:
            self.cleanup()

    def __repr__(self) -> str:
        return f"ShmBatchCache({str(self.path)!r}, budget_bytes={self.budget_bytes})"


class CachedDataset:
    """A :class:`BatchSource` that serves from a :class:`ShmBatchCache` first.

    ``source`` may be the dataset itself or a zero-argument factory; a factory is called (once, under
    a lock) only on the first miss, so a replacement process whose batches are all cached never opens
    the tokenized corpus. Returned batches are identical to ``source.batch(...)`` as long as the cache
    directory belongs to this data configuration (see module doc).

    Attributes:
        hits, misses: counters of :meth:`batch` lookups (prefetch does not count).
    """

    def __init__(self, source: BatchSource | Callable[[], BatchSource], cache: ShmBatchCache) -> None:
        self.cache = cache
        self.hits = 0
        self.misses = 0
        self._source: BatchSource | None = None
        self._factory: Callable[[], BatchSource] | None = None
        if isinstance(source, BatchSource):
            self._source = source
        elif callable(source):
            self._factory = source
        else:
            raise TypeError(f"source must have a batch() method or be a factory, got {type(source)!r}")
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def source(self) -> BatchSource:
        """The wrapped dataset (built from the factory on first access)."""
        if self._source is None:
            with self._lock:
                if self._source is None:
                    assert self._factory is not None
                    self._source = self._factory()
        return self._source

    def _fill(self, step: int, dp_rank: int, dp_size: int, split: str) -> Batch:
        batch = self.source.batch(step, dp_rank, dp_size, split=split)
        self.cache.put(step, dp_rank, dp_size, batch, split=split)
        return batch

    def batch(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> Batch:
        """``source.batch(step, dp_rank, dp_size, split=split)``, from the cache when present."""
        hit = self.cache.get(step, dp_rank, dp_size, split=split)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        return self._fill(step, dp_rank, dp_size, split)

    def prefetch(
        self,
        steps: Iterable[int],
        dp_rank: int,
        dp_size: int,
        *,
        split: str = "train",
        background: bool = True,
    ) -> threading.Thread | None:
        """Compute and cache every batch of ``steps`` that is not cached yet, in order.

        With ``background=True`` this runs in a daemon thread, which is returned (join it to wait);
        it stops early on :meth:`stop` or when the cache is cleaned up, and logs (does not raise)
        errors. With ``background=False`` it runs inline, raises errors, and returns ``None``.
        """
        step_list = list(steps)

        def work() -> None:
            for step in step_list:
                if self._stop.is_set() or self.cache._closed:
                    return
                if not self.cache.contains(step, dp_rank, dp_size, split=split):
                    self._fill(step, dp_rank, dp_size, split)

        if not background:
            work()
            return None

        def guarded() -> None:
            try:
                work()
            except Exception:
                log.exception("batch prefetch failed (dp_rank=%d, dp_size=%d)", dp_rank, dp_size)

        thread = threading.Thread(target=guarded, name=f"checkpointless-prefetch-r{dp_rank}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()
        return thread

    def stop(self, timeout: float | None = None) -> None:
        """Ask background prefetches to finish after their current batch, and wait for them."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        self._threads = [t for t in self._threads if t.is_alive()]
        self._stop.clear()
