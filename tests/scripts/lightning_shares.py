"""The Lightning script of ``lightning_train.py`` (its classifier: dropout, batch norm,
``self.log(..., sync_dist=True)``, gradient clipping, an LR scheduler, validation every epoch) over
192 points in batches of 4 a share, whose ``training_step`` also writes each (step, share) loss it
computes: the tests of several shares a replica compare them between runs of different sizes.

Usage: lightning_shares.py OUTPUT_DIR [--epochs N] [--accumulate N] [--pause SECONDS]
(``OUTPUT_DIR/losses-<pid>.jsonl``: one ``{"<step>/<share>": loss}`` a pass, a step executed again
after a recovery writing the same values again; ``--accumulate N``: ``accumulate_grad_batches=N``; ``--pause``: a sleep after each batch, outside
the step, so that a process started to grow the job back joins before its end)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning_train import Classifier, Points  # this script's folder is on sys.path
from torch.utils.data import DataLoader

from checkpointless.integrations.lightning import CheckpointlessStrategy


class Recording(Classifier):
    """The classifier, writing each pass's loss under its step and share."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        session = self.trainer.strategy.session  # type: ignore[attr-defined]
        share = session.dp_rank if session is not None else 0  # inside a share's pass: that share
        with open(self.out / f"losses-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps({f"{self.trainer.global_step}/{share}": loss.item()}) + "\n")
        return loss


class Pause(L.Callback):
    """A sleep after each batch (between steps)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.seconds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir", type=Path)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--pause", type=float, default=0.0)
    a = p.parse_args()
    a.output_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    strategy = CheckpointlessStrategy()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=a.epochs,
        gradient_clip_val=1.0,
        accumulate_grad_batches=a.accumulate,
        log_every_n_steps=2,
        default_root_dir=str(a.output_dir / "lightning"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[Pause(a.pause)] if a.pause else [],
    )
    train = DataLoader(Points(192, 1), batch_size=4, shuffle=True)
    trainer.fit(Recording(a.output_dir), train, DataLoader(Points(32, 2), batch_size=16))
    if trainer.is_global_zero:
        print(
            f"trained {trainer.global_step} steps, ranks {trainer.world_size}, state {strategy.digest}",
            flush=True,
        )


if __name__ == "__main__":
    main()
