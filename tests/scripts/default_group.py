"""A script written for torchrun's default process group: it reads its rank with
``dist.get_rank()``, splits its data with ``DistributedSampler(dataset)`` (no arguments), all-reduces
its loss for a log line inside the step, and evaluates every other step with an ``all_reduce`` of
its own between steps (``session.between_steps()``).

Usage: default_group.py STEPS [FAULT [RANK]] [--sharded]. ``--sharded``: the model is FSDP2 on the
session's mesh (``Session(build=...)``; its evaluation all-gathers the shards). FAULT strikes RANK (default 1) in generation 0, in
the evaluation after step 3, before its all-reduce: ``kill`` (SIGKILL), ``hang`` (SIGSTOP) or
``raise`` (an exception of the script's own). Prints one ``eval STEP COMPLETED VALUE`` line per
evaluation.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, TensorDataset

import checkpointless as cl

BATCH = 4  # per rank


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def build(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def main() -> None:
    sharded = "--sharded" in sys.argv
    argv = [a for a in sys.argv if a != "--sharded"]
    steps = int(argv[1])
    fault = argv[2] if len(argv) > 2 else ""
    victim = int(argv[3]) if len(argv) > 3 else 1
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    held_out = (torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    if sharded:
        session = cl.Session(build=build)
    else:
        model = make_model()
        session = cl.Session(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    assert dist.is_initialized(), "the session forms the default process group"
    assert (dist.get_rank(), dist.get_world_size()) == (session.rank, session.world_size)
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # rank and size from the default group
    per_epoch = len(sampler) // BATCH
    for step in session.steps(steps):
        epoch, i = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        idx = list(sampler)[i * BATCH : (i + 1) * BATCH]
        x, y = data[idx]
        with session.attempt():
            assert dist.get_rank() == session.rank  # this generation's group
            model, opt = session.model, session.optimizer
            assert model is not None and opt is not None
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # the script's own collective, inside the step
            session.log(loss=mean / dist.get_world_size())
        if step % 2 == 1:
            with session.between_steps() as block:
                if fault and session.generation == 0 and session.rank == victim and step == 3:
                    if fault == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    elif fault == "hang":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    else:
                        raise ValueError("the evaluation failed on this rank")
                part = slice(dist.get_rank(), None, dist.get_world_size())
                model = session.model
                assert model is not None
                with torch.no_grad():
                    total = torch.nn.functional.mse_loss(
                        model(held_out[0][part]), held_out[1][part], reduction="sum"
                    )
                dist.all_reduce(total)
            value = float(total) if block.completed else float("nan")
            print(f"eval {step} {int(block.completed)} {value:.6f}", flush=True)
    session.finish()


if __name__ == "__main__":
    main()
