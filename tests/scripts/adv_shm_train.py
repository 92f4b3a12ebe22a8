"""A tiny training script that keeps its batches in the job's node cache (``/dev/shm``), like recipes do.

Usage: adv_shm_train.py STEPS [SECONDS_PER_STEP [SEED]]

Each rank writes its batch of every step to ``ShmBatchCache(<job id>)`` (so the
job's ``/dev/shm/checkpointless-<job id>`` directory exists while it runs) and
reads it back. SECONDS_PER_STEP (default 0) sleeps in each step, so that a test
can interrupt a job mid-run without burning CPU. SEED (default 0) seeds the model and the data.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import checkpointless as cl
from checkpointless.corpus.shm_cache import ShmBatchCache
from checkpointless.protocol.env import ENV_JOB_ID


def main() -> None:
    steps = int(sys.argv[1])
    pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cache = ShmBatchCache(os.environ.get(ENV_JOB_ID, f"local-{os.getpid()}"), cleanup_on_exit=False)
    session = cl.Session(model, opt, seed=seed)  # a spare waits here for a rank
    for step in session.steps(steps):
        with session.attempt():
            batch = cache.get(step, session.dp_rank, session.dp_size)
            if batch is None:
                g = torch.Generator().manual_seed(seed * 10**6 + step * 1000 + session.dp_rank)
                x = torch.randint(0, 100, (4, 8), generator=g)
                cache.put(step, session.dp_rank, session.dp_size, (x, x))
                batch = (x, x)
            loss = model(batch[0].float() / 100).pow(2).mean()
            loss.backward()
            if pause:
                time.sleep(pause)
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
            session.log(loss=loss)
    session.finish()


if __name__ == "__main__":
    main()
