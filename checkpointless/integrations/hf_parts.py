"""Pieces of ``checkpointless.integrations.transformers.Trainer``: the ``TrainingArguments`` it
refuses under the launcher, the ``Trainer``'s own state a replacement receives, counts it takes
of the data and its length-grouped train order. Imported by that module once it has hidden
torchrun's variables."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers.trainer_callback import ExportableState

from checkpointless.integrations import _hf_compat as hf

if TYPE_CHECKING:
    from checkpointless.integrations.transformers import Trainer


def refusals(trainer: Trainer) -> list[str]:
    args = trainer.args
    out = []
    if getattr(args, "deepspeed", None):
        out.append("DeepSpeed (TrainingArguments.deepspeed)")
    if getattr(args, "fsdp", None):
        out.append("FSDP (TrainingArguments.fsdp; use checkpointless's sharded Session)")
    if getattr(args, "n_gpu", 1) > 1:
        out.append(f"DataParallel over {args.n_gpu} GPUs in one process (n_gpu > 1)")
    if getattr(args, "auto_find_batch_size", False):
        out.append("auto_find_batch_size")
    if getattr(args, "parallelism_config", None) is not None:
        out.append("parallelism_config (tensor, sequence or context parallelism)")
    sampling = getattr(args, "train_sampling_strategy", "random")
    if sampling not in ("random", "sequential", "group_by_length"):
        out.append(f"train_sampling_strategy={sampling!r} (the train order is a function of the step: "
                   "'random', 'sequential' or 'group_by_length')")  # fmt: skip
    if _overrides(trainer, "get_train_dataloader"):
        out.append("a get_train_dataloader of its own (the train set is read as a function of the step: "
                   "give an order of your own by overriding _get_train_sampler)")  # fmt: skip
    if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
        workers = args.dataloader_num_workers
        if workers > 1:
            out.append(f"dataloader_num_workers={workers} with an IterableDataset as train_dataset (each "
                       "worker would read its own copy of the stream: use 0 or 1)")  # fmt: skip
        if dataset_length(trainer.train_dataset) is None and args.max_steps <= 0:
            out.append("an IterableDataset without __len__ as train_dataset without max_steps (set "
                       "TrainingArguments.max_steps)")  # fmt: skip
    return out


def _overrides(trainer: Any, name: str) -> bool:
    """Whether the script's ``Trainer`` subclass defines ``name`` itself (not ``transformers.Trainer``'s)."""
    from transformers import Trainer as HFTrainer

    own = getattr(type(trainer), name, None)
    return own is not None and own is not getattr(HFTrainer, name)


def own_sampler_order(
    trainer: Any, dataset: Any, seed: int
) -> tuple[Callable[[int], list[int]] | None, int | None]:
    """``(order, samples per epoch)`` of the sampler a ``_get_train_sampler`` of the script's own gives
    (``checkpointless.loaders.sampler_order``: each epoch's order, its randomness seeded from ``seed`` and
    the epoch); ``(None, None)`` without one. A ``ValueError`` in one line for a sampler that cannot
    be read so."""
    if not _overrides(trainer, "_get_train_sampler"):
        return None, None
    from checkpointless.loaders.sampler_order import sampler_order

    sampler = hf.train_sampler(trainer, dataset)
    if sampler is None:  # no sampler: the DataLoader reads the dataset in order
        return (lambda epoch: list(range(len(dataset)))), len(dataset)
    try:
        return sampler_order(sampler, seed)
    except ValueError as e:
        raise ValueError(
            f"checkpointless.integrations.transformers.Trainer: _get_train_sampler: {e}"
        ) from None


def step_tokens(micro: list[Any], model: Any) -> int:
    """The tokens (elements of the model's main input) in one step's micro-batches on this rank."""
    name = getattr(model, "main_input_name", "input_ids")
    return sum(int(b[name].numel()) for b in micro if isinstance(b, dict) and torch.is_tensor(b.get(name)))


class TrainerProgress:
    """The ``Trainer``'s own state that steers training, moved to a replacement with the model (the
    ``Trainer``'s mid-training resume restores the same from ``trainer_state.json``): the best metric
    and its step (``load_best_model_at_end``, ``metric_for_best_model``) and the callbacks' exportable
    state (``EarlyStoppingCallback``'s patience, ``TrainerControl``), as at the start of the step under
    way. Equal on every replica (they evaluate alike), so the replicas' digests cover it; per-rank
    counters (timings, tokens seen) and ``log_history`` (timings in it) stay each rank's own."""

    def __init__(self, trainer: Trainer, best_checkpoint_dir: Callable[[], str | None]) -> None:
        """``best_checkpoint_dir``: rank 0's checkpoint of the best step so far (None before one)."""
        self._trainer = trainer
        self._best_checkpoint_dir = best_checkpoint_dir
        self.received = False  # loaded from a peer (this process replaces a rank) or a snapshot

    def _exportable(self) -> list[tuple[str, Any]]:
        t = self._trainer
        found = [cb for cb in [*t.callback_handler.callbacks, t.control] if isinstance(cb, ExportableState)]
        named, seen = [], Counter[str]()
        for cb in found:
            name = type(cb).__name__
            named.append((f"{name}.{seen[name]}", cb))
            seen[name] += 1
        return named

    def state_dict(self) -> dict[str, Any]:
        state = self._trainer.state
        callbacks = {name: cb.state() for name, cb in self._exportable()}
        return {
            "best_metric": state.best_metric,
            "best_global_step": state.best_global_step,
            "callbacks": callbacks,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        t = self._trainer
        self.received = True
        t.state.best_metric, t.state.best_global_step = saved["best_metric"], saved["best_global_step"]
        t.state.best_model_checkpoint = self._best_checkpoint_dir()
        for name, cb in self._exportable():
            if name in saved["callbacks"]:
                kept = saved["callbacks"][name]
                for attr, value in {
                    **kept["attributes"],
                    **(kept["args"] if cb is t.control else {}),
                }.items():
                    setattr(cb, attr, value)


def dataset_length(dataset: Any) -> int | None:
    """``len(dataset)``, None for a stream without one."""
    try:
        return len(dataset)
    except TypeError:
        return None


def length_grouped_order(trainer: Any, dataset: Any, batch: int, seed: int) -> Callable[[int], list[int]]:
    """``train_sampling_strategy="group_by_length"``: each epoch's order as HF's ``LengthGroupedSampler``
    makes it (``get_length_grouped_indices``: a permutation cut into mega-batches, each sorted by
    length, the longest sample first), drawn from ``(seed, epoch)`` and grouped by the global
    micro-batch (``batch`` samples over every rank): the ranks' parts of a micro-batch are alike in
    length, and the order is the same in every process and after a recovery. The lengths are HF's:
    the dataset's ``length_column_name`` column if it has one, else the length of each sample's
    main input (every sample read once, at the start, as HF's sampler reads them)."""
    from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

    lengths = None
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset) and trainer.args.length_column_name in dataset.column_names:
            lengths = dataset[trainer.args.length_column_name]
    except ImportError:
        pass
    processing = trainer.processing_class
    name = processing.model_input_names[0] if getattr(processing, "model_input_names", None) else None
    lengths = LengthGroupedSampler(batch, dataset=dataset, lengths=lengths, model_input_name=name).lengths

    def order(epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        return list(get_length_grouped_indices(lengths, batch, generator=g))

    return order


def read_step(
    trainer: Trainer, loader: Any, step: int, accumulation: int
) -> tuple[dict[int, list[Any]], dict[Any, Any], int]:
    """The micro-batches of each share the replica holds at ``step``; the items
    (``num_items_in_batch``) each share's loss is over: with ``average_tokens_across_devices``
    every share's, summed over the replicas as accelerate's gather sums them over the ranks (under
    the key None), else each share's own; and the number ``compute_loss`` scales the loss by (the
    shares, whose number the reduction divides by, when the items are every share's; else 1)."""
    session, args = trainer.session, trainer.args
    micro = {p: [loader.batch(step * accumulation + i, share=p) for i in range(accumulation)]
             for p in session.held_shares}  # fmt: skip
    session.log(tokens=sum(step_tokens(m, trainer.model) for m in micro.values()))  # the live tok/s
    items: dict[Any, Any] = {p: hf.num_items_in_batch(trainer, m, args.device) for p, m in micro.items()}
    if not args.average_tokens_across_devices or not all(torch.is_tensor(n) for n in items.values()):
        return micro, items, 1
    total = sum(items.values())
    group = session.process_group
    if group is not None and group.world_size > 1:
        group.allreduce_([total])
    return micro, {None: total}, session.dp_size


def startup_line(session: Any) -> str:
    """Rank 0's line beside the Trainer's startup lines, which count this process alone."""
    return (
        f"checkpointless: rank {session.rank} of {session.world_size}; accelerate runs in its single-process "
        "mode on each rank, so the Trainer's world size 1 (\"distributed training: False\") is this process's: "
        f"the session reduces the gradients over the job's {session.dp_size} shares"
    )
