"""Node-local batch cache in shared memory, so a replacement process starts without the corpus.

Layout: one directory per job, ``<root>/checkpointless-<job_id>/`` (``root`` defaults to ``/dev/shm``,
else the system temp dir), holding one ``.npy`` file per batch::

    <split>-s<step:012d>-r<dp_rank>-of<dp_size>.npy      e.g. train-s000000000042-r1-of4.npy

Each file is a ``(2, rows, cols)`` array: ``[inputs, targets]``, stored as ``uint16`` (or ``uint32``)
when the ids fit, else ``int64``; :meth:`ShmBatchCache.get` always returns int64 tensors. Files are
written to a hidden temporary name in the same directory and published with ``os.replace``, so a
reader sees a whole batch or none. The directory is created by the first write, never by opening a
handle or reading, so a process that starts after the owner's :meth:`~ShmBatchCache.cleanup` (a late
spare) leaves nothing behind; a handle that has seen the directory and then finds it gone treats
that as a cleanup and does not recreate it.

Space accounting: a file is charged what tmpfs really allocates for it, its size rounded up to whole
4 KiB pages (or its ``st_blocks``, if larger). Every handle keeps the files it wrote, read or saw in
memory, so a write costs no directory scan. To learn what other processes on the node added or
removed, a write rescans the directory now and then: at most once every
:attr:`ShmBatchCache.rescan_interval_s` seconds, and never more than 1% of the time (a scan of
60,000 files takes ~0.5 s, so it then happens once a minute); the scan runs without holding the
handle's lock, so readers are not held up. :meth:`ShmBatchCache.nbytes` rescans on demand. When the
total exceeds ``budget_bytes`` the files with the lowest step go first. Between rescans a handle
does not see other processes' new files, so several writers can together exceed the budget by what
they wrote within one interval.

Consumption: :class:`CachedDataset` drops a rank's ``train`` batches once that rank asks for a
later step (:meth:`ShmBatchCache.drop_before`). The batch of the step being served is kept, because
a replacement process that re-executes a failed step reads that same ``(step, rank)`` batch;
evaluation (``val``) batches are reused and only evicted by the budget.

The cache is optional: when a write fails for want of space (``ENOSPC``, a short write: a container's
64 MB ``/dev/shm`` fills up) or for any other OS error, the batch is not cached, the partial file is
removed, one warning names the directory and its free space, and writes are skipped for
:attr:`ShmBatchCache.retry_after_s` seconds before the cache is tried again. Callers are unaffected:
:meth:`ShmBatchCache.put` returns False and :class:`CachedDataset` serves the batch from its source.

One job directory holds batches of one data configuration: the name does not encode the seed,
corpus or geometry, so use a distinct ``job_id`` per data configuration. The directory outlives any
single process on purpose (that is what lets a replacement use it); whoever owns the node-level
lifetime (the launcher or agent) calls :meth:`ShmBatchCache.cleanup`, or uses the cache as a context
manager.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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
_PAGE = 4096
"""Allocation unit of tmpfs (and of most local filesystems)."""
_STALE_TMP_S = 600.0
"""A temporary file this old was left by a writer that died mid-write; a rescan removes it."""

Batch = tuple[torch.Tensor, torch.Tensor]
_Stream = tuple[str, int, int]  # (split, dp_rank, dp_size)


@runtime_checkable
class BatchSource(Protocol):
    """Anything with :meth:`checkpointless.corpus.TokenDataset.batch`'s signature and purity."""

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


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole 4 KiB pages."""
    return -(-nbytes // _PAGE) * _PAGE


def _disk_bytes(st: os.stat_result) -> int:
    """Space a file really occupies: its size in whole pages, or its allocated blocks if more."""
    return max(_pages(st.st_size), getattr(st, "st_blocks", 0) * 512)


@dataclass(frozen=True)
class _Entry:
    split: str
    step: int
    rank: int
    size: int
    disk: int
    added: float  # time.monotonic() when this handle learned of the file

    @property
    def stream(self) -> _Stream:
        return (self.split, self.rank, self.size)


def _entry(name: str, st: os.stat_result, added: float | None = None) -> _Entry | None:
    m = _NAME_RE.match(name)
    if m is None:
        return None
    when = time.monotonic() if added is None else added
    return _Entry(m["split"], int(m["step"]), int(m["rank"]), int(m["size"]), _disk_bytes(st), when)


class ShmBatchCache:
    """Bounded, shared, crash-safe directory of prefetched batches (see module doc for the layout).

    Safe to use from several threads and several processes on one node at once: writes are atomic
    renames, and a batch evicted or removed under a reader is simply a miss.

    Attributes:
        rescan_interval_s: least time between two directory scans made by writes (class attribute,
            may be overridden per instance); the interval also grows to 100 times the last scan's
            duration, which is about 10 us per file.
        retry_after_s: after a failed write (a full ``/dev/shm``), writes are skipped this long.
        write_failures: how many writes failed (their batches were not cached).
    """

    rescan_interval_s: float = 1.0
    retry_after_s: float = 30.0

    def __init__(
        self,
        job_id: str,
        *,
        root: str | os.PathLike[str] | None = None,
        budget_bytes: int = 512 * 2**20,
        cleanup_on_exit: bool = True,
    ) -> None:
        """A handle on ``<root>/checkpointless-<job_id>/`` (created by the first :meth:`put`, not here).

        Args:
            job_id: names the directory; letters, digits, ``.``, ``_`` and ``-`` only.
            root: parent directory; default ``/dev/shm`` (falls back to the temp dir).
            budget_bytes: upper bound on the space the cached batch files occupy (whole pages).
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
        self._closed = False
        self._seen_dir = False  # this handle saw the directory exist: if it vanishes, it was cleaned up
        self._lock = threading.Lock()
        # In-memory accounting of the files this handle knows of (wrote, read, or found by a scan).
        self._entries: dict[str, _Entry] = {}
        self._used = 0
        self._by_step: list[tuple[int, str]] = []  # heap over all entries, for eviction (lazy deletes)
        self._streams: dict[_Stream, list[tuple[int, str]]] = {}  # heap per stream, for drop_before
        self._next_scan = float("-inf")  # monotonic time from which a write may rescan
        self._scanned = False
        self._scanning = False
        self._removed_while_scanning: set[str] = set()
        self.write_failures = 0
        self._skip_writes_until = float("-inf")  # monotonic time: a write failed, retry from then
        self._warned = False

    @staticmethod
    def filename(step: int, dp_rank: int, dp_size: int, split: str = "train") -> str:
        """File name of one batch (without directory)."""
        if not re.fullmatch(r"[A-Za-z0-9_]+", split):
            raise ValueError(f"split must match [A-Za-z0-9_]+, got {split!r}")
        if step < 0 or dp_rank < 0 or dp_size < 1:
            raise ValueError(f"invalid batch address step={step} dp_rank={dp_rank} dp_size={dp_size}")
        return f"{split}-s{step:012d}-r{dp_rank}-of{dp_size}.npy"

    # ------------------------------------------------------------------ in-memory accounting

    def _add(self, name: str, entry: _Entry) -> None:
        old = self._entries.get(name)
        if old is not None:
            self._used -= old.disk
        self._entries[name] = entry
        self._used += entry.disk
        if old is None or old.step != entry.step:
            heapq.heappush(self._by_step, (entry.step, name))
            heapq.heappush(self._streams.setdefault(entry.stream, []), (entry.step, name))
        self._compact_heaps()

    def _forget(self, name: str) -> _Entry | None:
        old = self._entries.pop(name, None)
        if old is not None:
            self._used -= old.disk
        if self._scanning:
            self._removed_while_scanning.add(name)
        return old

    def _compact_heaps(self) -> None:
        """Rebuild the heaps once stale items (lazily deleted entries) outnumber live ones."""
        if len(self._by_step) > 2 * len(self._entries) + 64:
            self._rebuild_heaps()

    def _rebuild_heaps(self) -> None:
        self._by_step = [(e.step, name) for name, e in self._entries.items()]
        heapq.heapify(self._by_step)
        self._streams = {}
        for name, e in self._entries.items():
            self._streams.setdefault(e.stream, []).append((e.step, name))
        for heap in self._streams.values():
            heapq.heapify(heap)

    def _scan(self, added: float) -> dict[str, _Entry]:
        """Every batch file in the directory (one ``scandir``); removes stale temporary files."""
        entries: dict[str, _Entry] = {}
        now = time.time()
        try:
            with os.scandir(self.path) as it:
                for item in it:
                    try:
                        st = item.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if item.name.startswith(_TMP_PREFIX):
                        if now - st.st_mtime > _STALE_TMP_S:  # its writer died mid-write
                            with contextlib.suppress(OSError):
                                os.unlink(item.path)
                        continue
                    entry = _entry(item.name, st, added)
                    if entry is not None:
                        entries[item.name] = entry
            self._seen_dir = True
        except FileNotFoundError:
            pass
        return entries

    def _rescan(self, *, force: bool = False) -> None:
        """Replace the in-memory view by the directory's contents, if due (or ``force``).

        Called without the lock: the listing runs unlocked, so other threads' reads, writes and
        drops proceed meanwhile; what they register or remove during it is merged in afterwards.
        """
        with self._lock:
            if self._scanning or (not force and time.monotonic() < self._next_scan):
                return
            self._scanning = True
            self._removed_while_scanning = set()
        try:
            start = time.monotonic()
            scanned = self._scan(start)
        except BaseException:
            with self._lock:
                self._scanning = False
            raise
        with self._lock:
            for name in self._removed_while_scanning:
                scanned.pop(name, None)
            for name, entry in self._entries.items():
                if entry.added >= start:  # registered while we listed: the listing may have missed it
                    scanned[name] = entry
            self._entries = scanned
            self._used = sum(e.disk for e in scanned.values())
            self._rebuild_heaps()
            end = time.monotonic()
            self._next_scan = end + max(self.rescan_interval_s, 100.0 * (end - start))
            self._scanned = True
            self._scanning = False
            self._removed_while_scanning = set()

    def _unlink(self, name: str) -> None:
        self._forget(name)
        with contextlib.suppress(FileNotFoundError):
            (self.path / name).unlink()

    def _evict(self) -> None:
        """Delete the lowest steps until the known files fit the budget (caller holds the lock)."""
        while self._used > self.budget_bytes and self._by_step:
            step, name = heapq.heappop(self._by_step)
            entry = self._entries.get(name)
            if entry is not None and entry.step == step:
                self._unlink(name)

    # ------------------------------------------------------------------ public API

    def get(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> Batch | None:
        """The cached ``(inputs, targets)`` int64 tensors, or ``None`` on a miss."""
        if self._closed:
            return None
        name = self.filename(step, dp_rank, dp_size, split)
        try:
            with open(self.path / name, "rb") as f:
                st = os.fstat(f.fileno())
                arr = np.load(f, allow_pickle=False)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, EOFError) as exc:  # unreadable: treat as a miss, never as data
            log.warning("ignoring unreadable cached batch %s/%s: %s", split, step, exc)
            return None
        if arr.ndim != 3 or arr.shape[0] != 2:
            log.warning("ignoring cached batch %s/%s of shape %s", split, step, arr.shape)
            return None
        entry = _entry(name, st)
        with self._lock:
            self._seen_dir = True
            if entry is not None and name not in self._entries:
                self._add(name, entry)
        data = torch.from_numpy(arr.astype(np.int64))
        return data[0].contiguous(), data[1].contiguous()

    def contains(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> bool:
        """Whether the batch is currently cached (it may be evicted right after)."""
        found = (self.path / self.filename(step, dp_rank, dp_size, split)).exists()
        if found:
            self._seen_dir = True
        return found

    def put(self, step: int, dp_rank: int, dp_size: int, batch: Batch, *, split: str = "train") -> bool:
        """Store ``batch`` atomically, then evict lowest steps until within budget.

        Creates the job directory if this handle has never seen it (a handle that saw it and finds
        it gone does not recreate it: it was cleaned up). Costs no directory scan, except at most
        one every :attr:`rescan_interval_s`.

        Returns:
            Whether the batch is in the cache afterwards (False if it was itself evicted, exceeds
            the budget alone, or the cache was cleaned up).

        Raises:
            ValueError: if inputs and targets differ in shape.
        """
        inputs, targets = batch
        if tuple(inputs.shape) != tuple(targets.shape):
            raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ")
        if self._closed or time.monotonic() < self._skip_writes_until:
            return False
        name = self.filename(step, dp_rank, dp_size, split)
        arr = _compact(np.stack([inputs.detach().cpu().numpy(), targets.detach().cpu().numpy()]))
        if _pages(arr.nbytes) > self.budget_bytes:
            return False
        tmp = self.path / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.npy"
        try:
            st = self._write(tmp, arr)
            if st is None:  # the directory is gone: cleaned up (here or in another process)
                return False
            if _disk_bytes(st) > self.budget_bytes:
                tmp.unlink()
                return False
            os.replace(tmp, self.path / name)
        except FileNotFoundError:  # directory removed by cleanup() while we wrote
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        except OSError as e:  # no space left (or a short write, which numpy reports without errno)
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._write_failed(e)
            return False
        entry = _entry(name, st)
        assert entry is not None
        with self._lock:
            self._add(name, entry)
        self._rescan()  # only when due
        with self._lock:
            self._evict()
            return name in self._entries

    def _write_failed(self, e: OSError) -> None:
        """A write failed: skip writes for a while; the first time, say where and how full."""
        self.write_failures += 1
        self._skip_writes_until = time.monotonic() + self.retry_after_s
        if self._warned:
            return
        self._warned = True
        root = self.path.parent
        try:
            usage = shutil.disk_usage(root)
            space = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
        except OSError:
            space = "free space unknown"
        full = e.errno in (errno.ENOSPC, errno.EDQUOT, None)  # None: numpy's short write
        log.warning(
            "batch cache: cannot write to %s (%s; %s): batches are read from the source instead, and "
            "the cache is tried again every %.0fs%s",
            root, e.strerror or e, space, self.retry_after_s,
            " (a container's /dev/shm is often 64 MB: e.g. docker run --shm-size=1g)" if full else "",
        )  # fmt: skip

    def _write(self, tmp: Path, arr: np.ndarray) -> os.stat_result | None:
        """Write ``arr`` to ``tmp``, creating the directory on first use; its stat, or None if gone."""
        try:
            f = open(tmp, "wb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            if self._seen_dir or self._closed:
                return None
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            f = open(tmp, "wb")  # noqa: SIM115
        with f:
            self._seen_dir = True
            np.save(f, arr, allow_pickle=False)
            f.flush()
            return os.fstat(f.fileno())

    def drop_before(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> int:
        """Delete the known batches of ``(split, dp_rank, dp_size)`` whose step is below ``step``.

        Called once a rank has moved on to ``step``: those batches are consumed. Returns how many
        files were removed. Batches of other ranks or geometries are left alone. A handle that has
        never scanned the directory scans it once here, so a replacement also drops what its failed
        predecessor had prefetched.
        """
        if self._seen_dir and not self._scanned:
            self._rescan(force=True)
        removed = 0
        with self._lock:
            heap = self._streams.get((split, dp_rank, dp_size))
            while heap and heap[0][0] < step:
                old_step, name = heapq.heappop(heap)
                entry = self._entries.get(name)
                if entry is not None and entry.step == old_step:
                    self._unlink(name)
                    removed += 1
            self._compact_heaps()
        return removed

    def nbytes(self) -> int:
        """Space the cached batch files occupy now (whole pages), from a fresh directory scan."""
        self._rescan(force=True)
        with self._lock:
            return self._used

    def cleanup(self) -> None:
        """Remove the job directory and everything in it; later ``get``/``put`` are misses/no-ops."""
        self._closed = True
        shutil.rmtree(self.path, ignore_errors=True)
        with self._lock:
            self._entries.clear()
            self._used = 0
            self._rebuild_heaps()

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

    With ``drop_consumed`` (the default), asking for ``train`` batch ``step`` of a rank deletes that
    rank's cached ``train`` batches of earlier steps: they are consumed. The batch of ``step`` itself
    stays until the rank moves on, for a replacement that re-executes the step.

    Attributes:
        hits, misses: counters of :meth:`batch` lookups (prefetch does not count).
    """

    def __init__(
        self,
        source: BatchSource | Callable[[], BatchSource],
        cache: ShmBatchCache,
        *,
        drop_consumed: bool = True,
    ) -> None:
        self.cache = cache
        self.drop_consumed = drop_consumed
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
        """``source.batch(step, dp_rank, dp_size, split=split)``, from the cache when present.

        For the ``train`` split (with ``drop_consumed``) this rank's cached batches of steps below
        ``step`` are deleted afterwards.
        """
        hit = self.cache.get(step, dp_rank, dp_size, split=split)
        if hit is not None:
            self.hits += 1
            out = hit
        else:
            self.misses += 1
            out = self._fill(step, dp_rank, dp_size, split)
        if self.drop_consumed and split == "train":
            self.cache.drop_before(step, dp_rank, dp_size, split=split)
        return out

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
