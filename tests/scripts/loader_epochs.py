"""A DDP-style script with a map-style dataset read through ``session.loader`` (epochs, shuffling,
DataLoader worker processes) instead of a ``DataLoader`` with a ``DistributedSampler``.

Usage: loader_epochs.py STEPS [NUM_WORKERS]. 40 samples, global batch 8: 5 steps an epoch.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.data import TensorDataset

import checkpointless as cl


def main() -> None:
    steps = int(sys.argv[1])
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 6, generator=g)
    data = TensorDataset(x, x @ torch.linspace(-1, 1, 6).unsqueeze(1))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    session = cl.Session(model, opt)
    loader = session.loader(data, global_batch_size=8, shuffle=True, num_workers=workers)
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
