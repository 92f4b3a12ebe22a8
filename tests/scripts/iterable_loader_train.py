"""A script whose data is an ``IterableDataset`` read through ``session.loader``: a finite stream of
40 samples a pass (``__len__``), reordered each pass by ``set_epoch``, global batch 8: 5 steps a
pass, the passes one after another.

Usage: iterable_loader_train.py STEPS [NUM_WORKERS] [seek]. With ``seek`` the dataset has the fast
positioning hook (``iter_from``); without it the loader positions by reading and discarding.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset

import checkpointless as cl

SAMPLES = 40


class Pairs(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """``(x, y)`` pairs of a fixed regression problem, in an order drawn from the pass."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 6, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 6).unsqueeze(1)
        self.epoch = 0

    def __len__(self) -> int:
        return SAMPLES

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return ((self.x[i], self.y[i]) for i in self._order())


class SeekablePairs(Pairs):
    def iter_from(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return ((self.x[i], self.y[i]) for i in self._order()[index:])


def main() -> None:
    steps = int(sys.argv[1])
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    data = SeekablePairs() if "seek" in sys.argv[3:] else Pairs()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    session = cl.Session(model, opt)
    loader = session.loader(data, global_batch_size=8, num_workers=workers)
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
