"""A training script whose step gets stuck (heartbeat alive, no progress) once, on one rank.

Usage: stuck_step.py STEPS MARKER_DIR [RANK@STEP]
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

import checkpointless as cl


def main() -> None:
    steps, marker_dir = int(sys.argv[1]), Path(sys.argv[2])
    stuck = tuple(int(v) for v in sys.argv[3].split("@")) if len(sys.argv) > 3 else None
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = cl.Session(model, opt)
    for step in session.steps(steps):
        with session.attempt():
            g = torch.Generator().manual_seed(step * 10 + session.dp_rank)
            x = torch.randn(4, 8, generator=g)
            loss = model(x).pow(2).mean()
            loss.backward()
            marker = marker_dir / "stuck-once"
            if stuck == (session.rank, step) and not marker.exists():
                marker.touch()
                threading.Event().wait()  # a deadlock in user code: the process lives, the step never ends
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
    session.finish()


if __name__ == "__main__":
    main()
