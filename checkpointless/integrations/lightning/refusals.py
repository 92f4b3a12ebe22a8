"""What ``CheckpointlessStrategy`` refuses, each in one line of a ``ValueError`` (the package
docstring lists them): the Trainer's settings (before a spare waits), the train dataloader (when
Lightning asks for it), validation that would fall inside an accumulated step (when training
starts)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.utils.data import DataLoader, IterableDataset

from checkpointless.integrations.lightning import _compat as host
from checkpointless.loaders.from_dataloader import loader_settings


def refused_settings(strategy: Any, trainer: Any, *, launched: bool, sharing: bool = False) -> list[str]:
    """The Trainer's settings the strategy does not support (``launched``: under the launcher;
    ``sharing``: a replica may compute several shares, ``--shares`` above the workers or an
    elastic size)."""
    out = []
    module = strategy.lightning_module
    if module is not None and not module.automatic_optimization:
        out.append("manual optimization (LightningModule.automatic_optimization = False)")
    accumulate = trainer.accumulate_grad_batches
    if sharing and accumulate > 1:
        out.append(
            f"accumulate_grad_batches={accumulate} where a replica may compute several shares "
            "(--shares, --min-workers or --max-workers other than --workers; give 1)"
        )
    if (
        sharing
        and module is not None
        and is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)
    ):
        out.append(
            "a training_step(dataloader_iter) where a replica may compute several shares (each share's "
            "pass takes its own batch: give training_step(batch, batch_idx))"
        )
    if (
        accumulate > 1
        and module is not None
        and type(module).optimizer_step is not LightningModule.optimizer_step
    ):
        out.append(
            f"accumulate_grad_batches={accumulate} with a LightningModule.optimizer_step of its own "
            "(it would run at every micro-batch)"
        )
    if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
        out.append("GradientAccumulationScheduler (give one accumulate_grad_batches)")
    devices = len(strategy.parallel_devices or [])
    if devices > 1 or trainer.num_nodes > 1:
        out.append(
            f"devices={devices}, num_nodes={trainer.num_nodes} (one device per process: the processes "
            "are checkpointless launch's --workers)"
        )
    if trainer.overfit_batches > 0:
        out.append("overfit_batches")
    if trainer.max_steps == -1 and trainer.max_epochs in (None, -1):
        out.append("training without an end (max_epochs=-1 and no max_steps)")
    accelerator = type(trainer.accelerator).__name__
    device = strategy.root_device.type
    if launched and {"cpu": "CPUAccelerator", "cuda": "CUDAAccelerator"}.get(device) != accelerator:
        out.append(
            f"accelerator {accelerator} when the job trains on {device} (launch's --backend, --device)"
        )
    return out


def length(dataset: object) -> int | None:
    """``len(dataset)``, None for a stream without one."""
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None


def refused_loader(dataloader: object, world: int, max_steps: int = -1) -> str | None:
    """Why the train ``dataloader`` cannot be read as a function of the step by ``world`` ranks
    (``max_steps``: the Trainer's)."""
    if not isinstance(dataloader, DataLoader):
        return f"a train dataloader of type {type(dataloader).__name__} (give one torch DataLoader)"
    if dataloader.batch_size is None:
        return "a train DataLoader without batch_size (a batch_sampler of its own)"
    samples = length(dataloader.dataset)
    if isinstance(dataloader.dataset, IterableDataset):
        if dataloader.num_workers > 1:
            return (f"num_workers={dataloader.num_workers} with an IterableDataset as the train set (each "
                    "worker would read its own copy of the stream: use 0 or 1)")  # fmt: skip
        if samples is None:
            return (
                None
                if max_steps > 0
                else "an IterableDataset without __len__ as the train set without max_steps"
            )
    else:
        try:  # a sampler of its own is read as each epoch's order (checkpointless.loaders.sampler_order)
            own = loader_settings(dataloader, world, 0)[2].epoch_samples
            samples = samples if own is None else own
        except ValueError as e:
            return "a train DataLoader: " + str(e).removeprefix("session.loader(dataloader): ")
    assert samples is not None
    tail = samples % (dataloader.batch_size * world)
    if not dataloader.drop_last and tail % world:
        return (
            f"drop_last=False with a last global batch of {tail} samples, which {world} ranks "
            "cannot share evenly (set drop_last=True)"
        )
    return None


def validation_inside_a_step(trainer: Any) -> str | None:
    """Validation the Trainer would run between two micro-batches of one accumulated step, where
    the replicas' BatchNorm statistics still differ and the survivors' re-run of a failed step
    would not run it again."""
    accumulate = trainer.accumulate_grad_batches
    if accumulate == 1 or not trainer.enable_validation:
        return None
    what = f"validation inside an accumulated step (accumulate_grad_batches={accumulate}, "
    if host.val_check_time_interval(trainer) is not None:
        return what + f"val_check_interval={trainer.val_check_interval!r}, time based)"
    every, batches = trainer.val_check_batch, trainer.num_training_batches
    if every is None or every == float("inf"):
        return None
    if trainer.check_val_every_n_epoch is not None:  # after batches every, 2 x every, ... of an epoch
        inside = every % accumulate != 0 and every < batches
    else:  # counted across epochs, while each epoch's steps start at its first batch
        inside = every % batches != 0 and (every % accumulate != 0 or batches % accumulate != 0)
    if not inside:
        return None
    return what + f"validation every {every} batches, epochs of {batches}: give a multiple of {accumulate})"
