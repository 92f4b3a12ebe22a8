"""The control plane at scale: the real coordinator, driven by simulated host agents.

**What runs for real.** The launcher process of ``checkpointless coordinator --nodes N
--nproc-per-node 8 --spare-nodes 1``: ``Launcher`` with a ``ClusterSpec`` and the job's secret, built
as ``cli/coordinator.py``'s ``run`` builds it (``bench/scale_coord.py``). Its control store
(the c10d ``TCPStore`` server, libuv, a thread of that process), its coordinator loop and its event
log are unchanged product code, in a process of their own. Its store calls are counted in-process by
a thin wrapper around its store connections (every call, its keys and value bytes, the seconds it
took); a sampling profiler (a thread of that process reading the main thread's stack every 20 ms)
records where the loop's time goes, in a window of its own after the steady-state window.

**Settings.** 8 ranks per host, one spare host, one step per second. The series runs at
``hang_timeout_s`` 2 s, the value ``checkpointless cluster`` uses when hosts share one machine's
cores (so: a silent rank is hung after 2 s, an agent sends its status every 1.6 s, a host that does
not answer an order within 2 s or is silent for 8 s is lost; heartbeats still go every 0.1 s). At the
job's default, 0.5 s, a simulated rank whose heartbeat its simulator forwards more than 0.5 s late is
killed as hung (the findings say why its reported CPU time does not save it), and with the per-rank
protocol the simulators here ran that late at times from 100 hosts on: the series uses 2 s so that
what is measured is the coordinator, not the simulators' lag. The default is run at 100 hosts too.

**What is simulated** (``bench/scale_sim.py``). Each host is a simulated agent with two store
connections (its order connection, blocked in a ``wait`` on its next order as ``node.py``'s is; its
status connection, which also carries its relay's writes) speaking the agent protocol: hello, ticket,
accept, spawn orders obeyed by pretending the processes started (reported alive, their CPU time
growing as a training process's does), any other order (kill, ping, stop) answered at once with a
status, and ``node/<host>/status`` every status interval with the lease round trip after it. Its
relay (``launch/relay.py``) does what the agent's does, every heartbeat interval (0.1 s): the host's
new events as one sealed chunk ``node/<host>/events/<i>`` (each line naming its process: at each step
one ``steps_committed`` event with its 8 ranks' commits, packed as ``relay_wire.pack_commits`` packs them,
and any other event of theirs), then one sealed value
``node/<host>/relay`` = {seq, t, chunks, procs} with the latest heartbeat of each of its 8 processes
(the fields ``Session`` puts in: rank, gen, phase, committed, step, attempt, step_time_s, loss, total,
chunks; a new one each beat), then one round trip (a ``check`` of the abort key of its ranks'
generation, ``gen/latest`` while it has none). The processes' own traffic with their agent's store
(heartbeats, event chunks, lease checks on the host's loopback) is not simulated: it never reaches
the coordinator. Once every 10 beats the relay also checks the job's stop key for its ranks (which
read it in their host's lease, ``ControlClient.stop_requested``), and reads how many of its
chunks the coordinator has read (``node/<host>/read``, which the coordinator writes for every host in
one ``multi_set`` a pass) and deletes those (``Relay._delete_read``). What each rank still sends to
the coordinator's store itself is, per generation, its reads of the plan.
The round trips (the relays' lease and stop checks, their reads of that count and deletes) come from
separate processes ("ackers"), one per simulator. A power loss: the bench stops one worker host (its
status, its relay, its ranks' round trips, its order reads) at a recorded time. When the coordinator
aborts the generation, every surviving rank reports as a member does (a ``fault_detected`` event,
through its relay; its failure report in its heartbeat, which its relay's next value carries: no key
of its own); the spare host's processes wait on their assignment keys; every rank joins the next plan (new
generation, committed step) and commits again.

``--protocol per-rank`` simulates the protocol before the relay instead: each process writes
``hb/<proc>`` every 0.1 s and an event chunk ``events/<proc>/<i>`` per commit (with a heartbeat), and
makes its own lease round trip (a ``check`` on its generation's abort key every 0.1 s), all on the
coordinator's store, and its failure report too (``gen/<n>/fail/<rank>``, the list of reports, the
failure counter, the report bell); the statuses, stop checks and waits are the same.

Not simulated: the data plane (no process group is formed: group formation is costed on paper
below), the ranks' own connections (a worker holds two or three to the coordinator's store, a
simulated host one for its 8 ranks; a real agent's relay has a connection of its own), each rank's
read of the plan and its blocking ``wait_plan`` (each simulator process waits on the plan key once and
reads it once; size and read time are reported), training, torch. Many hosts share a simulator
process (one thread issues every host's writes, one thread per host blocks on its orders): on 2 cores
they may not issue every write the protocol asks for at the larger scales. The tables say
which share of the protocol's calls they issued ("offered"); agent statuses, commits and failure
reports go first, the periodic beats (relay values; per-rank: heartbeats) get what is left, oldest
first. Simulators, ackers and the coordinator share the machine's cores at the same priority, with
whatever else runs there (the load average is recorded per case).

Usage: ``python -m bench.control_scale [--quick] [--hosts 10,100] [--protocol per-rank] [--out DIR]``
-> ``bench/out/control_scale.json`` and ``bench/results/control_scale.json`` (with ``--out DIR``:
``DIR/control_scale.json`` only).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from torch.distributed import TCPStore

from bench import common
from bench.scale_coord import coordinator_main
from bench.scale_sim import (
    NPROC,
    PER_RANK,
    PROTOCOLS,
    RELAY,
    SIM_NICE,
    SPARE_NODES,
    STEP_S,
    acker_main,
    host_name,
    intervals,
    protocol_rates,
    raise_nofile,
    simulator_main,
)
from checkpointless.control.auth import new_secret, write_secret_file
from checkpointless.control.published import INTRUDER_KEYS
from checkpointless.launch.events import RELAYED_BYTES_PER_PASS, RELAYED_CHUNKS_PER_PASS
from checkpointless.launch.runtime import FULL_GC_EVERY
from checkpointless.observe.event_log import KEEP_COMMITS, KEEP_USAGE
from checkpointless.protocol.vocab import Event

SERIES_HANG_S = 2.0  # see the module docstring: the job default, 0.5 s, is the extra case
#: (worker hosts, hang_timeout_s) measured; 300 hosts locates the knee between 100 and 1,000
CASES = ((10, SERIES_HANG_S), (100, SERIES_HANG_S), (300, SERIES_HANG_S), (1000, SERIES_HANG_S),
         (2000, SERIES_HANG_S), (100, 0.5))  # fmt: skip
QUICK_CASES = ((10, SERIES_HANG_S), (100, SERIES_HANG_S))
HANG_TIMEOUT_S = 0.5  # RecoveryConfig's default, as `checkpointless coordinator` uses it
WARMUP_S, WINDOW_S, PROFILE_S, AFTER_S = 8.0, 20.0, 10.0, 3.0
SOAK_S, SOAK_FROM_HOSTS, SOAK_TAIL_S = 300.0, 1000, 120.0
"""From 1,000 hosts the job runs ``SOAK_S`` more before the loss, so that the coordinator's memory
is seen after its bounded buffers filled (the event log's budget, the relays' windows) and after the
log caught up with the start's backlog: its growth is fitted over the last ``SOAK_TAIL_S`` before the
loss. At 2,000 hosts the log reads the hosts' unread events of the start until about 250 s into the
run (``ctl/census.jsonl``: the store's keys fall from 65,000 to 14,000 meanwhile, and the
coordinator's heap grows); a soak of 180 s fitted that catch-up (25-35 MB/min), not a leak."""
QUICK_WARMUP_S, QUICK_WINDOW_S, QUICK_PROFILE_S = 5.0, 10.0, 6.0
_TICK = os.sysconf("SC_CLK_TCK")
_SELF = "bench.control_scale"  # run with ``-m``: its roles in processes of their own

#: published figures for the page's "on paper" part (each with the address it comes from)
PUBLISHED: list[dict[str, str]] = [
    {"what": "TCPStore, libuv server: time for 96K ranks to connect (store init)",
     "figure": "about 100 s (the legacy server timed out after 30 min)",
     "url": "https://pytorch.org/tutorials/intermediate/TCPStore_libuv_backend.html"},
    {"what": "ProcessGroupGloo init (full mesh of pairs; every rank's address through the TCPStore)",
     "figure": "2k ranks ~82 s, 4k ~393 s, 8k ~55 min; with batched store reads 18 s, 25 s, 85 s",
     "url": "https://github.com/pytorch/gloo/pull/408"},
    {"what": "gloo: the O(n^2) full mesh at init, and the TCPStore as 'a single point of info [with] "
             "limited QPS'", "figure": "(a maintainers' issue: lazy pairs proposed)",
     "url": "https://github.com/pytorch/gloo/issues/419"},
    {"what": "NCCL communicator init at large scale (PyTorch team, default init path)",
     "figure": "about 2.5 min above a few thousand GPUs",
     "url": "https://github.com/NVIDIA/nccl/issues/1156"},
    {"what": "NCCL init CPU time at 48K-96K GPUs (O(N^2) loops, fixed by this patch)",
     "figure": "ncclBuildRing 26 s at 96K, initTransportsRank 11 s at 48K",
     "url": "https://github.com/NVIDIA/nccl/pull/1789"},
]  # fmt: skip


# -- /proc ------------------------------------------------------------------------
def _proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of process ``pid``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = stat[stat.rindex(")") + 2 :].split()
    return (int(f[11]) + int(f[12])) / _TICK


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s live threads by kind: ``main``, ``store`` (the TCPStore server), ``other``."""
    out: dict[str, float] = {"main": 0.0, "store": 0.0, "other": 0.0}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        f = stat[stat.rindex(")") + 2 :].split()
        kind = "main" if int(tid) == pid else "store" if "tcpstore" in name else "other"
        out[kind] += (int(f[11]) + int(f[12])) / _TICK
    return out


def _mem(pid: int) -> dict[str, int]:
    """``rss`` (VmRSS) and ``hwm`` (VmHWM, the peak) of ``pid``, bytes."""
    out = {"rss": 0, "hwm": 0}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss"] = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                out["hwm"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of every core, from ``/proc/stat``."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values) - idle, sum(values)


def _stat(xs: Iterable[float]) -> dict[str, float | int]:
    return common.summary(list(xs))


# -- the bench: one scale ----------------------------------------------------------------
class SimHandle:
    """A simulator process: JSON commands on its stdin, one answer a line on its stdout."""

    def __init__(self, argv: list[str], log: IO[bytes], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                  cwd=common.REPO)  # fmt: skip
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._ids = itertools.count()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self._lines.put(line.decode())

    def request(self, cmd: dict[str, Any], timeout: float = 90.0) -> dict[str, Any]:
        assert self.p.stdin is not None
        rid = next(self._ids)
        self.p.stdin.write((json.dumps({**cmd, "id": rid}) + "\n").encode())
        self.p.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"simulator pid {self.p.pid}: no answer to {cmd['cmd']} within {timeout:g}s"
                )
            try:
                out = json.loads(self._lines.get(timeout=left))
            except queue.Empty:
                continue
            if out.get("id") == rid:
                return out

    def stop(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(OSError, TimeoutError, ValueError):
                self.request({"cmd": "stop"}, timeout=10)
        common.stop_process(self.p, timeout=10)


def _commits_per_s(r: dict[str, Any]) -> float | None:
    """The ranks' commits the log took in a second (results before the relays packed them: its events)."""
    got = _g(r, "steady", "coordinator", "commits_per_s")
    return got if got is not None else _g(r, "steady", "coordinator", "events_per_s")


class EventTail:
    """Follows the coordinator's ``events.jsonl`` as it is appended; keeps the rare events."""

    SKIP = (b'"step_committed"', b'"steps_committed"', b'"host_usage"', b'"failure_reported"')

    def __init__(self, path: Path) -> None:
        self.path, self.pos, self.buf = path, 0, b""
        self.events: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()
        self.last_failure_reported: float | None = None

    def read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return
        self.pos += len(data)
        lines = (self.buf + data).split(b"\n")
        self.buf = lines.pop()
        for line in lines:
            skip = next((s for s in self.SKIP if s in line), None)
            if skip is not None:
                self.counts[skip.decode().strip('"')] += 1
                if skip == b'"failure_reported"':
                    with contextlib.suppress(ValueError):
                        self.last_failure_reported = float(json.loads(line)["t"])
                continue
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                self.counts[str(ev.get("kind"))] += 1
                self.events.append(ev)

    def first(self, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        return next((e for e in self.events if pred(e)), None)


class RssSampler:
    """The coordinator's VmRSS every half second."""

    def __init__(self, pid: int) -> None:
        self.pid, self.samples = pid, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            m = _mem(self.pid)
            if m["rss"]:
                self.samples.append((time.time(), m["rss"]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def _wait_until(
    what: str, pred: Callable[[], bool], timeout: float, alive: Callable[[], None], every: float = 0.1
) -> float:
    """Poll ``pred`` every ``every`` seconds until true; seconds waited; ``TimeoutError`` naming
    ``what``. ``alive`` raises if a process the wait depends on is gone."""
    t0 = time.monotonic()
    while not pred():
        alive()
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(every)
    return time.monotonic() - t0


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    """``total`` hosts in ``parts`` contiguous ranges (first, count)."""
    out, first = [], 0
    for k in range(parts):
        count = total // parts + (1 if k < total % parts else 0)
        out.append((first, count))
        first += count
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _snapshot(pid: int, ctl: Path, sims: list[SimHandle]) -> dict[str, Any]:
    return {
        "wall": time.time(), "cpu": _proc_cpu(pid), "threads": _thread_cpu(pid), "mem": _mem(pid),
        "stats": _read_json(ctl / "stats.json"), "machine": _machine_cpu(),
        "sims": [s.request({"cmd": "stats"}) for s in sims],
        "sim_cpu": [_proc_cpu(s.p.pid) or 0.0 for s in sims],
    }  # fmt: skip


def _delta(a: dict[str, float], b: dict[str, float], dt: float) -> dict[str, float]:
    return {k: round((b.get(k, 0.0) - a.get(k, 0.0)) / dt, 2) for k in sorted(set(a) | set(b))
            if b.get(k, 0.0) - a.get(k, 0.0)}  # fmt: skip


def _sum_sims(snaps: list[dict[str, Any]], key: str) -> dict[str, float]:
    out: Counter[str] = Counter()
    for s in snaps:
        out.update(s.get(key, {}))
    return dict(out)


def _steady(
    a: dict[str, Any], b: dict[str, Any], hosts: int, hang: float, step_s: float, protocol: str
) -> dict[str, Any]:
    dt = b["wall"] - a["wall"]
    sa, sb = a["stats"], b["stats"]
    dts = max(1e-6, float(sb.get("t", 0)) - float(sa.get("t", 0)))
    ops_a, ops_b = sa.get("ops", {}), sb.get("ops", {})
    coord_calls = _delta(ops_a.get("calls", {}), ops_b.get("calls", {}), dts)
    coord_total = sum(coord_calls.values())
    lo, hi = a["wall"], b["wall"]
    iters = [d for t, d in sb.get("recent", []) if lo <= t <= hi]
    sim_dt = max(
        1e-6, statistics_mean([s["t"] for s in b["sims"]]) - statistics_mean([s["t"] for s in a["sims"]])
    )
    sim_calls = _delta(_sum_sims(a["sims"], "calls"), _sum_sims(b["sims"], "calls"), sim_dt)
    by_purpose: Counter[str] = Counter()
    for k, v in sim_calls.items():
        by_purpose[k.split(" ", 1)[0]] += v
    target = protocol_rates(hosts, hang, step_s, protocol)
    offered = {k: round(by_purpose.get(k, 0.0) / v, 3) for k, v in target.items() if v}
    sim_total = sum(v for k, v in by_purpose.items() if k != "instr")
    busy = (b["machine"][0] - a["machine"][0]) / max(1, b["machine"][1] - a["machine"][1])
    lat: dict[str, Any] = {}
    for s in b["sims"]:
        for k, v in s.get("lat", {}).items():
            cur = lat.setdefault(k, {"p50": 0.0, "p99": 0.0, "max": 0.0})
            for q in ("p50", "p99", "max"):
                cur[q] = max(cur[q], v[q])
    lags = [s["lag"] for s in b["sims"] if "lag" in s]
    lo_n = sum(g.get("lo_n", 0) for g in lags)
    acks = [s["ack_lag"] for s in b["sims"] if "ack_lag" in s]
    ack_n = sum(g["n"] for g in acks)
    threads = {k: round((b["threads"].get(k, 0.0) - a["threads"].get(k, 0.0)) / dt, 3) for k in b["threads"]}
    sizes = {k: statistics_mean([s["sizes"][k] for s in b["sims"] if s.get("sizes", {}).get(k)]) for k in
             ("status", "relay", "heartbeat", "chunk", "plan", "report")}  # fmt: skip
    bytes_out = sum(
        _delta(_sum_sims(a["sims"], "bytes_out"), _sum_sims(b["sims"], "bytes_out"), sim_dt).values()
    )
    bytes_in = sum(
        _delta(_sum_sims(a["sims"], "bytes_in"), _sum_sims(b["sims"], "bytes_in"), sim_dt).values()
    )
    c_in = _delta(ops_a.get("bytes_in", {}), ops_b.get("bytes_in", {}), dts)
    c_out = _delta(ops_a.get("bytes_out", {}), ops_b.get("bytes_out", {}), dts)
    iter_rate = len(iters) / dt if dt else 0.0
    return {
        "window_s": round(dt, 2),
        "coordinator": {
            "cpu_core_frac": round(((b["cpu"] or 0) - (a["cpu"] or 0)) / dt, 3),
            "threads_core_frac": threads,
            "rss_mb_start": round(a["mem"]["rss"] / 2**20, 1), "rss_mb_end": round(b["mem"]["rss"] / 2**20, 1),
            "hwm_mb": round(b["mem"]["hwm"] / 2**20, 1),
            "rss_growth_mb_per_min": round((b["mem"]["rss"] - a["mem"]["rss"]) / 2**20 / dt * 60, 1),
            "loop_iterations_per_s": round(iter_rate, 2),
            "loop_iteration_s": _stat(iters),
            "events_per_s": round((int(sb.get("events", 0)) - int(sa.get("events", 0))) / dts, 1),
            "commits_per_s": round((int(sb.get("commits", 0)) - int(sa.get("commits", 0))) / dts, 1),
            "gc_full": (_g(sb, "gc", "full") or 0) - (_g(sa, "gc", "full") or 0),
            "gc_full_s_per_s": round(((_g(sb, "gc", "full_s") or 0) - (_g(sa, "gc", "full_s") or 0)) / dts, 3),
            "store_calls_per_s": coord_calls, "store_calls_per_s_total": round(coord_total, 1),
            "keys_per_s": _delta(ops_a.get("keys", {}), ops_b.get("keys", {}), dts),
            "bytes_in_per_s": c_in, "bytes_out_per_s": c_out,
            "bytes_in_per_iteration": round(sum(c_in.values()) / iter_rate) if iter_rate else None,
            "seconds_in_store_calls_per_s": _delta(ops_a.get("seconds", {}), ops_b.get("seconds", {}), dts),
        },
        "simulators": {
            "store_calls_per_s": sim_calls, "by_purpose_per_s": {k: round(v, 1) for k, v in by_purpose.items()},
            "protocol_target_per_s": {k: round(v, 1) for k, v in target.items()}, "offered_frac": offered,
            "store_calls_per_s_total": round(sim_total, 1),
            "bytes_out_per_s": round(bytes_out), "bytes_in_per_s": round(bytes_in),
            "cpu_core_frac": round(sum(x - y for x, y in zip(b["sim_cpu"], a["sim_cpu"], strict=True)) / dt, 3),
            "round_trip_s": lat,
            "status_lag_max_s": max((g.get("status_max_s", 0.0) for g in lags), default=0.0),
            "lo_lag_mean_s": round(sum(g.get("lo_sum_s", 0.0) for g in lags) / lo_n, 4) if lo_n else None,
            "lo_lag_max_s": max((g.get("lo_max_s", 0.0) for g in lags), default=0.0),
            "lo_late_over_0.5s": sum(g.get("lo_late_0.5s", 0) for g in lags),
            "ack_lag_mean_s": round(sum(g["sum_s"] for g in acks) / ack_n, 4) if ack_n else None,
            "ack_lag_max_s": max((g["max_s"] for g in acks), default=0.0),
            "late_steps": sum(int(s.get("late_steps", 0)) for s in b["sims"]) - sum(int(s.get("late_steps", 0)) for s in a["sims"]),
            "committed": [min((s["committed_min"] for s in b["sims"] if s.get("committed_min") is not None), default=None),
                          max((s["committed_max"] for s in b["sims"] if s.get("committed_max") is not None), default=None)],
        },
        "store_calls_per_s_total": round(coord_total + sim_total, 1),
        "store_calls_per_host_per_s": round((coord_total + sim_total) / (hosts + SPARE_NODES), 2),
        "machine_cpu_busy_frac": round(busy, 3),
        "sizes_bytes": {k: (round(v) if v else None) for k, v in sizes.items()},
        "per_poll_bytes": {
            "statuses": round((hosts + SPARE_NODES) * (sizes["status"] or 0)),
            # relay: a value per host; per-rank: a heartbeat per process
            **({"relays": round((hosts + SPARE_NODES) * (sizes["relay"] or 0))} if protocol == RELAY
               else {"heartbeats": round((hosts + SPARE_NODES) * NPROC * (sizes["heartbeat"] or 0))}),
        },
    }  # fmt: skip


def statistics_mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _failure(
    hosts: int, victim: int, owner: SimHandle, sims: list[SimHandle], tail: EventTail,
    alive: Callable[[], None], timeout: float, ctl: Path,
) -> dict[str, Any]:  # fmt: skip
    """Power off host ``victim``; time the coordinator's detection, its plan, the recovery; sample the
    coordinator's stack from the loss to the plan (``profile_failure.json``)."""
    victim_host = host_name(victim)
    procs = {f"w{victim * NPROC + k}" for k in range(NPROC)}
    tail.read()
    (ctl / "profile_on").write_text("profile_failure.json")
    t_kill = float(owner.request({"cmd": "kill", "host": victim_host})["t"])

    def seen(pred: Callable[[dict[str, Any]], bool]) -> Callable[[], bool]:
        def check() -> bool:
            tail.read()
            return tail.first(pred) is not None

        return check

    out: dict[str, Any] = {"victim": victim_host, "t_kill": t_kill}
    plan = seen(lambda e: e.get("kind") == Event.GENERATION_STARTED and e.get("gen") == 1)
    try:
        _wait_until("plan of generation 1 after the host's loss", plan, timeout, alive)
        (ctl / "profile_off").touch()
        _wait_until("recovery_done of generation 1",
                    seen(lambda e: e.get("kind") == Event.RECOVERY_DONE and e.get("gen") == 1), timeout, alive)  # fmt: skip
    except (TimeoutError, RuntimeError) as e:  # the coordinator may end while it is waited for
        out["error"] = f"{e} ({time.time() - t_kill:.1f} s after the loss)"
    tail.read()

    def at(pred: Callable[[dict[str, Any]], bool]) -> float | None:
        ev = tail.first(pred)
        return round(float(ev["t"]) - t_kill, 4) if ev is not None else None

    out["first_fault_s"] = at(lambda e: e.get("kind") == Event.FAULT_DETECTED and e.get("target") in procs)
    out["first_fault_reason"] = (tail.first(lambda e: e.get("kind") == Event.FAULT_DETECTED
                                            and e.get("target") in procs) or {}).get("reason")  # fmt: skip
    out["host_lost_s"] = at(lambda e: e.get("kind") == Event.HOST_LOST and e.get("host") == victim_host)
    out["plan_s"] = at(lambda e: e.get("kind") == Event.GENERATION_STARTED and e.get("gen") == 1)
    out["recovery_done_s"] = at(lambda e: e.get("kind") == Event.RECOVERY_DONE and e.get("gen") == 1)
    out["false_faults"] = sum(1 for e in tail.events if e.get("kind") == Event.FAULT_DETECTED
                              and e.get("proc") == "coordinator" and e.get("target") not in procs)  # fmt: skip
    out["hosts_lost"] = sorted({str(e.get("host")) for e in tail.events if e.get("kind") == Event.HOST_LOST})
    out["failure_reported_events"] = tail.counts.get(Event.FAILURE_REPORTED, 0)
    if tail.last_failure_reported is not None:
        out["last_report_read_s"] = round(tail.last_failure_reported - t_kill, 4)
    try:
        snaps = [s.request({"cmd": "stats"}) for s in sims]
    except (TimeoutError, OSError, ValueError):  # a simulator gone with the coordinator
        snaps = []
    timing = [s.get("timing", {}) for s in snaps]

    def when(key: str, agg: Callable[[list[float]], float]) -> float | None:
        ts = [float(t[key]) for t in timing if key in t]
        return round(agg(ts) - t_kill, 4) if ts else None

    out["abort_seen_s"] = when("abort_seen_0", min)
    out["reports_done_s"] = when("reports_done_0", max)
    out["plan_seen_s"] = when("plan_seen_1", min)
    reads = [float(s["plan_read_s"]["1"]) for s in snaps if "1" in s.get("plan_read_s", {})]
    out["plan_read_s"] = round(max(reads), 4) if reads else None
    out["plan_bytes"] = max((s["sizes"].get("plan") or 0 for s in snaps), default=None)
    if out["plan_s"] is not None and out["host_lost_s"] is not None:
        out["plan_after_detection_s"] = round(out["plan_s"] - out["host_lost_s"], 4)
    if out["plan_s"] is not None and out["reports_done_s"] is not None:
        out["plan_after_reports_s"] = round(out["plan_s"] - out["reports_done_s"], 4)
    return out


@dataclass
class Params:
    hang_timeout: float = SERIES_HANG_S
    step_s: float = STEP_S
    warmup_s: float = WARMUP_S
    window_s: float = WINDOW_S
    profile_s: float = PROFILE_S
    soak_s: float = SOAK_S  # more steady time before the loss, from SOAK_FROM_HOSTS hosts
    sims: int | None = None  # simulator processes (None: 1 up to 100 hosts, else 2)
    nice: int = SIM_NICE
    protocol: str = RELAY  # scale_sim.PROTOCOLS


def measure(hosts: int, dest: Path, params: Params) -> dict[str, Any]:
    """One scale: the coordinator, its simulated hosts, join, steady window, profile window, a host's
    power loss and the recovery; every process ended in the end."""
    d = common.fresh_dir(dest / f"h{hosts}-t{params.hang_timeout:g}")
    ctl = d / "ctl"
    ctl.mkdir()
    secret_file = d / "secret"
    write_secret_file(secret_file, new_secret())
    env = common.child_env(TORCH_CPP_LOG_LEVEL="ERROR")
    join_timeout = 120.0 + 0.2 * hosts
    timeout = 60.0 + 0.1 * hosts
    n_sims = params.sims or (1 if hosts <= 100 else 2)
    res: dict[str, Any] = {"hosts": hosts, "ranks": hosts * NPROC, "spare_hosts": SPARE_NODES,
                           "connections": 2 * (hosts + SPARE_NODES), "simulators": n_sims, "protocol": params.protocol,
                           "ok": False}  # fmt: skip
    logs: list[IO[bytes]] = []
    sims: list[SimHandle] = []
    ackers: list[SimHandle] = []
    coord: subprocess.Popen[bytes] | None = None
    rss: RssSampler | None = None
    t_start = time.time()
    try:
        clog = open(d / "coordinator.log", "wb")  # noqa: SIM115 (closed in finally)
        logs.append(clog)
        coord = subprocess.Popen(
            [common.PYTHON, "-m", _SELF, "--role", "coordinator", "--hosts", str(hosts), "--secret-file",
             str(secret_file), "--out", str(d), "--hang-timeout", str(params.hang_timeout), "--join-timeout",
             str(join_timeout), "--timeout", "7200"],
            stdout=clog, stderr=subprocess.STDOUT, env=env, cwd=common.REPO,
        )  # fmt: skip
        rss = RssSampler(coord.pid)
        proc = coord

        def alive() -> None:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the coordinator exited with code {proc.returncode} (see {common.rel(d)}/coordinator.log)"
                )
            for s in sims + ackers:
                if s.p.poll() is not None:
                    raise RuntimeError(
                        f"a simulator exited with code {s.p.returncode} (see {common.rel(d)}/sim*.log)"
                    )

        _wait_until("the coordinator's store", lambda: (ctl / "addr").exists(), 120, alive)
        addr = (ctl / "addr").read_text().strip()
        for k, (first, count) in enumerate(_split(hosts + SPARE_NODES, n_sims)):
            log = open(d / f"sim{k}.log", "wb")  # noqa: SIM115 (closed in finally)
            logs.append(log)
            common_args = ["--addr", addr, "--secret-file", str(secret_file), "--hosts", str(hosts), "--first",
                           str(first), "--count", str(count), "--hang-timeout", str(params.hang_timeout),
                           "--nice", str(params.nice), "--protocol", params.protocol, "--step-s",
                           str(params.step_s)]  # fmt: skip
            sims.append(SimHandle(
                [common.PYTHON, "-m", _SELF, "--role", "simulator", *common_args, "--join-timeout",
                 str(join_timeout)], log, env))  # fmt: skip
            ackers.append(SimHandle([common.PYTHON, "-m", _SELF, "--role", "acker", *common_args], log, env))
        snaps: list[dict[str, Any]] = []

        def running() -> bool:
            snaps[:] = [s.request({"cmd": "stats"}) for s in sims]
            members = sum(int(s.get("members", 0)) for s in snaps)
            lowest = [s["committed_min"] for s in snaps if s.get("committed_min") is not None]
            return members >= hosts * NPROC and len(lowest) == len(snaps) and min(lowest) >= 1

        _wait_until("every rank committing in generation 0", running, join_timeout, alive, every=0.5)
        accepted = [float(s["timing"]["accepted"]) for s in snaps if "accepted" in s.get("timing", {})]
        res["join"] = {"all_accepted_s": round(max(accepted) - t_start, 2) if accepted else None,
                       "all_committing_s": round(time.time() - t_start, 2)}  # fmt: skip
        time.sleep(params.warmup_s)
        a = _snapshot(coord.pid, ctl, sims + ackers)
        time.sleep(params.window_s)
        b = _snapshot(coord.pid, ctl, sims + ackers)
        res["steady"] = _steady(a, b, hosts, params.hang_timeout, params.step_s, params.protocol)
        if params.profile_s > 0:
            (ctl / "profile_on").touch()
            time.sleep(params.profile_s)
            (ctl / "profile_off").touch()
            with contextlib.suppress(TimeoutError):
                _wait_until("the coordinator's profile", lambda: (ctl / "profile.json").exists(), 60 + 0.05 * hosts,
                            alive)  # fmt: skip
            res["profile"] = {"window_s": params.profile_s, **_read_json(ctl / "profile.json")}
        time.sleep(params.soak_s)
        tail = EventTail(d / "run" / "events.jsonl")
        victim = hosts // 2
        k = next(k for k, (first, count) in enumerate(_split(hosts + SPARE_NODES, n_sims))
                 if first <= victim < first + count)  # fmt: skip
        ackers[k].request({"cmd": "kill", "host": host_name(victim)})
        res["failure"] = _failure(hosts, victim, sims[k], sims, tail, alive, timeout, ctl)
        res["profile_failure"] = _read_json(ctl / "profile_failure.json")
        time.sleep(AFTER_S)
        res["events_counts"] = dict(tail.counts)
        res["ok"] = "error" not in res["failure"]
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
    finally:
        t_stop = time.monotonic()
        if coord is not None and coord.poll() is None:
            coord.send_signal(signal.SIGTERM)  # the launcher stops the job: orders every agent to stop
            try:
                coord.wait(timeout=60 + 0.05 * hosts)
            except subprocess.TimeoutExpired:
                res["stop_error"] = "the coordinator did not exit after SIGTERM; killed"
                coord.kill()
                coord.wait(timeout=30)
        res["stop_s"] = round(time.monotonic() - t_stop, 2)
        for s in sims + ackers:
            s.stop()
        if rss is not None:
            rss.stop()
            if rss.samples:
                res["rss_mb_max"] = round(max(r for _, r in rss.samples) / 2**20, 1)
                res["rss_mb_curve"] = [
                    [round(t - t_start, 1), round(r / 2**20, 1)] for t, r in rss.samples[::10]
                ]
                killed = _g(res, "failure", "t_kill")
                if params.soak_s and isinstance(killed, float):
                    res["rss_before_loss"] = _rss_tail(rss.samples, killed, t_start)
        for f in logs:
            f.close()
    res["coordinator_result"] = _read_json(ctl / "result.json")
    final = _read_json(ctl / "stats.json")
    res["coordinator_final"] = {"loop_iterations": final.get("iters"), "events": final.get("events"),
                                "store_calls": _g(final, "ops", "calls"), "store_seconds": _g(final, "ops", "seconds"),
                                "run_s": round(float(final.get("t", t_start)) - t_start, 1),
                                "gc": final.get("gc")}  # fmt: skip
    res["profile_whole_run"] = _read_json(ctl / "profile_all.json")
    res["coordinator_log"] = _log_summary(d / "coordinator.log")
    res["memory_census"] = _census(ctl / "census.jsonl", _g(res, "failure", "t_kill"), t_start)
    res["wall_s"] = round(time.time() - t_start, 1)
    return res


def _rss_tail(samples: list[tuple[float, int]], until: float, t_start: float) -> dict[str, Any] | None:
    """The coordinator's memory over the last ``SOAK_TAIL_S`` before ``until``: its level and its
    growth (least squares), after the soak."""
    tail = [(t, r / 2**20) for t, r in samples if until - SOAK_TAIL_S <= t <= until]
    fit = _fit([t for t, _ in tail], [r for _, r in tail])
    if fit is None:
        return None
    return {"from_s": round(tail[0][0] - t_start, 1), "to_s": round(tail[-1][0] - t_start, 1),
            "mb_at_loss": round(tail[-1][1], 1), "growth_mb_per_min": round(fit["b_per_host"] * 60, 1)}  # fmt: skip


CENSUS_FIELDS = ("t", "rss_mb", "blocks", "heap_used", "heap_free", "keys")


def _census(path: Path, killed: Any, t_start: float) -> dict[str, Any]:
    """The coordinator's ``ctl/census.jsonl`` (``scale_coord.MemoryCensus``, every 10 s; ``t`` from the run's
    start): the curve of its RSS, Python's allocated blocks, glibc's heap (in use, free) and the store's
    key count, up to the loss; when the store's backlog drained (its keys within 20% of their level
    before the loss, their median over its last 60 s, from then on); the growth fitted from then to the loss; the largest containers
    of the launcher at the loss."""
    lines: list[dict[str, Any]] = []
    with contextlib.suppress(OSError):
        for text in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                ln = json.loads(text)
                ln["t"] = round(ln.pop("wall") - t_start, 1)
                lines.append(ln)
    until = (killed - t_start) if isinstance(killed, float) else float("inf")
    before = [ln for ln in lines if ln.get("t", 0) <= until and "keys" in ln and "rss_mb" in ln]
    if not before:
        return {}
    out: dict[str, Any] = {
        "curve": [[ln.get(k) for k in CENSUS_FIELDS] for ln in lines],
        "fields": CENSUS_FIELDS,
    }
    peak = max(before, key=lambda ln: ln["keys"])
    out["keys_peak"], out["keys_peak_s"] = peak["keys"], peak["t"]
    start = before.index(peak)
    last = sorted(ln["keys"] for ln in before[start:] if ln["t"] >= before[-1]["t"] - 60)
    level = last[len(last) // 2]  # the keys' level before the loss: their median over its last 60 s
    i = len(before)
    while i > start and before[i - 1]["keys"] <= 1.2 * level:
        i -= 1
    drained = before[i:]
    fit = _fit([ln["t"] for ln in drained], [ln["rss_mb"] for ln in drained]) if len(drained) >= 3 else None
    if fit is not None:
        out["drained_s"], out["keys_drained"] = drained[0]["t"], level
        out["after_drain"] = {"from_s": drained[0]["t"], "to_s": drained[-1]["t"], "rss_mb_from": drained[0]["rss_mb"],
                              "rss_mb_to": drained[-1]["rss_mb"], "growth_mb_per_min": round(fit["b_per_host"] * 60, 1)}  # fmt: skip
    largest = before[-1].get("census") or {}
    out["largest"] = dict(sorted(largest.items(), key=lambda kv: -kv[1])[:10])
    return out


def _log_summary(path: Path) -> dict[str, Any]:
    """How often the coordinator warned of its own stalls, and its other warnings' first lines."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    stalls = [ln for ln in lines if "stalled for" in ln]
    worst = 0.0
    for ln in stalls:
        with contextlib.suppress(ValueError, IndexError):
            worst = max(worst, float(ln.split("stalled for ")[1].split("s")[0]))
    other = [
        ln[-300:]
        for ln in lines
        if ("WARNING" in ln or "ERROR" in ln or "Traceback" in ln) and "stalled for" not in ln
    ]
    return {"stall_warnings": len(stalls), "worst_stall_s": worst, "other": other[:20]}


# -- the whole bench -----------------------------------------------------------------------
def _fit(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """Least squares ``y = a + b x`` and the largest relative deviation of a point from it."""
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    dev = max(abs(y - (a + b * x)) / max(abs(y), 1e-9) for x, y in zip(xs, ys, strict=True))
    return {"a": round(a, 3), "b_per_host": round(b, 4), "max_rel_dev": round(dev, 3)}


def store_microbench(keys_n: int = 16_000, value_bytes: int = 64, reps: int = 3) -> dict[str, Any]:
    """A store with one client: its cost for what group formation asks of it at 16,000 ranks: ``keys_n`` values of
    ``value_bytes`` (an address) read in one ``multi_get`` by one client, as each rank reads every peer's
    (gloo's rendezvous, ``sockets.exchange_listeners``); and one 0.56 MB value (the plan at 16,000 ranks)."""
    srv = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    cli = TCPStore(
        "127.0.0.1", srv.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    names = [f"a/{i}" for i in range(keys_n)]
    for i in range(0, keys_n, 2000):
        cli.multi_set(names[i : i + 2000], [b"x" * value_bytes] * len(names[i : i + 2000]))
    multi = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cli.multi_get(names)
        multi.append(time.perf_counter() - t0)
    cli.set("plan", b"x" * 560_000)
    plan = []
    for _ in range(reps * 3):
        t0 = time.perf_counter()
        cli.get("plan")
        plan.append(time.perf_counter() - t0)
    del cli, srv
    return {"keys": keys_n, "value_bytes": value_bytes, "multi_get_s": min(multi),
            "per_key_us": round(1e6 * min(multi) / keys_n, 3), "plan_bytes": 560_000, "plan_get_s": min(plan),
            "loadavg": common.load_average()}  # fmt: skip


def run(
    quick: bool, out: Path, cases: tuple[tuple[int, float], ...] | None = None, params: Params | None = None
) -> dict[str, Any]:
    """Every case (worker hosts, hang timeout) in turn; what the page's section is made from."""
    import dataclasses

    raise_nofile()
    params = params or Params()
    if quick:
        params.warmup_s, params.window_s, params.profile_s = QUICK_WARMUP_S, QUICK_WINDOW_S, QUICK_PROFILE_S
    cases = cases or (QUICK_CASES if quick else CASES)
    dest = common.fresh_dir(out / "control_scale")
    rows = []
    for hosts, hang in cases:
        print(f"   control_scale: {hosts} hosts x {NPROC} ranks + {SPARE_NODES} spare host, hang timeout {hang:g}s",
              flush=True)  # fmt: skip
        load = common.load_average()
        soak = params.soak_s if hosts >= SOAK_FROM_HOSTS and not quick else 0.0
        row = measure(hosts, dest, dataclasses.replace(params, hang_timeout=hang, soak_s=soak))
        row["hang_timeout_s"], row["loadavg_start"], row["loadavg_end"] = hang, load, common.load_average()
        what = (
            "ok" if row["ok"] else "FAILED: " + str(row.get("error") or row.get("failure", {}).get("error"))
        )
        print(f"   control_scale: {hosts} hosts: {what} ({row['wall_s']:.0f}s)", flush=True)
        rows.append(row)
    micro = store_microbench()
    series = [r for r in rows if "steady" in r and r["hang_timeout_s"] == SERIES_HANG_S]
    xs = [float(r["hosts"]) for r in series]
    lin = {
        "store_calls_per_s": _fit(xs, [r["steady"]["store_calls_per_s_total"] for r in series]),
        "coordinator_store_calls_per_s": _fit(xs, [r["steady"]["coordinator"]["store_calls_per_s_total"] for r in series]),
        "coordinator_cpu_core_frac": _fit(xs, [r["steady"]["coordinator"]["cpu_core_frac"] for r in series]),
    }  # fmt: skip
    return {
        "quick": quick, "nproc_per_node": NPROC, "spare_nodes": SPARE_NODES, "protocol": params.protocol,
        "params": {"series_hang_timeout_s": SERIES_HANG_S, "step_s": params.step_s, "warmup_s": params.warmup_s,
                   "window_s": params.window_s, "profile_s": params.profile_s, "sim_nice": params.nice},
        "protocol_target_per_s": {f"{h}@{t:g}": protocol_rates(h, t, params.step_s, params.protocol)
                                  for h, t in cases},
        "rows": rows, "linear_fit": lin, "store_microbench": micro, "published": PUBLISHED,
        "machine": common.machine_info(),
    }  # fmt: skip


# -- the page ---------------------------------------------------------------------------
def _g(r: Any, *path: str) -> Any:
    """``r[path[0]][path[1]]...``, None where a step is missing."""
    for p in path:
        if not isinstance(r, dict) or p not in r:
            return None
        r = r[p]
    return r


def _outcome(r: dict[str, Any]) -> str:
    if r.get("ok"):
        return "recovered"
    crash = _g(r, "coordinator_result", "error")
    if crash and "interrupted" not in str(crash):
        return f"coordinator ended: {str(crash)[:120]}"
    err = str(r.get("error") or _g(r, "failure", "error") or "failed")
    if "not within" in err and _g(r, "failure", "first_fault_s") is None:
        return f"nothing detected: {err.split(': ')[-1]} ({_loop_note(r)})"
    return err[:160]


def _store_us_per_call(r: dict[str, Any]) -> float | None:
    """The store thread's CPU per store call in the steady window (µs): what one call costs it."""
    cores = _g(r, "steady", "coordinator", "threads_core_frac", "store")
    calls = _g(r, "steady", "store_calls_per_s_total")
    return 1e6 * cores / calls if cores and calls else None


def _loop_note(r: dict[str, Any]) -> str:
    """How many loop iterations the coordinator made over its run (``TickHook``)."""
    fin = r.get("coordinator_final") or {}
    return f"{fin.get('loop_iterations')} loop iteration(s) in {f_(fin.get('run_s'), 0)} s"


def f_(x: Any, digits: int = 3) -> str:
    return common.fmt(x, digits)


#: what each purpose of the simulators' calls is, in the tables' words
_PURPOSE = {"status": "agent statuses", "relay": "relay values", "events": "event chunks",
            "ack": "lease round trips", "stop": "stop checks", "hb": "heartbeats", "commit": "commits",
            "read": "reads of the count of chunks read", "delete": "deletes of chunks read"}  # fmt: skip
#: the purposes the steady table's "offered" column shows, per protocol
_OFFERED = {RELAY: ("relay", "ack", "events", "stop"), PER_RANK: ("hb", "ack", "commit", "stop")}


def _protocol(res: dict[str, Any]) -> str:
    """What the simulated hosts spoke (results from before the relay say ``heartbeats: per-rank``)."""
    return str(res.get("protocol") or res.get("heartbeats") or PER_RANK)


def _target(res: dict[str, Any], r: dict[str, Any]) -> dict[str, float]:
    """The calls/s the protocol asked of case ``r``'s hosts, as its run recorded them."""
    hang = r.get("hang_timeout_s", SERIES_HANG_S)
    stored = (res.get("protocol_target_per_s") or {}).get(f"{r['hosts']}@{hang:g}")
    return stored or protocol_rates(r["hosts"], hang, res["params"]["step_s"], _protocol(res))


def verdicts(res: dict[str, Any], r: dict[str, Any] | None) -> list[list[str]]:
    """The goals at 2,000 hosts against case ``r`` (that scale, the series' setting)."""
    f = common.fmt
    if r is None:
        return [["(no 2,000-host case in these results)", "–", "–", "–"]]
    plan = _g(r, "failure", "plan_after_detection_s")
    cpu = _g(r, "steady", "coordinator", "cpu_core_frac")
    iters = _g(r, "coordinator_final", "loop_iterations")
    stuck = iters is not None and iters < 10
    peak = r.get("rss_mb_max")
    growth = _g(r, "steady", "coordinator", "rss_growth_mb_per_min")
    target = _target(res, r)
    hosts = r["hosts"] + SPARE_NODES
    offered = _g(r, "steady", "simulators", "offered_frac") or {}
    if _protocol(res) == RELAY:
        us = _store_us_per_call(r)
        need = sum(target.values()) * us / 1e6 if us else None
        short = [k for k in target if (offered.get(k) or 0) < 0.9]
        traffic = [
            "steady store traffic linear in hosts", "linear",
            f"by construction: {sum(target.values()) / hosts:,.0f} store calls/s per host (a relay value and a "
            f"round trip per beat, an event chunk per step, its status and a round trip every "
            f"{intervals(r.get('hang_timeout_s', SERIES_HANG_S))[2]:g} s, its 8 ranks' stop checks: "
            f"{target.get('stop', 0) / hosts:,.0f}/s), {sum(target.values()):,.0f}/s at 2,000 hosts on one store "
            "thread" + (f", about {need:.2f} cores of it at the {f(us, 0)} µs per call measured there" if need
                        else "")
            + "; the simulators offered " + ", ".join(f"{f(offered.get(k), 3)} of the {_PURPOSE[k]}" for k in target),
            "–" if need is None else "linear, but **not met** as a load one store thread carries" if need >= 1
            else f"linear; not established (offered under 0.9: {', '.join(_PURPOSE[k] for k in short)})" if short
            else "met",
        ]  # fmt: skip
    else:
        per_rank = sum(target.get(k, 0.0) for k in ("hb", "ack", "commit", "stop")) / hosts
        traffic = [
            "steady store traffic linear in hosts", "linear",
            f"by construction: {sum(target.values()) / hosts:,.0f} store calls/s per host, {per_rank:,.0f} of them "
            "from its 8 ranks (heartbeats, lease checks, commits), so linear with a large constant "
            f"({sum(target.values()):,.0f}/s at 2,000 hosts, one store thread); measured: the simulators offered "
            f"{f(offered.get('hb'), 3)} of the heartbeats and {f(offered.get('ack'), 3)} of the lease checks at "
            "2,000 hosts",
            "linear, but **not met** as a load one store thread carries (finding 3)",
        ]  # fmt: skip
    return [
        ["new plan within 1 s of detection (host_lost → gen 1 plan)", "≤ 1 s",
         f(plan, 2) + " s" if plan is not None
         else f"no host_lost, no plan: {_outcome(r)} ({_loop_note(r)})",
         "**not met**" if plan is None or plan > 1 else "met"],
        ["coordinator process CPU", "< 1 core",
         f"{f(cpu, 2)} cores (2 cores shared with the simulators)"
         + (f"; under a core only because its loop was blocked on the store: {_loop_note(r)}" if stuck else ""),
         "–" if cpu is None else "**not met**" if stuck or cpu >= 1 else "met"],
        _memory_goal(r, peak, growth),
        traffic,
    ]  # fmt: skip


def _memory_goal(r: dict[str, Any], peak: float | None, growth: float | None) -> list[str]:
    """The memory goal's row: the peak, and the growth after the soak where there was one (else in the
    steady window, while the bounded buffers still fill); an hour of that growth must stay under 1 GB."""
    f = common.fmt
    soak = r.get("rss_before_loss")
    if soak:
        at, grow = soak["mb_at_loss"], soak["growth_mb_per_min"]
        text = (f"{f(peak, 0)} MB at its peak (the whole run: the loss, the recovery and the job's stop, when every host writes its last events); before the loss "
                f"{f(at, 0)} MB, growing {f(grow, 1)} MB/min over the last {f(soak['to_s'] - soak['from_s'], 0)} s of "
                f"a {f(soak['to_s'], 0)} s run")  # fmt: skip
        lasting = at + max(0.0, grow) * 60
    else:
        text = f"{f(peak, 0)} MB at its peak (the run lasted minutes), growing {f(growth, 0)} MB/min"
        lasting = (peak or 0) + (growth or 0) * 60
    verdict = "–" if peak is None else "**not met**" if peak >= 1024 or lasting >= 1024 else "met"
    return ["coordinator process memory", "< 1 GB", text, verdict]


def _census_text(r: dict[str, Any]) -> str:
    """Where a soaked run's memory went (``_census``), in a sentence or two."""
    c = r.get("memory_census") or {}
    after = c.get("after_drain")
    if not after:
        return ""
    f = common.fmt
    big = ", ".join(
        f"`{k.removeprefix('launcher.')}` {v:,}" for k, v in list(c.get("largest", {}).items())[:6]
    )
    if c["keys_peak"] < 2 * c["keys_drained"]:  # no backlog of the start to read: the log kept up
        return (
            f" At {r['hosts']:,} hosts (`ctl/census.jsonl`, every 10 s) the store held at most {c['keys_peak']:,} "
            f"keys (no backlog of the start); the coordinator's largest containers at the loss: {big}."
        )
    return (
        f" At {r['hosts']:,} hosts, every 10 s (`ctl/census.jsonl`): the store held up to {c['keys_peak']:,} keys "
        f"({f(c['keys_peak_s'], 0)} s into the run: the hosts' unread event chunks while the log read the "
        f"start's backlog), {c['keys_drained']:,} from {f(c['drained_s'], 0)} s on; from then to the loss the "
        f"coordinator went from {f(after['rss_mb_from'], 0)} to {f(after['rss_mb_to'], 0)} MB "
        f"({f(after['growth_mb_per_min'], 1)} MB/min fitted). Its largest containers then: {big}."
    )


def markdown(res: dict[str, Any]) -> str:
    rows = res.get("rows", [])
    if not rows:
        return "FAILED: no case measured"
    f = common.fmt
    g = _g
    relayed = _protocol(res) == RELAY
    offered = _OFFERED[RELAY if relayed else PER_RANK]

    def label(r: dict[str, Any]) -> str:
        return f"{r['hosts']:,} ({r['ranks']:,})" + ("" if r.get("hang_timeout_s") == SERIES_HANG_S
                                                     else f", hang {r.get('hang_timeout_s'):g} s")  # fmt: skip

    failure = common.md_table(
        ["hosts (ranks)", "first `fault_detected` s", "abort seen s", "last report made s", "`host_lost` s",
         "gen 1 plan s", "plan − host_lost s", "`recovery_done` s", "outcome"],
        [[label(r), f(g(r, "failure", "first_fault_s"), 2), f(g(r, "failure", "abort_seen_s"), 2),
          f(g(r, "failure", "reports_done_s"), 2), f(g(r, "failure", "host_lost_s"), 2),
          f(g(r, "failure", "plan_s"), 2), f(g(r, "failure", "plan_after_detection_s"), 2),
          f(g(r, "failure", "recovery_done_s"), 2), _outcome(r)]
         for r in rows],
    )  # fmt: skip
    steady = common.md_table(
        ["hosts (ranks)", "coordinator CPU, cores: process / main / store thread", "loop iterations/s · p95 s",
         "RSS MB window start → end · peak · growth MB/min", "store calls/s: all · per host · coordinator's",
         "offered: " + " / ".join(_PURPOSE[k] for k in offered), "machine CPU busy · load avg"],
        [[label(r),
          " / ".join(f(g(r, "steady", "coordinator", *k), 2) for k in
                     (("cpu_core_frac",), ("threads_core_frac", "main"), ("threads_core_frac", "store"))),
          f"{f(g(r, 'steady', 'coordinator', 'loop_iterations_per_s'), 2)} · "
          f"{f(g(r, 'steady', 'coordinator', 'loop_iteration_s', 'p95'), 2)}",
          f"{f(g(r, 'steady', 'coordinator', 'rss_mb_start'), 0)} → {f(g(r, 'steady', 'coordinator', 'rss_mb_end'), 0)}"
          f" · {f(r.get('rss_mb_max'), 0)} · {f(g(r, 'steady', 'coordinator', 'rss_growth_mb_per_min'), 0)}",
          f"{f(g(r, 'steady', 'store_calls_per_s_total'), 0)} · {f(g(r, 'steady', 'store_calls_per_host_per_s'), 1)}"
          f" · {f(g(r, 'steady', 'coordinator', 'store_calls_per_s_total'), 0)}",
          " / ".join(f(g(r, "steady", "simulators", "offered_frac", k), 2) for k in offered),
          f"{f(g(r, 'steady', 'machine_cpu_busy_frac'), 2)} · {r.get('loadavg_start', ['–'])[0]}"]
         for r in rows if g(r, "steady")],
    )  # fmt: skip
    traffic = common.md_table(
        ["hosts (ranks)", "status value B",
         *(["relay value B (its heartbeat B)", "per poll: statuses B (hosts × status)",
            "per poll: relay values B (hosts × relay)"] if relayed
           else ["heartbeat value B", "per poll: statuses B (hosts × status)", "per poll: heartbeats B (ranks × hb)"]),
         "coordinator reads B/s", "events/s into the log (rank commits in them /s)", "protocol's calls/s (target)"],
        [[label(r), f(g(r, "steady", "sizes_bytes", "status"), 0),
          f"{f(g(r, 'steady', 'sizes_bytes', 'relay'), 0)} ({f(g(r, 'steady', 'sizes_bytes', 'heartbeat'), 0)})"
          if relayed else f(g(r, "steady", "sizes_bytes", "heartbeat"), 0),
          f"{g(r, 'steady', 'per_poll_bytes', 'statuses') or 0:,}", f"{g(r, 'steady', 'per_poll_bytes', 'relays' if relayed else 'heartbeats') or 0:,}",
          f"{sum((g(r, 'steady', 'coordinator', 'bytes_in_per_s') or {}).values()):,.0f}",
          f"{f(g(r, 'steady', 'coordinator', 'events_per_s'), 0)} ({f(_commits_per_s(r), 0)})",
          f"{sum((g(r, 'steady', 'simulators', 'protocol_target_per_s') or {}).values()):,.0f}"]
         for r in rows if g(r, "steady")],
    )  # fmt: skip
    prof_lines = []
    for r in rows:
        top = (r.get("profile") or {}).get("exclusive") or []
        if top:
            prof_lines.append(
                f"- {label(r)}: " + "; ".join(f"{fn} {100 * share:.0f}%" for fn, share in top[:4])
            )
    big = next((r for r in rows if r["hosts"] == 2000 and r.get("hang_timeout_s") == SERIES_HANG_S), None)
    parts = [
        f"{res['nproc_per_node']} ranks per host, one spare host, {res['params']['step_s']:g} step/s, protocol "
        + (
            "`relay` (today's: each host's agent forwards its ranks' heartbeats, events and lease, one value, one "
            "chunk and one round trip per host)"
            if relayed
            else "`per-rank` (before the agents' relay: each rank "
            "beats, writes its events and renews its lease on the coordinator's store)"
        )
        + "; the series at hang timeout "
        f"{res['params']['series_hang_timeout_s']:g} s (the method says why), the job's default 0.5 s at 100 hosts. "
        f"Steady window {res['params']['window_s']:g} s after {res['params']['warmup_s']:g} s of warm-up; then "
        f"{res['params']['profile_s']:g} s of sampling profile; then one worker host loses power (t = 0 below). "
        "Alone: `OMP_NUM_THREADS=1 python -m bench.control_scale` (every case) or `--quick` (10 and 100 hosts); "
        "`--hosts 10,100 --hang-timeout 0.5` for other cases, `--protocol per-rank` for the protocol before the "
        "relay.",
        "",
        "**A host's power loss** (seconds from the loss, on one clock: the events' times are the coordinator's; "
        "abort seen and last report made: by the simulated ranks, on their clock, the same machine's; a hung "
        "member's generation is aborted at its kill, so the reports come before the host is declared lost):",
        "",
        failure,
        "",
        "**Steady state** (the window before the loss):",
        "",
        steady,
        "",
        "**Bytes per coordinator tick.** The coordinator reads every host's status at each loop iteration and "
        + ("every host's relay value" if relayed else "every process's heartbeat")
        + " at each heartbeat poll (0.1 s), each in one `multi_get`:",
        "",
        traffic,
        "",
    ]
    if prof_lines:
        parts += ["**Where the coordinator's main thread spends its wall time** (sampled every 20 ms in the profile "
                  "window; `store OP <- f`: blocked in a store round trip made by `f`):", "", *prof_lines, ""]  # fmt: skip
    parts += ["**The goals at 2,000 hosts:**", "",
              common.md_table(["goal", "target", "measured", "verdict"], verdicts(res, big)), ""]  # fmt: skip
    parts += [_findings(res), "", _on_paper(res)]
    return "\n".join(parts)


def _rtt_us(r: dict[str, Any], op: str) -> float | None:
    """The coordinator's mean wall time per ``op`` call in the steady window (µs): a round trip's cost."""
    calls = _g(r, "steady", "coordinator", "store_calls_per_s", f"main {op}")
    secs = _g(r, "steady", "coordinator", "seconds_in_store_calls_per_s", f"main {op}")
    return 1e6 * secs / calls if calls and secs else None


def _share(r: dict[str, Any], needle: str, whole: bool = False) -> float | None:
    """The share of the loop's sampled wall time whose leaf contains ``needle``."""
    prof = r.get("profile_whole_run" if whole else "profile") or {}
    hits = [share for fn, share in prof.get("exclusive", []) if needle in fn or fn.startswith(needle)]
    return sum(hits) if prof.get("exclusive") else None


def _findings(res: dict[str, Any]) -> str:
    """The bottlenecks, each with the evidence the runs recorded (code and numbers)."""
    return _findings_relay(res) if _protocol(res) == RELAY else _findings_per_rank(res)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _loop_rate(r: dict[str, Any]) -> str:
    """The coordinator loop's pace in case ``r``: iterations a second, or how few it made at all."""
    fin = r.get("coordinator_final") or {}
    if fin.get("loop_iterations") is not None and fin["loop_iterations"] < 20:
        return f"{fin['loop_iterations']} iteration(s) in {common.fmt(fin.get('run_s'), 0)} s"
    return f"{common.fmt(_g(r, 'steady', 'coordinator', 'loop_iterations_per_s'), 1)} iterations/s"


def _findings_common(res: dict[str, Any], first: int) -> list[str]:
    """The findings that hold in both protocols (numbered from ``first``)."""
    rows, f = res["rows"], common.fmt
    series = [r for r in rows if r.get("hang_timeout_s") == SERIES_HANG_S]
    lines, n = [], first
    slow = [r for r in rows if _g(r, "failure", "first_fault_s") is not None]
    if slow:
        lines.append(
            f"{n}. **A busy coordinator postpones its own detections.** `HeartbeatReader._forgive_own_stall` credits "
            "each of the coordinator's stalls to the silence clocks (a loaded machine must not kill every rank "
            "for the coordinator's own pause); when the read after a stall brings most processes' heartbeats, "
            "a silent one gets at most one hang timeout of credit (2026-12-04: it used to get every stall, and "
            "a coordinator slower than its reads found a dead host's processes only the sum of its stalls late). The "
            "first `fault_detected` came "
            + ", ".join(
                f"{f(_g(r, 'failure', 'first_fault_s'), 1)} s after the power loss at {r['hosts']:,} hosts, "
                f"hang timeout {r['hang_timeout_s']:g} s ({_g(r, 'coordinator_log', 'stall_warnings')} stall "
                f"warnings, up to {f(_g(r, 'coordinator_log', 'worst_stall_s'), 1)} s)"
                for r in slow
            )
            + "."
        )
        n += 1
    lines.append(
        f"{n}. **The hang rule's CPU exemption does not hold for a remote process** (from the code; a development "
        "run of the per-rank protocol at 100 hosts and the 0.5 s default, with the simulators' heartbeats up to "
        "0.6 s late, lost 16 healthy ranks and the job this way). `ProcessWatch` spares a silent process that "
        "used CPU in a window of `hang_timeout_s / 2`; a remote process's CPU time changes only when its agent's "
        "status does, every `0.8 x hang_timeout_s`, so a window often sees none and a busy process whose "
        "heartbeats are late is killed as stopped."
    )
    growth = [(r["hosts"], _g(r, "steady", "coordinator", "rss_growth_mb_per_min"), r.get("rss_mb_max"))
              for r in series if _g(r, "steady")]  # fmt: skip
    soaked = [r for r in series if r.get("rss_before_loss")]
    lines.append(
        f"{n + 1}. **Memory is bounded while the event log falls behind.** Every rank sends an event per step. The "
        "launcher's log (`observe/event_log.py`) writes each to `events.jsonl` and keeps a bounded share in "
        f"memory (every event up to {KEEP_COMMITS:,} commits and {KEEP_USAGE:,} usage samples, then each rank's first "
        "commit of a generation and its last ones before a fault; the report's figures from every event). The chunks it has not read wait in the "
        "store, in the same process, but each relay keeps at most 32 KB of them unread there (plus one chunk "
        "of up to 32 KB) and holds the rest on its host, merged into larger chunks (`launch/relay.py`); a pass "
        f"reads at most {RELAYED_CHUNKS_PER_PASS} chunks and about {RELAYED_BYTES_PER_PASS >> 20} MB. Growth in the "
        "steady window (20 s, while those buffers fill) "
        + ", ".join(f"{f(gr, 0)} MB/min at {h:,} hosts (peak {f(pk, 0)} MB)" for h, gr, pk in growth)
        + (
            "; after a longer run (the soak): "
            + ", ".join(
                f"{f(r['rss_before_loss']['mb_at_loss'], 0)} MB at {r['hosts']:,} hosts "
                f"{f(r['rss_before_loss']['to_s'], 0)} s into the run, growing "
                f"{f(r['rss_before_loss']['growth_mb_per_min'], 1)} MB/min over its last "
                f"{f(r['rss_before_loss']['to_s'] - r['rss_before_loss']['from_s'], 0)} s"
                for r in soaked
            )
            if soaked
            else ""
        )
        + "; the log took in "
        + ", ".join(
            f"{f(_commits_per_s(r), 0)} rank commits/s in {f(_g(r, 'steady', 'coordinator', 'events_per_s'), 0)} "
            f"events/s at {r['hosts']:,} hosts (the ranks committed {r['hosts'] * NPROC / STEP_S:,.0f}/s)"
            for r in series
            if r["hosts"] >= 1000 and _g(r, "steady")
        )
        + ". What the log does not take in waits on the hosts, then (past 32 MB a host) its step commits are "
        "dropped and counted (`events_dropped`, the report's `step_commits_dropped`). "
        + (
            "Each host's relay packs its ranks' commits of one step into one `steps_committed` event "
            "(`relay_wire.pack_commits`, since 2026-12-05: at 2,000 hosts the log took in 3,664 of the 16,000 "
            "commits a second sent one event each)."
            if any(_g(r, "steady", "coordinator", "commits_per_s") is not None for r in series)
            else "Commits aggregated per host and step are what would bring the log within reach of 16,000 a second."
        )
        + "".join(_census_text(r) for r in soaked)
    )
    gcs = [
        (r["hosts"], _g(r, "steady", "coordinator", "gc_full"), _g(r, "coordinator_final", "gc"))
        for r in series
    ]
    if any(g for _, _, g in gcs):
        lines.append(
            f"{n + 2}. **Python's full garbage collections.** The launcher freezes what exists when its loop starts "
            "(the process table) out of every collection and makes a full collection wait for "
            f"{FULL_GC_EVERY} of the middle "
            "generation (`runtime.steady_gc`); the event log keeps no tuple per event (a tuple holding a dict "
            "stays tracked). Before, at 2,000 hosts, a full collection came about every second and took 0.2-0.6 s, "
            "none finding garbage (a third of the loop; a plan 0.7 s late when one fell after a host's loss). "
            "Measured in the whole run: "
            + ", ".join(
                f"{g['full']} full collections at {h:,} hosts, {f(g['full_s'], 1)} s in all, the longest "
                f"{f(g['longest_s'], 2)} s"
                for h, _, g in gcs
                if g
            )
            + "."
        )
    return lines


def _findings_relay(res: dict[str, Any]) -> str:
    """``_findings`` of runs whose hosts relayed (``launch/relay.py``)."""
    rows, f = res["rows"], common.fmt
    series = [r for r in rows if r.get("hang_timeout_s") == SERIES_HANG_S]
    step_s = res["params"]["step_s"]
    ok = [r["hosts"] for r in series if r.get("ok")]
    failed = [r["hosts"] for r in series if not r.get("ok")]
    if ok and failed:
        head = (f"The coordinator recovered up to {max(ok):,} hosts here"
                + (f" and not from {min(h for h in failed if h > max(ok)):,} hosts up" if max(failed) > max(ok)
                   else "") + f" (failed: {', '.join(f'{h:,}' for h in failed)} hosts)")  # fmt: skip
    elif ok:
        head = f"The coordinator recovered at every scale measured here, up to {max(ok):,} hosts"
    else:
        head = "The coordinator recovered at no scale measured here"
    hosts = 2000 + SPARE_NODES
    full = protocol_rates(2000, SERIES_HANG_S, step_s, RELAY)
    full_default = protocol_rates(2000, HANG_TIMEOUT_S, step_s, RELAY)
    costs = [(r["hosts"], _store_us_per_call(r)) for r in series if _store_us_per_call(r)]
    us = min((c for _, c in costs), default=None)
    mid = next((r for r in series if r["hosts"] == 100), series[0] if series else None)
    rtt_del = _rtt_us(mid, "delete_key") if mid else None

    def each(fn: Callable[[dict[str, Any]], str]) -> str:
        return ", ".join(f"{fn(r)} at {r['hosts']:,} hosts" for r in series)

    lines = [
        "**Findings** (what limits the control plane, with the evidence; the profile shares are of the loop's "
        "sampled wall time):",
        "",
        f"1. **{head}.** Each host's agent relays its ranks' heartbeats, events and leases: the coordinator reads "
        "one relay value per host per heartbeat poll (one `multi_get` for every host) and one event chunk per "
        "host per step, the oldest unread one of each host in turn, at most "
        f"{RELAYED_CHUNKS_PER_PASS} a pass; it deletes none (a relay deletes its chunks once the count of "
        "chunks read, written for every host in one `multi_set` a pass, passes them; the coordinator deleted "
        f"each before, a round trip a chunk: {2000 / step_s:,.0f}/s at 2,000 hosts"
        + (f", {f(rtt_del, 0)} µs each at 100 hosts" if rtt_del else "")
        + f"); every 5 s `IntruderWatch.check` checks at most {INTRUDER_KEYS} plain key names, one `check` "
        "each; a member's failure report comes in its heartbeat, in its host's relay value (2026-12-04: it was "
        "4 store calls per rank, 64,000 at 2,000 hosts, and the list of reports was deduplicated by a list "
        "scan, quadratic: 6.6 s of the loop there; a hung member's generation is now aborted when it is "
        "killed, not when its lost host's exit is confirmed, so its peers report meanwhile). "
        "Blocked in store round trips: "
        + each(lambda r: _pct(_share(r, "store ")))
        + " of the loop's time in the profile window (the list above names the calls). The loop: "
        + each(_loop_rate)
        + ".",
        f"2. **One store thread carries every host's traffic.** The relay protocol "
        f"asks {sum(full.values()):,.0f} store calls/s of 2,000 hosts x 8 ranks at this series' setting "
        f"({sum(full_default.values()):,.0f} at the 0.5 s default): per host a relay value and a round trip "
        f"every 0.1 s, an event chunk per step, a status and a round trip every "
        f"{intervals(SERIES_HANG_S)[2]:g} s, and a check of the job's stop every 10 beats for its ranks "
        f"(which read it in their host's lease, `ControlClient.stop_requested`): "
        f"{full['stop']:,.0f}/s, {_pct(full['stop'] / sum(full.values()))} of the whole, "
        f"{full['stop'] / hosts:,.0f} of the {sum(full.values()) / hosts:,.0f} calls/s per host. The store's "
        "server is one libuv thread of the coordinator's process; its CPU per call in the steady windows: "
        + (", ".join(f"{f(c, 0)} µs at {h:,} hosts" for h, c in costs) if costs else "–")
        + (f", so the 2,000-host protocol needs about {sum(full.values()) * us / 1e6:.2f} cores of it" if us else "")
        + ". The simulators offered "
        + ", ".join(
            f"{f(_g(r, 'steady', 'simulators', 'offered_frac', 'relay'), 2)} of the relay values and "
            f"{f(_g(r, 'steady', 'simulators', 'offered_frac', 'stop'), 2)} of the stop checks at {r['hosts']:,}"
            for r in series if _g(r, "steady")
        )
        + " hosts (below 1: the figures there are of a lighter load than the protocol's).",
        *_findings_common(res, 3),
    ]  # fmt: skip
    return "\n".join(lines)


def _findings_per_rank(res: dict[str, Any]) -> str:
    """``_findings`` of runs of the protocol before the relay (every rank on the coordinator's store)."""
    rows = res["rows"]
    f = common.fmt
    series = [r for r in rows if r.get("hang_timeout_s") == SERIES_HANG_S]
    step_s = res["params"]["step_s"]

    def each(fn: Callable[[dict[str, Any]], str]) -> str:
        return ", ".join(f"{fn(r)} at {r['hosts']:,} hosts" for r in series)

    mid = next((r for r in series if r["hosts"] == 100), series[0] if series else None)
    rtt_check = _rtt_us(mid, "check") if mid else None
    rtt_del = _rtt_us(mid, "delete_key") if mid else None
    ranks = 2000 * NPROC
    deletes = ranks / step_s
    checks = (4 * (ranks + SPARE_NODES * NPROC) + 2 * ranks) / 5.0  # IntruderWatch.check, every 5 s
    costs = [(r["hosts"], _store_us_per_call(r)) for r in series if _store_us_per_call(r)]
    us = min((c for _, c in costs), default=None)
    full = protocol_rates(2000, SERIES_HANG_S, step_s, PER_RANK)
    full_default = protocol_rates(2000, HANG_TIMEOUT_S, step_s, PER_RANK)
    if not any("stop" in t for t in (res.get("protocol_target_per_s") or {}).values()):
        full.pop("stop"), full_default.pop("stop")  # runs from before the stop checks were simulated
    crashed = [r for r in rows if "DistNetworkError" in str(_g(r, "coordinator_result", "error") or "")]

    lines = [
        "**Findings** (what limits the control plane, with the evidence; the profile shares are of the loop's "
        "sampled wall time):",
        "",
        "1. **The coordinator's loop breaks first, between 100 and 300 hosts here: it makes serial store round "
        "trips in proportion to the ranks.** Every step it deletes each rank's event chunk, one `delete_key` "
        "round trip each (`Launcher._record_chunk`); every 5 s `IntruderWatch.check` checks about six "
        "plain key names per process, one `check` each; during a failure `Coordinator._check_reports` reads each "
        "member's report (a check and a get) every tick. Each round trip waits behind the hosts' traffic on "
        "the one store thread"
        + (
            f" ({f(rtt_check, 0)} µs a `check`, {f(rtt_del, 0)} µs a `delete_key` at 100 hosts)"
            if rtt_del
            else ""
        )
        + ". Blocked in store round trips: "
        + each(lambda r: _pct(_share(r, "store ")))
        + " of the loop's time in the profile window (the largest part each time in the list above: the event "
        "chunks' deletes and reads, the intruder checks). The loop: "
        + each(_loop_rate)
        + ". Once an iteration outlasts a step the unread chunks pile up and the next read of them is larger "
        "still (over the 300-host run, the `multi_get` of that backlog was "
        + _pct(
            next(
                (
                    _share(r, "multi_get <- checkpointless/launch/launcher.py", whole=True)
                    for r in series
                    if r["hosts"] == 300
                ),
                None,
            )
        )
        + " of the loop's time): the coordinator never catches up, detects nothing, plans nothing. On paper, "
        f"at 2,000 hosts the loop owes {deletes:,.0f} deletes and {checks:,.0f} checks a second, serially"
        + (
            f": {(deletes * rtt_del + checks * rtt_check) / 1e6:.1f} s of round trips per second at the 100-host "
            "costs above"
            if rtt_del and rtt_check
            else ""
        )
        + (
            f", and still {(deletes + checks) * us / 1e6:.1f} s at the store thread's own CPU per call "
            f"({f(us, 0)} µs)"
            if us
            else ""
        )
        + ": it cannot keep up on any machine.",
    ]
    if crashed:
        r = crashed[0]
        lines.append(
            f"2. **A hard limit, and the crash at {r['hosts']:,} hosts.** The libuv store server refuses a request "
            "naming more than 131,072 keys (`MAX_KEY_COUNT = 128 * 1024` in `TCPStoreLibUvBackend.cpp`; checked "
            "here: a `multi_get` of 131,073 keys gets `Connection reset by peer`, 131,072 pass). "
            "`Launcher._collect_events` reads every announced unread chunk in one `multi_get`: once the loop lags "
            "131,072 / ranks steps (8 steps at 16,000 ranks) the store resets the launcher's own connection and "
            "the uncaught `DistNetworkError` ends the coordinator, and with it the job (every host fences "
            f"itself when its lease runs out). Here: {_loop_note(r)}, then `{_g(r, 'coordinator_result', 'error')}` "
            "from `Launcher._collect_events` → `SignedStore.get_sealed_present` → `multi_get`. The heartbeat "
            "read has the same limit at 131,072 processes."
        )
    else:
        lines.append(
            "2. **A hard limit.** The libuv store server refuses a request naming more than 131,072 keys "
            "(`MAX_KEY_COUNT = 128 * 1024` in `TCPStoreLibUvBackend.cpp`; a `multi_get` of 131,073 keys gets "
            "`Connection reset by peer`). `Launcher._collect_events` reads every announced unread chunk in one "
            "`multi_get`: a loop that lags 131,072 / ranks steps ends the coordinator."
        )
    lines.append(
        "3. **One store thread carries every host's and every rank's traffic.** Today's protocol asks "
        f"{sum(full.values()):,.0f} store calls/s of 2,000 hosts x 8 ranks at this series' setting "
        f"({sum(full_default.values()):,.0f} at the 0.5 s default): per rank a heartbeat `set` every 0.1 s, a "
        "lease `check` every 0.1 s (62.5 ms at the default) and two writes per step; per host a status and a "
        "round trip every beat. The store's server is one libuv thread of the coordinator's process; its CPU "
        "per call in the steady windows: "
        + (", ".join(f"{f(c, 0)} µs at {h:,} hosts" for h, c in costs) if costs else "–")
        + (
            f", so the 2,000-host protocol needs about {sum(full.values()) * us / 1e6:.0f} cores of it"
            if us
            else ""
        )
        + ". Beyond ~100 hosts the simulators here offered only part of it (the offered column: "
        + ", ".join(
            f"{f(_g(r, 'steady', 'simulators', 'offered_frac', 'hb'), 2)} of the heartbeats at {r['hosts']:,}"
            for r in series
            if _g(r, "steady")
        )
        + "), so the figures from 300 hosts on are of a lighter load than the protocol's: the real one fails "
        f"sooner. Of the {sum(full.values()) / 2001:,.0f} calls/s per host, "
        f"{(full['hb'] + full['ack']) / 2001:,.0f} are the 8 ranks' heartbeats and lease checks: folded into "
        "the host's status (one key, one round trip per host), they would shrink eightfold."
    )
    lines.append(
        "4. **Two O(n^2) scans in every loop iteration, before any store call.** `RemoteNodes.poll`, for each "
        "host, scans every process (`[... for n, p in self.children.items() if p._host is h]`): 2,001 x 16,008 "
        "= 32 million steps at 2,000 hosts. `ProcessWatch.check_processes` asks `Plan.rank_of` the rank of every "
        "worker each tick, and `rank_of` scans every member: 16,000 x 16,000 = 256 million steps per tick "
        f"({_pct(_share(mid, 'rank_of')) if mid else '–'} of the loop's time already at 100 hosts)."
    )
    lines += _findings_common(res, 5)
    return "\n".join(lines)


def _on_paper(res: dict[str, Any]) -> str:
    """What forming the next generation's process groups costs at 2,000 hosts x 8 ranks, from what was
    measured here and published figures."""
    rows = res["rows"]
    f = common.fmt
    hosts = 2000
    ranks = hosts * NPROC
    micro = res.get("store_microbench") or {}
    per_key = micro.get("per_key_us")
    plan_get = micro.get("plan_get_s")
    plans = [(r["hosts"], _g(r, "failure", "plan_bytes")) for r in rows if _g(r, "failure", "plan_bytes")]
    big = max(plans, default=None)
    plan_bytes = (big[1] / (big[0] * NPROC) if big else 35.0) * ranks  # the plan grows with the ranks
    mesh = ranks * (ranks - 1)
    lines = [
        "**On paper: forming generation n+1 at 2,000 hosts x 8 ranks.** After the plan, every rank builds "
        "the new generation's groups on the same store (`comm.py`): a `ProcessGroupGloo` over every rank (a "
        "full mesh: each rank reads every peer's address from the store), then each rank publishes its "
        "listeners and reads every peer's (`sockets.exchange_listeners`, one `multi_get` of all the others); "
        "with NCCL, an NCCL communicator plus a gloo control group of the same size. Measured here, on a "
        "store with no other client (this 2-core machine, shared with another job: load average "
        f"{(micro.get('loadavg') or ['?'])[0]}): "
        + (
            f"one `multi_get` of {micro['keys']:,} keys of {micro['value_bytes']} bytes took "
            f"{f(micro['multi_get_s'] * 1e3, 0)} ms ({f(per_key, 1)} µs a key), one get of a "
            f"{micro['plan_bytes'] / 1e6:.2f} MB value {f(plan_get * 1e3, 2)} ms."
            if per_key and plan_get
            else "(no store micro-benchmark in these results)."
        )
        + " With those, and published figures:",
        "",
        f"- **The plan.** It lists every rank's process and host: {plan_bytes / 1e6:.2f} MB at 16,000 ranks"
        + (f" ({f(big[1] / 1e3, 0)} kB measured at {big[0]:,} hosts)" if big else "")
        + ". Every rank reads it (`ControlClient.wait_plan`), from its host's relay, which reads it once "
        "from the coordinator's store for the host's ranks (`Relay._copy_plan`, since 2026-12-05): "
        f"{plan_bytes * hosts / 1e9:.1f} GB out of the store per recovery"
        + (f", {hosts * plan_get:.1f} s of the store thread at the rate above" if plan_get else "")
        + f" (every rank reading it there, as before: {plan_bytes * ranks / 1e9:.1f} GB"
        + (f", {ranks * plan_get:.1f} s" if plan_get else "")
        + ").",
        f"- **gloo.** Each rank reads every peer's entry: at least {mesh / 1e6:,.0f} million key reads per full "
        "mesh, twice per generation (gloo's rendezvous, then the listeners)"
        + (
            f"; {mesh * per_key / 1e6 / 60:,.0f} min of the one store thread each at the {f(per_key, 1)} µs a key "
            "measured here"
            if per_key
            else ""
        )
        + ". Published: `ProcessGroupGloo` init took 82 s at 2k ranks, 393 s at 4k, 55 min at 8k, and 18 s, "
        "25 s, 85 s with batched reads [gloo#408] (85 s for 8k x 8k reads is 1.3 µs a key on their store); the "
        "full mesh and the store's limited request rate are the known cause [gloo#419]. Quadratic: at 16k "
        "ranks 4 times the 8k figure, about 6 min even batched on their hardware, and the gloo control group "
        "beside NCCL pays it too.",
        "- **NCCL.** A new communicator over every rank: about 2.5 min at a few thousand GPUs with the default "
        "init [nccl#1156]; tens of seconds of CPU in O(N^2) steps at 48K-96K GPUs before their fix "
        "[nccl#1789]. The store carries only the unique id.",
        "- **Connections.** The store's connections survive a recovery (only the replaced host's reconnect); a "
        "restart of the whole job would reconnect every one: 96K ranks took about 100 s on the libuv store "
        "[tcpstore].",
        "",
        "So at 2,000 hosts a recovery is bounded by forming the new groups over every rank (minutes by the "
        "measured store cost and by the published figures), then by distributing the plan (seconds), not by "
        "detection, once the control plane itself keeps up"
        + (
            " (the findings above say how far it does). What it needs still: groups that do not rebuild over "
            "every rank (NCCL's `ncclCommShrink` / `ncclCommGrow` [nccl-api], or a hierarchy: groups within a "
            "replica set, a small group across), event chunks deleted in one call, no "
            "per-process round trips in the coordinator's loop or per rank and step on its store, and a store "
            "that is not one thread (sharded)."
            if _protocol(res) == RELAY
            else " (the findings above: with this protocol it does not). What it needs: groups that do not "
            "rebuild over every rank (NCCL's `ncclCommShrink` / `ncclCommGrow` [nccl-api], or a hierarchy: "
            "groups within a replica set, a small group across), one plan read per host, heartbeats folded into "
            "each host's status (one key per host, not eight), event chunks batched and deleted in one call, no "
            "per-process round trips in the coordinator's loop, and a store that is not one thread (sharded, or "
            "agents relaying their hosts' traffic)."
        ),
        "",
        "Published figures used above:",
        "",
        common.md_table(
            ["", "what", "figure", "source"],
            [
                [f"[{k}]", p["what"], p["figure"], p["url"]]
                for k, p in zip(
                    ("tcpstore", "gloo#408", "gloo#419", "nccl#1156", "nccl#1789", "nccl-api"),
                    [*res.get("published", PUBLISHED), NCCL_API],
                    strict=False,
                )
            ],
        ),
    ]
    return "\n".join(lines)


NCCL_API = {"what": "NCCL communicator API: ncclCommShrink, ncclCommGrow, ncclCommInitRankScalable",
            "figure": "(API reference)", "url": "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/api/comms.html"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 and 100 hosts, shorter windows")
    p.add_argument("--hosts", default=None, help="comma-separated scales (worker hosts), e.g. 10,100")
    p.add_argument(
        "--sims", type=int, default=None, help="simulator processes (default: 1 up to 100 hosts, else 2)"
    )
    p.add_argument("--no-profile", action="store_true", help="skip the profile window")
    p.add_argument("--soak", type=float, default=SOAK_S,
                   help=f"seconds more of steady running before the loss, from {SOAK_FROM_HOSTS:,} hosts (default "
                   f"{SOAK_S:g}): the coordinator's memory after its bounded buffers filled")  # fmt: skip
    p.add_argument("--no-results", action="store_true", help="do not write bench/results/control_scale.json")
    p.add_argument("--protocol", choices=PROTOCOLS, default=RELAY,
                   help="what the simulated hosts speak: relay (today's, the default) or per-rank (the one "
                   "before the agents' relay)")  # fmt: skip
    p.add_argument("--out", default=None, help="write the runs and control_scale.json under this directory "
                   "(not bench/out), and no result to bench/results")  # fmt: skip
    p.add_argument(
        "--role",
        choices=("bench", "coordinator", "simulator", "acker"),
        default="bench",
        help=argparse.SUPPRESS,
    )
    for flag in ("--addr", "--secret-file"):
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)
    for flag, kind, default in (("--first", int, 0), ("--count", int, 0), ("--step-s", float, STEP_S),
                                ("--hang-timeout", float, None), ("--join-timeout", float, 300.0),
                                ("--timeout", float, 7200.0), ("--nice", int, SIM_NICE)):  # fmt: skip
        p.add_argument(flag, type=kind, default=default, help=argparse.SUPPRESS)
    a, _ = p.parse_known_args(argv)
    if a.role != "bench":  # a process of one case (``measure``)
        a.hosts = int(a.hosts)
        role = {"coordinator": coordinator_main, "simulator": simulator_main, "acker": acker_main}
        return role[a.role](a)
    hang = a.hang_timeout if a.hang_timeout is not None else SERIES_HANG_S
    cases = tuple((int(x), hang) for x in a.hosts.split(",")) if a.hosts else None
    params = Params(
        sims=a.sims, profile_s=0.0 if a.no_profile else PROFILE_S, protocol=a.protocol, soak_s=a.soak
    )
    out = Path(a.out).resolve() if a.out else common.OUT
    out.mkdir(parents=True, exist_ok=True)
    git = common.git_state()
    res = run(a.quick, out, cases, params)
    res["_command"] = "OMP_NUM_THREADS=1 python -m bench.control_scale" + "".join(
        f" {x}" for x in (argv or sys.argv[1:])
    )
    res["_date"] = res["machine"]["date"]
    res["_commit"], res["_dirty"] = git["commit"], git["dirty"]
    common.write_json(out / "control_scale.json", res)
    if not a.no_results and not a.out:
        common.write_json(common.RESULTS / "control_scale.json", res)
    print(markdown(res))
    return 0 if all(r.get("ok") for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
