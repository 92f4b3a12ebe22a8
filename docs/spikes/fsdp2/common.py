"""Shared harness: launch N spawned workers that connect to one TCPStore on 127.0.0.1."""
import io, os, queue, sys, time, traceback
os.environ["OMP_NUM_THREADS"] = "1"
import torch
import torch.multiprocessing as mp
import torch.distributed as dist
from datetime import timedelta

TIMEOUT = timedelta(seconds=30)


def _entry(fn, rank, world, port, q, extra):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
        res = fn(rank, world, store, *extra)
        buf = io.BytesIO(); torch.save(res, buf)  # plain bytes: no shared-memory fds across exit
        q.put((rank, "ok", buf.getvalue()))
    except BaseException as e:
        q.put((rank, "err", f"{type(e).__name__}: {e}\n" + traceback.format_exc()[-3000:]))


def launch(fn, world=4, extra=(), timeout=90):
    torch.set_num_threads(1)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, master.port, q, extra)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.time() + timeout
    try:
        while len(out) < world and time.time() < deadline:
            try:
                r, st, res = q.get(timeout=1)
                if st == "ok":
                    res = torch.load(io.BytesIO(res), weights_only=False)
                out[r] = (st, res)
                if os.environ.get("SPIKE_VERBOSE"):
                    print(f"[launch] result of {r} at {time.time() - (deadline - timeout):.1f}s")
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
    finally:
        t_res = time.time()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if os.environ.get("SPIKE_VERBOSE"):
            print(f"[launch] all results by {t_res - (deadline - timeout):.1f}s, processes gone {time.time() - t_res:.1f}s later")
    return out


def tiny_model(seed=0):
    torch.manual_seed(seed)
    # 15 outputs: uneven shards over 2 ranks (8 and 7 rows)
    return torch.nn.Sequential(torch.nn.Linear(8, 15), torch.nn.ReLU(), torch.nn.Linear(15, 4))


def batch(step, dp_rank, n=4):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
