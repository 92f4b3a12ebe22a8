"""Every private member of Lightning that ``CheckpointlessStrategy`` calls, replaces or sets, listed
in ``PINS`` with the releases tested (STYLE.md items 18 and 23, as ``checkpointless._compat`` does
for torch's).

Lightning moves its private names between releases without notice. The strategy's modules reach
one only through the functions below, one per member (or per pair patched together);
tests/unit/test_integration_pins.py pins each entry of ``PINS`` (it exists, is callable where
called, takes the parameters passed; a replaced method's parameters are Lightning's; an attribute
is assigned where Lightning assigns it), fails when a release changes one, and checks that the
strategy's modules touch no other private member of Lightning's. Nothing of Fabric's private API
is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from checkpointless._compat import Pin

TESTED: dict[str, tuple[int, int]] = {"lightning": (2, 6)}
"""The releases (major, minor) the pins ran on: what pyproject.toml's ``lightning`` extra
(lightning>=2.5,<2.7, ``SUPPORTED``) installs for CI."""

_LOOPS = "lightning.pytorch.loops"
_CONNECTORS = "lightning.pytorch.trainer.connectors"

PINS: tuple[Pin, ...] = (
    Pin(f"{_LOOPS}.training_epoch_loop:_TrainingEpochLoop", "_num_ready_batches_reached", "call"),
    Pin(f"{_LOOPS}.fit_loop:_FitLoop", "_should_accumulate", "call"),
    Pin(f"{_LOOPS}.training_epoch_loop:_TrainingEpochLoop", "_broadcast_sigterm_tensor", "override"),
    Pin(f"{_CONNECTORS}.signal_connector:_SignalConnector", "_sigterm_notifier_fn", "override", ("signum", "_")),
    Pin("lightning.pytorch.callbacks:ModelCheckpoint", "_link_checkpoint", "override",
        ("trainer", "filepath", "linkpath")),
    Pin(f"{_CONNECTORS}.checkpoint_connector:_CheckpointConnector", "dump_checkpoint", "call", ("weights_only",)),
    Pin("lightning.pytorch:Trainer", "_signal_connector", "attribute", where="lightning.pytorch:Trainer.__init__"),
    Pin("lightning.pytorch:Trainer", "_checkpoint_connector", "attribute",
        where="lightning.pytorch:Trainer.__init__"),
    Pin(f"{_CONNECTORS}.checkpoint_connector:_CheckpointConnector", "_loaded_checkpoint", "attribute",
        where=f"{_CONNECTORS}.checkpoint_connector:_CheckpointConnector.__init__"),
    Pin(f"{_LOOPS}.fit_loop:_FitLoop", "_combined_loader", "attribute", where=f"{_LOOPS}.fit_loop:_FitLoop.__init__"),
    Pin("lightning.pytorch:Trainer", "_val_check_time_interval", "attribute",
        where="lightning.pytorch.trainer.setup:_init_debugging_flags"),
    Pin("lightning.fabric.loggers.csv_logs:CSVLogger", "_version", "attribute",
        where="lightning.fabric.loggers.csv_logs:CSVLogger.__init__"),
    Pin(f"{_LOOPS}.optimization.automatic:Closure", "_zero_grad_fn", "attribute",
        where=f"{_LOOPS}.optimization.automatic:Closure.__init__"),
    Pin("lightning.pytorch:LightningModule", "_on_before_batch_transfer", "call", ("batch", "dataloader_idx")),
)  # fmt: skip
"""``_CheckpointConnector.dump_checkpoint`` is public on a private class (reached through
``Trainer._checkpoint_connector``)."""


def ready_batches_reached(trainer: Any) -> bool:
    """``_TrainingEpochLoop._num_ready_batches_reached()``: the epoch's last batch is under way."""
    return bool(trainer.fit_loop.epoch_loop._num_ready_batches_reached())


def should_accumulate(trainer: Any) -> bool:
    """``_FitLoop._should_accumulate()``: this batch's gradients accumulate (not an optimizer step's
    last micro-batch): Lightning's own test."""
    return bool(trainer.fit_loop._should_accumulate())


def mute_sigterm_broadcast(trainer: Any, notifier: Callable[[Any], Callable[[int, Any], None]]) -> None:
    """No broadcast of Lightning's SIGTERM flag over the default group: the epoch loop's
    ``_broadcast_sigterm_tensor`` does nothing, and the signal connector's
    ``_sigterm_notifier_fn`` becomes ``notifier(connector)`` (each where the Trainer has it)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        epoch_loop._broadcast_sigterm_tensor = lambda: None
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None and hasattr(connector, "_sigterm_notifier_fn"):
        connector._sigterm_notifier_fn = notifier(connector)


def forget_loaded_checkpoint(trainer: Any) -> None:
    """Nothing left for the Trainer to load of the checkpoint ``fit(ckpt_path=...)`` read
    (``_CheckpointConnector._loaded_checkpoint``)."""
    trainer._checkpoint_connector._loaded_checkpoint = {}


def dump_checkpoint(trainer: Any, weights_only: bool) -> dict[str, Any]:
    """``Trainer._checkpoint_connector.dump_checkpoint``: the checkpoint Lightning saves now."""
    checkpoint: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(weights_only=weights_only)
    return checkpoint


def drop_train_iterator(trainer: Any) -> None:
    """The fit loop's train iterator dropped (``_FitLoop._combined_loader``): made again at fit's start."""
    trainer.fit_loop._combined_loader = None


def val_check_time_interval(trainer: Any) -> Any:
    """``Trainer._val_check_time_interval``: a time-based ``val_check_interval`` (None if not)."""
    return getattr(trainer, "_val_check_time_interval", None)


def wrap_link_checkpoint(callback: Any, wrap: Callable[[Callable[..., None]], Callable[..., None]]) -> None:
    """A ``ModelCheckpoint``'s ``_link_checkpoint`` (a static method: trainer, target, link path)
    replaced on the instance by ``wrap(its own)``, once."""
    if "_link_checkpoint" not in vars(callback):
        callback._link_checkpoint = wrap(callback._link_checkpoint)


def logger_version(logger: Any) -> Any:
    """A logger's version (the directory it writes to) if it has one to set (CSV, TensorBoard: their
    ``_version``)."""
    return logger.version if hasattr(logger, "_version") and isinstance(logger.version, int | str) else None


def set_logger_version(logger: Any, version: Any) -> None:
    """Set a logger's version (``_version``), where it has one."""
    if version is not None and hasattr(logger, "_version"):
        logger._version = version


def zero_grad_inside(closure: Any) -> bool:
    """Whether ``closure`` is Lightning's automatic-optimization ``Closure`` (its ``zero_grad``
    can be left out: ``without_zero_grad``), not a wrapper of a ``LightningModule.optimizer_step``
    of the script's own."""
    return hasattr(closure, "_zero_grad_fn")


@contextlib.contextmanager
def without_zero_grad(closure: Any) -> Iterator[None]:
    """Lightning's ``Closure`` runs without its ``zero_grad`` inside (``Closure._zero_grad_fn``
    None, put back after): a later share's pass adds its gradients to the earlier ones'."""
    zero_grad, closure._zero_grad_fn = closure._zero_grad_fn, None
    try:
        yield
    finally:
        closure._zero_grad_fn = zero_grad


def before_batch_transfer(module: Any, batch: Any) -> Any:
    """``LightningModule._on_before_batch_transfer``: the ``on_before_batch_transfer`` hook (the
    module's or the DataModule's), as the training loop calls it on a batch it fetched."""
    return module._on_before_batch_transfer(batch, dataloader_idx=0)
