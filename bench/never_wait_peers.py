"""The peers of ``bench.never_wait`` on the same models: torchft at its best, and torchrun + DCP.

Both train the demo model of ``never_wait.SIZES`` at world size 2 (two processes, one intra-op
thread each, gloo on loopback), and rank 1's current process is SIGKILLed from outside every
``KILL_EVERY_S[size]`` seconds after the first commit, ``kills`` times:

- ``torchft``: ``bench.baselines.torchft_ddp``, one replica group per process, the lighthouse's
  heartbeat at ``compare.TORCHFT_FAST_HB_MS`` (its shortest setting without false failures here);
  the survivor trains on alone with its own half of the batch (the dead group's samples of those
  steps are dropped: counted as ``alone_steps``), the restarted group heals over HTTP from it;
- ``torchrun``: ``bench.baselines.torchrun_dcp``, a DCP save every N steps, N from Young/Daly with
  the save's cost measured by a short fault-free job first; each kill restarts both processes,
  which reload the newest checkpoint and redo the steps after it.

Per kill, on rank 0 (torchft's survivor; torchrun's rank 0, whatever its process): ``stall_s``
is the gap between its last commit before the kill and its first commit of a later step, minus
its normal step (the median before the first kill), as ``never_wait`` measures its own survivor.
``full_s``: kill -> rank 1's first commit after the kill (torchft: one the healed group took part
in). ``join_stall_s`` (torchft): rank 0's gap around that commit, minus its normal step.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

from bench import baselines, common, compare
from bench.baselines import torchft_ddp, torchrun_dcp

#: seconds between kills: the restarted process (torchft's group, torchrun's whole job) must be
#: training again before the next one (a kill of a restart that has not committed yet is left
#: out of the figures)
KILL_EVERY_S = {"130MB": 14.0, "1.5GB": 28.0}
PEERS = ("torchft", "torchrun")
WARMUP = 2


def available(peer: str) -> str | None:
    """None when ``peer`` can run here, else why not."""
    return torchft_ddp.available() if peer == "torchft" else None


def run_peer(peer: str, spec: Any, size: str, kills: int, out: Path) -> dict[str, Any]:
    """One faulted job of ``peer`` with ``kills`` kills; its analysis and settings."""
    every = KILL_EVERY_S[size]
    window = every * (kills + 0.5)
    settings: dict[str, Any]
    if peer == "torchft":
        settings = {"heartbeat_timeout_ms": compare.TORCHFT_FAST_HB_MS}
        res = torchft_ddp.run(spec, out / "torchft", steps=None, duration_s=window, kill_every_s=every,
                              max_restarts=kills + 5, timeout_s=window + 600, **settings)  # fmt: skip
    else:
        settings = {"every": _young_daly_every(spec, every, out)}
        res = torchrun_dcp.run(spec, out / "torchrun", steps=None, duration_s=window, kill_every_s=every,
                               max_restarts=kills + 5, timeout_s=window + 600, **settings)  # fmt: skip
    if not res.ok:
        raise RuntimeError(f"{peer} {size} failed: {res.error} (logs in {res.run_dir})")
    return {"settings": settings, "kill_every_s": every, **analyse(baselines.read_logs(res.run_dir), peer)}


def _young_daly_every(spec: Any, mtbf_s: float, out: Path) -> int:
    """torchrun's checkpoint interval in steps: Young/Daly with a measured save and step."""
    run_dir = out / "torchrun-calibrate"
    res = torchrun_dcp.run(spec, run_dir, steps=10, every=2, max_restarts=0, timeout_s=900)
    if not res.ok:
        raise RuntimeError(f"torchrun calibration failed: {res.error}")
    recs = baselines.read_logs(run_dir)
    saves = [float(r["seconds"]) for r in recs if r["ev"] == "ckpt"]
    step = _normal_step(_commits(recs, 0), None)
    return compare.young_daly(statistics.median(saves), mtbf_s, step)


def _commits(recs: list[dict[str, Any]], rank: int) -> list[tuple[float, int, dict[str, Any]]]:
    return [(float(r["t"]), int(r["step"]), r) for r in recs if r["ev"] == "commit" and r["rank"] == rank]


def _normal_step(commits: list[tuple[float, int, dict[str, Any]]], before: float | None) -> float:
    ts = [c[0] for c in commits if before is None or c[0] < before][WARMUP:]
    return statistics.median(b - a for a, b in itertools.pairwise(ts))


def analyse(recs: list[dict[str, Any]], peer: str) -> dict[str, Any]:
    """Per kill: the survivor's stall, kill -> rank 1 trains again, and (torchft) the join's stall."""
    r0, r1 = _commits(recs, 0), _commits(recs, 1)
    kills = [float(r["t"]) for r in recs if r["ev"] == "fault" and r.get("how") == "external"]
    normal = _normal_step(r0, kills[0] if kills else None)
    rows = []
    for i, t in enumerate(kills):
        before = [c for c in r0 if c[0] < t]
        if not before:
            continue
        t_a, step_a, _ = before[-1]
        if i and not any(kills[i - 1] < c[0] < t for c in r1):
            continue  # rank 1's restart was not training yet: not a kill of a live peer
        after = next((c for c in r0 if c[0] > t and c[1] > step_a), None)
        if after is None:
            continue
        row: dict[str, Any] = {"kill": i, "gap_s": after[0] - t_a, "new_step_s": normal,
                               "stall_s": after[0] - t_a - normal}  # fmt: skip
        back = next((c for c in r1 if c[0] > t and c[2].get("participating", True)), None)
        row["full_s"] = None if back is None else back[0] - t
        if peer == "torchft" and back is not None:
            lo = [c[0] for c in r0 if c[0] < back[0]]
            hi = [c[0] for c in r0 if c[0] >= back[0]]
            row["join_stall_s"] = hi[0] - lo[-1] - normal if lo and hi else None
        rows.append(row)
    alone = sum(1 for c in r0 if c[2].get("participants") == 1 and kills and c[0] > kills[0])
    return {"normal_step_s": normal, "kills": rows, "alone_steps": alone if peer == "torchft" else 0}


def summary(job: dict[str, Any]) -> dict[str, Any]:
    return {k: common.summary(r.get(k) for r in job["kills"]) for k in ("stall_s", "full_s", "join_stall_s")}
