"""A model whose buffers move on one rank only, at some steps: a constant table (a rotary one's
kind, never changed) and a counter that rank 1's forward pass bumps at steps 3 and 6 (a
data-dependent update). As with ``DistributedDataParallel``'s ``broadcast_buffers``, rank 0's
buffers win; they are broadcast at the steps where some rank's moved and at no other.

Prints ``BUFFERS broadcasts=N seen=V`` at the end: the broadcasts this process took part in after
its session began, and its counter.

Usage: buffer_moves.py STEPS
"""

from __future__ import annotations

import sys

import torch

import checkpointless as cl


class Counted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.register_buffer("table", torch.arange(16.0), persistent=False)  # constant
        self.register_buffer("seen", torch.zeros(()))  # moves on rank 1 at BUMPS
        self.bump = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bump:
            self.seen += 1
        return self.lin(x) + self.table[:1]


BUMPS = (3, 6)


def main() -> None:
    steps = int(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Counted()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    session = cl.Session(model, opt)
    broadcasts = 0
    buffers = session._model.buffers
    real = buffers.sync

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal broadcasts
        broadcasts += 1
        return real(*args, **kwargs)

    buffers.sync = counted  # type: ignore[method-assign]
    for step in session.steps(steps):
        with session.attempt():
            model.bump = session.rank == 1 and step in BUMPS
            g = torch.Generator().manual_seed(step * 10 + session.dp_rank)
            loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
            loss.backward()
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
    session.finish()
    print(f"BUFFERS broadcasts={broadcasts} seen={float(model.seen)}", flush=True)


if __name__ == "__main__":
    main()
