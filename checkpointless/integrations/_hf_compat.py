"""Every private member of ``transformers`` (and ``accelerate``) that the Hugging Face integration
calls, overrides or sets, listed in ``PINS`` with the releases tested (STYLE.md items 18 and 23,
as ``checkpointless._compat`` does for torch's).

transformers moves its private names between releases without notice. The integration
(``transformers.py``, ``hf_parts.py``, ``hf_eval.py``) calls or sets one only through the functions
below, one per member; the methods it overrides (``Trainer._save_checkpoint``,
``_finalize_training``, ``_inner_training_loop``, and ``save_model``'s ``_internal_call``) keep
their names there, since HF calls them by name. tests/unit/test_integration_pins.py pins each entry
of ``PINS`` (it exists, is callable where called, takes the parameters passed; an override's
parameters are HF's; an attribute is assigned where HF's own loop assigns it), fails when a
release changes one, and checks that the integration touches no other private member of HF's.

This module imports neither library: ``transformers.py`` hides torchrun's variables before
transformers is first imported.
"""

from __future__ import annotations

from typing import Any

from checkpointless._compat import Pin

TESTED: dict[str, tuple[int, int]] = {"transformers": (5, 25), "accelerate": (1, 16)}
"""The releases (major, minor) the pins ran on: those pyproject.toml's ``transformers`` extra
(transformers>=5.20,<6, accelerate>=1.10,<2) installs for CI."""

_T = "transformers:Trainer"

PINS: tuple[Pin, ...] = (
    # called (through the functions below)
    Pin(_T, "_get_train_sampler", "call", ("train_dataset",)),
    Pin(_T, "_get_output_dir", "call", ("trial",)),
    Pin(_T, "_remove_unused_columns", "call", ("dataset", "description")),
    Pin(_T, "_get_collator_with_removed_columns", "call", ("data_collator", "description")),
    Pin(_T, "_init_training_state", "call",
        ("max_steps", "num_update_steps_per_epoch", "num_train_epochs", "resume_from_checkpoint", "trial")),
    Pin(_T, "_prepare_for_training", "call", ("max_steps", "train_dataloader", "resume_from_checkpoint")),
    Pin(_T, "_evaluate", "call", ("trial", "ignore_keys_for_eval", "skip_scheduler")),
    Pin(_T, "_get_num_items_in_batch", "call", ("batch_samples", "device")),
    Pin(_T, "_clip_grad_norm", "call", ("model",)),
    Pin(_T, "_get_grad_norm", "call", ("model", "grad_norm")),
    Pin(_T, "_get_learning_rate", "call", ()),
    Pin(_T, "_track_num_input_tokens", "call", ("inputs",)),
    Pin(_T, "_maybe_log_save_evaluate", "call",
        ("tr_loss", "grad_norm", "model", "trial", "epoch", "ignore_keys_for_eval", "start_time", "learning_rate")),
    Pin(_T, "_wrap_model", "call", ("model", "training")),
    Pin(_T, "_prepare_input", "call", ("data",)),
    Pin("accelerate.state:GradientState", "_set_sync_gradients", "call", ("sync_gradients",)),
    # overridden by checkpointless.integrations.transformers.Trainer (HF calls them by name)
    Pin(_T, "_save_checkpoint", "override", ("model", "trial")),
    Pin(_T, "_finalize_training", "override", ("trial", "num_train_samples", "start_time")),
    Pin(_T, "_inner_training_loop", "override",
        ("batch_size", "args", "resume_from_checkpoint", "trial", "ignore_keys_for_eval")),
    Pin(_T, "save_model", "override", ("output_dir", "_internal_call")),
    # attributes: read, or set up as HF's own _inner_training_loop sets them up
    Pin(_T, "_train_batch_size", "attribute", where="transformers:Trainer.__init__"),
    Pin(_T, "_tr_loss", "attribute", where="transformers:Trainer._inner_training_loop"),
    Pin(_T, "_total_loss_scalar", "attribute", where="transformers:Trainer._inner_training_loop"),
    Pin(_T, "_globalstep_last_logged", "attribute", where="transformers:Trainer._inner_training_loop"),
    Pin(_T, "_initial_num_input_tokens_seen", "attribute", where="transformers:Trainer._inner_training_loop"),
    Pin(_T, "_initial_global_step", "attribute", where="transformers:Trainer._inner_training_loop"),
)  # fmt: skip


# -- called ---------------------------------------------------------------------------------------


def train_sampler(trainer: Any, dataset: Any) -> Any:
    """``Trainer._get_train_sampler(dataset)``: the sampler of the train ``DataLoader`` (None: in order)."""
    return trainer._get_train_sampler(dataset)


def output_dir(trainer: Any, trial: Any) -> str:
    """``Trainer._get_output_dir(trial=...)``: the run's directory, where its checkpoints go."""
    result: str = trainer._get_output_dir(trial=trial)
    return result


def remove_unused_columns(trainer: Any, dataset: Any, description: str) -> Any:
    """``Trainer._remove_unused_columns``: a ``datasets.Dataset`` without the columns the model does not take."""
    return trainer._remove_unused_columns(dataset, description=description)


def collator_with_removed_columns(trainer: Any, collator: Any, description: str) -> Any:
    """``Trainer._get_collator_with_removed_columns``: the collator, dropping the columns the model does not take."""
    return trainer._get_collator_with_removed_columns(collator, description=description)


def init_training_state(
    trainer: Any, max_steps: int, per_epoch: int, epochs: int, resume_from_checkpoint: Any, trial: Any
) -> Any:
    """``Trainer._init_training_state``: the ``TrainerState`` of a training run (resumed from a checkpoint)."""
    return trainer._init_training_state(max_steps, per_epoch, epochs, resume_from_checkpoint, trial)


def prepare_for_training(trainer: Any, max_steps: int, dataloader: Any, resume_from_checkpoint: Any) -> Any:
    """``Trainer._prepare_for_training``: ``(model, train_dataloader)`` with the optimizer and scheduler made."""
    return trainer._prepare_for_training(max_steps, dataloader, resume_from_checkpoint)


def evaluate(trainer: Any, trial: Any, ignore_keys_for_eval: Any, skip_scheduler: bool) -> Any:
    """``Trainer._evaluate``: an evaluation of the evaluation strategy (its metrics, the callbacks told)."""
    return trainer._evaluate(trial, ignore_keys_for_eval, skip_scheduler=skip_scheduler)


def num_items_in_batch(trainer: Any, micro: list[Any], device: Any) -> Any:
    """``Trainer._get_num_items_in_batch``: the items (tokens) the step's loss is averaged over."""
    return trainer._get_num_items_in_batch(micro, device)


def clip_grad_norm(trainer: Any, model: Any) -> Any:
    """``Trainer._clip_grad_norm``: clip to ``max_grad_norm``, the norm before clipping."""
    return trainer._clip_grad_norm(model)


def grad_norm(trainer: Any, model: Any, norm: Any) -> Any:
    """``Trainer._get_grad_norm``: the norm to log."""
    return trainer._get_grad_norm(model, grad_norm=norm)


def learning_rate(trainer: Any) -> Any:
    """``Trainer._get_learning_rate``: the learning rate to log."""
    return trainer._get_learning_rate()


def track_num_input_tokens(trainer: Any, inputs: Any) -> None:
    """``Trainer._track_num_input_tokens``: ``state.num_input_tokens_seen`` counts ``inputs``."""
    trainer._track_num_input_tokens(inputs)


def maybe_log_save_evaluate(
    trainer: Any, grad_norm: Any, model: Any, trial: Any, epoch: int, ignore_keys_for_eval: Any,
    start_time: float, learning_rate: Any,
) -> None:  # fmt: skip
    """``Trainer._maybe_log_save_evaluate``: the logging, evaluation and save strategies after a step
    (the loss logged is the loop's, ``train_loss``)."""
    trainer._maybe_log_save_evaluate(
        trainer._tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
        learning_rate=learning_rate,
    )  # fmt: skip


def wrap_model(trainer: Any, model: Any) -> Any:
    """``Trainer._wrap_model(model, training=False)``: the model as the evaluation loop runs it."""
    return trainer._wrap_model(model, training=False)


def prepare_input(trainer: Any, data: Any) -> Any:
    """``Trainer._prepare_input``: ``data`` on the Trainer's device."""
    return trainer._prepare_input(data)


def set_sync_gradients(trainer: Any, sync: bool) -> None:
    """``GradientState._set_sync_gradients`` of the Trainer's accelerator: whether this micro-batch's
    backward is the step's last (accelerate's gradient accumulation and its DataLoader read it)."""
    trainer.accelerator.gradient_state._set_sync_gradients(sync)


# -- attributes -----------------------------------------------------------------------------------


def train_batch_size(trainer: Any) -> int:
    """``Trainer._train_batch_size``: the per-device train batch size."""
    result: int = trainer._train_batch_size
    return result


def start_loop(trainer: Any, loss: Any) -> None:
    """The counters HF's ``_inner_training_loop`` sets up before its first step, which
    ``_maybe_log_save_evaluate`` reads: the loss accumulated since the last log (``loss``, a zero
    tensor on the device), the totals and the step and tokens the run started at."""
    trainer._initial_num_input_tokens_seen = trainer.state.num_input_tokens_seen
    trainer._initial_global_step = trainer.state.global_step
    trainer._tr_loss = loss
    trainer._total_loss_scalar = 0.0
    trainer._globalstep_last_logged = trainer.state.global_step


def add_train_loss(trainer: Any, loss: Any) -> None:
    """A committed step's loss into ``Trainer._tr_loss`` (in place, as HF's loop adds it)."""
    trainer._tr_loss += loss
