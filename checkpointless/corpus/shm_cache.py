"""Node-local batch cache in shared memory, so a replacement process starts without the corpus.

Layout: one directory per job, ``<root>/checkpointless-<job_id>/`` (``root`` defaults to ``/dev/shm``,
else the system temp dir), holding one ``.npy`` file per batch (its name, contents and atomic
publication: :mod:`checkpointless.corpus.batch_files`); :meth:`ShmBatchCache.get` always returns
int64 tensors. The directory is created by the first write, never by opening a handle or reading,
so a process that starts after the owner's :meth:`~ShmBatchCache.cleanup` (a late spare) leaves
nothing behind; a handle that has seen the directory and then finds it gone treats that as a
cleanup and does not recreate it.

Space accounting: a file is charged what tmpfs really allocates for it (whole pages). Every handle
keeps the files it wrote, read or saw in memory, so a write costs no directory scan. To learn what
other processes on the node added or removed, a write rescans the directory now and then: at most
once every :attr:`ShmBatchCache.rescan_interval_s` seconds, and never more than 1% of the time (a
scan of 60,000 files takes ~0.5 s, so it then happens once a minute); the scan runs without holding
the handle's lock, so readers are not held up. :meth:`ShmBatchCache.nbytes` rescans on demand. When
the total exceeds ``budget_bytes`` the files with the lowest step go first. Between rescans a handle
does not see other processes' new files, so several writers can together exceed the budget by what
they wrote within one interval.

Consumption: :class:`~checkpointless.corpus.cached_dataset.CachedDataset` serves batches from the
cache first and drops a rank's consumed ones (:meth:`ShmBatchCache.drop_before`).

The cache is optional: when a write fails for want of space (``ENOSPC``, a short write: a container's
64 MB ``/dev/shm`` fills up) or for any other OS error, the batch is not cached, the partial file is
removed, one warning names the directory and its free space, and writes are skipped for
:attr:`ShmBatchCache.retry_after_s` seconds before the cache is tried again. Callers are unaffected:
:meth:`ShmBatchCache.put` returns False and ``CachedDataset`` serves the batch from its source.

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
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType

import numpy as np
import torch

from checkpointless.corpus.batch_files import (
    TMP_PREFIX,
    Batch,
    BatchEntry,
    Stream,
    batch_filename,
    compact,
    default_root,
    disk_bytes,
    pages,
    parse_entry,
    scan_directory,
)

__all__ = ["ShmBatchCache"]

log = logging.getLogger(__name__)

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9._-]+$")


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
        self.path = Path(root if root is not None else default_root()) / f"checkpointless-{job_id}"
        self._closed = False
        self._seen_dir = False  # this handle saw the directory exist: if it vanishes, it was cleaned up
        self._lock = threading.Lock()
        # In-memory accounting of the files this handle knows of (wrote, read, or found by a scan).
        self._entries: dict[str, BatchEntry] = {}
        self._used = 0
        self._by_step: list[tuple[int, str]] = []  # heap over all entries, for eviction (lazy deletes)
        self._streams: dict[Stream, list[tuple[int, str]]] = {}  # heap per stream, for drop_before
        self._next_scan = float("-inf")  # monotonic time from which a write may rescan
        self._scanned = False
        self._scanning = False
        self._removed_while_scanning: set[str] = set()
        self.write_failures = 0
        self._skip_writes_until = float("-inf")  # monotonic time: a write failed, retry from then
        self._warned = False

    filename = staticmethod(batch_filename)

    @property
    def closed(self) -> bool:
        """Whether :meth:`cleanup` ran on this handle: every later get is a miss, every put a no-op."""
        return self._closed

    # ------------------------------------------------------------------ in-memory accounting

    def _add(self, name: str, entry: BatchEntry) -> None:
        old = self._entries.get(name)
        if old is not None:
            self._used -= old.disk
        self._entries[name] = entry
        self._used += entry.disk
        if old is None or old.step != entry.step:
            heapq.heappush(self._by_step, (entry.step, name))
            heapq.heappush(self._streams.setdefault(entry.stream, []), (entry.step, name))
        self._compact_heaps()

    def _forget(self, name: str) -> BatchEntry | None:
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

    def _scan(self, added: float) -> dict[str, BatchEntry]:
        """Every batch file in the directory (one ``scandir``); removes stale temporary files."""
        entries, found = scan_directory(self.path, added)
        if found:
            self._seen_dir = True
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
        entry = parse_entry(name, st)
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
        arr = compact(np.stack([inputs.detach().cpu().numpy(), targets.detach().cpu().numpy()]))
        if pages(arr.nbytes) > self.budget_bytes:
            return False
        tmp = self.path / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.npy"
        try:
            st = self._write(tmp, arr)
            if st is None:  # the directory is gone: cleaned up (here or in another process)
                return False
            if disk_bytes(st) > self.budget_bytes:
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
        entry = parse_entry(name, st)
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
