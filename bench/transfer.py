"""State-transfer throughput: ``send_state``/``recv_state`` between two processes over gloo on loopback.

For each state size (10 MB, 100 MB, 1 GB, 2 GB; quick: 10 MB, 100 MB) two real processes form a
``checkpointless.comm.Group`` on a ``TCPStore`` hosted by this process. Rank 0 sends, rank 1
receives. Per repetition, after a barrier, the receiver times:

- ``into``: ``recv_state(into=...)`` from the barrier, which both ranks leave together, to the
  verified state, received in place into the receiver's own tensors of the same structure (what a
  replacement does: its model and optimizer exist), under a job key as the launcher runs it;
- ``wire_into``: the same tensors with plain ``Group.send``/``Group.recv`` into the same
  receiver's tensors (no metadata, no check): raw gloo moving the same bytes to the same place.
  The target is ``into`` at least 0.8x its throughput, the ratio taken within each repetition;
- ``e2e``: ``recv_state`` into freshly allocated tensors (first-touch page faults included);
- ``wire``: plain ``Group.send``/``Group.recv`` into one 16 MiB buffer freed and allocated again
  per tensor (the allocator hands the same memory back, so the destination stays in cache: no
  receiver that keeps the bytes can do this; shown because earlier runs used it as the reference);
- ``check``: ``checkpointless.state.transfer._seal_tensors`` (the GMAC tags the protocol computes) over the
  same tensors, timed in each process (the protocol checks on both sides, per tensor in a thread
  pool, while the tensors are on the wire, so check and wire time overlap and the columns of the
  split need not add up).

The floor is a plain in-memory copy of the same bytes in one process (``clone()`` and ``copy_``
into a preallocated buffer), single-threaded like every worker.

Usage: ``python -m bench.transfer [--quick] [--sizes BYTES,...] [--reps N]`` (writes
``bench/out/transfer.json`` and prints the tables).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench import common

CHUNK_BYTES = 16 * 2**20  # the state is a dict of float32 tensors of at most 16 MiB (like a model's)
MB = 10**6


def make_state(nbytes: int, seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}": torch.rand(k, generator=g) for i, k in enumerate(_chunk_sizes(nbytes))}
    return {"model": tensors, "progress": {"committed_step": 7}}


def _chunk_sizes(nbytes: int) -> list[int]:
    n_floats, per, sizes = nbytes // 4, CHUNK_BYTES // 4, []
    while n_floats > 0:
        sizes.append(min(per, n_floats))
        n_floats -= sizes[-1]
    return sizes


def _tensors(state: dict[str, Any]) -> list[Any]:
    return list(state["model"].values())


# -- the two processes ------------------------------------------------------------------
def _raw_wire(group: Any, tensors: list[Any] | None, n: int, dest: Any) -> float:
    """Seconds for plain ``Group.send``/``Group.recv`` of ``tensors`` (rank 0) into ``dest(i)``
    (rank 1; the reference is dropped right after each receive), barrier to barrier."""
    group.barrier()
    t0 = time.perf_counter()
    if tensors is not None:
        for t in tensors:
            group.send(t, 1)
    else:
        for i in range(n):
            group.recv(dest(i), 0)
    group.barrier()
    return time.perf_counter() - t0


def worker(rank: int, port: int, sizes: list[int], reps: int, out: Path) -> None:
    common.pin_threads()
    import torch

    from checkpointless.comm import Group
    from checkpointless.control.client import connect
    from checkpointless.state import recv_state, send_state
    from checkpointless.state.transfer import _seal_tensors

    store = connect(f"127.0.0.1:{port}", timedelta(seconds=60))
    key = b"bench/transfer job key, 32 bytes"  # the launcher's jobs always have one (32 random bytes)
    group = Group(store, 0, rank, 2, timeout=timedelta(seconds=300))
    results: list[dict[str, Any]] = []
    for nbytes in sizes:
        state = make_state(nbytes) if rank == 0 else None
        tensors = _tensors(state) if state is not None else None
        row: dict[str, Any] = {
            "bytes": nbytes,
            "e2e_s": [],
            "into_s": [],
            "wire_s": [],
            "wire_into_s": [],
            "hash_s": [],
            "stats_s": [],
        }
        recv_shapes = _chunk_sizes(nbytes)  # the receiver's buffers for the raw-wire measurement
        # the receiver's own state of the same structure (a replacement's built model and optimizer)
        mine = make_state(nbytes, seed=1) if rank == 1 else None
        for _ in range(reps):
            # end to end into the receiver's own tensors (recv_state(into=...), what a replacement does)
            group.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                assert state is not None
                send_state(group, 1, state, key=key)
            else:
                received, _ = recv_state(group, 0, into=mine, key=key)
                assert received["progress"]["committed_step"] == 7
                del received
            group.barrier()
            row["into_s"].append(time.perf_counter() - t0)
            # end to end: the checkpointless protocol (hash, header, meta, tensors, hash check)
            group.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                assert state is not None
                stats = send_state(group, 1, state, key=key)
            else:
                received, stats = recv_state(group, 0, key=key)
                assert received["progress"]["committed_step"] == 7
                del received
            group.barrier()
            row["e2e_s"].append(time.perf_counter() - t0)
            row["stats_s"].append(stats.seconds)
            row["moved_bytes"] = stats.bytes
            # raw wire: the same tensors, plain send/recv, into one buffer allocated and freed per tensor
            row["wire_s"].append(
                _raw_wire(group, tensors, len(recv_shapes), lambda i, s=recv_shapes: torch.empty(s[i]))
            )
            # raw wire into the receiver's own tensors: the same bytes to the same place as ``into``
            own = _tensors(mine) if mine is not None else []
            row["wire_into_s"].append(_raw_wire(group, tensors, len(recv_shapes), lambda i, own=own: own[i]))
            # the protocol's check alone, in this process
            if rank == 0:
                assert tensors is not None
                t0 = time.perf_counter()
                _seal_tensors(None, b"bench", bytes(16), tensors)
                row["hash_s"].append(time.perf_counter() - t0)
        if rank == 1:
            # hash the receiver's kind of tensors (freshly allocated) once per rep too
            fresh = _tensors(make_state(nbytes, seed=1))
            for _ in range(reps):
                t0 = time.perf_counter()
                _seal_tensors(None, b"bench", bytes(16), fresh)
                row["hash_s"].append(time.perf_counter() - t0)
            del fresh
        results.append(row)
        del state, tensors, mine
    group.barrier()
    common.write_json(out, results)


def copy_floor(sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Single-process, single-thread in-memory copy of the same tensors."""
    common.pin_threads()
    import torch

    rows = []
    for nbytes in sizes:
        tensors = _tensors(make_state(nbytes))
        dst = [torch.empty_like(t) for t in tensors]
        clone_s, copy_s = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            cl = [t.clone() for t in tensors]
            clone_s.append(time.perf_counter() - t0)
            del cl
            t0 = time.perf_counter()
            for d, t in zip(dst, tensors, strict=True):
                d.copy_(t)
            copy_s.append(time.perf_counter() - t0)
        rows.append({"bytes": nbytes, "clone_s": clone_s, "copy_s": copy_s})
        del tensors, dst
    return rows


# -- orchestration -----------------------------------------------------------------------
def run(
    quick: bool, out_dir: Path, sizes: list[int] | None = None, reps: int | None = None
) -> dict[str, Any]:
    from checkpointless.launch.launcher import open_store

    if sizes is None:
        sizes = [10 * MB, 100 * MB] if quick else [10 * MB, 100 * MB, 1000 * MB, 2000 * MB]
    if reps is None:
        reps = 3 if quick else 5
    work = common.fresh_dir(out_dir / "transfer")
    store = open_store("127.0.0.1", 0)
    procs: list[subprocess.Popen[bytes]] = []
    t_start = time.time()
    try:
        for rank in (0, 1):
            cmd = [
                common.PYTHON, "-m", "bench.transfer", "--worker", str(rank),
                "--port", str(store.port), "--sizes", ",".join(map(str, sizes)), "--reps", str(reps),
                "--out", str(work / f"rank{rank}.json"),
            ]  # fmt: skip
            log = open(work / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed right after start)
            procs.append(subprocess.Popen(cmd, env=common.child_env(), stdout=log, stderr=subprocess.STDOUT))
            log.close()
        codes = common.wait_all(procs, timeout=900)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    if any(codes):
        logs = "\n".join((work / f"rank{r}.log").read_text()[-2000:] for r in (0, 1))
        raise RuntimeError(f"transfer workers failed with {codes}:\n{logs}")
    sender = json.loads((work / "rank0.json").read_text())
    receiver = json.loads((work / "rank1.json").read_text())
    floor = copy_floor(sizes, reps)
    rows = []
    for s, r, f in zip(sender, receiver, floor, strict=True):
        nbytes = r["moved_bytes"]
        e2e = statistics.median(r["e2e_s"])
        into = statistics.median(r["into_s"]) if r.get("into_s") else None
        wire = statistics.median(r["wire_s"])
        wire_into = statistics.median(r["wire_into_s"])
        paired = [w / i for w, i in zip(r["wire_into_s"], r["into_s"], strict=True)]
        hash_src = statistics.median(s["hash_s"])
        hash_dst = statistics.median(r["hash_s"])
        clone = statistics.median(f["clone_s"])
        copy = statistics.median(f["copy_s"])
        rows.append(
            {
                "bytes": nbytes,
                "reps": reps,
                "e2e_s": e2e,
                "e2e_gbps": nbytes / e2e / 1e9,
                "into_s": into,
                "into_gbps": nbytes / into / 1e9 if into else None,
                "into_vs_wire": statistics.median(paired),
                "into_vs_wire_range": [min(paired), max(paired)],
                "into_vs_recycled": wire / into if into else None,
                "e2e_vs_wire": wire_into / e2e,
                "wire_s": wire,
                "wire_gbps": nbytes / wire / 1e9,
                "wire_into_s": wire_into,
                "wire_into_gbps": nbytes / wire_into / 1e9,
                "hash_src_s": hash_src,
                "hash_dst_s": hash_dst,
                "hash_gbps": nbytes / hash_src / 1e9,
                "hash_share": (hash_src + hash_dst) / e2e,
                "other_s": max(0.0, e2e - wire - hash_src - hash_dst),
                "clone_s": clone,
                "clone_gbps": nbytes / clone / 1e9,
                "copy_s": copy,
                "copy_gbps": nbytes / copy / 1e9,
                "e2e_over_copy": e2e / copy,
                "raw": {"sender": s, "receiver": r, "floor": f},
            }
        )
    return {"quick": quick, "sizes": sizes, "reps": reps, "wall_s": time.time() - t_start, "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    rows = res["rows"]
    t1 = common.md_table(
        [
            "state",
            "send/recv_state GB/s, into the receiver's tensors",
            "raw gloo GB/s, same tensors",
            "ratio (range)",
            "send/recv_state GB/s, freshly allocated",
            "vs raw gloo",
            "raw gloo GB/s, one recycled buffer",
            "into vs recycled",
            "clone GB/s",
            "copy_ GB/s",
            "vs clone",
            "vs copy_",
        ],
        [
            [
                f"{r['bytes'] / MB:.0f} MB",
                r.get("into_gbps"),
                r["wire_into_gbps"],
                f"{r['into_vs_wire']:.2f} ({r['into_vs_wire_range'][0]:.2f}–{r['into_vs_wire_range'][1]:.2f})",
                r["e2e_gbps"],
                common.fmt(r.get("e2e_vs_wire"), 2),
                r["wire_gbps"],
                common.fmt(r.get("into_vs_recycled"), 2),
                r["clone_gbps"],
                r["copy_gbps"],
                f"{r['e2e_s'] / r['clone_s']:.1f}× slower",
                f"{r['e2e_over_copy']:.1f}× slower",
            ]
            for r in rows
        ],
    )
    t2 = common.md_table(
        [
            "state",
            "end to end s",
            "wire s (recycled buffer)",
            "check at source s",
            "check at receiver s",
            "other s",
            "check share",
        ],
        [
            [
                f"{r['bytes'] / MB:.0f} MB",
                r["e2e_s"],
                r["wire_s"],
                r["hash_src_s"],
                r["hash_dst_s"],
                r["other_s"],
                f"{100 * r['hash_share']:.0f}%",
            ]
            for r in rows
        ],
    )
    return (
        f"Median of {res['reps']} repetitions per size. GB/s = 10^9 bytes per second of tensor payload; "
        "the check is GMAC (AES-128-GCM over the bytes as associated data, OpenSSL via `cryptography`) "
        "per 4 MiB piece, one message each, on both sides (wire format 4; 3: per 64 MiB, one message per "
        "tensor; BLAKE3 in 2, SHA-256 in 1). Both processes share "
        "this machine's 2 cores with gloo's own threads, so the check cannot overlap the wire as it does "
        "between two hosts. *ratio* = raw gloo time / send/recv_state time into the same tensors, per "
        "repetition, median and range: the target (≥ 0.8).\n\n"
        f"{t1}\n\nTime split of one transfer (medians, each part timed alone; in the protocol the check "
        f"on both sides overlaps the wire, so the parts add up to more than end to end):\n\n{t2}\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--sizes", help="comma-separated state sizes in bytes (default: by --quick)")
    p.add_argument("--reps", type=int, help="repetitions per size (default: 3 quick, 5 full)")
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        worker(a.worker, a.port, [int(s) for s in a.sizes.split(",")], a.reps, a.out)
        return 0
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else None
    res = run(a.quick, common.OUT, sizes, a.reps)
    common.write_json(common.OUT / "transfer.json", res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
