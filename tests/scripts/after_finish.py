"""A few steps, ``session.finish()``, then work after training: rank r sleeps SECONDS_r, writes
FILE.r (a model saved at the end) and exits with CODE_r.

Usage: after_finish.py FILE SECONDS_0 CODE_0 SECONDS_1 CODE_1
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import checkpointless as cl


def main() -> None:
    path, plan = Path(sys.argv[1]), sys.argv[2:]
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
    seconds, code = float(plan[2 * session.rank]), int(plan[2 * session.rank + 1])
    time.sleep(seconds)
    path.with_name(f"{path.name}.{session.rank}").write_text("saved")
    raise SystemExit(code)


if __name__ == "__main__":
    main()
