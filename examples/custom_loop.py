"""Any nn.Module with checkpointless: a complete custom training loop.

Run it fault tolerant, with a worker killed at step 10:

    checkpointless launch --workers 2 --spares 1 --steps 40 \\
        --fault kill:rank=1@step=10 --out runs/custom -- python examples/custom_loop.py --steps 40

or as a single process, without fault tolerance, for debugging:

    python examples/custom_loop.py --steps 40
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import checkpointless as cl


def batch(step: int, dp_rank: int, dp_size: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A pure function of (step, rank): a replacement reads exactly what the failed rank would have."""
    g = torch.Generator().manual_seed(step * 1_000_003 + dp_rank * 7919 + dp_size)
    x = torch.randn(size // dp_size, 16, generator=g)
    y = x @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(size // dp_size, 1, generator=g)
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)

    # Everything that must survive a failure is registered; spares wait here for a rank.
    session = cl.Session(model, optimizer, state={"scheduler": scheduler})
    for step in session.steps(args.steps):
        with session.attempt() as attempt:
            x, y = batch(step, session.dp_rank, session.dp_size)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            session.reduce_gradients()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=False)
            session.log(loss=loss)  # recorded only if this step commits
        if attempt.committed:
            final_loss = loss.item()
    digest = session.finish()
    if session.rank == 0:
        print(f"done: {args.steps} steps, final loss {final_loss:.4f}, state {digest[:16]}")


if __name__ == "__main__":
    main()
