"""A Hugging Face ``Trainer`` script of the usual shape (the integration tests run it unchanged but
for its import line): a small causal LM built from a config, a map-style dataset, gradient
accumulation, clipping, a cosine schedule with warm-up, logging, evaluation and checkpoints.

Usage: hf_trainer.py OUTPUT_DIR STEPS [--bf16] [--resume CHECKPOINT] [--iterable] [--workers N]
                     [--raise-at STEP:MICRO:RANK] [--padded] [--per-device N] [--lora]
                     [--die-in-save STEP] [--eval-check] [--eval-fault KIND:STEP:RANK] [--group-by-length]
                     [--pause SECONDS]
(``--iterable``: the train set as an endless stream, an ``IterableDataset`` without ``__len__``
whose passes are shuffled from its own seed; ``--workers``: ``dataloader_num_workers``;
``--raise-at``: the model's forward raises once, on that rank, at that micro-batch of that step;
``--padded``: each sample's tail is left out of the loss, a random length per sample;
``--per-device``: per_device_train_batch_size, 2 by default; ``--lora``: a peft LoRA model;
``--die-in-save``: the process writing the checkpoint of that step is SIGKILLed once, after the
model's weights and before the optimizer's, as a power loss would stop it; ``--eval-check``,
``--eval-fault``: ``evalcheck.py``; ``--group-by-length``: samples of different lengths, padded by
the collator, read in HF's length-grouped order, ``train_sampling_strategy="group_by_length"``)
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from evalcheck import EvalCheck, EvalFault
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from checkpointless.integrations.transformers import Trainer


class Tokens(torch.utils.data.Dataset):
    """Fixed pseudo-random token sequences (a real script reads a tokenized corpus)."""

    def __init__(self, n: int, length: int, vocab: int, seed: int, padded: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, length), generator=g)
        # padded: each sample's tail left out of the loss (-100), from 1 to length - 1 labels kept,
        # so the ranks' micro-batches hold different numbers of labels
        self.kept = torch.randint(1, length, (n,), generator=g) if padded else torch.full((n,), length)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.data[i].clone()
        labels[int(self.kept[i]) :] = -100
        return {"input_ids": self.data[i], "labels": labels}


class Varied(Tokens):
    """``Tokens`` cut to a length of their own (``kept``, from 1 to the full length)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = int(self.kept[i])
        return {"input_ids": self.data[i][:n], "labels": self.data[i][:n].clone()}


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch of ``Varied`` samples padded to its longest (labels -100 and no attention there)."""
    width = max(len(s["input_ids"]) for s in samples)
    batch = {"input_ids": torch.zeros(len(samples), width, dtype=torch.long),
             "labels": torch.full((len(samples), width), -100), "attention_mask": torch.zeros(len(samples), width,
             dtype=torch.long)}  # fmt: skip
    for j, s in enumerate(samples):
        n = len(s["input_ids"])
        batch["input_ids"][j, :n], batch["labels"][j, :n], batch["attention_mask"][j, :n] = (
            s["input_ids"],
            s["labels"],
            1,
        )
    return batch


class Stream(torch.utils.data.IterableDataset):
    """Endless passes over ``inner``, each in an order drawn from the stream's own seed and the
    pass's number (a streaming corpus with a shuffle of its own); no ``__len__``."""

    def __init__(self, inner: Tokens, seed: int) -> None:
        self.inner, self.seed = inner, seed

    def __iter__(self):  # type: ignore[no-untyped-def]
        n = 0
        while True:
            order = torch.randperm(len(self.inner), generator=torch.Generator().manual_seed(self.seed + n))
            for i in order.tolist():
                yield self.inner[i]
            n += 1


class RaiseOnce(TrainerCallback):
    """Makes the model's forward raise once, on ``rank``, at micro-batch ``micro`` of ``step``."""

    def __init__(self, model: torch.nn.Module, step: int, micro: int, rank: int) -> None:
        self.where, self.rank, self.forwards, self.step = (step, micro), rank, 0, -1
        model.register_forward_pre_hook(self._forward)

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.step, self.forwards = state.global_step, 0

    def _forward(self, module: torch.nn.Module, inputs: object) -> None:
        if not module.training:
            return  # evaluation
        micro, self.forwards = self.forwards, self.forwards + 1
        if (self.step, micro) == self.where and int(os.environ.get("RANK", "0")) == self.rank:
            self.where = (-1, -1)
            raise RuntimeError(f"a fault of the script's own at micro-batch {micro} of step {self.step}")


class CallbackOrder(TrainerCallback):
    """Prints the callbacks the loop calls over its first two steps, in order, at the end of training."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def _note(self, name: str, state) -> None:  # type: ignore[no-untyped-def]
        if state.global_step < 2 or (name == "on_step_end" and state.global_step == 2):
            self.seen.append(name)

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._note("on_step_begin", state)

    def on_substep_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._note("on_substep_end", state)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._note("on_pre_optimizer_step", state)

    def on_optimizer_step(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._note("on_optimizer_step", state)

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self._note("on_step_end", state)

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        print("CALLBACKS " + " ".join(self.seen), flush=True)


class Pace(TrainerCallback):
    """Sleeps ``seconds`` after each step (a step as long as a real model's, on a tiny one)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)


class WeightedTrainer(Trainer):
    """A ``Trainer`` subclass with a train order of its own (``_get_train_sampler``, as scripts that
    even out an imbalanced set write it): every fourth sample drawn 3 times as often, with
    replacement, 80 draws an epoch."""

    def _get_train_sampler(self, train_dataset=None):  # type: ignore[no-untyped-def]
        n = len(train_dataset if train_dataset is not None else self.train_dataset)
        weights = [3.0 if i % 4 == 0 else 1.0 for i in range(n)]
        return torch.utils.data.WeightedRandomSampler(weights, 80, replacement=True)


def die_in_save(trainer: Trainer, step: int, marker: str) -> None:
    """SIGKILL the process writing checkpoint ``step``, once (``marker``: the job already lost one),
    between the model's weights and the optimizer's."""
    real = trainer._save_optimizer_and_scheduler

    def dying(output_dir: str) -> None:
        if trainer.state.global_step == step and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        real(output_dir)

    trainer._save_optimizer_and_scheduler = dying  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--resume", default=None)
    p.add_argument("--iterable", action="store_true")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--raise-at", default=None, metavar="STEP:MICRO:RANK")
    p.add_argument("--padded", action="store_true")
    p.add_argument("--per-device", type=int, default=2)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--die-in-save", type=int, default=None, metavar="STEP")
    p.add_argument("--eval-check", action="store_true")
    p.add_argument("--eval-fault", default=None, metavar="KIND:STEP:RANK")
    p.add_argument("--group-by-length", action="store_true")
    p.add_argument("--pause", type=float, default=0.0, help="seconds slept after each step")
    p.add_argument("--weighted", action="store_true", help="WeightedTrainer: a sampler of its own")
    a = p.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    if a.lora:  # peft's LoRA on the attention projections: the base frozen, the adapters trained
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        )
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.steps,
        per_device_train_batch_size=a.per_device,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        max_grad_norm=0.5,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=5,
        per_device_eval_batch_size=4,
        save_steps=6,
        save_total_limit=2,
        bf16=a.bf16,
        use_cpu=True,
        report_to=[],
        seed=7,
        dataloader_num_workers=a.workers,
        disable_tqdm=True,
        **({"train_sampling_strategy": "group_by_length"} if a.group_by_length else {}),
    )
    train: torch.utils.data.Dataset = Tokens(96, 16, 128, 1, padded=a.padded)
    if a.group_by_length:
        train = Varied(96, 16, 128, 1, padded=True)
    if a.iterable:
        train = Stream(train, seed=11)
    callbacks: list[TrainerCallback] = [CallbackOrder()]
    if a.pause:
        callbacks.append(Pace(a.pause))
    if a.raise_at:
        step, micro, rank = (int(v) for v in a.raise_at.split(":"))
        callbacks.append(RaiseOnce(model, step, micro, rank))
    trainer = (WeightedTrainer if a.weighted else Trainer)(model=model, args=args, train_dataset=train, eval_dataset=Tokens(22, 16, 128, 2),
                      callbacks=callbacks, **({"data_collator": pad} if a.group_by_length else {}))  # fmt: skip
    if a.eval_check:
        trainer.add_callback(EvalCheck(trainer))
    if a.eval_fault:
        trainer.add_callback(EvalFault(trainer, a.eval_fault, os.path.join(a.output_dir, ".eval-fault")))
    if a.die_in_save is not None:
        die_in_save(trainer, a.die_in_save, os.path.join(a.output_dir, ".died-in-save"))
    out = trainer.train(resume_from_checkpoint=a.resume)
    print(f"trained {out.global_step} steps, loss {out.training_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
