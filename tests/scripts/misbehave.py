"""A training script that makes one mistake (or suffers one slow step) on purpose.

Usage: misbehave.py STEPS MODE [RANK@STEP]

Modes: ``clean``; ``skip_reduce`` (RANK skips reduce_gradients at STEP); ``shapes`` (RANK builds
a wider layer); ``no_finish`` (every rank forgets session.finish()); ``log_outside`` (session.log
after the block); ``slow_step`` (RANK sleeps 3 s once at STEP, heartbeat alive); ``gil_pause``
(RANK holds the GIL for 2 s once at STEP, in native code: the heartbeat thread cannot run, as in a
full garbage collection); ``spare_dies``
(a spare exits with code 1 while starting); ``exception_first`` (the loop of the recipe style: an
exception at step 0, then code after the block); ``gloo_error`` (RANK's step raises, every time
from STEP on, a RuntimeError whose text names gloo: the user's, not a peer's); ``no_attempt`` (the
loop body has no ``with session.attempt():``); ``outside`` (RANK raises, outside the step, before
STEP: every process that holds the rank does); ``outside_once`` (the first process of RANK only raises
there, as a user callback after a step might: its replacement trains on); ``outside_all`` (every rank
raises there at once: a mistake in the script, not a fault).
"""

from __future__ import annotations

import os
import sys
import time

import torch

import checkpointless as cl


def main() -> None:
    steps, mode = int(sys.argv[1]), sys.argv[2]
    target = tuple(int(v) for v in sys.argv[3].split("@")) if len(sys.argv) > 3 else (-1, -1)
    if mode == "spare_dies" and os.environ.get("CHECKPOINTLESS_ROLE") == "spare":
        print("this spare cannot start: no accelerator found (simulated)", flush=True)
        sys.exit(1)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    wide = mode == "shapes" and os.environ.get("CHECKPOINTLESS_PROC") == f"w{target[0]}"
    model = torch.nn.Sequential(torch.nn.Linear(8, 9 if wide else 8), torch.nn.Linear(9 if wide else 8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    session = cl.Session(model, opt)
    slowed = False
    for step in session.steps(steps):
        if mode == "no_attempt":
            continue
        if mode == "outside_all" and step == target[1]:
            raise KeyError("val_loss")  # a callback's mistake: every rank makes it at once
        if mode == "outside" and session.rank == target[0] and step == target[1]:
            raise ValueError("DistributedSampler(dataset) needs the rank: build it after Session()")
        if (
            mode == "outside_once"
            and os.environ.get("CHECKPOINTLESS_PROC") == f"w{target[0]}"
            and step == target[1]
        ):
            raise OSError("the user's checkpoint save failed: disk full")
        with session.attempt() as attempt:
            g = torch.Generator().manual_seed(step * 10 + session.dp_rank)
            x = torch.randn(4, 8, generator=g)
            loss = model(x).pow(2).mean()
            loss.backward()
            here = (session.rank, step) == target
            if mode == "slow_step" and here and not slowed:
                slowed = True
                time.sleep(3.0)  # a slow read or a GC pause: the heartbeat thread keeps beating
            if mode == "gil_pause" and here and not slowed:
                slowed = True
                t = time.perf_counter()
                sum(range(1_000_000))
                per_item = (time.perf_counter() - t) / 1_000_000
                sum(range(int(2.0 / per_item)))  # one C call holding the GIL throughout
            if mode == "exception_first" and step == 0 and session.rank == 1 and not slowed:
                slowed = True
                raise RuntimeError("a recoverable error at step 0")
            if mode == "gloo_error" and session.rank == target[0] and step >= target[1]:
                raise RuntimeError("[gloo/transport] the user's own data pipeline failed")
            if not (mode == "skip_reduce" and here):
                session.reduce_gradients()
            opt.step()
            opt.zero_grad()
            if mode != "log_outside":
                session.log(loss=loss)
        if mode == "log_outside":
            session.log(loss=loss.item())
        if attempt.committed and step % 5 == 0:
            session.emit("probe", value=loss.detach())  # a one-element tensor converts
        time.sleep(0.04 if mode == "spare_dies" else 0.01)
    if mode != "no_finish":
        session.finish()


if __name__ == "__main__":
    main()
