"""A dataset served from the node's batch cache first (:class:`CachedDataset`), so a replacement
process whose batches are all cached never opens the corpus.

Consumption: :class:`CachedDataset` drops a rank's ``train`` batches once that rank asks for a
later step (:meth:`~checkpointless.corpus.shm_cache.ShmBatchCache.drop_before`). The batch of the
step being served is kept, because a replacement process that re-executes a failed step reads that
same ``(step, rank)`` batch; evaluation (``val``) batches are reused and only evicted by the budget.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

from checkpointless.corpus.batch_files import Batch
from checkpointless.corpus.shm_cache import ShmBatchCache

__all__ = ["BatchSource", "CachedDataset"]

log = logging.getLogger(__name__)


@runtime_checkable
class BatchSource(Protocol):
    """Anything with :meth:`checkpointless.corpus.TokenDataset.batch`'s signature and purity."""

    def batch(self, step: int, dp_rank: int, dp_size: int, *, split: str = "train") -> Batch: ...


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
                if self._stop.is_set() or self.cache.closed:
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
