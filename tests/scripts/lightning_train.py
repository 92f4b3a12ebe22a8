"""A Lightning script of the usual shape, made checkpointless by its ``strategy=`` argument (the
integration tests run it as it is): a small classifier with dropout and batch norm, a DataLoader
over a map-style dataset, an LR scheduler stepped every step, ``self.log(..., sync_dist=True)`` in
training and validation, gradient clipping, validation every epoch.

Usage: lightning_train.py OUTPUT_DIR [--epochs N] [--manual] [--accumulate N] [--stream STEPS]
                          [--raise-at STEP:MICRO:RANK] [--save-every N] [--save-last-link] [--resume CKPT]
                          [--die-in-save STEP[:MATCH]]
(``--manual``: manual optimization, refused; ``--accumulate N``: ``accumulate_grad_batches=N``;
``--raise-at``: ``training_step`` raises once, on that rank, at that micro-batch of that step;
``--stream STEPS``: the train set an endless stream, an ``IterableDataset`` without ``__len__``
shuffled by its own seed, read for ``max_steps=STEPS`` in epochs of 6 batches; ``--save-every N``:
a ``ModelCheckpoint`` more, every N steps into ``OUTPUT_DIR/every``, keeping them all;
``--save-last-link``: the default ``ModelCheckpoint`` with ``save_last="link"``;
``--resume CKPT``: ``fit(ckpt_path=CKPT)``; ``--die-in-save STEP[:MATCH]``: the process writing
the checkpoint of that step whose path contains MATCH (``every``: ``--save-every``'s) is SIGKILLed
once, before the file is written, as a power loss would stop it)
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, WeightedRandomSampler

from checkpointless.integrations.lightning import CheckpointlessStrategy


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Fixed pseudo-random points in 3 classes (a real script reads files)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, :3].sum(1) > 0).long() + (self.x[:, 3] > 1).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Endless passes over ``inner``, each in an order drawn from the stream's own seed and the
    pass's number (a streaming corpus with a shuffle of its own); no ``__len__``."""

    def __init__(self, inner: Points, seed: int) -> None:
        self.inner, self.seed = inner, seed

    def __iter__(self):  # type: ignore[no-untyped-def]
        n = 0
        while True:
            order = torch.randperm(len(self.inner), generator=torch.Generator().manual_seed(self.seed + n))
            for i in order.tolist():
                yield self.inner[i]
            n += 1


class Classifier(L.LightningModule):
    def __init__(self, manual: bool = False, raise_at: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        self.raise_at = raise_at  # (step, micro-batch, rank): raise there, once
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3)
        )
        self.automatic_optimization = not manual

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        micro = batch_idx % self.trainer.accumulate_grad_batches
        if self.raise_at == (self.trainer.global_step, micro, self.global_rank):
            self.raise_at = None
            raise RuntimeError(
                f"a fault of the script's own at micro-batch {micro} of step {self.trainer.global_step}"
            )
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()  # type: ignore[union-attr]
            self.manual_backward(loss)
            opt.step()  # type: ignore[union-attr]
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def die_in_save(strategy: CheckpointlessStrategy, step: int, match: str, marker: str) -> None:
    """SIGKILL the process writing the checkpoint of ``step`` whose path contains ``match``, once
    (``marker``: the job already lost one), before the file is written."""
    io = strategy.checkpoint_io
    real = io.save_checkpoint

    def dying(checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if checkpoint["global_step"] == step and match in str(path) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        real(checkpoint, path, storage_options=storage_options)

    io.save_checkpoint = dying  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--manual", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--stream", type=int, default=0, metavar="STEPS")
    p.add_argument("--raise-at", default=None, metavar="STEP:MICRO:RANK")
    p.add_argument("--save-every", type=int, default=0, metavar="N")
    p.add_argument("--save-last-link", action="store_true")
    p.add_argument("--resume", default=None, metavar="CKPT")
    p.add_argument("--die-in-save", default=None, metavar="STEP[:MATCH]")
    p.add_argument("--weighted", action="store_true", help="a WeightedRandomSampler of 80 draws an epoch")
    a = p.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(7, verbose=False)
    raise_at = tuple(int(v) for v in a.raise_at.split(":")) if a.raise_at else None
    model = Classifier(manual=a.manual, raise_at=raise_at)  # type: ignore[arg-type]
    train = DataLoader(Points(96, 1), batch_size=8, shuffle=True)
    if a.weighted:  # class imbalance evened out: every third sample drawn 4 times as often, with replacement
        weights = [4.0 if i % 3 == 0 else 1.0 for i in range(96)]
        train = DataLoader(Points(96, 1), batch_size=8, sampler=WeightedRandomSampler(weights, 80))
    stream = {}
    if a.stream:
        train = DataLoader(Stream(Points(96, 1), seed=3), batch_size=8)
        stream = {"max_steps": a.stream, "limit_train_batches": 6}
    val = DataLoader(Points(32, 2), batch_size=16)
    strategy = CheckpointlessStrategy()
    every = []
    if a.save_every:
        every = [ModelCheckpoint(dirpath=f"{a.output_dir}/every", filename="{step}",
                                 every_n_train_steps=a.save_every, save_top_k=-1)]  # fmt: skip
    if a.save_last_link:  # the default ModelCheckpoint (top 1 at epochs' ends) and a last.ckpt link to it
        every.append(ModelCheckpoint(save_last="link"))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=a.epochs,
        gradient_clip_val=None if a.manual else 1.0,  # Lightning's own rule
        accumulate_grad_batches=a.accumulate,
        log_every_n_steps=2,
        default_root_dir=a.output_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=every,
        **stream,  # type: ignore[arg-type]
    )
    if a.die_in_save is not None:
        step, _, match = a.die_in_save.partition(":")
        die_in_save(strategy, int(step), match or "every", os.path.join(a.output_dir, ".died-in-save"))
    trainer.fit(model, train, val, ckpt_path=a.resume)
    if trainer.is_global_zero:
        # the default process group: the session's own (no env:// group of Lightning's), or one of
        # a single rank alone
        group = strategy.session.process_group if strategy.session is not None else None
        if group is not None and group.pg is dist.group.WORLD:
            owner = "the session's"
        else:
            owner = f"of {dist.get_world_size()}" if dist.is_initialized() else "none"
        print(
            f"trained {trainer.global_step} steps, val_loss {float(trainer.callback_metrics['val_loss']):.4f}, "
            f"epoch {trainer.current_epoch}, best {_best(trainer)}, ranks {trainer.world_size}, "
            f"process group: {owner}, state {strategy.digest}",
            flush=True,
        )


def _best(trainer: L.Trainer) -> str:
    """The checkpoint callback's best file (as the script would hand it to ``trainer.test``)."""
    callback = trainer.checkpoint_callback
    return os.path.basename(callback.best_model_path) if callback is not None else "none"


if __name__ == "__main__":
    main()
