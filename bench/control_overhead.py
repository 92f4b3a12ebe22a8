"""Two costs the hardening added or removed, measured directly (figures quoted in the closing notes).

1. A sealed, synchronous commit record (``ControlClient.emit(..., sync=True)``): what every
   committed step now pays so that a SIGKILL cannot lose its record.
2. How fast a rank two hops from a SIGKILLed one leaves a 4-rank ring all-reduce once its live
   neighbours *destroy* their group (what ``Group.abort`` does), versus only calling
   ``ProcessGroupGloo.abort()`` (the old behaviour: it waits for the collective timeout).

Usage: ``OMP_NUM_THREADS=1 python -m bench.control_overhead [--commits N] [--timeout S]``
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from checkpointless.protocol.vocab import Event


def commit_cost(n: int) -> list[float]:
    from checkpointless.control.auth import new_secret
    from checkpointless.control.client import ControlClient
    from checkpointless.launch.launcher import open_store

    store = open_store("127.0.0.1", 0)
    client = ControlClient(f"127.0.0.1:{store.port}", "w0", new_secret(), heartbeat_interval=0.1)
    client.update(rank=0, gen=0)
    per_round = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n):
            client.emit(Event.STEP_COMMITTED, sync=True, step=i, loss=1.0)
        per_round.append((time.perf_counter() - t0) / n * 1e3)
    client.close()
    return per_round


def _ring_rank(rank: int, port: int, destroy: bool, timeout_s: float, out: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("ring/", store), rank, 4, timedelta(seconds=timeout_s))
    t = torch.ones(2_000_000)
    for i in range(20):
        if rank == 1 and i == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            pg.allreduce([t]).wait()
        except Exception:
            waited = time.perf_counter() - t0
            if rank == 3:
                os.write(out, f"{waited:.4f}\n".encode())
            pg.abort()
            if destroy:
                del pg  # the last reference: the sockets close and the far rank is released
            time.sleep(timeout_s + 2)
            return


def far_rank_release(destroy: bool, timeout_s: float) -> float:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    r, w = os.pipe()
    pids = []
    for rank in range(4):
        pid = os.fork()
        if pid == 0:
            try:
                _ring_rank(rank, store.port, destroy, timeout_s, w)
            finally:
                os._exit(0)
        pids.append(pid)
    os.close(w)
    value = float(os.read(r, 64).decode().split()[0])
    for pid in pids:  # the survivors sleep past the timeout: end them now
        os.kill(pid, signal.SIGKILL)  # rank 1 is a zombie until reaped: the signal is harmless
        os.waitpid(pid, 0)
    return value


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--commits", type=int, default=1000)
    p.add_argument("--timeout", type=float, default=10.0, help="collective timeout of the ring (s)")
    a = p.parse_args()
    costs = commit_cost(a.commits)
    print(f"sealed synchronous commit: median {statistics.median(costs):.3f} ms "
          f"(5 rounds of {a.commits}: {', '.join(f'{c:.3f}' for c in costs)})")  # fmt: skip
    for destroy in (True, False):
        runs = [far_rank_release(destroy, a.timeout) for _ in range(3 if destroy else 1)]
        how = "neighbours destroy their group" if destroy else "neighbours only call abort()"
        print(f"far rank of a 4-rank ring leaves the all-reduce after {', '.join(f'{x:.3f}' for x in runs)} s "
              f"({how}; collective timeout {a.timeout:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
