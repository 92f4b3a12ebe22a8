"""Plain FSDP2 HSDP, no fault tolerance: the steady-state reference of sharded checkpointless.

``WORLD`` processes started directly (``init_process_group`` over a ``TCPStore``), the recipe's
model sharded exactly as ``checkpointless run`` shards it (``recipes.train.shard_model`` on a
``replicate x shard`` mesh from ``init_device_mesh``), the same data pipeline, optimizer, LR
schedule and gradient clipping, the same per-rank slice of each batch; no session, no spare, no
control store. Rank 0 writes the wall-clock time at the end of every step to ``times.json``.

Usage (from ``bench/hsdp.py``): ``python bench/baselines/fsdp2_plain.py RECIPE --workers 4 --shards 2
--out DIR [--set key=value]... [--session-each]`` (``--session-each``: every rank in a session of its
own, hence, on Linux with scheduling autogroups, in a scheduling group of its own)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from checkpointless.corpus.cached_dataset import CachedDataset
    from checkpointless.corpus.shm_cache import ShmBatchCache
    from checkpointless.recipes.config import load_recipe
    from checkpointless.recipes.preflight import open_dataset
    from checkpointless.recipes.train import build_training

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = load_recipe(args.recipe, args.overrides, check_data=False)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world // args.shards, args.shards), mesh_dim_names=("replicate", "shard"))
    training = build_training(cfg, mesh)
    cache = ShmBatchCache(f"fsdp2-plain-{os.getppid()}", cleanup_on_exit=False)
    data = CachedDataset(lambda: open_dataset(cfg), cache)
    steps = cfg.train.steps
    times: list[float] = []
    for step in range(steps):
        torch.manual_seed(step * 1_000_003 + rank)  # the session reseeds every step too
        data.prefetch(range(step + 1, min(steps, step + 3)), rank, world)
        inputs, targets = data.batch(step, rank, world)
        loss = training.model(inputs, targets)
        loss.backward()
        training.update()
        float(loss.item())
        times.append(time.time())
    data.stop(timeout=5)
    if rank == 0:
        (Path(args.out) / "times.json").write_text(json.dumps(times))
        cache.cleanup()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("recipe")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--set", action="append", default=[], dest="overrides")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--session-each", action="store_true", help="start every rank in a session of its own")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.workers):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.workers), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env,
                                      start_new_session=args.session_each))  # fmt: skip
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
