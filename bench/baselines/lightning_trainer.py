"""A Lightning script, timed, for ``bench/integrations.py``: the same script two ways, one
argument apart.

The shape of ``tests/scripts/lightning_train.py`` (a ``LightningModule`` classifier with batch
norm and dropout, a ``DataLoader`` over a map-style dataset with ``shuffle=True``, AdamW with an
LR scheduler stepped every step, gradient clipping, ``self.log`` every step) with a larger model,
so that a step takes tens of milliseconds, 2 accumulated micro-batches per optimizer step, and no
validation, checkpoints or logger (they are not steady state):

- default: ``strategy=CheckpointlessStrategy()``, run by ``checkpointless launch``;
- ``--plain``: ``strategy=DDPStrategy(process_group_backend="gloo")`` on ``devices=2``, run by
  ``torchrun --standalone --nproc-per-node 2`` (Lightning's DDP; its ``DistributedSampler``).

Rank 0 writes ``OUT/times.json``: ``time.perf_counter()`` at the ``on_train_batch_end`` that ends
each optimizer step (``global_step`` moved), which the benchmark turns into per-step times.

Usage: lightning_trainer.py OUTPUT_DIR STEPS [--plain] [--turns FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset
from turns import Turns

FEATURES, HIDDEN, CLASSES = 256, 1024, 10
PER_RANK, ACCUMULATE, WORKERS = 64, 2, 2


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed pseudo-random points in ``CLASSES`` classes."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = self.x[:, :CLASSES].argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Dropout(0.1),
            nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES),
        )  # fmt: skip

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StepTimes(Callback):
    """``time.perf_counter()`` at the end of every optimizer step (the batch that moved
    ``global_step``), then this job's turn (``turns.py``)."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns
        self._step = 0

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.turns.step_end()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--plain", action="store_true", help="Lightning's DDP strategy (for torchrun)")
    p.add_argument("--turns", default=None, help="take turns with another job (turns.py)")
    a = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    if a.plain:
        from lightning.pytorch.strategies import DDPStrategy

        strategy: Any = DDPStrategy(process_group_backend="gloo")
        devices: Any = WORKERS
    else:
        from checkpointless.integrations.lightning import CheckpointlessStrategy

        strategy, devices = CheckpointlessStrategy(), "auto"
    model = Classifier()
    timer = StepTimes(Turns(a.turns, "plain" if a.plain else "checkpointless", a.steps))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=a.steps,
        max_epochs=1000,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1.0,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=a.output_dir,
    )
    train = DataLoader(Points(PER_RANK * WORKERS * ACCUMULATE * 16, 1), batch_size=PER_RANK, shuffle=True)
    trainer.fit(model, train)
    if trainer.is_global_zero:
        params = sum(t.numel() for t in model.parameters())
        Path(a.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(a.output_dir) / "times.json").write_text(
            json.dumps({"params": params, "times": timer.turns.times})
        )
        print(f"trained {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
