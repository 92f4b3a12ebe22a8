"""A training script whose loop is shorter on one rank (a mistake): ``session.steps(STEPS - 2)``.

Usage: short_loop.py STEPS MODE. ``rank1``: rank 1 runs fewer steps from the start;
``replacement``: a process started as a spare runs fewer steps once it replaces a rank (a script
that counts its steps from its own snapshot). Every other process runs STEPS steps.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import checkpointless as cl


def main() -> None:
    steps, mode = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    session = cl.Session(model, opt)
    spare = os.environ.get("CHECKPOINTLESS_ROLE") == "spare"
    short = (mode == "rank1" and session.rank == 1) or (mode == "replacement" and spare)
    for step in session.steps(steps - 2 if short else steps):
        with session.attempt():
            g = torch.Generator().manual_seed(step * 10 + session.dp_rank)
            loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
            loss.backward()
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
            session.log(loss=loss)
        time.sleep(0.02)
    session.finish()


if __name__ == "__main__":
    main()
