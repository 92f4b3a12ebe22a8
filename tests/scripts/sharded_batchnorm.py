"""A sharded (FSDP2 HSDP) loop whose model has BatchNorm, whose running statistics every rank
moves from its own batch, and a constant buffer: ``reduce_gradients`` must broadcast rank 0's
buffers at every step here (replicas would differ after the first one otherwise, which the first
consistency check stops), and a recovery must carry them. Usage as ``examples/sharded_loop.py``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from sharded_loop import batch

import checkpointless as cl


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.bn, self.out = nn.Linear(30, 32), nn.BatchNorm1d(32), nn.Linear(32, 15)
        self.register_buffer("scale", torch.full((15,), 0.5))  # never changes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x)))) * self.scale


def build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Net()
    fully_shard(model.out, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    session = cl.Session(build=build)
    for step in session.steps(args.steps):
        with session.attempt():
            model, optimizer = session.model, session.optimizer
            assert model is not None and optimizer is not None
            x, y = batch(step, session.dp_rank, session.dp_size)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            session.reduce_gradients()
            optimizer.step()
            optimizer.zero_grad()
            session.log(loss=loss)
    session.finish()


if __name__ == "__main__":
    main()
