"""The last-resort durable tier: asynchronous ``torch.distributed.checkpoint`` snapshots.

Recovery normally moves state from a live replica (``state.send_state``). When no live
replica holds some shard (every copy lost at once), and only then, the job rolls back to the
newest complete snapshot written here. Off by default (``RecoveryConfig.durable_every``).

Layout under ``durable_dir``::

    step-000000049/shard-0/        DCP files of shard 0's state after step 49 (one writer per shard)
    step-000000049/shard-0.json    its manifest, written last (atomic rename): the snapshot is
                                   complete only when every shard's manifest exists

A snapshot's state is flattened the way the transfer flattens it (``state._encode_state``): the
DCP state dict holds the tensors as ``t0, t1, ...`` and the manifest holds the metadata skeleton
and the BLAKE3 digest of the tensors. Loading decodes the skeleton with the transfer's safe
decoder, allocates exactly the tensors it declares, lets DCP fill them, and checks the digest
before anything is handed to the model: a partial snapshot (no manifest) is never chosen and a
corrupt one raises ``IntegrityError`` instead of being loaded.

Saving is asynchronous: ``DurableWriter.save`` copies the state (a plain CPU copy: the staging)
in the training thread and writes it in a background thread; a save still running when the next
one is due makes that one skipped, never queued. The writer keeps the two newest snapshots.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointless.control.vocab import Event
from checkpointless.errors import IntegrityError

if TYPE_CHECKING:
    import torch

# torch and the transfer's codec are imported where used: the coordinator (``latest_complete``)
# runs in the launcher, which never imports torch

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{9})$")
KEEP = 2


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def _manifest(root: Path, step: int, shard: int) -> Path:
    return _step_dir(root, step) / f"shard-{shard}.json"


def latest_complete(root: str | Path, shards: int = 1) -> int | None:
    """The newest step whose snapshot has a manifest for every shard (None if there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = sorted(
        (int(m[1]) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()), reverse=True
    )
    for step in steps:
        if all(_manifest(root, step, s).is_file() for s in range(shards)):
            return step
    return None


def _write(root: Path, step: int, shard: int, meta: bytes, tensors: list[torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    from checkpointless.state import _hash_tensors

    target = _step_dir(root, step) / f"shard-{shard}"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({f"t{i}": t for i, t in enumerate(tensors)}, checkpoint_id=str(target), no_dist=True)
    manifest = {
        "format": "checkpointless-durable",
        "version": 1,
        "step": step,
        "shard": shard,
        "meta": meta.decode("ascii"),
        "tensors": len(tensors),
        "digest": _hash_tensors(tensors),
    }
    tmp = _manifest(root, step, shard).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, _manifest(root, step, shard))  # the snapshot exists from here on


#: ``on_event(kind, fields)``: a snapshot written, failed or skipped (``Event.DURABLE_WRITTEN``,
#: ``DURABLE_FAILED``, ``DURABLE_SKIPPED``)
OnEvent = Callable[[str, dict[str, Any]], None]


class DurableWriter:
    """One process's snapshots of its shard, every ``every`` committed steps, written in a thread.

    ``on_event`` hears of each outcome (called from the writer thread for a write), so that the
    job's report tells how fresh the durable tier is: a tier whose writes fail or keep being
    skipped would otherwise roll a job back further than its user thinks.
    """

    def __init__(self, root: str | Path, every: int, shard: int = 0, on_event: OnEvent | None = None) -> None:
        self.root, self.every, self.shard = Path(root), every, shard
        self._on_event = on_event
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        self.saved: list[int] = []
        self.skipped: list[int] = []

    def due(self, step: int) -> bool:
        return self.every > 0 and (step + 1) % self.every == 0

    def save(self, step: int, state: dict[str, Any]) -> bool:
        """Snapshot ``state`` (as of committed ``step``) in the background; False if one is still running."""
        if self._thread is not None and self._thread.is_alive():
            self.skipped.append(step)
            self._tell(Event.DURABLE_SKIPPED, step=step, shard=self.shard)
            return False
        from checkpointless.state import _encode_state

        meta, tensors = _encode_state(state)
        staged = [t.detach().to("cpu", copy=True).contiguous() for t in tensors]
        shard = self.shard

        def write() -> None:
            t0 = time.monotonic()
            try:
                _write(self.root, step, shard, meta, staged)
                self.saved.append(step)
                self._prune()
            except Exception as e:  # a full disk must not kill training: the tier is a fallback
                self.error = f"{type(e).__name__}: {e}"
                log.error("durable snapshot of step %d failed: %s", step, self.error)
                self._tell(Event.DURABLE_FAILED, step=step, shard=shard, error=self.error[:300])
                return
            size = sum(t.numel() * t.element_size() for t in staged)
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

    def _prune(self) -> None:
        steps = sorted(
            int(m[1]) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        )
        complete = [s for s in steps if _manifest(self.root, s, self.shard).is_file()]
        for s in complete[:-KEEP]:
            shutil.rmtree(_step_dir(self.root, s) / f"shard-{self.shard}", ignore_errors=True)
            _manifest(self.root, s, self.shard).unlink(missing_ok=True)
            try:
                _step_dir(self.root, s).rmdir()  # the last shard out removes the step
            except OSError:
                pass


def load(root: str | Path, step: int, shard: int = 0) -> dict[str, Any]:
    """The state of ``shard`` in the snapshot of ``step``, checked against its manifest.

    Raises ``IntegrityError`` if the manifest is missing or malformed, or the tensors' digest
    differs (a corrupt snapshot is never returned).
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from checkpointless.state import _decode_meta, _hash_tensors, _unflatten

    root = Path(root)
    where = f"durable snapshot of step {step}, shard {shard} ({_step_dir(root, step)})"
    try:
        manifest = json.loads(_manifest(root, step, shard).read_text())
        if manifest.get("format") != "checkpointless-durable" or manifest.get("version") != 1:
            raise IntegrityError(f"{where}: unknown manifest format")
        skeleton, refs = _decode_meta(str(manifest["meta"]).encode("ascii"))
        tensors = [torch.empty(r.shape, dtype=r.dtype) for r in refs]
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({f"t{i}": t for i, t in enumerate(tensors)},
                     checkpoint_id=str(_step_dir(root, step) / f"shard-{shard}"), no_dist=True)  # fmt: skip
    except IntegrityError as e:
        raise IntegrityError(f"{where}: {e}") from None
    except (OSError, ValueError, KeyError, RuntimeError, CheckpointException) as e:
        raise IntegrityError(f"{where}: cannot be read: {type(e).__name__}: {e}"[:400]) from None
    if _hash_tensors(tensors) != manifest.get("digest"):
        raise IntegrityError(f"{where}: its tensors do not match the manifest's digest (corrupt); not loaded")
    state: dict[str, Any] = _unflatten(skeleton, tensors)
    return state
