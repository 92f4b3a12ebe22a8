"""A Hugging Face ``Trainer`` script of the other usual shape: sequence classification over a
``datasets.Dataset`` with variable-length rows padded by the collator, trained by epochs, evaluated
and saved at every epoch's end with ``compute_metrics``, the best checkpoint loaded at the end, early
stopping, then ``evaluate``, ``predict`` and ``save_model`` after training (the integration tests run
it unchanged but for its import line).

Usage: hf_classifier.py OUTPUT_DIR EPOCHS [--workers N] [--raise-at STEP:RANK] [--eval-check]
(``--raise-at``: the model's forward raises once, on that rank, in that step; ``--eval-check``:
``evalcheck.py``)
"""

from __future__ import annotations

import argparse
import hashlib
import os

import datasets
import numpy as np
import torch
from evalcheck import EvalCheck
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    EarlyStoppingCallback,
    TrainerCallback,
    TrainingArguments,
)

from checkpointless.integrations.transformers import Trainer

VOCAB, PAD = 64, 0


def rows(n: int, seed: int) -> datasets.Dataset:
    """Token rows of 4 to 12 tokens; the label says whether token 7 appears (a learnable rule)."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(1, VOCAB, int(rng.integers(4, 13))).tolist() for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": ids, "label": [int(7 in r) for r in ids],
                                       "text": [" ".join(map(str, r)) for r in ids]})  # fmt: skip


def pad(features: list[dict[str, object]]) -> dict[str, torch.Tensor]:
    """Right-pads each batch to its longest row (what ``DataCollatorWithPadding`` does)."""
    longest = max(len(f["input_ids"]) for f in features)  # type: ignore[arg-type]
    ids = torch.full((len(features), longest), PAD)
    mask = torch.zeros((len(features), longest), dtype=torch.long)
    for i, f in enumerate(features):
        row = torch.tensor(f["input_ids"])
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([f["label"] for f in features])}


def accuracy(pred) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


class RaiseOnce(TrainerCallback):
    """Makes the model's forward raise once, on ``rank``, in ``step``."""

    def __init__(self, model: torch.nn.Module, step: int, rank: int) -> None:
        self.where, self.rank, self.step = step, rank, -1
        model.register_forward_pre_hook(self._forward)

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.step = state.global_step

    def _forward(self, module: torch.nn.Module, inputs: object) -> None:
        if module.training and self.step == self.where and int(os.environ.get("RANK", "0")) == self.rank:
            self.where = -1
            raise RuntimeError(f"a fault of the script's own in step {self.step}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("epochs", type=float)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--raise-at", default=None, metavar="STEP:RANK")
    p.add_argument("--eval-check", action="store_true")
    a = p.parse_args()
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=2, pad_token_id=PAD)  # fmt: skip
    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))  # each rank its own weights: as under
    model = BertForSequenceClassification(config)  # DDP, every replica starts from rank 0's
    args = TrainingArguments(
        output_dir=a.output_dir,
        num_train_epochs=a.epochs,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        learning_rate=5e-3,
        weight_decay=0.01,
        warmup_steps=0.1,  # a share of the steps (transformers 5)
        lr_scheduler_type="linear",
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
        save_total_limit=2,
        use_cpu=True,
        report_to="none",
        seed=3,
        data_seed=5,
        dataloader_num_workers=a.workers,
        disable_tqdm=True,
    )
    callbacks: list[TrainerCallback] = [EarlyStoppingCallback(early_stopping_patience=10)]
    if a.raise_at:
        step, rank = (int(v) for v in a.raise_at.split(":"))
        callbacks.append(RaiseOnce(model, step, rank))
    trainer = Trainer(model=model, args=args, train_dataset=rows(256, 1), eval_dataset=rows(24, 2),
                      data_collator=pad, compute_metrics=accuracy, callbacks=callbacks)  # fmt: skip
    if a.eval_check:
        trainer.add_callback(EvalCheck(trainer))
    out = trainer.train()
    metrics = trainer.evaluate()
    pred = trainer.predict(rows(8, 3))
    trainer.save_model(os.path.join(a.output_dir, "final"))
    weights = b"".join(t.detach().contiguous().numpy().tobytes() for t in trainer.model.state_dict().values())
    print(f"trained {out.global_step} steps; best {trainer.state.best_model_checkpoint} ({trainer.state.best_metric}); "
          f"final eval {metrics['eval_accuracy']:.4f}; predictions {pred.predictions.argmax(-1).tolist()}; "
          f"weights {hashlib.sha256(weights).hexdigest()[:16]}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
