"""The last-resort durable tier: asynchronous ``torch.distributed.checkpoint`` snapshots.

Recovery normally moves state from a live replica (``state.send_state``). When no live
replica holds some shard (every copy lost at once), and only then, the job rolls back to the
newest complete snapshot of its own run written here. Off by default (``RecoveryConfig.durable_every``).

The snapshots' layout, their run, their checks and their loading are ``durable_snapshots.py``.

Saving is asynchronous: ``DurableWriter.save`` copies the state (a plain CPU copy: the staging)
in the training thread and writes it in a background thread, into a temporary directory that
is read back and checked before it replaces the step's directory and the manifest seals it; a
save still running when the next one is due makes that one skipped, never queued. The writer
keeps the two newest snapshots of its shard (and the newest one complete for every shard), and
prunes down to the newest one before writing when the disk has no room for the next. A failed
write is reported (``Event.DURABLE_FAILED``) and leaves no files behind.
"""

from __future__ import annotations

import errno
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointless.durable_snapshots import (
    RunId,
    complete_steps,
    manifest_path,
    one_line,
    snapshot_steps,
    step_path,
    write_snapshot,
)
from checkpointless.protocol.vocab import Event

if TYPE_CHECKING:
    from checkpointless.config import JobConfig

log = logging.getLogger(__name__)

KEEP = 2
_SLACK = 64 << 10  # bytes a snapshot takes beyond its tensors' (DCP's metadata), at least


#: ``on_event(kind, fields)``: a snapshot written, failed or skipped (``Event.DURABLE_WRITTEN``,
#: ``DURABLE_FAILED``, ``DURABLE_SKIPPED``)
OnEvent = Callable[[str, dict[str, Any]], None]


class DurableWriter:
    """One process's snapshots of its shard of ``run``, every ``every`` committed steps, written in a thread.

    ``on_event`` hears of each outcome (called from the writer thread for a write), so that the
    job's report tells how fresh the durable tier is: a tier whose writes fail or keep being
    skipped would otherwise roll a job back further than its user thinks. ``shards``: the job's
    (pruning keeps the newest step complete for all of them).
    """

    def __init__(
        self, root: str | Path, every: int, run: RunId, shard: int = 0, shards: int = 1,
        on_event: OnEvent | None = None,
    ) -> None:  # fmt: skip
        self.root, self.every, self.run, self.shard, self.shards = Path(root), every, run, shard, shards
        self.dir = run.dir(root)
        self._on_event = on_event
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.saved: list[int] = []
        self.skipped: list[int] = []

    @classmethod
    def for_job(cls, job: JobConfig, seed: int, on_event: OnEvent | None = None) -> DurableWriter:
        """The writer of this process's run (``RunId.of``), as ``job.recovery`` configures it."""
        rc = job.recovery
        assert rc.durable_dir is not None
        return cls(
            rc.durable_dir, rc.durable_every, RunId.of(job, seed), shards=job.shards, on_event=on_event
        )

    def candidates(self, shards: int, at_most: int) -> list[int]:
        """The steps of this run's snapshots complete for ``shards`` shards, at most ``at_most``, newest first."""
        return complete_steps(self.dir, shards, job=self.run.job, at_most=at_most)

    def due(self, step: int) -> bool:
        return self.every > 0 and (step + 1) % self.every == 0

    def save(self, step: int, state: dict[str, Any], *, shard: int | None = None) -> bool:
        """Snapshot ``state`` (as of committed ``step``) in the background; False if one is still running.
        ``shard``: the shard this process holds now (a recovery may give it another)."""
        if shard is not None:
            self.shard = shard
        if self._thread is not None and self._thread.is_alive():
            self.skipped.append(step)
            self._tell(Event.DURABLE_SKIPPED, step=step, shard=self.shard)
            return False
        from torch.distributed.checkpoint.api import CheckpointException

        from checkpointless.state.codec import encode_state

        meta, tensors = encode_state(state)
        staged = [t.detach().to("cpu", copy=True).contiguous() for t in tensors]
        shard = self.shard
        size = sum(t.numel() * t.element_size() for t in staged)

        def write() -> None:
            t0 = time.monotonic()
            try:
                self._make_room(size + size // 20 + _SLACK)
                write_snapshot(self.dir, self.run, step, shard, meta, staged)
                self.saved.append(step)
                self._prune(shard)
            except (
                Exception,
                CheckpointException,
            ) as e:  # a full disk must not kill training: the tier is a fallback
                self.error = one_line(e)
                log.error("durable snapshot of step %d failed: %s", step, self.error)
                self._tell(Event.DURABLE_FAILED, step=step, shard=shard, error=self.error)
                return
            self._tell(
                Event.DURABLE_WRITTEN, step=step, shard=shard, seconds=time.monotonic() - t0, bytes=size
            )

        self._thread = threading.Thread(target=write, name=f"durable-{step}", daemon=True)
        self._thread.start()
        return True

    def _tell(self, kind: str, **fields: Any) -> None:
        if self._on_event is not None:
            try:
                self._on_event(kind, fields)
            except Exception as e:  # reporting must not break the tier (or the training loop)
                log.warning("durable tier: cannot report %s: %s", kind, e)

    def wait(self, timeout: float = 300.0) -> None:
        """Let a running save finish (at the end of the job), up to ``timeout`` seconds."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _make_room(self, need: int) -> None:
        """Prune down to the newest snapshot if the disk has fewer than ``need`` bytes free; raise
        ``OSError`` (ENOSPC) if it still has, rather than start a write that cannot complete."""
        where = self.root
        while not where.is_dir() and where != where.parent:
            where = where.parent
        free = shutil.disk_usage(where).free
        if free >= need:
            return
        self._prune(self.shard, keep=1)
        free = shutil.disk_usage(where).free
        if free < need:
            raise OSError(
                errno.ENOSPC, f"no room in {self.root}: {free} bytes free, the snapshot needs about {need}"
            )

    def _prune(self, shard: int, keep: int = KEEP) -> None:
        """Remove this shard's files of its run's older snapshots: all but the ``keep`` newest complete
        ones and the newest one complete for every shard; leftovers of failed or cut-short writes
        (no manifest) older than those too. Never another shard's files, nor another run's."""
        steps = snapshot_steps(self.dir)
        mine = [s for s in steps if manifest_path(self.dir, s, shard).is_file()]
        kept = set(mine[-keep:])
        every = complete_steps(self.dir, self.shards, job=self.run.job)
        if every:
            kept.add(every[0])
        if not kept:
            return
        for s in steps:
            if s in kept or s > max(kept):
                continue
            step_dir = step_path(self.dir, s)
            manifest_path(self.dir, s, shard).unlink(missing_ok=True)  # incomplete first, then the data
            shutil.rmtree(step_dir / f"shard-{shard}", ignore_errors=True)
            for p in step_dir.glob(f".shard-{shard}.*.tmp"):  # a write cut short (the process killed)
                shutil.rmtree(p, ignore_errors=True)
                p.unlink(missing_ok=True)
            try:
                step_dir.rmdir()  # the last shard out removes the step
            except OSError:
                pass
