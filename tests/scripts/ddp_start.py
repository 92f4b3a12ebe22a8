"""A script written for DDP: its model is not seeded alike on every rank (each process draws its
own initial weights, as a script whose data loading consumed randomness differently would), it
resumes at a step of its own (``session.steps(total, start=START)``), and it reads the variables
torchrun sets.

Usage: ddp_start.py STEPS START [MODE]. MODE ``badstart``: rank 1 begins one step later (a mistake).
"""

from __future__ import annotations

import os
import sys
import zlib

import torch

import checkpointless as cl


def main() -> None:
    steps, start = int(sys.argv[1]), int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else ""
    torch.set_num_threads(1)
    torch.manual_seed(zlib.crc32(os.environ.get("CHECKPOINTLESS_PROC", "alone").encode()))  # per process
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    session = cl.Session(model, opt)
    if "CHECKPOINTLESS_STORE" in os.environ:  # what torchrun sets, once the rank is known
        assert os.environ["RANK"] == str(session.rank), (os.environ["RANK"], session.rank)
        assert os.environ["WORLD_SIZE"] == str(session.world_size)
        assert os.environ["LOCAL_WORLD_SIZE"] == str(session.world_size)  # one host
    if mode == "badstart" and session.rank == 1:
        start += 1
    for step in session.steps(steps, start=start):
        with session.attempt():
            g = torch.Generator().manual_seed(step * 10 + session.dp_rank)
            loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
            loss.backward()
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
            session.log(loss=loss)
    session.finish()


if __name__ == "__main__":
    main()
