"""A Hugging Face ``Trainer`` made checkpointless with one changed line.

::

    from checkpointless.integrations.transformers import Trainer   # was: from transformers import Trainer
    # (or Seq2SeqTrainer, for transformers.Seq2SeqTrainer)

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=ds, ...)
    trainer.train()

launched with ``checkpointless launch --workers N --spares K -- python script.py``. Run with plain
``python script.py`` (no launcher) the class is ``transformers.Trainer`` unchanged.

Under the launcher the training loop is the ``Trainer``'s own pieces (``training_step`` and
``compute_loss`` with its autocast, gradient clipping, the optimizer and LR scheduler it creates,
the callbacks, with their ``on_epoch_begin``/``on_epoch_end`` at the steps that start and end an
epoch, ``_maybe_log_save_evaluate`` for the logging, evaluation and save strategies) put together in
a ``Session``'s step loop:

- an optimizer step is the re-executable block (``session.attempt()``): its ``gradient_accumulation_steps``
  micro-batches' forward and backward passes (all but the last under ``session.no_sync()``), the
  gradient reduction, clipping (after the reduction, as DDP clips), the optimizer and scheduler
  steps. A failed step is executed again after the recovery; its state (model, optimizer, LR
  scheduler, gradient scaler, the ``Trainer``'s best metric and the callbacks' exportable state:
  ``TrainerProgress``) moves to a replacement peer-to-peer.
- the data: micro-batch ``m`` of the job (``m = step * gradient_accumulation_steps + i``) is this
  share's part of a global batch of ``per_device_train_batch_size x S`` samples (S the job's
  shares: ``--shares``, by default the starting workers; one share a rank at that size) drawn by
  ``session.loader`` (an epoch's order is a permutation from the seed and the epoch, ``data_seed``
  or ``seed``): a function of the step, so a replacement and a re-executed step read what the failed
  attempt read, and a resumed run (``resume_from_checkpoint``) starts at its step with no skipping.
- elastic sizes: a replica holding several shares runs each share's micro-batches in turn
  (``session.shares()``, ``hf_parts.read_step``), ``num_items_in_batch`` counting every share's.
- ``accelerate`` runs in its single-process mode on every rank: it never starts an ``env://`` process
  group of its own (the gradients are reduced by the session, over the job's generation). The
  evaluations of the evaluation strategy (and ``eval_on_start``) are shared between the ranks:
  each computes its contiguous share of the batches and every rank then runs HF's evaluation loop
  over all of their outputs, so the metrics are the whole set's as one process computes them, at
  1/ranks of the work; a peer lost in the middle changes nothing (``hf_eval``). ``evaluate``
  before or after ``train`` runs on each rank over the whole set. Only rank 0 writes checkpoints and the model
  (``save_steps``, ``save_model``). A checkpoint rank 0 was writing when it died (after the step's
  commit: nobody executes that again) is written whole by the replacement that takes rank 0
  (``hf_checkpoints.complete_checkpoint``; the private members of HF's it calls, overrides or sets are
  listed and pinned in ``_hf_compat``). What accelerate's gathers gave the step under ``torchrun`` the
  step does over the session's group instead: ``num_items_in_batch`` summed over the ranks (with
  ``average_tokens_across_devices``; the loss then scaled by the ranks, ``compute_loss``) and the
  logged loss averaged over them.

Refused in one line (``ValueError``) under the launcher: DeepSpeed, FSDP, ``n_gpu > 1``
(``DataParallel``), ``auto_find_batch_size``, tensor, sequence or context parallelism
(``parallelism_config``), a ``train_sampling_strategy`` other than ``"random"`` (the default),
``"sequential"`` (the dataset's order) and ``"group_by_length"`` (HF's length-grouped order, drawn
per epoch and grouped by the global micro-batch: ``hf_parts.length_grouped_order``), a
``get_train_dataloader`` of the script's subclass (a ``_get_train_sampler`` of its own is read:
``hf_parts.own_sampler_order``), an
``IterableDataset`` train set read by more than one worker process (``dataloader_num_workers > 1``)
or without ``__len__`` and without ``max_steps``. Tested with the
``transformers`` and ``accelerate`` versions pinned in ``pyproject.toml``'s ``transformers`` extra.

An ``IterableDataset`` train set (a ``datasets`` streaming dataset among them) is read by
``session.loader``'s iterable path, whose docstring (``checkpointless.loaders.iterable_loader``) is the
contract it must keep: one stream, the same in every process, shuffled (if at all) from its own seed
and ``set_epoch``; micro-batch ``m`` is samples ``[m x B, (m + 1) x B)`` of it (``B`` the global
micro-batch), passes following one another when it has ``__len__``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from typing import Any

import torch

from checkpointless.config import JobConfig
from checkpointless.integrations import _hf_compat as hf
from checkpointless.integrations import hf_eval
from checkpointless.protocol.env import ENV_CONFIG, ENV_STORE

log = logging.getLogger(__name__)

_TORCHRUN_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def under_launcher() -> bool:
    """Whether this process was started by ``checkpointless launch`` (or ``run``, ``cluster``)."""
    return ENV_STORE in os.environ


_hidden: dict[str, str] = {}
if under_launcher():
    # accelerate (through TrainingArguments and the Trainer's Accelerator) starts an env:// process
    # group when it sees torchrun's variables: hide them until its state exists in single-process
    # mode; the session reduces over the job's own groups. The device comes from the slot.
    for _name in _TORCHRUN_VARS:
        if _name in os.environ:
            _hidden[_name] = os.environ.pop(_name)
    from checkpointless.devices import local_device as _local_device

    if _local_device().type == "cuda":
        torch.cuda.set_device(_local_device())

from transformers import Seq2SeqTrainer as _HFSeq2SeqTrainer  # noqa: E402  (after the variables are hidden)
from transformers import Trainer as _HFTrainer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from checkpointless.integrations.hf_checkpoints import best_checkpoint_dir, complete_checkpoint  # noqa: E402
from checkpointless.integrations.hf_parts import (  # noqa: E402
    TrainerProgress,
    dataset_length,
    length_grouped_order,
    own_sampler_order,
    read_step,
    refusals,
    startup_line,
)

if not hasattr(_HFTrainer, "_prepare_for_training"):  # the 5.x loop's pieces this class is built of
    import transformers as _transformers

    raise ImportError(
        f"checkpointless.integrations.transformers needs transformers 5.x (found {_transformers.__version__}): "
        "pip install 'checkpointless[transformers]'"
    )


class Trainer(_HFTrainer):
    """``transformers.Trainer``, checkpointless under ``checkpointless launch`` (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._session: Any = None
        self._items_ranks = 1  # the ranks whose items the step's num_items_in_batch counts
        self._eval_point = hf_eval.EvalPoint()  # whether every rank evaluates at this point (hf_eval.py)
        super().__init__(*args, **kwargs)
        if not under_launcher():
            return
        os.environ.update(_hidden)  # accelerate's state exists now, in single-process mode
        refused = refusals(self)
        if refused:
            raise ValueError(
                "checkpointless.integrations.transformers.Trainer does not support " + "; ".join(refused)
            )

    def _rank(self) -> int:
        return self._session.rank if self._session is not None else int(os.environ.get("RANK", "0"))

    def is_world_process_zero(self) -> bool:
        return super().is_world_process_zero() if not under_launcher() else self._rank() == 0

    def is_local_process_zero(self) -> bool:
        return super().is_local_process_zero() if not under_launcher() else self._rank() == 0

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """``transformers.Trainer``'s; in a step whose ``num_items_in_batch`` counts every rank's
        items (``average_tokens_across_devices``), the loss is scaled by the ranks, as HF's own
        scales it by ``accelerator.num_processes`` under ``torchrun`` (1 here: accelerate runs in its
        single-process mode). The reduced gradient is then the gradient of the loss over every
        rank's tokens, as with ``torchrun``, whatever the ranks' token counts."""
        out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                   num_items_in_batch=num_items_in_batch)  # fmt: skip
        ranks = self._items_ranks
        if (
            ranks == 1
            or num_items_in_batch is None
            or not (self.model_accepts_loss_kwargs or self.compute_loss_func)
        ):
            return out
        return (out[0] * ranks, *out[1:]) if return_outputs else out * ranks

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str | None = None,
    ) -> Any:
        """``transformers.Trainer``'s, its batches shared between the ranks during training
        (``checkpointless.integrations.hf_eval``). ``metric_key_prefix``: HF's default when None."""
        loss_only = (
            prediction_loss_only if prediction_loss_only is not None else self.args.prediction_loss_only
        )
        prefix = {} if metric_key_prefix is None else {"metric_key_prefix": metric_key_prefix}
        with hf_eval.sharded(self, self._eval_point, dataloader, loss_only, ignore_keys) as loader:
            return super().evaluation_loop(loader, description, prediction_loss_only, ignore_keys, **prefix)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Rank 0 alone writes a checkpoint (the replicas are equal; accelerate's single-process
        mode would have every rank write the same files at once). The others note the best one as
        rank 0 does (``load_best_model_at_end``): it is rank 0's directory, written by the time
        training ends (``Session.finish`` returns once every rank is done)."""
        if not under_launcher() or self._rank() == 0:
            super()._save_checkpoint(model, trial)
        elif self.args.save_strategy in ("steps", "epoch", "best"):
            self.state.best_model_checkpoint = best_checkpoint_dir(self, trial)

    def _finalize_training(self, trial: Any, num_train_samples: int, start_time: float) -> Any:
        """As ``transformers.Trainer``'s, but rank 0 alone deletes checkpoints (``save_total_limit``
        1 with the best model kept): every rank deleting the same directories would race."""
        if not under_launcher() or self._rank() == 0:
            return super()._finalize_training(trial, num_train_samples, start_time)
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            return super()._finalize_training(trial, num_train_samples, start_time)
        finally:
            self.args.save_total_limit = limit

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not under_launcher() or self._rank() == 0:
            super().save_model(output_dir, _internal_call)

    @property
    def session(self) -> Any:
        """The ``checkpointless.Session`` of the training under way (None before ``train``, or without a launcher)."""
        return self._session

    def _train_data(self) -> tuple[Any, Any]:
        """The train set and its collator, as ``Trainer`` prepares them for its DataLoader."""
        dataset, collator = self.train_dataset, self.data_collator
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                return hf.remove_unused_columns(self, dataset, "training"), collator
        except ImportError:
            pass
        return dataset, hf.collator_with_removed_columns(self, collator, "training")

    def _share_pass(self, model: Any, micro: list[Any], items: Any) -> list[Any]:
        """One share's micro-batches, forward and backward (all but the last under ``no_sync``): the
        losses ``training_step`` returns."""
        args, losses = self.args, []
        self.current_gradient_accumulation_steps = len(micro)
        for i, inputs in enumerate(micro):
            last = i == len(micro) - 1
            hf.set_sync_gradients(self, last)
            with contextlib.nullcontext() if last else self._session.no_sync():
                losses.append(self.training_step(model, inputs, items))
            if not last:  # between two micro-batches, as HF's loop calls it
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
        return losses

    def _inner_training_loop(
        self,
        batch_size: int | None = None,
        args: Any = None,
        resume_from_checkpoint: str | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        if not under_launcher():
            return super()._inner_training_loop(
                batch_size=batch_size, args=args, resume_from_checkpoint=resume_from_checkpoint,
                trial=trial, ignore_keys_for_eval=ignore_keys_for_eval,
            )  # fmt: skip
        from checkpointless.session import Session

        args = args or self.args
        self.accelerator.free_memory()
        shares = JobConfig.from_json(os.environ[ENV_CONFIG]).share_count  # session.dp_size, before it exists
        accumulation = args.gradient_accumulation_steps
        dataset, collator = self._train_data()
        micro_global = hf.train_batch_size(self) * shares  # samples per micro-batch, over every share
        stream = isinstance(dataset, torch.utils.data.IterableDataset)  # its order is its own
        seed = args.data_seed if args.data_seed is not None else args.seed
        own_order, own_samples = (None, None) if stream else own_sampler_order(self, dataset, seed)
        samples = dataset_length(dataset) if own_samples is None else own_samples
        if samples is None:  # a stream read once (refusals: max_steps is set): one epoch of max_steps
            per_epoch = args.max_steps
        else:
            micro_per_epoch = samples // micro_global
            if micro_per_epoch < accumulation:
                raise ValueError(
                    f"the train set has {samples} samples: fewer than one optimizer step of "
                    f"{accumulation} x {micro_global} (gradient_accumulation_steps x "
                    f"per_device_train_batch_size x {shares} shares)"
                )
            per_epoch = micro_per_epoch // accumulation
        max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
        epochs = math.ceil(max_steps / per_epoch)
        hf.init_training_state(self, max_steps, per_epoch, epochs, resume_from_checkpoint, trial)
        model, _ = hf.prepare_for_training(self, max_steps, None, resume_from_checkpoint)
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper
        progress = TrainerProgress(self, lambda: best_checkpoint_dir(self))
        state: dict[str, Any] = {"lr_scheduler": self.lr_scheduler, "trainer": progress}
        if getattr(self.accelerator, "scaler", None) is not None:
            state["grad_scaler"] = self.accelerator.scaler
        session = self._session = Session(self.model, optimizer, state=state, seed=args.seed)
        if session.rank == 0:  # what HF's startup lines get wrong here, where the Trainer logs them
            hf_logging.get_logger("transformers.trainer").info(startup_line(session))
        if progress.received and session.rank == 0:
            complete_checkpoint(self, session.step, per_epoch, max_steps, model, trial)
        sampling = "stream" if stream else getattr(args, "train_sampling_strategy", "random")
        if own_order is not None:
            sampling = "own"  # the order of the script's _get_train_sampler
        elif sampling == "group_by_length":
            own_order = length_grouped_order(self, dataset, micro_global, seed)
        loader = session.loader(
            dataset, micro_global, shuffle=sampling == "random", seed=None if stream else seed, collate_fn=collator,
            num_workers=args.dataloader_num_workers, drop_last=True, pin_memory=args.dataloader_pin_memory,
            order=own_order, epoch_samples=own_samples,
        )  # fmt: skip
        self.callback_handler.train_dataloader = loader

        start_time = time.time()
        hf.start_loop(self, torch.tensor(0.0, device=args.device))
        model.zero_grad()
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start and not progress.received:  # (a replacement's peers did)
            self._eval_point.reached()  # every rank is here, before the first step
            hf.evaluate(self, trial, ignore_keys_for_eval, skip_scheduler=True)
            self._eval_point.left()
        plateau = isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        assert self.optimizer is not None and self.lr_scheduler is not None  # made by _prepare_for_training
        warned_epoch_stop = False
        epoch_begun = -1  # the epoch whose on_epoch_begin ran (a step executed again does not repeat it)
        grad_norm: Any = None
        learning_rate = None
        for step in session.steps(max_steps, start=self.state.global_step):
            self.state.global_step = step  # a step executed again after a recovery starts here too
            epoch = step // per_epoch
            if epoch != epoch_begun:  # also the epoch a resumed run or a replacement starts in, as HF does
                self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
                epoch_begun = epoch
            grad_norm = None
            learning_rate = None
            with session.attempt() as attempt:
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                micro, items, self._items_ranks = read_step(self, loader, step, accumulation)
                losses = []
                try:
                    for share in session.shares():  # one per replica, or more once an elastic job shrank
                        if share not in micro:  # a lost peer's, taken over (--never-wait)
                            micro[share] = [
                                loader.batch(step * accumulation + i) for i in range(accumulation)
                            ]
                            if None not in items:  # (else its items are in the sum already)
                                items[share] = hf.num_items_in_batch(self, micro[share], args.device)
                        losses += self._share_pass(model, micro[share], items.get(share, items.get(None)))
                finally:
                    self._items_ranks = 1
                step_loss = torch.stack(losses).sum()
                # the logged loss: the shares' mean, as HF's gather makes it over the ranks, summed
                # behind the gradients' reduction (no sync point of its own)
                group = session.process_group  # read again: a take-over enters a new generation
                group = None if group is None or group.world_size == 1 else group
                works = [] if group is None else [group.allreduce_start(step_loss)]
                try:
                    session.reduce_gradients()
                except BaseException:
                    works.clear()  # a live Work would keep the failed group's sockets open
                    raise
                if group is not None:
                    group.wait_all(works)
                step_loss /= session.dp_size
                if args.max_grad_norm > 0:
                    grad_norm = hf.clip_grad_norm(self, model)
                grad_norm = hf.grad_norm(self, model, grad_norm)
                self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
                self.optimizer.step()
                self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
                learning_rate = hf.learning_rate(self)
                if not self.accelerator.optimizer_step_was_skipped and not plateau:
                    self.lr_scheduler.step()
                model.zero_grad()
            if not attempt.committed:
                continue  # recovered: the same step again
            hf.add_train_loss(self, step_loss)
            for inputs in next(
                iter(micro.values())
            ):  # one share's: what a replica computes at the starting size
                self.current_flos += float(self.floating_point_ops(inputs))  # type: ignore[assignment]
                hf.track_num_input_tokens(self, inputs)
            self.state.global_step = step + 1
            self.state.epoch = (step + 1) / per_epoch  # type: ignore[assignment]
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._eval_point.reached()  # every rank is here, after the commit
            hf.maybe_log_save_evaluate(
                self, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate
            )
            if self.control.should_epoch_stop and not warned_epoch_stop:
                log.warning("control.should_epoch_stop is not honoured: the step decides what is read")
                warned_epoch_stop = True
            self.control.should_epoch_stop = False
            last = step + 1 >= max_steps or self.control.should_training_stop
            if last or (step + 1) % per_epoch == 0:  # the epoch's end (or training's), as HF's loop has it
                self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
                hf.maybe_log_save_evaluate(
                    self, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate
                )
            self._eval_point.left()
            if self.control.should_training_stop:
                break
        loader.close()
        session.finish()
        return self._finalize_training(trial, max_steps * micro_global * accumulation, start_time)


class Seq2SeqTrainer(Trainer, _HFSeq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` (``predict_with_generate``: the evaluation generates),
    checkpointless under ``checkpointless launch`` as ``Trainer`` is: one changed import line. The
    tokens its evaluation generates are shared between the ranks as any outputs (``hf_eval``)."""
