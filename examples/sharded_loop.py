"""A sharded model (FSDP2 / HSDP) with checkpointless: a complete custom training loop.

Four workers as 2 replicas x 2 shards, one spare, a worker killed at step 10; the replacement
receives only its own shard, from the other replica of that shard:

    checkpointless launch --workers 4 --shards 2 --spares 1 --steps 30 \\
        --fault kill:rank=1@step=10 --out runs/sharded -- python examples/sharded_loop.py --steps 30

or as a single process (a 1 x 1 mesh), without fault tolerance, for debugging:

    python examples/sharded_loop.py --steps 30

With ``--min-workers 2`` the job goes on with one replica when one is lost and no spare is ready
(the loop over ``session.shares()`` then runs each rank's part of both replicas' shares), and
grows back to 4 ranks when spares are ready again.

FSDP2 binds a module to its process groups for good, so the session builds the model again in
every generation (after each recovery) by calling ``build(mesh)``; the loop therefore uses
``session.model``, ``session.optimizer`` and ``session.state[...]``, never variables of its own
that would keep an old generation's model.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import checkpointless as cl


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


def make_model(width: int = 32, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same initial weights
    # 30 inputs and 15 outputs: shards of uneven size over 2 ranks
    return nn.Sequential(nn.Linear(30, width), *[Block(width) for _ in range(depth)], nn.Linear(width, 15))


def build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """One generation's model, sharded on ``mesh`` (replicate x shard), its optimizer and schedule."""
    model = make_model()
    for block in model[1:-1]:
        fully_shard(block, mesh=mesh)  # one all-gather per block in forward and backward
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    return model, optimizer, {"scheduler": scheduler}


def batch(step: int, dp_rank: int, dp_size: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A pure function of (step, rank): a replacement reads exactly what the failed rank would have."""
    g = torch.Generator().manual_seed(step * 1_000_003 + dp_rank * 7919 + dp_size)
    x = torch.randn(max(1, size // dp_size), 30, generator=g)
    return x, x[:, :15].sin() + 0.05 * torch.randn(x.shape[0], 15, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)

    session = cl.Session(build=build)  # spares wait here for a rank
    for step in session.steps(args.steps):
        with session.attempt() as attempt:
            model, optimizer = session.model, session.optimizer
            assert model is not None and optimizer is not None
            for _share in session.shares():  # one per rank, or more once an elastic job shrank
                x, y = batch(step, session.dp_rank, session.dp_size)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()  # FSDP2 reduce-scatters within a replica, all-reduces across replicas
                session.log(loss=loss)  # the mean over this rank's shares, if this step commits
            session.reduce_gradients()  # a marker here: the step's reduction happened in backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            session.state["scheduler"].step()
            optimizer.zero_grad()
        if attempt.committed:
            final_loss = loss.item()
    digest = session.finish()
    if session.rank == 0:
        print(f"done: {args.steps} steps, final loss {final_loss:.4f}, shard state {digest[:16]}")


if __name__ == "__main__":
    main()
