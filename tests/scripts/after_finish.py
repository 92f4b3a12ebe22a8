"""A few steps, ``session.finish()``, then work after training: rank 0 sleeps SECONDS and writes FILE
(a model saved at the end); rank 1 exits with CODE.

Usage: after_finish.py FILE SECONDS CODE
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import checkpointless as cl


def main() -> None:
    path, seconds, code = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = cl.Session(model, opt, seed=0)
    for step in session.steps(3):
        with session.attempt():
            x = torch.full((2, 4), float(step + session.dp_rank))
            model(x).sum().backward()
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
    session.finish()
    if session.rank == 0:
        time.sleep(seconds)
        path.write_text("saved")
    elif code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
