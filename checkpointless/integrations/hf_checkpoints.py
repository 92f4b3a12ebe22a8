"""Rank 0's checkpoints under the launcher: where the best one is, as every rank names it
(``best_checkpoint_dir``), and one that rank 0 was writing when it died (after the step's commit,
outside any step: nobody executes that work again), written whole by the replacement that takes
rank 0 (``complete_checkpoint``). Imported by
``checkpointless.integrations.transformers`` once it has hidden torchrun's variables."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from checkpointless.integrations import _hf_compat as hf

if TYPE_CHECKING:
    from checkpointless.integrations.transformers import Trainer

log = logging.getLogger(__name__)


def best_checkpoint_dir(trainer: Trainer, trial: Any = None) -> str | None:
    """Rank 0's checkpoint of the best step so far (None before one)."""
    step = trainer.state.best_global_step
    run_dir = hf.output_dir(trainer, trial)
    return os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}") if step else None


def complete_checkpoint(
    trainer: Trainer, step: int, per_epoch: int, max_steps: int, model: Any, trial: Any
) -> None:
    """Rank 0 taken over after the commit of the step before ``step``: the checkpoint of
    ``step`` that the old rank 0 may have been writing when it died (after that commit, outside
    any step: nobody executes that work again) is written now if it is due and not whole.

    A checkpoint is whole once its ``trainer_state.json`` is there (``Trainer._save_checkpoint``
    writes it after the model, optimizer, scheduler and RNG states). Due: a directory begun for
    it, the save schedule (``DefaultFlowCallback``: ``save_steps``, an epoch's end, the last
    step) or the best step so far. The model, optimizer and scheduler written are those the
    rank received, equal to the old rank 0's; the per-process parts (RNG state, ``log_history``,
    the FLOs counted) are this process's."""
    from transformers.trainer_callback import DefaultFlowCallback, TrainerControl
    from transformers.trainer_utils import SaveStrategy

    if step <= 0 or trainer.args.save_strategy == SaveStrategy.NO:
        return
    folder = os.path.join(hf.output_dir(trainer, trial), f"{PREFIX_CHECKPOINT_DIR}-{step}")
    if os.path.exists(os.path.join(folder, "trainer_state.json")):
        return  # written whole before the rank was lost
    # as of that step (the loop's start stays the job's: every rank passes the same)
    kept = trainer.state.global_step, trainer.state.epoch
    trainer.state.global_step, trainer.state.epoch = step, step / per_epoch
    try:
        flow, control = DefaultFlowCallback(), TrainerControl()
        control = flow.on_step_end(trainer.args, trainer.state, control)
        if step % per_epoch == 0 or step >= max_steps:
            control = flow.on_epoch_end(trainer.args, trainer.state, control)
        if os.path.isdir(folder) or control.should_save or trainer.state.best_global_step == step:
            log.warning("[rank 0] writing %s again: the rank's last process died before it was whole", folder)
            trainer._save_checkpoint(model, trial)
    finally:
        trainer.state.global_step, trainer.state.epoch = kept
