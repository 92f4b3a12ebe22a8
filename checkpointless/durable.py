"""The last-resort durable tier: asynchronous ``torch.distributed.checkpoint`` snapshots.

Recovery normally moves state from a live replica (``state.send_state``). When no live
replica holds some shard (every copy lost at once), and only then, the job rolls back to the
newest complete snapshot of its own run written here. Off by default (``RecoveryConfig.durable_every``).

Layout under ``durable_dir``::

    run-<run key>/                            one run's snapshots (``RunId``): never another's
      step-000000049/shard-0/                 DCP files of shard 0's state after step 49
      step-000000049/shard-0.json             its manifest, written last (atomic rename): the
                                              snapshot is complete only when every shard's exists

A snapshot belongs to a run: the run key hashes the job's shape and seed (``job_key``: what the
coordinator knows), the session's seed and the worker's command line (the model, the recipe, its
hyperparameters), and both keys are in every manifest. Two jobs sharing ``durable_dir`` never
restore nor prune each other's snapshots; a job started again with the same command line and config
names the same run on purpose (its trajectory is the same, bit for bit). The coordinator picks the
newest snapshot complete for every shard, of this job's shape and seed, at or before the highest
step the job committed (``latest_complete``); the ranks load their own run's newest one at or
before that step which verifies (``recovery_source.restore_durable``).

A snapshot's state is flattened the way the transfer flattens it (``state.codec.encode_state``): the
DCP state dict holds the tensors as ``t0, t1, ...`` and the manifest holds the metadata skeleton,
the digest of the tensors (``state.digests.snapshot_digest``) and the size of every data file. Loading decodes the skeleton
with the transfer's safe decoder, allocates exactly the tensors it declares, lets DCP fill them,
and checks the digest before anything is handed to the model: a partial snapshot (no manifest) is
never chosen, one whose files are gone or truncated is skipped without being read, and a corrupt
one raises ``IntegrityError`` instead of being loaded.

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
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointless.errors import IntegrityError
from checkpointless.protocol.vocab import Event

if TYPE_CHECKING:
    import torch

    from checkpointless.config import JobConfig

# torch and the transfer's codec are imported where used: the coordinator (``latest_complete``)
# runs in the launcher, which never imports torch

log = logging.getLogger(__name__)

_RUN_DIR = re.compile(r"^run-([0-9a-f]{16})$")
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_FORMAT, _VERSION = "checkpointless-durable", 2
KEEP = 2
_SLACK = 64 << 10  # bytes a snapshot takes beyond its tensors' (DCP's metadata), at least


def job_key(job: JobConfig) -> str:
    """What the coordinator knows of a run: the job's shape and seed (16 hex digits)."""
    text = json.dumps([job.workers, job.shards, job.seed, job.backend])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class RunId:
    """Which run a snapshot belongs to.

    ``job``: ``job_key`` (the coordinator filters by it); ``run``: also the session's seed and the
    worker's command line (names the run's directory; the ranks load only from it).
    """

    job: str
    run: str

    @staticmethod
    def of(job: JobConfig, seed: int, argv: Sequence[str] | None = None) -> RunId:
        """The run of this process: ``argv`` defaults to its command line (every rank's and spare's)."""
        key = job_key(job)
        text = json.dumps([key, seed, list(sys.argv if argv is None else argv)])
        return RunId(job=key, run=hashlib.sha256(text.encode()).hexdigest()[:16])

    def dir(self, root: str | Path) -> Path:
        return Path(root) / f"run-{self.run}"


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step:09d}"


def _manifest(run_dir: Path, step: int, shard: int) -> Path:
    return _step_dir(run_dir, step) / f"shard-{shard}.json"


def _steps(run_dir: Path) -> list[int]:
    """The steps with a directory in ``run_dir``, oldest first."""
    if not run_dir.is_dir():
        return []
    return sorted(int(m[1]) for p in run_dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def _one_line(e: BaseException) -> str:
    """``Type: message`` on one line; DCP's ``CheckpointException`` by the exception it wraps (its
    own text is a traceback per rank)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            e = inner[0]
    return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _problem(run_dir: Path, step: int, shard: int, job: str | None) -> tuple[str, str | None]:
    """Whether the snapshot of (``step``, ``shard``) can be a candidate, without reading its data.

    ``("ok", None)``; ``("absent", None)`` (no manifest: partial, or still being written);
    ``("foreign", None)`` (another job's shape or seed); ``("damaged", why)``: a malformed
    manifest, or a data file missing or not of the size written.
    """
    path = _manifest(run_dir, step, shard)
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return "absent", None
    except (OSError, ValueError) as e:
        return "damaged", f"shard {shard}: unreadable manifest: {_one_line(e)}"
    if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
        return "damaged", f"shard {shard}: not a manifest of this format"
    if manifest.get("version") != _VERSION or (job is not None and manifest.get("job") != job):
        return "foreign", None
    data = path.with_suffix("")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "damaged", f"shard {shard}: the manifest lists no files"
    for name, size in files.items():
        try:
            actual = (data / name).stat().st_size
        except OSError:
            return "damaged", f"shard {shard}: {name} is missing"
        if actual != size:
            return "damaged", f"shard {shard}: {name} has {actual} bytes, {size} were written"
    return "ok", None


def complete_steps(
    run_dir: str | Path,
    shards: int = 1,
    *,
    job: str | None = None,
    at_most: int | None = None,
    damaged: list[tuple[int, str]] | None = None,
) -> list[int]:
    """The steps of ``run_dir`` whose snapshot is complete and intact for every shard, newest first.

    ``job``: only snapshots of this ``job_key``; ``at_most``: none after this step. A snapshot whose
    manifests all exist but which fails ``_problem`` is appended to ``damaged`` as (step, why).
    """
    run_dir = Path(run_dir)
    found = []
    for step in reversed(_steps(run_dir)):
        if at_most is not None and step > at_most:
            continue
        verdicts = [_problem(run_dir, step, s, job) for s in range(shards)]
        kinds = {kind for kind, _ in verdicts}
        if kinds == {"ok"}:
            found.append(step)
        elif "absent" not in kinds and "foreign" not in kinds and damaged is not None:
            damaged.append((step, "; ".join(why for _, why in verdicts if why)))
    return found


def latest_complete(
    root: str | Path,
    shards: int = 1,
    *,
    job: str | None = None,
    at_most: int | None = None,
    damaged: list[tuple[int, str]] | None = None,
) -> int | None:
    """The newest step, over every run under ``root``, whose snapshot is complete and intact for every
    shard (``complete_steps``), None if there is none. The coordinator passes its ``job_key`` and the
    highest step the job committed: a newer snapshot, or one of another shape or seed, is another run's."""
    root = Path(root)
    if not root.is_dir():
        return None
    newest = [
        steps[0]
        for p in root.iterdir()
        if _RUN_DIR.match(p.name) and (steps := complete_steps(p, shards, job=job, at_most=at_most, damaged=damaged))
    ]  # fmt: skip
    return max(newest, default=None)


def _read(data: Path, meta: str, digest: object, where: str) -> Any:
    """The state in DCP directory ``data``, as ``meta`` declares it, checked against ``digest``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from checkpointless.state.codec import decode_meta, unflatten
    from checkpointless.state.digests import snapshot_digest

    try:
        skeleton, refs = decode_meta(meta.encode("ascii"))
        tensors = [torch.empty(r.shape, dtype=r.dtype) for r in refs]
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({f"t{i}": t for i, t in enumerate(tensors)}, checkpoint_id=str(data), no_dist=True)
    except IntegrityError as e:
        raise IntegrityError(" ".join(f"{where}: {e}".split())) from None
    except (OSError, ValueError, KeyError, RuntimeError, CheckpointException) as e:
        raise IntegrityError(f"{where}: cannot be read: {_one_line(e)}") from None
    if snapshot_digest(tensors) != digest:
        raise IntegrityError(f"{where}: its tensors do not match the manifest's digest (corrupt); not loaded")
    return unflatten(skeleton, tensors)


def _write(
    run_dir: Path, run: RunId, step: int, shard: int, meta: bytes, tensors: list[torch.Tensor]
) -> None:
    """Write, read back, then seal (step, shard): a step written before (a re-run after a rollback)
    stays complete and intact until the new data is checked, and is never complete without its data."""
    import torch.distributed.checkpoint as dcp

    from checkpointless.state.digests import snapshot_digest

    step_dir = _step_dir(run_dir, step)
    final, manifest = step_dir / f"shard-{shard}", _manifest(run_dir, step, shard)
    tag = f"{os.getpid()}-{threading.get_ident()}"
    tmp, sealing = step_dir / f".shard-{shard}.{tag}.tmp", step_dir / f".shard-{shard}.{tag}.json.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({f"t{i}": t for i, t in enumerate(tensors)}, checkpoint_id=str(tmp), no_dist=True)
        digest = snapshot_digest(tensors)
        _read(tmp, meta.decode("ascii"), digest, f"durable snapshot of step {step}, shard {shard}, read back")
        files = {p.name: p.stat().st_size for p in tmp.iterdir()}
        record = {
            "format": _FORMAT, "version": _VERSION, "job": run.job, "run": run.run, "step": step,
            "shard": shard, "meta": meta.decode("ascii"), "tensors": len(tensors), "digest": digest,
            "files": files,
        }  # fmt: skip
        sealing.write_text(json.dumps(record))
        manifest.unlink(missing_ok=True)  # from here until the rename below the step is not complete
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        os.replace(sealing, manifest)  # the snapshot exists from here on
    except BaseException:  # DCP's CheckpointException is one: no partial files stay behind
        shutil.rmtree(tmp, ignore_errors=True)
        sealing.unlink(missing_ok=True)
        if not manifest.is_file():
            shutil.rmtree(final, ignore_errors=True)
        try:
            step_dir.rmdir()
        except OSError:
            pass
        raise


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
                _write(self.dir, self.run, step, shard, meta, staged)
                self.saved.append(step)
                self._prune(shard)
            except (
                Exception,
                CheckpointException,
            ) as e:  # a full disk must not kill training: the tier is a fallback
                self.error = _one_line(e)
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
        steps = _steps(self.dir)
        mine = [s for s in steps if _manifest(self.dir, s, shard).is_file()]
        kept = set(mine[-keep:])
        every = complete_steps(self.dir, self.shards, job=self.run.job)
        if every:
            kept.add(every[0])
        if not kept:
            return
        for s in steps:
            if s in kept or s > max(kept):
                continue
            step_dir = _step_dir(self.dir, s)
            _manifest(self.dir, s, shard).unlink(missing_ok=True)  # incomplete first, then the data
            shutil.rmtree(step_dir / f"shard-{shard}", ignore_errors=True)
            for p in step_dir.glob(f".shard-{shard}.*.tmp"):  # a write cut short (the process killed)
                shutil.rmtree(p, ignore_errors=True)
                p.unlink(missing_ok=True)
            try:
                step_dir.rmdir()  # the last shard out removes the step
            except OSError:
                pass


def load(root: str | Path, step: int, shard: int, run: RunId) -> dict[str, Any]:
    """The state of ``shard`` in ``run``'s snapshot of ``step``, checked against its manifest.

    Raises ``IntegrityError`` (one line) if the manifest is missing, malformed or of another run,
    a data file is missing, or the tensors' digest differs (a corrupt snapshot is never returned).
    """
    run_dir = run.dir(root)
    where = f"durable snapshot of step {step}, shard {shard} ({_step_dir(run_dir, step)})"
    try:
        manifest = json.loads(_manifest(run_dir, step, shard).read_text())
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{where}: no readable manifest: {_one_line(e)}") from None
    if not isinstance(manifest, dict) or (manifest.get("format"), manifest.get("version")) != (
        _FORMAT,
        _VERSION,
    ):
        raise IntegrityError(f"{where}: unknown manifest format")
    if (manifest.get("job"), manifest.get("run")) != (run.job, run.run):
        raise IntegrityError(f"{where}: written by another run")
    kind, why = _problem(run_dir, step, shard, run.job)
    if kind != "ok":
        raise IntegrityError(f"{where}: {why or kind}")
    state: dict[str, Any] = _read(
        _step_dir(run_dir, step) / f"shard-{shard}", str(manifest.get("meta")), manifest.get("digest"), where
    )
    return state
