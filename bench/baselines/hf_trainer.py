"""``tests/scripts/hf_trainer.py``'s Hugging Face ``Trainer`` script, timed, for ``bench/integrations.py``.

The same shape (a ``LlamaForCausalLM`` built from a config, a map-style dataset, gradient
accumulation, clipping, a cosine schedule with warm-up, logging) with a larger model, so that a
step takes tens of milliseconds, and no evaluation or checkpoints (they are not steady state). One
import differs between the two sides of the comparison:

- default: ``checkpointless.integrations.transformers.Trainer``, run by ``checkpointless launch``;
- ``--plain``: ``transformers.Trainer``, run by ``torchrun`` (DDP through accelerate, gloo on CPU).

``ddp_find_unused_parameters=False``: the plain side's DDP otherwise walks the autograd graph after
every backward (the Trainer's default for a model without activation checkpointing), a cost of the
baseline's configuration, not of checkpointless. The checkpointless side ignores the setting.

Rank 0 writes ``OUT/times.json``: ``time.perf_counter()`` at every ``on_step_end`` (after each
optimizer step), which the benchmark turns into per-step times.

Usage: hf_trainer.py OUTPUT_DIR STEPS [--plain] [--turns FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments
from turns import Turns

VOCAB, LENGTH = 256, 64
MODEL = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip


class Tokens(torch.utils.data.Dataset):
    """Fixed pseudo-random token sequences (as in ``tests/scripts/hf_trainer.py``)."""

    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i].clone()}


class StepTimes(TrainerCallback):
    """``time.perf_counter()`` at the end of every optimizer step, then this job's turn (``turns.py``)."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.turns.step_end()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--plain", action="store_true", help="transformers.Trainer (for torchrun)")
    p.add_argument("--turns", default=None, help="take turns with another job (turns.py)")
    a = p.parse_args()
    if a.plain:
        from transformers import Trainer
    else:
        from checkpointless.integrations.transformers import Trainer
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=LENGTH, **MODEL)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        max_grad_norm=0.5,
        logging_steps=10,
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        report_to=[],
        seed=7,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    timer = StepTimes(Turns(a.turns, "plain" if a.plain else "checkpointless", a.steps))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(512, LENGTH, VOCAB, 1), callbacks=[timer])
    out = trainer.train()
    if trainer.is_world_process_zero():
        params = sum(t.numel() for t in model.parameters())
        Path(a.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(a.output_dir) / "times.json").write_text(
            json.dumps({"params": params, "times": timer.turns.times})
        )
    print(f"trained {out.global_step} steps, loss {out.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
