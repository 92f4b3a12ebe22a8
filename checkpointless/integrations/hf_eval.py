"""``Trainer.evaluate`` during training, cut between the ranks: each evaluates its contiguous
share of the evaluation batches, the ranks exchange what ``prediction_step`` gave for them, and
every rank then runs ``transformers.Trainer.evaluation_loop`` over all of them as if it had
computed them itself (the loop's containers, padding, ``compute_metrics`` and the loss's mean are
HF's own, in the batches' order). So the metrics are those of one process evaluating the whole
set: a function of the model and the set, not of the number of ranks, at 1/ranks of the work.

The batches are the evaluation ``DataLoader``'s own (its batch sampler's index lists, its collator;
worker processes started as ``session.loader``'s are). ``preprocess_logits_for_metrics`` is applied
by the rank that computed the batch, before the exchange, as HF applies it before its gather.

A peer lost during the evaluation (killed, hung, cut off, or late beyond the collective timeout)
fails the exchange: the group is released (the next step's reduction recovers, and the
replacement receives the state as it is after this evaluation: the best metric, the callbacks'),
and each rank computes the batches it did not receive itself, so every rank ends with the same
metrics as without the fault.

Ranks whose evaluation batches differ (a loader with an order of its own per rank) are found in
the exchange (a digest of the batches' index lists): each then evaluates the whole set as it cut it.

Used only where every rank is at the same point: after a step's commit in the training loop (the
evaluation and save strategies), and at ``eval_on_start`` of a job that has not begun. Elsewhere
(``evaluate`` before or after ``train``, ``batch_eval_metrics``, an evaluation set without a
length or a batch sampler), each rank evaluates the whole set, as one process does.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from checkpointless.errors import CollectiveError, ExchangeRefused
from checkpointless.integrations import _hf_compat as hf
from checkpointless.shards import exchange, plan_digest, shard

if TYPE_CHECKING:
    from checkpointless.integrations.transformers import Trainer

log = logging.getLogger(__name__)


@dataclass
class EvalPoint:
    """Where the ranks are, for the evaluations the ``Trainer``'s loop runs (held by the ``Trainer``,
    passed to ``sharded``): ``aligned`` while every rank is at the same point (after a step's commit,
    or at ``eval_on_start`` of a job that has not begun), until the loop goes on or an exchange fails
    (the group is released); ``count``, the evaluations since the last commit (their exchanges'
    sequence numbers, the same on every rank)."""

    aligned: bool = False
    count: int = 0

    def reached(self) -> None:
        """Every rank is here (the loop's call, after a commit or before the first step)."""
        self.aligned, self.count = True, 0

    def left(self) -> None:
        """The ranks are not at one point any more: the loop went on, or an exchange failed (the
        group is released)."""
        self.aligned = False


def _batches(dataloader: Any) -> list[list[int]] | None:
    """The evaluation loader's batches as index lists (None when it has no batch sampler over a
    map-style dataset of known length)."""
    base = getattr(dataloader, "base_dataloader", dataloader)  # accelerate's DataLoaderShard wraps one
    dataset = getattr(base, "dataset", None)
    sampler = getattr(base, "batch_sampler", None)
    if dataset is None or sampler is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        len(dataset)
        batches = [list(b) for b in sampler]
    except TypeError:
        return None
    return batches if all(all(type(i) is int for i in b) for b in batches) else None


def _loader(dataloader: Any, batches: list[list[int]]) -> torch.utils.data.DataLoader[Any]:
    """A ``DataLoader`` of ``batches`` of the evaluation loader's dataset, with its collator."""
    from checkpointless.loaders.loader import worker_processes

    base = getattr(dataloader, "base_dataloader", dataloader)
    workers = base.num_workers
    return torch.utils.data.DataLoader(
        base.dataset, batch_sampler=batches, collate_fn=base.collate_fn, num_workers=workers,
        pin_memory=base.pin_memory, **worker_processes(workers, base.worker_init_fn),
    )  # fmt: skip


class _Replay:
    """What ``evaluation_loop`` iterates (per batch, a stand-in with the batch's rows, which HF
    counts, and its main input when ``include_for_metrics`` has ``"inputs"``) and the
    ``prediction_step`` it calls (the batch's outputs, computed on this rank or received)."""

    def __init__(self, trainer: Trainer, point: EvalPoint, dataloader: Any, batches: list[list[int]],
                 loss_only: bool, ignore_keys: Any) -> None:  # fmt: skip
        self.trainer, self.point, self.dataloader, self.batches = trainer, point, dataloader, batches
        self.loss_only, self.ignore_keys = loss_only, ignore_keys
        self.dataset = getattr(dataloader, "dataset", None)
        self.batch_size = getattr(dataloader, "batch_size", None)
        self.outputs: dict[int, Any] = {}
        self.next = 0  # the batch prediction_step gives next
        self.real_step = trainer.prediction_step
        self.preprocess: Any = trainer.preprocess_logits_for_metrics
        self.computed = 0  # batches this rank computed (for the log line)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # HF's loop has made the model ready (eval mode, its evaluation dtype) by now
        t = self.trainer
        model: Any = t.model
        self._fill(hf.wrap_model(t, model))
        main = getattr(t.model, "main_input_name", "input_ids")
        # accelerate's DataLoaderShard tells its gradient state where it is: HF's gather drops the
        # last batch's repeated losses beyond the set's end by it (``remainder``)
        dl, last = self.dataloader, len(self.batches) - 1
        tracked = all(hasattr(dl, a) for a in ("begin", "end", "end_of_dataloader"))
        if tracked:
            dl.begin()
        try:
            for b in range(len(self.batches)):
                out = self.outputs[b]
                stand: dict[str, Any] = {}
                if out["rows"] is not None:
                    stand["_rows"] = torch.empty(out["rows"], 0)
                if out["inputs"] is not None:
                    stand[main] = out["inputs"]
                if tracked and b == last:
                    dl.end_of_dataloader = True
                yield stand
            if tracked and hasattr(dl, "iteration"):
                dl.iteration += 1
        finally:
            if tracked:
                dl.end()

    def prediction_step(
        self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None
    ) -> Any:
        out = self.outputs.pop(self.next)
        self.next += 1
        return out["loss"], out["logits"], out["labels"]

    def _compute(self, model: Any, which: range) -> None:
        """Batches ``which`` through the real ``prediction_step``, kept as HF's loop adds them."""
        from transformers.trainer_pt_utils import find_batch_size

        if not which:
            return
        t = self.trainer
        include = t.args.include_for_metrics
        main = getattr(t.model, "main_input_name", "input_ids")
        for b, inputs in zip(which, _loader(self.dataloader, [self.batches[b] for b in which]), strict=True):
            loss, logits, labels = self.real_step(model, inputs, self.loss_only, ignore_keys=self.ignore_keys)
            decode = hf.prepare_input(t, inputs[main]) if "inputs" in include else None
            if labels is not None:
                labels = t.accelerator.pad_across_processes(labels, dim=1, pad_index=-100)
            if logits is not None:
                logits = t.accelerator.pad_across_processes(logits, dim=1, pad_index=-100)
                if self.preprocess is not None:
                    logits = self.preprocess(logits, labels)
            self.outputs[b] = {"rows": find_batch_size(inputs), "loss": loss, "logits": logits,
                               "labels": labels, "inputs": decode}  # fmt: skip
            self.computed += 1

    def _fill(self, model: Any) -> None:
        """Every batch's outputs: this rank's computed, the others' received (or computed here,
        the exchange having failed)."""
        t, point = self.trainer, self.point
        session = t.session
        group = session.process_group
        n, world = len(self.batches), group.world_size
        mine = shard(n, world, group.rank)
        self._compute(model, mine)
        # the same on every rank, a replacement too: the step and the evaluations since its commit
        seq, point.count = (session.committed_step << 20) + point.count, point.count + 1
        try:
            got = exchange(group, seq, [self.outputs[b] for b in mine], plan_digest(self.batches))
        except (CollectiveError, ExchangeRefused) as e:
            if isinstance(e, CollectiveError):
                point.left()  # until the next step: the group is released
            log.warning("[rank %d] the evaluation's exchange failed (%s): this rank computes the other ranks' "
                        "batches", group.rank, e)  # fmt: skip
            got = []
        from accelerate.utils import send_to_device

        for r, outs in enumerate(got):
            if r != group.rank:
                for b, out in zip(shard(n, world, r), outs, strict=True):
                    self.outputs[b] = send_to_device(out, t.args.device)  # where HF's loop keeps its own
        if not got:  # the exchange failed: the other ranks' shares computed here
            for r in range(world):
                if r != group.rank:
                    self._compute(model, shard(n, world, r))


@contextlib.contextmanager
def sharded(
    trainer: Trainer, point: EvalPoint, dataloader: Any, loss_only: bool, ignore_keys: Any
) -> Iterator[Any]:
    """The loader to hand ``evaluation_loop`` (module doc): the dataloader itself where the
    evaluation is not cut between the ranks (``point``: the ``Trainer``'s, whether every rank is here)."""
    session = trainer.session
    group = session.process_group if session is not None else None
    batches = None
    if group is not None and group.world_size > 1 and point.aligned and not trainer.args.batch_eval_metrics:
        batches = _batches(dataloader)
    if not batches:
        yield dataloader
        return
    assert group is not None
    replay = _Replay(trainer, point, dataloader, batches, loss_only, ignore_keys)
    own = trainer.__dict__.get("prediction_step")  # a script's own wrapper, if any (replay.real_step)
    trainer.prediction_step = replay.prediction_step  # type: ignore[method-assign]
    trainer.preprocess_logits_for_metrics = None
    try:
        yield replay
    finally:
        if own is None:
            del trainer.prediction_step
        else:
            trainer.prediction_step = own  # type: ignore[method-assign]
        trainer.preprocess_logits_for_metrics = replay.preprocess
        log.info("[rank %d] evaluated %d of %d batches", group.rank, replay.computed, len(batches))
