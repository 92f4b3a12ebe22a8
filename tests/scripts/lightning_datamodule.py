"""A Lightning script in the shape of the public examples (not the team's own): a ``LightningDataModule``
(a dataset with a random augmentation read by a DataLoader worker process), ``ModelCheckpoint`` on the
validation loss (top 2 and the last), ``EarlyStopping``, ``LearningRateMonitor``, a ``CSVLogger``,
``bf16-mixed`` precision, a warm-up then cosine schedule stepped every step, validation twice an
epoch; made checkpointless by its ``strategy=`` argument alone.

Usage: lightning_datamodule.py OUTPUT_DIR [--epochs N]
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from checkpointless.integrations.lightning import CheckpointlessStrategy


class Jittered(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points in 4 classes; a training sample is jittered by noise drawn as it is read."""

    def __init__(self, n: int, seed: int, augment: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 12, generator=g)
        self.y = (self.x[:, 0] > 0).long() * 2 + (self.x[:, 1] > 0.5).long()
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i]
        if self.augment:
            x = x + 0.05 * torch.randn_like(x)
        return x, self.y[i]


class Points(L.LightningDataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        self.train_set = Jittered(128, 1, augment=True)
        self.val_set = Jittered(48, 2, augment=False)

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=1)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(self.val_set, batch_size=16)


class Net(L.LightningModule):
    def __init__(self, lr: float = 5e-3, warmup: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(12, 48), nn.GELU(), nn.Dropout(0.1), nn.Linear(48, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.body(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.body(x)
        self.log("val_loss", nn.functional.cross_entropy(logits.float(), y), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = self.trainer.estimated_stepping_batches
        warmup = self.hparams.warmup

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(11, verbose=False)
    checkpoints = ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True, filename="{epoch}-{step}")
    trainer = L.Trainer(
        strategy=CheckpointlessStrategy(),
        accelerator="cpu",
        precision="bf16-mixed",
        max_epochs=a.epochs,
        val_check_interval=0.5,
        gradient_clip_val=0.5,
        callbacks=[checkpoints, EarlyStopping(monitor="val_loss", patience=20), LearningRateMonitor("step")],
        logger=CSVLogger(a.output_dir, name="csv"),
        log_every_n_steps=2,
        default_root_dir=a.output_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), datamodule=Points())
    if trainer.is_global_zero:
        print(f"trained {trainer.global_step} steps, best {checkpoints.best_model_score:.4f}", flush=True)


if __name__ == "__main__":
    main()
