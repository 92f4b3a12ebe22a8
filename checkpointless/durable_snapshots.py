"""The durable tier's snapshots on disk (``durable.py`` writes them in the background): where
each one lies, its manifest, which ones are complete and intact, one written and read back, one loaded.

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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointless.errors import IntegrityError

if TYPE_CHECKING:
    import torch

    from checkpointless.config import JobConfig

# torch and the transfer's codec are imported where used: the coordinator (``latest_complete``)
# runs in the launcher, which never imports torch

_RUN_DIR = re.compile(r"^run-([0-9a-f]{16})$")
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_FORMAT, _VERSION = "checkpointless-durable", 2


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


def step_path(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step:09d}"


def manifest_path(run_dir: Path, step: int, shard: int) -> Path:
    return step_path(run_dir, step) / f"shard-{shard}.json"


def snapshot_steps(run_dir: Path) -> list[int]:
    """The steps with a directory in ``run_dir``, oldest first."""
    if not run_dir.is_dir():
        return []
    return sorted(int(m[1]) for p in run_dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def one_line(e: BaseException) -> str:
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
    path = manifest_path(run_dir, step, shard)
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return "absent", None
    except (OSError, ValueError) as e:
        return "damaged", f"shard {shard}: unreadable manifest: {one_line(e)}"
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
    for step in reversed(snapshot_steps(run_dir)):
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
        raise IntegrityError(f"{where}: cannot be read: {one_line(e)}") from None
    if snapshot_digest(tensors) != digest:
        raise IntegrityError(f"{where}: its tensors do not match the manifest's digest (corrupt); not loaded")
    return unflatten(skeleton, tensors)


def write_snapshot(
    run_dir: Path, run: RunId, step: int, shard: int, meta: bytes, tensors: list[torch.Tensor]
) -> None:
    """Write, read back, then seal (step, shard): a step written before (a re-run after a rollback)
    stays complete and intact until the new data is checked, and is never complete without its data."""
    import torch.distributed.checkpoint as dcp

    from checkpointless.state.digests import snapshot_digest

    step_dir = step_path(run_dir, step)
    final, manifest = step_dir / f"shard-{shard}", manifest_path(run_dir, step, shard)
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


def load(root: str | Path, step: int, shard: int, run: RunId) -> dict[str, Any]:
    """The state of ``shard`` in ``run``'s snapshot of ``step``, checked against its manifest.

    Raises ``IntegrityError`` (one line) if the manifest is missing, malformed or of another run,
    a data file is missing, or the tensors' digest differs (a corrupt snapshot is never returned).
    """
    run_dir = run.dir(root)
    where = f"durable snapshot of step {step}, shard {shard} ({step_path(run_dir, step)})"
    try:
        manifest = json.loads(manifest_path(run_dir, step, shard).read_text())
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{where}: no readable manifest: {one_line(e)}") from None
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
        step_path(run_dir, step) / f"shard-{shard}", str(manifest.get("meta")), manifest.get("digest"), where
    )
    return state
