"""A Hugging Face ``Seq2SeqTrainer`` script of the usual shape (the integration tests run it
unchanged but for its import line): a small encoder-decoder (BART) built from a config learns to
copy short token rows, evaluated with ``predict_with_generate`` (generated tokens scored by
``compute_metrics``) every few steps, then ``predict`` after training.

Usage: hf_seq2seq.py OUTPUT_DIR STEPS [--eval-check] [--eval-fault KIND:STEP:RANK]
(``evalcheck.py``)
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from evalcheck import EvalCheck, EvalFault
from transformers import BartConfig, BartForConditionalGeneration, Seq2SeqTrainingArguments

from checkpointless.integrations.transformers import Seq2SeqTrainer

VOCAB, PAD, BOS, EOS = 32, 0, 1, 2


class Rows(torch.utils.data.Dataset):
    """Rows of 3 to 6 tokens; the target is the row itself."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 7, (n,), generator=g).tolist()
        self.rows = [torch.randint(3, VOCAB, (k,), generator=g) for k in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = torch.cat([self.rows[i], torch.tensor([EOS])])
        return {"input_ids": row, "labels": row}


def pad(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pads inputs with PAD and labels with -100 to the batch's longest row."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.full((len(features), longest), PAD)
    labels = torch.full((len(features), longest), -100)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = f["input_ids"]
        labels[i, : len(f["labels"])] = f["labels"]
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(), "labels": labels}


def exact(pred) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """The share of generated tokens equal to the target's, over the target's tokens."""
    generated, labels = pred.predictions, pred.label_ids
    width = min(generated.shape[1] - 1, labels.shape[1])
    hits = (generated[:, 1 : width + 1] == labels[:, :width]) & (labels[:, :width] != -100)
    return {"token_accuracy": float(hits.sum() / max(1, int((labels != -100).sum())))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--eval-check", action="store_true")
    p.add_argument("--eval-fault", default=None, metavar="KIND:STEP:RANK")
    a = p.parse_args()
    torch.manual_seed(0)
    config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=EOS,
                        forced_bos_token_id=None, forced_eos_token_id=None)  # fmt: skip
    model = BartForConditionalGeneration(config)
    args = Seq2SeqTrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="no",
        predict_with_generate=True,
        generation_max_length=9,
        use_cpu=True,
        report_to=[],
        seed=1,
        disable_tqdm=True,
    )
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=Rows(64, 1), eval_dataset=Rows(18, 2),
                             data_collator=pad, compute_metrics=exact)  # fmt: skip
    if a.eval_check:
        trainer.add_callback(EvalCheck(trainer))
    if a.eval_fault:
        trainer.add_callback(EvalFault(trainer, a.eval_fault, os.path.join(a.output_dir, ".eval-fault")))
    out = trainer.train()
    pred = trainer.predict(Rows(4, 3))
    digest = np.asarray(pred.predictions).tobytes().hex()[:16]
    print(f"trained {out.global_step} steps; predictions {digest}", flush=True)


if __name__ == "__main__":
    main()
