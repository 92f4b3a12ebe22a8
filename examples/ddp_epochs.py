"""A torchrun/DDP script of the common shape, ported: a ``Trainer`` class, a map-style dataset read
by epochs (what a ``DataLoader`` with a ``DistributedSampler`` gave it), and a snapshot file the
script writes itself. docs/guide/porting.md shows the changes line by line.

    checkpointless launch --workers 2 --spares 1 --fault kill:rank=1@step=7 --out runs/epochs \\
        -- python examples/ddp_epochs.py --epochs 4 --snapshot runs/epochs/snapshot.pt
    python examples/ddp_epochs.py --epochs 4      # alone: one process, no fault tolerance
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import checkpointless as cl


def make_dataset(n: int = 256) -> Dataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 20, generator=g)
    return TensorDataset(
        x, (x @ torch.linspace(-1, 1, 20)).unsqueeze(1) + 0.05 * torch.randn(n, 1, generator=g)
    )


class Trainer:
    def __init__(self, model: nn.Module, data: Dataset, batch_size: int, snapshot: str | None) -> None:
        self.model = model  # no DistributedDataParallel: the session reduces the gradients
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.snapshot_path = snapshot
        start = self._load_snapshot()  # every rank loads the same file, before the session
        self.session = cl.Session(self.model, self.optimizer)
        # what DataLoader(data, batch_size, sampler=DistributedSampler(data)) gave each rank per step,
        # as a function of the step: the global batch is batch_size x ranks samples
        self.loader = self.session.loader(
            data, global_batch_size=batch_size * self.session.dp_size, shuffle=True
        )
        self.start = start

    def _load_snapshot(self) -> int:
        if not self.snapshot_path or not os.path.exists(self.snapshot_path):
            return 0
        snap = torch.load(self.snapshot_path, weights_only=True)
        self.model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(snap["optimizer"])
        return int(snap["step"])

    def _save_snapshot(self, step: int) -> None:
        if self.snapshot_path and self.session.rank == 0:  # after a commit: the state of a whole step
            tmp = self.snapshot_path + ".tmp"
            torch.save(
                {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step},
                tmp,
            )
            os.replace(tmp, self.snapshot_path)

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.session.reduce_gradients()
        self.optimizer.step()
        return loss

    def train(self, epochs: int, save_every: int) -> str:
        per_epoch = self.loader.steps_per_epoch
        for step in self.session.steps(epochs * per_epoch, start=self.start):
            with self.session.attempt() as attempt:
                x, y = self.loader.batch(step)  # inside the attempt: a re-executed step reads it again
                loss = self._run_batch(x, y)
                self.session.log(loss=loss, epoch=self.loader.epoch(step))
            if attempt.committed and (step + 1) % (save_every * per_epoch) == 0:
                self._save_snapshot(step + 1)
        self.loader.close()
        return self.session.finish()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="per rank, as with a DistributedSampler")
    p.add_argument("--save-every", type=int, default=2, help="epochs between snapshots")
    p.add_argument("--snapshot", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    # the session starts every replica from rank 0's weights (as DDP does), so the ranks need not
    # agree on a seed; this one makes two runs comparable bit for bit
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 1))
    trainer = Trainer(model, make_dataset(), a.batch_size, a.snapshot)
    digest = trainer.train(a.epochs, a.save_every)
    if trainer.session.rank == 0:
        print(f"done {a.epochs} epochs, state {digest[:16]}")


if __name__ == "__main__":
    main()
