"""A Hugging Face ``Trainer`` script that evaluates after every step, for ``bench/hf_eval.py``.

``bench/baselines/hf_trainer.py``'s model and data with an evaluation set of ``EVAL_SAMPLES``
sequences, evaluated (loss and a ``compute_metrics`` over the logits, reduced first by
``preprocess_logits_for_metrics``, as a script does for a language model) after each of ``STEPS``
optimizer steps. Three ways: ``checkpointless launch`` with
``checkpointless.integrations.transformers.Trainer`` (the batches shared by the ranks);
``--plain`` under ``torchrun`` (``transformers.Trainer``: accelerate's distributed sampler and
gather); ``--plain`` alone, one process evaluating the whole set (what each rank did before the
evaluation was shared).

Rank 0 writes ``OUT/evals.json``: every evaluation's ``eval_runtime`` (HF's own timing of
``evaluate``) and its metrics.

Usage: hf_eval.py OUTPUT_DIR STEPS [--plain]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from hf_trainer import LENGTH, MODEL, VOCAB, Tokens
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

EVAL_SAMPLES, EVAL_BATCH = 512, 16


class Evals(TrainerCallback):
    def __init__(self) -> None:
        self.evals: list[dict[str, float]] = []

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self.evals.append(dict(metrics or {}))


def argmax(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def accuracy(pred: Any) -> dict[str, float]:
    hits = pred.predictions[:, :-1] == pred.label_ids[:, 1:]
    return {"accuracy": float(hits.mean())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--plain", action="store_true", help="transformers.Trainer (alone or under torchrun)")
    a = p.parse_args()
    if a.plain:
        from transformers import Trainer
    else:
        from checkpointless.integrations.transformers import Trainer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, max_position_embeddings=LENGTH, **MODEL))
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=EVAL_BATCH,
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="no",
        use_cpu=True,
        report_to=[],
        seed=7,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    evals = Evals()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(512, LENGTH, VOCAB, 1),
                      eval_dataset=Tokens(EVAL_SAMPLES, LENGTH, VOCAB, 2), compute_metrics=accuracy,
                      preprocess_logits_for_metrics=argmax, callbacks=[evals])  # fmt: skip
    trainer.train()
    if trainer.is_world_process_zero():
        Path(a.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(a.output_dir) / "evals.json").write_text(json.dumps(evals.evals))
    if a.plain:
        # gloo's group may abort the process in its teardown at exit ("terminate called without an
        # active exception"), and Trainer.end()'s destroy_process_group hung once: leave at once
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
