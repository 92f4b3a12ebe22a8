"""A tiny Session job whose last step is slow: a test stops its launcher during that step.

Usage: slow_last_step.py STEPS LAST_STEP_SECONDS

Every rank trains a linear model on batches that are a pure function of (step, rank); the last
step sleeps LAST_STEP_SECONDS before its gradient reduction, so that a signal to the launcher
can arrive while the job is one step from its end.
"""

from __future__ import annotations

import sys
import time

import torch

import checkpointless as cl


def main() -> None:
    steps, last_s = int(sys.argv[1]), float(sys.argv[2])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    session = cl.Session(model, opt, seed=0)
    for step in session.steps(steps):
        with session.attempt():
            g = torch.Generator().manual_seed(step * 1000 + session.dp_rank)
            x = torch.randn(4, 8, generator=g)
            loss = model(x).pow(2).mean()
            loss.backward()
            if step == steps - 1:
                time.sleep(last_s)
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
            session.log(loss=loss)
    session.finish()


if __name__ == "__main__":
    main()
