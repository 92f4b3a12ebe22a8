"""A step cut into shares: ``for share in session.shares():`` around the forward and backward
passes, the batch read through ``session.loader`` (the current share is the loader's data-parallel
rank), a model with BatchNorm and dropout, samples with random noise drawn as they are read.

Usage: shares_train.py STEPS OUT_DIR [--no-loop] [--global-batch N] (16 by default) [--pause S]
(a step lasts at least S seconds, so that a job lasts long enough to change size) [--sync-bn] (the
BatchNorm a SyncBatchNorm) [--draw-before] (a random scale of the loss drawn before the share loop). Every process
appends each committed step's losses to ``OUT_DIR/losses-<pid>.jsonl`` (``{"<step>/<share>": loss}``
a line), and rank 0 writes ``OUT_DIR/final.pt`` (the model's state dict). ``--no-loop``: the same step without the loop (a script that runs at a fixed size).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from loader_epochs import Noisy  # the same dataset (this folder is the script's path)

import checkpointless as cl


def main() -> None:
    steps, out = int(sys.argv[1]), Path(sys.argv[2])
    loop = "--no-loop" not in sys.argv
    batch = int(sys.argv[sys.argv.index("--global-batch") + 1]) if "--global-batch" in sys.argv else 16
    pause = float(sys.argv[sys.argv.index("--pause") + 1]) if "--pause" in sys.argv else 0.0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g)
    data = Noisy(x, x @ torch.linspace(-1, 1, 6).unsqueeze(1))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))  # fmt: skip
    if "--sync-bn" in sys.argv:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    session = cl.Session(model, opt)
    loader = session.loader(data, global_batch_size=batch, shuffle=True, seed=0)
    losses: dict[str, float] = {}

    def share_pass(step: int) -> None:
        xb, yb = loader.batch(step)
        loss = torch.nn.functional.mse_loss(model(xb), yb) * scale
        loss.backward()
        losses[f"{step}/{session.dp_rank}"] = loss.item()
        session.log(loss=loss)

    out.mkdir(parents=True, exist_ok=True)
    for step in session.steps(steps):
        losses.clear()
        with session.attempt() as attempt:
            time.sleep(pause)
            scale = 1.0 + 0.5 * float(torch.rand(())) if "--draw-before" in sys.argv else 1.0
            if loop:
                for _ in session.shares():
                    share_pass(step)
            else:
                share_pass(step)
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
            if "--decay-outside" in sys.argv:
                with torch.no_grad():
                    model[0].weight.mul_(0.999)
        if attempt.committed:
            with open(out / f"losses-{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(losses) + "\n")
    digest = session.finish()
    if session.rank == 0:
        torch.save(model.state_dict(), out / "final.pt")
        print(f"done {steps} steps, state {digest[:16]}")


if __name__ == "__main__":
    main()
