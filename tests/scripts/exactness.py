"""A training loop that exercises what a replica must hold alike beyond the model's tensors.

Usage: exactness.py STEPS MODE [RANK@STEP]

Modes: ``drift`` (a registered counter drifts on RANK from STEP on); ``unfreeze`` (the first layer
is frozen until STEP, then every rank unfreezes it); ``accumulate`` (two backward passes per step,
the second leaves a layer unused on RANK, the first inside ``session.no_sync()`` at odd steps).
The final state digest is printed by the launcher; every mode must end bitwise equal to its own
fault-free run.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

import checkpointless as cl


class Counter:
    """User state registered with the session (a data position, an EMA, ...)."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = int(state["value"])


def main() -> None:
    steps, mode = int(sys.argv[1]), sys.argv[2]
    rank_at, step_at = (int(v) for v in sys.argv[3].split("@")) if len(sys.argv) > 3 else (-1, -1)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
    )
    if mode == "unfreeze":
        model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    counter = Counter()
    session = cl.Session(model, opt, state={"counter": counter})
    for step in session.steps(steps):
        with session.attempt():
            if mode == "unfreeze" and step == step_at:
                model[0].weight.requires_grad_(True)
            g = torch.Generator().manual_seed(step * 10 + session.dp_rank)
            x = torch.randn(4, 8, generator=g)
            if mode == "accumulate":
                with session.no_sync() if step % 2 else _nothing():
                    model(x).pow(2).mean().backward()
                h = model[1](model[0](torch.randn(4, 8, generator=g)))
                out = model[3](h) if session.rank == rank_at else model[3](model[2](h))
                out.pow(2).mean().backward()
            else:
                model(x).pow(2).mean().backward()
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
            counter.value += 2 if mode == "drift" and session.rank == rank_at and step >= step_at else 1
        time.sleep(0.01)
    session.finish()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
