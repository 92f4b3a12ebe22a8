"""Test scripts' evaluation probes (``--eval-check``, ``--eval-fault``): how many evaluation batches
this rank computed, whether the metrics equal those of the whole set evaluated by this process
alone (``transformers.Trainer.evaluation_loop`` itself), and a fault in the middle of an evaluation."""

from __future__ import annotations

import os
import signal
import time

import torch
import transformers
from transformers import TrainerCallback


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class EvalCheck(TrainerCallback):
    """At every evaluation, prints ``EVALCHECK step=S rank=R batches=N equal=B metrics=...``:
    the batches this process computed in it (its ``prediction_step`` calls), and whether its
    metrics equal the whole set's evaluated here alone."""

    def __init__(self, trainer: transformers.Trainer) -> None:
        self.trainer, self.batches = trainer, 0
        real = trainer.prediction_step

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.batches += 1
            return real(*args, **kwargs)

        trainer.prediction_step = counted  # type: ignore[method-assign]

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # type: ignore[no-untyped-def]
        t, computed = self.trainer, self.batches
        if isinstance(t, transformers.Seq2SeqTrainer):
            t.gather_function = t.accelerator.gather  # as its evaluate() sets it
        whole = transformers.Trainer.evaluation_loop(
            t,
            t.get_eval_dataloader(),
            "Evaluation",
            prediction_loss_only=True if t.compute_metrics is None else None,
        ).metrics
        self.batches = 0
        same = {k: metrics[k] for k in whole}
        print(f"EVALCHECK step={state.global_step} rank={rank()} batches={computed} equal={same == whole} "
              f"metrics={sorted(same.items())} whole={sorted(whole.items())}", flush=True)  # fmt: skip


class EvalFault(TrainerCallback):
    """``kind`` (kill or hang) on ``rank`` at the evaluation after step ``step``, in its second
    forward pass (the first batch done), once in the job (``marker``)."""

    def __init__(self, trainer: transformers.Trainer, spec: str, marker: str) -> None:
        kind, step, who = spec.split(":")
        self.kind, self.step, self.rank, self.marker = kind, int(step), int(who), marker
        self.trainer, self.forwards = trainer, 0
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        trainer.model.register_forward_pre_hook(self._forward)

    def _forward(self, module: torch.nn.Module, inputs: object) -> None:
        if module.training:
            self.forwards = 0
            return
        self.forwards += 1
        due = self.trainer.state.global_step == self.step and rank() == self.rank and self.forwards == 2
        if due and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP)
            time.sleep(60)  # (stopped: the launcher kills it)
