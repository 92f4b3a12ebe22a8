"""Lightning's own progress, moved with the training state: what a replacement loads to enter the
Trainer's loop at the step under way, the way Lightning resumes a mid-epoch checkpoint."""

from __future__ import annotations

import copy
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from checkpointless.integrations.lightning import _compat as host


class Progress:
    """Lightning's own progress at the start of the step under way, registered with the session as
    ``lightning``: the fit loop's ``state_dict`` (its counters) as a checkpoint saved at the previous
    batch's ``on_train_batch_end`` holds it (Lightning's own mid-epoch resume), and each callback's
    ``state_dict`` (by ``state_key``) at this step's start, after the previous step's validation
    and epoch end. With gradient accumulation the step starts at its first micro-batch. Equal on
    every replica (the replicas compare it with the rest of the state). It adds a callback to the
    Trainer (the last one) to see ``on_train_batch_end``."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {"step": -1}
        self.received = False  # loaded from a peer: this process is a replacement
        self._loops: dict[str, Any] | None = None  # at the last on_train_batch_end
        self._saves: list[dict[str, Any]] = []  # the checkpoints saved since the last capture (``saved``)

        self.callback = _BatchEnd(self)

    def resumed(self, loops: dict[str, Any] | None) -> None:
        """The fit loop's state in the checkpoint ``fit(ckpt_path=...)`` resumes from: what a
        replacement joining at the first step after it loads, as this process did (a replacement's
        own, received from its peer, takes its place)."""
        if not self.received and loops is not None:
            self._loops = copy.deepcopy(loops)

    def saved(self, checkpoint: dict[str, Any], path: str) -> None:
        """A checkpoint Lightning saves (every rank calls the strategy's ``save_checkpoint``; rank 0
        writes): its path and what it holds besides the tensors, which are the model's and the
        optimizer's at the next step's start (``SAVED_KEYS``). The next ``capture`` takes these
        (and the removals, ``removed``) into the snapshot, in their order, so that a replacement of
        rank 0 can finish what its predecessor died doing (``CheckpointlessStrategy._complete_saves``)."""
        rest = {k: checkpoint[k] for k in SAVED_KEYS if k in checkpoint}
        self._saves.append({"path": path, "weights_only": "optimizer_states" not in checkpoint,
                            "rest": copy.deepcopy(rest)})  # fmt: skip

    def closing(self, trainer: Any) -> None:
        """After the last step (every rank, before ``Session.finish``; the strategy's
        ``on_train_end``, after the callbacks'): the saves and removals since the last step began
        (the last epoch's checkpoint) join the snapshot, with the Trainer as ``fit`` leaves it (its
        loops' counters, the callbacks' and loggers' state after the last epoch's end, whether it
        stopped early): the state a replacement joining after the last step receives (``finished``)."""
        self.snapshot["saves"] = [*self.snapshot.get("saves", []), *self._saves]
        self._saves = []
        self.snapshot["final"] = {
            "loops": copy.deepcopy(trainer.fit_loop.state_dict()),
            "callbacks": _callback_states(trainer),
            "loggers": _logger_versions(trainer),
            "stopped": bool(trainer.should_stop),
        }

    def finished(self, trainer: Any) -> None:
        """A replacement joining after the last step: the Trainer as ``fit`` left it on its source
        (``closing``). Its fit loop is then done, so ``fit`` returns at once, as Lightning's does
        when resumed from a checkpoint saved at training's end, and the script's code after ``fit``
        runs in this process as it would have in the lost one."""
        final = self.snapshot.get("final")
        if final is None:
            raise RuntimeError("the state received after the last step lacks the Trainer's final state")
        trainer.fit_loop.load_state_dict(copy.deepcopy(final["loops"]))
        _load_callbacks(trainer, final["callbacks"])
        _set_logger_versions(trainer, final["loggers"])
        trainer.should_stop = final["stopped"]
        # Lightning's loop counts a finished training as no restart, and would run the sanity check's
        # validation batches before finding its loop done: they ran at fit's start, not now
        trainer.fit_loop.epoch_loop.val_loop.restarting = True

    def removed(self, path: str) -> None:
        """A checkpoint Lightning removes (an outdated top-k one: every rank asks, rank 0 removes)."""
        self._saves.append({"path": path, "removed": True})

    def linked(self, target: str, path: str) -> None:
        """A link Lightning makes (``ModelCheckpoint(save_last="link")``: ``path``, the last
        checkpoint, to ``target``, the last one saved; every rank asks, rank 0 links)."""
        self._saves.append({"path": path, "link": target})

    def files(self) -> dict[str, dict[str, Any] | None]:
        """What the saves, removals and links of the snapshot leave on disk: per path, its last save
        or link (or None where the last thing done to it was its removal)."""
        last: dict[str, dict[str, Any] | None] = {}
        for op in self.snapshot.get("saves", []):
            last[op["path"]] = None if op.get("removed") else op
        return last

    def capture(self, trainer: Any) -> None:
        """At the start of step ``trainer.global_step`` (the strategy's ``on_train_batch_start`` of
        the step's first micro-batch)."""
        self.snapshot = {
            "step": trainer.global_step,
            "loops": self._loops,
            "at_start": copy.deepcopy(trainer.fit_loop.state_dict()),
            "callbacks": _callback_states(trainer),
            "loggers": _logger_versions(trainer),
            "saves": self._saves,
        }
        self._saves = []

    def restore(self, trainer: Any) -> None:
        """Put the Trainer where the snapshot was taken, as Lightning resumes from a checkpoint saved
        at the previous batch's end (``align`` finishes it at the step's start)."""
        self._loops = self.snapshot["loops"]  # this step's snapshot holds it again, as its source's
        self._saves = list(self.snapshot.get("saves", []))  # and its saves
        if self._loops is not None:  # None: the first step, nothing to resume
            trainer.fit_loop.load_state_dict(copy.deepcopy(self._loops))
        _load_callbacks(trainer, self.snapshot["callbacks"])
        _set_logger_versions(trainer, self.snapshot["loggers"])  # rank 0 logs on in the same directory

    def align(self, trainer: Any) -> None:
        """At a replacement's first ``on_train_batch_start``: every counter of the Trainer's loops
        as its source's at that point. Lightning's resume leaves some off by one (the epoch's
        ``ready``/``started`` after a resume at an epoch's last batch, the batch's ``ready``); they
        count, they do not steer this step, and the replicas compare them."""
        for key, value in copy.deepcopy(self.snapshot["at_start"]).items():
            *path, name = key.split(".")
            loop = trainer.fit_loop
            for attr in path:
                loop = getattr(loop, attr)
            if name != "state_dict":
                getattr(loop, name).load_state_dict(value)
            elif loop is not trainer.fit_loop:  # the fit loop's own is its loaders' state: none here
                loop.on_load_checkpoint(value)

    def state_dict(self) -> dict[str, Any]:
        return self.snapshot

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.snapshot = state
        self.received = True


SAVED_KEYS = ("epoch", "global_step", "loops", "callbacks", "lr_schedulers")
"""What ``Progress.saved`` keeps of a checkpoint Lightning saves: its counters, the callbacks' and
the LR schedulers' state as they were then. The rest (the model's and the optimizer's tensors, the
precision plugin's state, the hyperparameters) is what a dump at the next step's start holds."""


class Metrics:
    """The Trainer's metrics as ``fit`` leaves them (``callback_metrics``, ``logged_metrics``,
    ``progress_bar_metrics``), registered as ``lightning_metrics``: taken after the last step and
    moved to a replacement that joins after it, whose script reads them after ``fit`` as the lost
    rank's would. They are a rank's own (``self.log`` without ``sync_dist`` logs each rank's value),
    so the replicas do not compare them (``per_rank``) and the replacement has its source's."""

    per_rank = True

    def __init__(self) -> None:
        self.metrics: dict[str, dict[str, Any]] = {}

    def capture(self, trainer: Any) -> None:
        def plain(metrics: dict[str, Any]) -> dict[str, Any]:
            return {
                k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                for k, v in metrics.items()
            }

        self.metrics = {
            "callback": plain(trainer.callback_metrics),
            "logged": plain(trainer.logged_metrics),
            "progress_bar": plain(trainer.progress_bar_metrics),
        }

    def restore(self, trainer: Any) -> None:
        """Into the Trainer's own dictionaries (its properties return them)."""
        trainer.callback_metrics.update(self.metrics.get("callback", {}))
        trainer.logged_metrics.update(self.metrics.get("logged", {}))
        trainer.progress_bar_metrics.update(self.metrics.get("progress_bar", {}))

    def state_dict(self) -> dict[str, Any]:
        return self.metrics

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.metrics = state


def _callback_states(trainer: Any) -> dict[str, Any]:
    """Each callback's ``state_dict`` (by ``state_key``), the empty ones left out."""
    callbacks = {}
    for cb in trainer.callbacks:
        state = cb.state_dict()
        if state:
            callbacks[cb.state_key] = copy.deepcopy(state)
    return callbacks


def _load_callbacks(trainer: Any, callbacks: dict[str, Any]) -> None:
    for cb in trainer.callbacks:
        if cb.state_key in callbacks:
            state = copy.deepcopy(callbacks[cb.state_key])
            if isinstance(state.get("dirpath"), str) and hasattr(cb, "dirpath"):
                cb.dirpath = state["dirpath"]  # ModelCheckpoint's: its rank 0's, not resolved anew
            cb.load_state_dict(state)


def _logger_versions(trainer: Any) -> list[Any]:
    return [host.logger_version(logger) for logger in trainer.loggers]


def _set_logger_versions(trainer: Any, versions: list[Any]) -> None:
    for logger, version in zip(trainer.loggers, versions, strict=False):
        host.set_logger_version(logger, version)


class _BatchEnd(Callback):
    """Keeps the fit loop's state at the ``on_train_batch_end`` that ends an optimizer step (each
    batch's without accumulation) for ``Progress`` (no state of its own)."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if not host.should_accumulate(trainer):  # the next step starts at the next batch
            self._progress._loops = copy.deepcopy(trainer.fit_loop.state_dict())
