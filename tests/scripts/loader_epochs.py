"""A DDP-style script with a map-style dataset read through ``session.loader`` (epochs, shuffling,
DataLoader worker processes) instead of a ``DataLoader`` with a ``DistributedSampler``; with
``--dataloader``, the script's own ``DataLoader`` and ``DistributedSampler`` handed to
``session.loader`` (the same batches). The model has dropout; the dataset adds random noise to
each sample as it reads it (a random transform, drawn in the DataLoader's worker processes).

Usage: loader_epochs.py STEPS [NUM_WORKERS] [--dataloader]. 40 samples, global batch 8: 5 steps an epoch.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import checkpointless as cl


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples ``(x_i + noise, y_i)``: the noise drawn from torch's global generator at each read."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i] + 0.1 * torch.randn_like(self.x[i]), self.y[i]


def seed_worker(worker_id: int) -> None:
    """A DDP script's usual ``worker_init_fn`` (PyTorch's reproducibility notes)."""
    import random

    random.seed(torch.initial_seed() % 2**32)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--dataloader"]
    steps = int(args[0])
    workers = int(args[1]) if len(args) > 1 else 0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 6, generator=g)
    data = Noisy(x, x @ torch.linspace(-1, 1, 6).unsqueeze(1))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    session = cl.Session(model, opt)
    if "--dataloader" in sys.argv:  # what a DDP script built, handed over (4 per rank at 2 ranks)
        sampler = DistributedSampler(
            data, num_replicas=session.dp_size, rank=session.dp_rank, shuffle=True, seed=0
        )
        loader = session.loader(DataLoader(data, batch_size=8 // session.dp_size, sampler=sampler,
                                           num_workers=workers, drop_last=True,
                                           worker_init_fn=seed_worker))  # fmt: skip
    else:
        loader = session.loader(data, global_batch_size=8, shuffle=True, seed=0, num_workers=workers)
    for step in session.steps(steps):
        with session.attempt():
            xb, yb = loader.batch(step)
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
            session.log(loss=loss, epoch=loader.epoch(step))
    loader.close()
    digest = session.finish()
    if session.rank == 0:
        print(f"done {steps} steps, state {digest[:16]}")


if __name__ == "__main__":
    main()
