"""The control plane at scale: the real coordinator, driven by simulated host agents.

**What runs for real.** The launcher process of ``checkpointless coordinator --nodes N
--nproc-per-node 8 --spare-nodes 1``: ``Launcher`` with a ``ClusterSpec`` and the job's secret, built
as ``launch/cluster.py``'s ``cmd_coordinator`` builds it. Its control store (the c10d ``TCPStore``
server, libuv, a thread of that process), its coordinator loop and its event log are unchanged
product code, in a process of their own. Its store calls are counted in-process by a thin wrapper
around its store connections (every call, its keys and value bytes, the seconds it took); a
sampling profiler (a thread of that process reading the main thread's stack every 20 ms) records
where the loop's time goes, in a window of its own after the steady-state window.

**Settings.** 8 ranks per host, one spare host, one step per second. The series runs at
``hang_timeout_s`` 2 s, the value ``checkpointless cluster`` uses when hosts share one machine's
cores (so: a silent rank is hung after 2 s, an agent beats every 1.6 s, a host that does not answer an
order within 2 s or is silent for 8 s is lost; ranks still beat every 0.1 s and check their lease
every 0.1 s). At the job's default, 0.5 s, a simulated rank whose heartbeat its simulator issues
more than 0.5 s late is killed as hung (finding 6 says why its reported CPU time does not save it),
and from 100 hosts on the simulators here run that late at times: the series uses 2 s so that what
is measured is the coordinator, not the simulators' lag. The default is run at 100 hosts too.

**What is simulated.** Each host is a simulated agent with two store connections (its order
connection, blocked in a ``wait`` on its next order as ``node.py``'s is; its status connection, which
also carries its 8 processes' writes) speaking the agent protocol: hello, ticket, accept, spawn
orders obeyed by pretending the processes started (reported alive, their CPU time growing as a
training process's does), any other order (kill, ping, stop) answered at once with a status, and
``node/<host>/status`` every beat with the lease round trip after it. Its 8 processes write what a
worker's ``ControlClient`` writes, sealed with the job's secret: ``hb/<proc>`` every 0.1 s (the fields
``Session`` puts in: rank, gen, phase, committed, step, attempt, step_time_s, loss, total, chunks), and
at each step a ``step_committed`` event chunk and a heartbeat. Their lease checks (a ``check`` round
trip per process every 0.1 s, on the generation's abort key) come from separate processes ("ackers"),
one per simulator. A power loss: the bench stops one worker host (its status, its ranks' heartbeats
and lease checks, its order reads) at a recorded time. When the coordinator aborts the generation,
every surviving rank reports as a member does (a ``fault_detected`` event, ``gen/<n>/fail/<rank>``, the
failure counter, the report bell); the spare host's processes wait on their assignment keys; every
rank joins the next plan (new generation, committed step) and commits again.

Not simulated: the data plane (no process group is formed: group formation is costed on paper
below), the ranks' own connections (a worker holds two or three, a simulated host one for its 8
ranks), each rank's read of the plan and its blocking ``wait_plan`` (each simulator process waits on
the plan key once and reads it once; size and read time are reported), training, torch. Many hosts
share a simulator process (one thread issues every host's writes, one thread per host blocks on its
orders): on 2 cores they cannot issue every write the protocol asks for beyond ~100 hosts. The tables
say which share of the protocol's calls they issued ("offered"); agent statuses, commits and failure
reports go first, the ranks' periodic heartbeats get what is left, oldest first. Simulators,
ackers and the coordinator share the machine's cores at the same priority, with whatever else runs
there (the load average is recorded per case).

Usage: ``python bench/control_scale.py [--quick] [--hosts 10,100]`` -> ``bench/out/control_scale.json``
and ``bench/results/control_scale.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import heapq
import itertools
import json
import math
import os
import pstats
import queue
import random
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import common
from torch.distributed import DistStoreError, TCPStore

from checkpointless.control import keys
from checkpointless.control.auth import (
    SignedStore,
    job_namespace,
    new_secret,
    read_secret_file,
    write_secret_file,
)
from checkpointless.control.plan import Plan
from checkpointless.control.vocab import Event, Phase, Reason, Role, event

NPROC = 8  # ranks per host
SPARE_NODES = 1
SERIES_HANG_S = 2.0  # see the module docstring: the job default, 0.5 s, is the extra case
#: (worker hosts, hang_timeout_s) measured; 300 hosts locates the knee between 100 and 1,000
CASES = ((10, SERIES_HANG_S), (100, SERIES_HANG_S), (300, SERIES_HANG_S), (1000, SERIES_HANG_S),
         (2000, SERIES_HANG_S), (100, 0.5))  # fmt: skip
QUICK_CASES = ((10, SERIES_HANG_S), (100, SERIES_HANG_S))
STEP_S = 1.0  # the simulated training's pace
TOTAL_STEPS = 10**9  # what the ranks' session.steps(total) says: the job never ends by itself
HANG_TIMEOUT_S = 0.5  # RecoveryConfig's default, as `checkpointless coordinator` uses it
WARMUP_S, WINDOW_S, PROFILE_S, AFTER_S = 8.0, 20.0, 10.0, 3.0
QUICK_WARMUP_S, QUICK_WINDOW_S, QUICK_PROFILE_S = 5.0, 10.0, 6.0
SIM_NICE = 0  # nice 5 starved the simulators on a loaded machine (their statuses late: false hang kills)
CONNECT_THREADS = 32  # c10d's client now and then takes 5 s to connect: many at once
HEARTBEAT_MODES = ("per-rank",)  # today's protocol; an "aggregated" mode (hb folded into the status) later
PID_BASE = 100_000  # the simulated agents' pids (only an identifier in the accept key)
_ORDER_WAIT = timedelta(hours=1)  # as node.py: a timed-out wait logs two c10d lines, so wait long
_SPARE_POLL = timedelta(seconds=30)  # as client.py's wait_assignment
_TICK = os.sysconf("SC_CLK_TCK")
_SELF = Path(__file__).resolve()

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


def _raise_nofile() -> None:
    """As many descriptors as the hard limit allows: the store holds two connections per host."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _stat(xs: Iterable[float]) -> dict[str, float | int]:
    return common.summary(list(xs))


# -- the coordinator's process ------------------------------------------------------
_CATEGORIES = ("hb", "node", "events", "gen", "assign", "agents", "job", "report", "fatal", "done", "fault",
               "consistency", "checkpointless")  # fmt: skip


class OpCounter:
    """Every store call of the coordinator's process: calls per operation, keys and value bytes per
    key category (the key's first component: ``hb``, ``node``, ``events``, ``gen``...), and the
    seconds the calls took, per connection (``main``: the launcher's loop; ``bell``: the report
    bell's two connections)."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.keys: Counter[str] = Counter()
        self.bytes_in: Counter[str] = Counter()
        self.bytes_out: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()

    def _category(self, key: Any) -> str:
        k = key.decode() if isinstance(key, bytes) else str(key)
        if k.startswith(self.ns):
            k = k[len(self.ns) :]
        head = k.split("/", 1)[0]
        return head if head in _CATEGORIES else "other"

    def record(self, label: str, op: str, args: tuple[Any, ...], result: Any, seconds: float) -> None:
        names = args[0] if args else []
        if isinstance(names, str | bytes):
            names = [names]
        cats = [self._category(k) for k in names] if isinstance(names, list) else []
        out = 0
        if op == "set" and len(args) > 1:
            out = len(args[1])
        elif op == "multi_set" and len(args) > 1:
            out = sum(len(v) for v in args[1])
        inb: list[int] = []
        if op == "get" and result is not None:
            inb = [len(result)]
        elif op == "multi_get" and result is not None:
            inb = [len(v) for v in result]
        with self._lock:
            self.calls[f"{label} {op}"] += 1
            self.seconds[f"{label} {op}"] += seconds
            for i, c in enumerate(cats):
                self.keys[f"{op} {c}"] += 1
                if i < len(inb):
                    self.bytes_in[c] += inb[i]
            if out and cats:
                self.bytes_out[cats[0]] += out

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                "calls": dict(self.calls), "keys": dict(self.keys), "bytes_in": dict(self.bytes_in),
                "bytes_out": dict(self.bytes_out), "seconds": dict(self.seconds),
            }  # fmt: skip


class CountingStore:
    """A c10d store whose every call is counted (``OpCounter``); attributes pass through."""

    def __init__(self, inner: Any, counter: OpCounter, label: str) -> None:
        self._inner, self._counter, self._label = inner, counter, label

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name.startswith("_") or not callable(attr):
            return attr
        counter, label = self._counter, self._label

        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            result = None
            try:
                result = attr(*args, **kwargs)
                return result
            finally:
                counter.record(label, name, args, result, time.perf_counter() - t0)

        self.__dict__[name] = call
        return call


class TickHook:
    """An ``on_tick`` callback of the launcher (its main thread, once per loop): times the loop; a
    thread of its own writes the counters to ``ctl/stats.json`` twice a second."""

    def __init__(self, ctl: Path, counter: OpCounter) -> None:
        self.ctl, self.counter = ctl, counter
        self.launcher: Any = None
        self.iters = 0
        self._recent: deque[tuple[float, float]] = deque(maxlen=50_000)  # (wall clock, seconds since last)
        self._lock = threading.Lock()
        self._last: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._stats_loop, name="bench-stats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def __call__(self, coord: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last is not None:
                self._recent.append((time.time(), now - self._last))
            self.iters += 1
        self._last = now

    def write(self) -> None:
        with self._lock:
            cutoff = time.time() - 90.0
            recent = [(round(t, 4), round(d, 5)) for t, d in self._recent if t >= cutoff]
            iters = self.iters
        events = len(self.launcher.events) if self.launcher is not None else 0
        _write_atomic(self.ctl / "stats.json", json.dumps(
            {"t": time.time(), "iters": iters, "recent": recent, "ops": self.counter.snapshot(), "events": events}
        ))  # fmt: skip

    def _stats_loop(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(Exception):  # a failed write must not end the coordinator
                self.write()


def _short(file: str, line: int, func: str) -> str:
    for marker in ("checkpointless/", "bench/", "site-packages/", "lib/python3"):
        if marker in file:
            file = file[file.index(marker) :]
            break
    return f"{file}:{line}({func})" if line else func


SAMPLE_S = 0.02


class StackSampler:
    """Where the coordinator's main thread spends its wall time: between the bench's
    ``ctl/profile_on`` and ``ctl/profile_off`` a thread samples that thread's Python stack every
    ``SAMPLE_S`` (an in-process sampling profiler: it sees the loop even when one iteration lasts
    minutes, where a profiler started from the loop would not start). A store call is attributed to
    its caller (``store <op> <- caller``); the loop's idle wait shows as ``selectors``."""

    def __init__(self, ctl: Path, thread_id: int) -> None:
        self.ctl, self.tid = ctl, thread_id
        self.window: list[Counter[str]] | None = None  # [inclusive, exclusive, samples] while asked
        self.whole: list[Counter[str]] = [Counter(), Counter(), Counter()]  # since the start
        self._started = time.monotonic()
        threading.Thread(target=self._loop, name="bench-sampler", daemon=True).start()

    def _loop(self) -> None:
        on, off = self.ctl / "profile_on", self.ctl / "profile_off"
        window_start, last_dump = 0.0, time.monotonic()
        while True:
            time.sleep(SAMPLE_S)
            with contextlib.suppress(Exception):  # a sample lost is no harm
                self._sample()
            now = time.monotonic()
            if self.window is None and on.exists():
                on.unlink()
                self.window, window_start = [Counter(), Counter(), Counter()], now
            elif self.window is not None and off.exists():
                off.unlink()
                _write_atomic(
                    self.ctl / "profile.json", json.dumps(summary_of(self.window, now - window_start))
                )
                self.window = None
            if now - last_dump > 2.0:  # the whole run's, kept current: a coordinator may not end cleanly
                last_dump = now
                _write_atomic(
                    self.ctl / "profile_all.json", json.dumps(summary_of(self.whole, now - self._started))
                )

    def _sample(self) -> None:
        frame = sys._current_frames().get(self.tid)
        names: list[str] = []
        f = frame
        while f is not None and len(names) < 100:
            code = f.f_code
            names.append(_short(code.co_filename, code.co_firstlineno, code.co_name))
            f = f.f_back
        if not names or frame is None:
            return
        leaf = names[0]
        if names[0].startswith("bench/control_scale.py") and names[0].endswith("(call)"):
            # blocked in (or making) a store call: named by the first caller outside the store's wrappers
            caller = next((n for n in names[1:] if "control/auth.py" not in n), "?")
            leaf = f"store {frame.f_locals.get('name', '?')} <- {caller}"
        for acc in (self.whole, self.window):
            if acc is None:
                continue
            acc[2]["n"] += 1
            acc[1][leaf] += 1
            for n in set(names):
                acc[0][n] += 1


def summary_of(acc: list[Counter[str]], seconds: float, top: int = 30) -> dict[str, Any]:
    """A sampler's counts as shares of its samples: ``inclusive`` (on the stack), ``exclusive`` (the leaf)."""
    n = max(1, acc[2]["n"])
    return {
        "samples": acc[2]["n"], "window_s": round(seconds, 2),
        "inclusive": [[k, round(v / n, 4)] for k, v in acc[0].most_common(top)],
        "exclusive": [[k, round(v / n, 4)] for k, v in acc[1].most_common(top)],
    }  # fmt: skip


def coordinator_main(a: argparse.Namespace) -> int:
    """The launcher process of ``checkpointless coordinator`` (``cluster.py``'s ``cmd_coordinator``),
    with its store connections counted and its loop timed."""
    import logging

    from checkpointless.config import JobConfig, RecoveryConfig
    from checkpointless.launch import launcher as launcher_mod
    from checkpointless.launch.remote import ClusterSpec

    _raise_nofile()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    secret = read_secret_file(Path(a.secret_file))
    counter = OpCounter(job_namespace(secret))
    real_open, real_tcp = launcher_mod.open_store, launcher_mod.TCPStore

    def tcp_store(*args: Any, **kwargs: Any) -> Any:  # the report bell's connections
        store = real_tcp(*args, **kwargs)
        return store if kwargs.get("is_master") else CountingStore(store, counter, "bell")

    launcher_mod.TCPStore = tcp_store  # type: ignore[misc]
    launcher_mod.open_store = lambda host, port: CountingStore(real_open(host, port), counter, "main")  # type: ignore[assignment]
    base = RecoveryConfig()
    rc = RecoveryConfig(hang_timeout_s=a.hang_timeout,
                        heartbeat_interval_s=min(base.heartbeat_interval_s, a.hang_timeout / 4))  # fmt: skip
    job = JobConfig(workers=a.hosts * NPROC, spares=SPARE_NODES * NPROC, recovery=rc)
    out = Path(a.out)
    ctl = out / "ctl"

    def listening(addr: str) -> None:
        _write_atomic(ctl / "addr", addr)

    spec = ClusterSpec(nodes=a.hosts, nproc_per_node=NPROC, spare_nodes=SPARE_NODES, start_agents=listening,
                       join_timeout_s=a.join_timeout)  # fmt: skip
    hook = TickHook(ctl, counter)
    launcher = launcher_mod.Launcher(job, [], host="127.0.0.1", port=0, out_dir=out / "run", cluster=spec,
                                     secret=secret, on_tick=[hook], timeout_s=a.timeout)  # fmt: skip
    hook.launcher = launcher
    hook.start()
    StackSampler(ctl, threading.main_thread().ident or 0)
    try:
        result = launcher.run()
        outcome = {"ok": result.ok, "error": result.error, "interrupted": result.interrupted,
                   "events": len(result.events)}  # fmt: skip
    except BaseException as e:  # recorded for the bench, then raised
        outcome = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-3000:],
        }
        raise
    finally:
        with contextlib.suppress(Exception):
            hook.write()
        _write_atomic(ctl / "result.json", json.dumps(outcome))
    return 0


# -- the simulated hosts ---------------------------------------------------------------
_HB_BARE = '{"seq": %d, "phase": "%s", "t": %r, "chunks": %d}'
_HB_JOINED = '{"seq": %d, "phase": "%s", "rank": %d, "gen": %d, "committed": %d, "total": %d, "start": 0, "t": %r, "chunks": %d}'
_HB_STEPPING = (
    '{"seq": %d, "phase": "%s", "rank": %d, "gen": %d, "committed": %d, "total": %d, "start": 0, "step": %d, '
    '"attempt": %d, "step_time_s": %r, "loss": %r, "t": %r, "chunks": %d}'
)


_STEP_EVENT = (  # vocab.event(STEP_COMMITTED, ...) as json.dumps writes it, one line
    '{"t": %r, "kind": "step_committed", "proc": "%s", "rank": %d, "gen": %d, "step": %d, "step_time_s": %r, '
    '"loss": %r}\n'
)


class FastSealer:
    """``SignedStore``'s ``name``, ``seal`` and ``open``, with the HMAC keyed once (the same bytes)."""

    def __init__(self, secret: bytes, namespace: str = "") -> None:
        import hashlib
        import hmac

        self._base = hmac.new(secret, digestmod=hashlib.sha256)
        self._store = SignedStore(None, secret, namespace=namespace)
        self.namespace = namespace

    def name(self, key: str) -> str:
        return self.namespace + key

    def seal(self, key: str, text: str) -> bytes:
        data = text.encode()
        h = self._base.copy()
        h.update(key.encode() + b"\0" + data)
        return h.hexdigest().encode() + b"." + data

    def open(self, key: str, raw: bytes) -> str | None:
        return self._store.open(key, raw)


class SimStats:
    """A simulator's own store calls by purpose (``status``, ``hb``, ``ack``, ``commit``, ``report``,
    ``order``, ``join``, ``plan``, ``spare``; ``instr``: the bench's own watchers), value bytes, and
    the round trips' latencies since the last snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.bytes_out: Counter[str] = Counter()
        self.bytes_in: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self._lat: dict[str, list[float]] = {}

    def op(self, purpose: str, op: str, out: int = 0, inb: int = 0, lat: float | None = None) -> None:
        # no lock: one thread (the driver) makes nearly every call; a count the rare order thread
        # races with may be lost, and the GIL makes the snapshot's copies whole
        self.calls[f"{purpose} {op}"] += 1
        if out:
            self.bytes_out[purpose] += out
        if inb:
            self.bytes_in[purpose] += inb
        if lat is not None:
            lst = self._lat.setdefault(purpose, [])
            if len(lst) < 200_000:
                lst.append(lat)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            lat, self._lat = self._lat, {}
            return {
                "calls": dict(self.calls), "bytes_out": dict(self.bytes_out), "bytes_in": dict(self.bytes_in),
                "errors": dict(self.errors),
                "lat": {k: {"n": len(v), "p50": common.percentile(v, 50), "p99": common.percentile(v, 99),
                            "max": max(v)} for k, v in lat.items() if v},
            }  # fmt: skip


class Conn:
    """One store connection of a simulator; every call counted under a purpose."""

    def __init__(self, addr: str, stats: SimStats, timeout_s: float = 120.0) -> None:
        host, port = addr.rsplit(":", 1)
        self.raw = TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                            timeout=timedelta(seconds=timeout_s))  # fmt: skip
        self.stats = stats

    def set(self, purpose: str, name: str, value: bytes) -> None:
        self.raw.set(name, value)
        self.stats.op(purpose, "set", out=len(value))

    def check(self, purpose: str, name: str) -> bool:
        t0 = time.perf_counter()
        ok = bool(self.raw.check([name]))
        self.stats.op(purpose, "check", lat=time.perf_counter() - t0)
        return ok

    def get(self, purpose: str, name: str) -> bytes:
        t0 = time.perf_counter()
        value = bytes(self.raw.get(name))
        self.stats.op(purpose, "get", inb=len(value), lat=time.perf_counter() - t0)
        return value

    def add(self, purpose: str, name: str, amount: int) -> int:
        t0 = time.perf_counter()
        n = int(self.raw.add(name, amount))
        self.stats.op(purpose, "add", lat=time.perf_counter() - t0)
        return n

    def delete(self, purpose: str, name: str) -> None:
        self.raw.delete_key(name)
        self.stats.op(purpose, "delete")

    def wait(self, purpose: str, name: str, timeout: timedelta) -> None:
        self.stats.op(purpose, "wait")
        self.raw.wait([name], timeout)


def _reply_line(lock: threading.Lock, obj: dict[str, Any]) -> None:
    """One JSON line to the driver on stdout (a simulator's or the ack load's answer)."""
    with lock:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


@dataclass
class SimProc:
    """One process of a simulated host, as its ``ControlClient`` would publish it."""

    name: str
    role: str
    slot: int
    pid: int
    host: int  # its agent's index
    started: float
    prio: str = "lo"  # which schedule its heartbeats and lease checks are on (spares: "hi")
    alive: bool = True
    exit: int | None = None
    rank: int | None = None
    gen: int | None = None
    phase: str = Phase.STARTING
    committed: int = -1
    attempt: int = 0
    seq: int = 0
    chunks: int = 0
    next_hb: float = 0.0
    reported: int = -1  # the generation whose failure it reported
    assigned: int | None = None  # a spare's assignment (a generation) not joined yet
    cpu_frozen: float | None = None
    step_time: float = 0.0  # the last step's time and loss, as Session's metrics
    loss: float = 0.0

    def cpu(self, now: float) -> float | None:
        """The CPU seconds its agent reports: a worker trains (a core's worth), a spare idles."""
        if self.cpu_frozen is not None:
            return self.cpu_frozen
        busy = 0.95 if self.role == Role.WORKER else 0.01
        return round(2.5 + busy * (now - self.started), 2)


@dataclass
class SimAgent:
    index: int
    host: str
    spare: bool
    pid: int
    orders: Conn | None = None  # the agent's main connection: its orders
    conn: Conn | None = None  # its status connection, which also carries its processes' writes
    procs: dict[str, SimProc] = field(default_factory=dict)
    seq: int = 0
    node: int = -1
    dead: bool = False
    stopping: bool = False
    next_status: float = 0.0
    exited_unreported: bool = False


def host_name(index: int) -> str:
    return f"h{index:04d}"


def _usage(seq: int) -> dict[str, Any]:
    """An 8-accelerator host's usage sample, as ``UsageSampler`` writes it (NVML there)."""
    r = random.Random(seq // 5)  # the agent samples every fifth beat
    return {
        "cpus": 96, "cpu_percent": round(r.uniform(8, 14), 1), "mem_used_bytes": r.randrange(200, 260) * 2**30,
        "mem_total_bytes": 2048 * 2**30,
        "gpus": [{"index": i, "util_percent": float(r.randrange(90, 100)), "mem_used_bytes": r.randrange(60, 75) * 2**30,
                  "mem_total_bytes": 80 * 2**30} for i in range(NPROC)],
    }  # fmt: skip


class Simulator:
    """Simulated agents ``first .. first+count-1`` (worker hosts below ``hosts``, the spare host at
    ``hosts``): one driver thread issues every host's writes from two schedules (``hi``: agent
    statuses, the spares' beats; ``lo``: the workers' heartbeats and lease checks) and a work queue
    (commits, failure reports, joins), one thread per host blocks on its orders."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.addr = a.addr
        self.secret = read_secret_file(Path(a.secret_file))
        self.sealer = FastSealer(self.secret, job_namespace(self.secret))
        self.plain = FastSealer(self.secret)
        self.stats = SimStats()
        self.hosts = a.hosts
        self.agents = [
            SimAgent(i, host_name(i), i >= a.hosts, PID_BASE + i) for i in range(a.first, a.first + a.count)
        ]
        self.by_host = {ag.host: ag for ag in self.agents}
        self.by_index = {ag.index: ag for ag in self.agents}
        hang = a.hang_timeout
        lease = 0.5 * hang  # RecoveryConfig.lease_s (LEASE_FRACTION)
        self.hb_s = min(0.1, hang / 4)  # heartbeat_interval_s, as the coordinator command sets it
        self.ack_s = min(self.hb_s, lease / 4)  # ControlClient._ack_every
        self.status_s = max(self.hb_s, 4 * hang / 5)  # remote.status_interval
        self.step_s = a.step_s
        self.join_timeout = a.join_timeout
        self.inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.hi: list[tuple[float, int, str, Any]] = []
        self.lo: list[tuple[float, int, str, Any]] = []
        self.work: deque[tuple[str, SimAgent, SimProc, int]] = deque()
        self._seq = itertools.count()
        self.plans: dict[int, Plan] = {}
        self.gen_running: int | None = None
        self.next_commit = math.inf
        self.pending_commits = 0
        self.pending_reports: dict[int, int] = {}
        self.failed: set[int] = set()
        self.timing: dict[str, float] = {}
        self.stopped = threading.Event()
        self.sizes: dict[str, list[int]] = {
            k: [0, 0] for k in ("status", "heartbeat", "chunk", "plan", "report")
        }
        self.lag = {"status_max_s": 0.0, "lo_max_s": 0.0, "lo_late_0.5s": 0, "lo_n": 0, "lo_sum_s": 0.0}
        self.late_steps = 0
        self.plan_read_s: dict[int, float] = {}
        self._out_lock = threading.Lock()

    # -- bookkeeping ----------------------------------------------------------------
    def _size(self, kind: str, n: int) -> None:
        s = self.sizes[kind]
        s[0] += n
        s[1] += 1

    def _push(self, heap: list[tuple[float, int, str, Any]], due: float, kind: str, obj: Any) -> None:
        heapq.heappush(heap, (due, next(self._seq), kind, obj))

    def _sget(self, conn: Conn, purpose: str, key: str, plain: bool = False) -> str | None:
        """``SignedStore.get``: a check, then the value (verified)."""
        s = self.plain if plain else self.sealer
        name = s.name(key)
        if not conn.check(purpose, name):
            return None
        return s.open(key, conn.get(purpose, name))

    def _set(self, conn: Conn, purpose: str, key: str, text: str) -> int:
        raw = self.sealer.seal(key, text)
        conn.set(purpose, self.sealer.name(key), raw)
        return len(raw)

    # -- start: connect, join ----------------------------------------------------------
    def run(self) -> None:
        threading.Thread(target=self._control, name="sim-control", daemon=True).start()
        conns = _connect_many(self.addr, self.stats, 2 * len(self.agents))
        for i, ag in enumerate(self.agents):
            ag.orders, ag.conn = conns[2 * i], conns[2 * i + 1]
        self.timing["connected"] = time.time()
        self._join_all()
        self.timing["accepted"] = time.time()
        for ag in self.agents:
            threading.Thread(
                target=self._order_loop, args=(ag,), name=f"orders-{ag.host}", daemon=True
            ).start()
        threading.Thread(target=self._watch, args=("abort", keys.abort), daemon=True).start()
        threading.Thread(target=self._watch, args=("plan", keys.plan), daemon=True).start()
        self._loop()

    def _join_all(self) -> None:
        """Each agent's ``node.Agent.join``: the hello, the job, a ticket and its hello, then its
        accept polled every 50 ms (the coordinator answers once every host has said hello)."""
        deadline = time.monotonic() + self.join_timeout
        for ag in self.agents:
            assert ag.orders is not None
            while self._sget(ag.orders, "join", keys.CLUSTER_HELLO, plain=True) is None:
                self._check_deadline(deadline, "no hello from the coordinator")
                time.sleep(0.1)
            while self._sget(ag.orders, "join", keys.JOB_CONFIG) is None:
                self._check_deadline(deadline, "no job from the coordinator")
                time.sleep(0.05)
            hello: dict[str, Any] = {"host": ag.host, "addr": "127.0.0.1", "nproc": NPROC, "spare": ag.spare,
                                     "pid": ag.pid}  # fmt: skip
            if not ag.spare:
                hello["node_rank"] = ag.index
            ticket = ag.orders.add("join", self.sealer.name(keys.AGENTS_COUNT), 1) - 1
            self._set(ag.orders, "join", keys.agent_hello(ticket), json.dumps(hello))
            self._drain()
        waiting = list(self.agents)
        while waiting:
            self._check_deadline(deadline, f"{len(waiting)} host(s) not accepted")
            t0 = time.monotonic()
            still = []
            for ag in waiting:
                assert ag.orders is not None
                text = self._sget(ag.orders, "join", keys.node_accept(ag.host, ag.pid))
                if text is None:
                    still.append(ag)
                    continue
                reply = json.loads(text)
                if "error" in reply:
                    raise RuntimeError(f"{ag.host} refused: {reply['error']}")
                ag.node = int(reply["node"])
            waiting = still
            self._drain()
            time.sleep(max(0.0, 0.05 - (time.monotonic() - t0)))

    def _check_deadline(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"join: {what} within {self.join_timeout:g}s")

    # -- threads that block on the store ---------------------------------------------------
    def _order_loop(self, ag: SimAgent) -> None:
        """``node.Agent._order_loop``: a blocking wait on the next order's key, then read and delete it."""
        conn, index = ag.orders, 0
        assert conn is not None
        while not self.stopped.is_set():
            key = keys.node_order(ag.host, index)
            try:
                conn.wait("order", self.sealer.name(key), _ORDER_WAIT)
                if ag.dead:
                    return  # a host without power reads nothing
                text = self._sget(conn, "order", key)
                if text is None:
                    continue
                conn.delete("order", self.sealer.name(key))
            except (RuntimeError, OSError):
                return  # the coordinator is gone
            index += 1
            self.inbox.put(("order", ag, json.loads(text)))

    def _assign_loop(self, p: SimProc) -> None:
        """A spare's ``ControlClient.wait_assignment``, on a connection of its own (as the spare's)."""
        try:
            conn = Conn(self.addr, self.stats)
        except (RuntimeError, OSError):
            return
        key = keys.assign(p.name)
        while not self.stopped.is_set():
            try:
                conn.wait("spare", self.sealer.name(key), _SPARE_POLL)
            except DistStoreError:  # the wait timed out: is the job over?
                with contextlib.suppress(RuntimeError, OSError):
                    if self._sget(conn, "spare", keys.JOB_STOP) is not None:
                        return
                continue
            except (RuntimeError, OSError):
                return
            try:
                value = self._sget(conn, "spare", key)
            except (RuntimeError, OSError):
                return
            if value is None:
                continue
            if value != keys.STOP:
                self.inbox.put(("assigned", p, int(value)))
            return

    def _watch(self, kind: str, key_of: Callable[[int], str]) -> None:
        """The bench's own instrument: a blocking wait on generation g's abort (or plan) key, then
        g+1's, on a connection of its own; the simulated ranks learn of an abort from it at once (a
        real rank within one lease check, 62.5 ms) and of a plan (a real rank: its own ``wait_plan``)."""
        try:
            conn = Conn(self.addr, self.stats)
        except (RuntimeError, OSError):
            return
        for gen in itertools.count():
            try:
                conn.wait("instr", self.sealer.name(key_of(gen)), _ORDER_WAIT)
            except (RuntimeError, OSError):
                return
            self.inbox.put((kind, gen, time.time()))

    # -- control (stdin: one JSON command a line, one JSON answer a line) ----------------
    def _control(self) -> None:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd.get("cmd") == "stop":
                self.stopped.set()
                self._reply({"id": cmd.get("id"), "ok": True})
                break
            reply: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
            self.inbox.put(("cmd", cmd, reply))
            try:
                out = reply.get(timeout=60)
            except queue.Empty:
                out = {"error": "the simulator's driver did not answer within 60 s"}
            out["id"] = cmd.get("id")
            self._reply(out)
        self.stopped.set()

    def _reply(self, obj: dict[str, Any]) -> None:
        _reply_line(self._out_lock, obj)

    def _command(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["cmd"] == "kill":
            ag = self.by_host[cmd["host"]]
            ag.dead = True  # from now on nothing of this host is written: a power loss
            t = time.time()
            now = time.monotonic()
            for p in ag.procs.values():
                p.cpu_frozen = p.cpu(now)
            self.timing["killed"] = t
            return {"t": t, "host": ag.host}
        if cmd["cmd"] == "stats":
            return self._snapshot()
        return {"error": f"unknown command {cmd['cmd']!r}"}

    def _snapshot(self) -> dict[str, Any]:
        procs = [p for ag in self.agents if not ag.dead for p in ag.procs.values() if p.alive]
        members = [p for p in procs if p.gen is not None and p.gen == self.gen_running and p.committed >= 0]
        committed = [p.committed for p in members]
        ru = resource.getrusage(resource.RUSAGE_SELF)
        lag, self.lag = (
            self.lag,
            {"status_max_s": 0.0, "lo_max_s": 0.0, "lo_late_0.5s": 0, "lo_n": 0, "lo_sum_s": 0.0},
        )
        return {
            "t": time.time(), "cpu_s": ru.ru_utime + ru.ru_stime, **self.stats.snapshot(),
            "agents": len(self.agents), "dead": sum(ag.dead for ag in self.agents),
            "accepted": sum(ag.node >= 0 for ag in self.agents), "procs": len(procs), "members": len(members),
            "gen": self.gen_running, "committed_min": min(committed, default=None),
            "committed_max": max(committed, default=None),
            "sizes": {k: (v[0] / v[1] if v[1] else None) for k, v in self.sizes.items()},
            "lag": lag, "late_steps": self.late_steps, "timing": dict(self.timing),
            "plan_read_s": {str(g): s for g, s in self.plan_read_s.items()},
            "work": len(self.work), "lo_queue": len(self.lo),
        }  # fmt: skip

    # -- the driver --------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "cmd":
            item[2].put(self._command(item[1]))
        elif kind == "order":
            self._on_order(item[1], item[2])
        elif kind == "assigned":
            p: SimProc = item[1]
            p.assigned = item[2]
            if item[2] in self.plans:
                self._queue_join(self.by_index[p.host], p, item[2])
        elif kind == "abort":
            self._on_abort(item[1], item[2])
        elif kind == "plan":
            self._on_plan(item[1], item[2])

    def _loop(self) -> None:
        while not self.stopped.is_set():
            self._drain()
            now = time.monotonic()
            self._run_due(self.hi, now + 0.05)
            if self.gen_running is not None and now >= self.next_commit:
                if self.pending_commits:
                    self.late_steps += 1  # the last step's commits are not all out yet
                else:
                    self._queue_commits(self.gen_running)
                self.next_commit += self.step_s
                if self.next_commit < now:
                    self.next_commit = now + self.step_s
            self._run_work(time.monotonic() + 0.02)
            self._run_due(self.lo, min(self.hi[0][0] if self.hi else math.inf, time.monotonic() + 0.02))
            due = min(self.hi[0][0] if self.hi else math.inf, self.lo[0][0] if self.lo else math.inf,
                      self.next_commit)  # fmt: skip
            wait = 0.0 if self.work else max(0.0, min(0.01, due - time.monotonic()))
            if wait > 0:
                try:
                    self._handle(self.inbox.get(timeout=wait))
                except queue.Empty:
                    pass

    def _run_due(self, heap: list[tuple[float, int, str, Any]], limit: float) -> None:
        """Run the items of ``heap`` that are due, until ``limit`` (monotonic) passes."""
        now = time.monotonic()
        while heap and heap[0][0] <= now < limit:
            due, _, kind, obj = heapq.heappop(heap)
            try:
                self._run_item(kind, obj, due)
            except (RuntimeError, OSError) as e:
                self.stats.errors[f"{kind} {type(e).__name__}"] += 1
            now = time.monotonic()

    def _run_item(self, kind: str, obj: Any, due: float) -> None:
        now = time.monotonic()
        if kind == "status":
            ag: SimAgent = obj
            if ag.dead or due != ag.next_status:
                return
            self.lag["status_max_s"] = max(self.lag["status_max_s"], now - due)
            self._status(ag)
            return
        p: SimProc = obj
        ag = self.by_index[p.host]
        if ag.dead or not p.alive:
            return
        if kind == "hb":
            if due != p.next_hb:
                return  # a commit flush moved the next beat
            if p.prio == "lo":
                self._lo_lag(now - due)
            self._heartbeat(ag, p, "hb")
            p.next_hb = due + self.hb_s if now - due < self.hb_s else now + self.hb_s
            self._push(self.hi if p.prio == "hi" else self.lo, p.next_hb, "hb", p)

    def _lo_lag(self, lag: float) -> None:
        g = self.lag
        g["lo_max_s"] = max(g["lo_max_s"], lag)
        g["lo_n"] += 1
        g["lo_sum_s"] += lag
        if lag > 0.5:
            g["lo_late_0.5s"] += 1

    def _run_work(self, limit: float) -> None:
        while self.work and time.monotonic() < limit:
            kind, ag, p, gen = self.work.popleft()
            try:
                if kind == "commit":
                    self.pending_commits -= 1
                    self._commit(ag, p, gen)
                elif kind == "report":
                    self.pending_reports[gen] -= 1
                    self._report(ag, p, gen)
                    if self.pending_reports[gen] == 0:
                        self.timing[f"reports_done_{gen}"] = time.time()
                elif kind == "join":
                    self._join(ag, p, gen)
                elif kind == "first":
                    self._first(ag, p)
            except (RuntimeError, OSError) as e:
                self.stats.errors[f"{kind} {type(e).__name__}"] += 1

    # -- what an agent writes ------------------------------------------------------------
    def _status(self, ag: SimAgent) -> None:
        """``node.Agent._report`` and the lease round trip after it."""
        assert ag.conn is not None
        now = time.monotonic()
        ag.seq += 1
        procs: dict[str, dict[str, Any]] = {}
        for p in ag.procs.values():
            d: dict[str, Any] = {"alive": p.alive, "pid": p.pid, "slot": p.slot,
                                 "exit": None if p.alive else p.exit, "cpu": p.cpu(now)}  # fmt: skip
            if not p.alive:
                d["tail"] = ""
            procs[p.name] = d
        stopped = ag.stopping and not any(p.alive for p in ag.procs.values())
        text = json.dumps({"seq": ag.seq, "procs": procs, "stopped": stopped, "usage": _usage(ag.seq)})
        self._size("status", self._set(ag.conn, "status", keys.node_status(ag.host), text))
        if ag.exited_unreported:
            ag.exited_unreported = False
            self._set(ag.conn, "status", keys.REPORT_BELL, "1")
        ag.conn.add("status", self.sealer.name(keys.AGENTS_COUNT), 0)
        ag.next_status = time.monotonic() + self.status_s
        self._push(self.hi, ag.next_status, "status", ag)

    def _beat_now(self, ag: SimAgent) -> None:
        ag.next_status = time.monotonic()
        self._push(self.hi, ag.next_status, "status", ag)

    def _on_order(self, ag: SimAgent, order: dict[str, Any]) -> None:
        if ag.dead:
            return
        op = order.get("op")
        now = time.monotonic()
        if op == "spawn":
            name, role = str(order["name"]), str(order["role"])
            p = SimProc(name, role, len(ag.procs), 1_000_000 + ag.index * 100 + len(ag.procs), ag.index, now,
                        prio="hi" if role == Role.SPARE else "lo")  # fmt: skip
            ag.procs[name] = p
            self.work.append(("first", ag, p, -1))
            if role == Role.SPARE:
                threading.Thread(
                    target=self._assign_loop, args=(p,), name=f"assign-{name}", daemon=True
                ).start()
        elif op == "kill":
            p2 = ag.procs.get(str(order["name"]))
            if p2 is not None and p2.alive:
                p2.alive, p2.exit, p2.cpu_frozen = False, -9, p2.cpu(now)
                ag.exited_unreported = True
        elif op == "stop":  # the job's end: its processes see job/stop and exit
            ag.stopping = True
            for p3 in ag.procs.values():
                if p3.alive:
                    p3.alive, p3.exit, p3.cpu_frozen = False, 0, p3.cpu(now)
        self._beat_now(ag)

    def _first(self, ag: SimAgent, p: SimProc) -> None:
        """A new process's first writes: a worker's first heartbeat (starting); a spare's
        ``spare_ready`` event and its heartbeat (phase spare), its model built."""
        if ag.dead or not p.alive:
            return
        if p.role == Role.SPARE:
            p.phase = Phase.SPARE
            self._event(ag, p, event(Event.SPARE_READY, proc=p.name), "hb")
        self._heartbeat(ag, p, "hb")
        now = time.monotonic()
        p.next_hb = now + self.hb_s * random.random()
        self._push(self.hi if p.prio == "hi" else self.lo, p.next_hb, "hb", p)
        if p.role == Role.WORKER and 0 in self.plans and self.gen_running is not None:
            self._queue_join(ag, p, 0)

    def _heartbeat(self, ag: SimAgent, p: SimProc, purpose: str) -> None:
        """``ControlClient._flush``'s heartbeat: the fields ``Session`` and ``member.py`` put in (the
        JSON ``json.dumps`` would write, from a template: a third of the simulator's time went there)."""
        assert ag.conn is not None
        p.seq += 1
        if p.rank is None:
            text = _HB_BARE % (p.seq, p.phase, time.time(), p.chunks)
        elif not p.attempt:
            text = _HB_JOINED % (
                p.seq,
                p.phase,
                p.rank,
                p.gen,
                p.committed,
                TOTAL_STEPS,
                time.time(),
                p.chunks,
            )
        else:
            step = p.committed + 1 if p.phase == Phase.COMPUTE else p.committed
            text = _HB_STEPPING % (p.seq, p.phase, p.rank, p.gen, p.committed, TOTAL_STEPS, step, p.attempt,
                                   p.step_time, p.loss, time.time(), p.chunks)  # fmt: skip
        self._size("heartbeat", self._set(ag.conn, purpose, keys.heartbeat(p.name), text))

    def _event(self, ag: SimAgent, p: SimProc, ev: dict[str, Any], purpose: str) -> None:
        """One event chunk (``ControlClient._flush``: written before the heartbeat that counts it)."""
        assert ag.conn is not None
        key = keys.events(p.name, p.chunks)
        p.chunks += 1
        self._size("chunk", self._set(ag.conn, purpose, key, json.dumps(ev) + "\n"))

    def _queue_commits(self, gen: int) -> None:
        for ag in self.agents:
            if ag.dead:
                continue
            for p in ag.procs.values():
                if p.alive and p.gen == gen and p.phase != Phase.RECOVERING:
                    self.work.append(("commit", ag, p, gen))
                    self.pending_commits += 1

    def _commit(self, ag: SimAgent, p: SimProc, gen: int) -> None:
        """``Session._commit``: the heartbeat fields, a ``step_committed`` event, a sync flush."""
        if ag.dead or not p.alive or p.gen != gen or self.gen_running != gen or p.phase == Phase.RECOVERING:
            return
        assert ag.conn is not None
        p.committed += 1
        p.attempt += 1
        p.phase = Phase.IDLE
        p.step_time, p.loss = (
            round(self.step_s * random.uniform(0.97, 1.0), 6),
            round(random.uniform(2, 3), 6),
        )
        key = keys.events(p.name, p.chunks)
        p.chunks += 1
        text = _STEP_EVENT % (time.time(), p.name, p.rank, gen, p.committed, p.step_time, p.loss)
        self._size("chunk", self._set(ag.conn, "commit", key, text))
        self._heartbeat(ag, p, "commit")
        p.phase = Phase.COMPUTE  # the next step starts at once; the next beat shows it
        p.next_hb = time.monotonic() + self.hb_s
        self._push(self.hi if p.prio == "hi" else self.lo, p.next_hb, "hb", p)

    def _on_abort(self, gen: int, t: float) -> None:
        """Generation ``gen`` failed: every live member here leaves it and reports (``member._recover``)."""
        if gen in self.failed:
            return
        self.failed.add(gen)
        self.timing[f"abort_seen_{gen}"] = t
        if self.gen_running == gen:
            self.gen_running, self.next_commit = None, math.inf
        self.work = deque(w for w in self.work if w[0] != "commit")
        self.pending_commits = 0
        n = 0
        for ag in self.agents:
            if ag.dead:
                continue
            for p in ag.procs.values():
                if p.alive and p.gen == gen and p.reported != gen:
                    self.work.appendleft(("report", ag, p, gen))
                    n += 1
        self.pending_reports[gen] = n
        if n == 0:
            self.timing[f"reports_done_{gen}"] = time.time()

    def _report(self, ag: SimAgent, p: SimProc, gen: int) -> None:
        """A member released by the abort: ``fault_detected`` (collective error, a sync flush), then
        ``ControlClient.report_failure`` (the sealed report, the counter, the bell)."""
        if ag.dead or not p.alive or p.gen != gen or p.reported == gen:
            return
        assert ag.conn is not None
        p.reported = gen
        self._event(ag, p, event(Event.FAULT_DETECTED, proc=p.name, rank=p.rank, gen=gen, step=p.committed + 1,
                                 reason=Reason.COLLECTIVE_ERROR,
                                 error="Connection closed by peer [10.0.0.1]:12345"), "report")  # fmt: skip
        self._heartbeat(ag, p, "report")
        p.phase = Phase.RECOVERING
        report = json.dumps({"committed": p.committed, "reason": Reason.COLLECTIVE_ERROR, "proc": p.name,
                             "has_state": True})  # fmt: skip
        self._size("report", self._set(ag.conn, "report", keys.fail(gen, p.rank or 0), report))
        ag.conn.add("report", self.sealer.name(keys.fail_count(gen)), 1)
        self._set(ag.conn, "report", keys.REPORT_BELL, "1")

    def _on_plan(self, gen: int, t: float) -> None:
        """Generation ``gen``'s plan is out: read it once for this simulator's hosts (each real rank
        reads it itself), then every member here joins it."""
        self.timing[f"plan_seen_{gen}"] = t
        conn = next((ag.conn for ag in self.agents if not ag.dead), None)
        if conn is None:
            return
        t0 = time.perf_counter()
        text = self._sget(conn, "plan", keys.plan(gen))
        self.plan_read_s[gen] = time.perf_counter() - t0
        if text is None:
            return
        self._size("plan", len(text) + 65)
        plan = Plan.from_json(text)
        self.plans[gen] = plan
        members = set(plan.members.values())
        for ag in self.agents:
            if ag.dead:
                continue
            for p in ag.procs.values():
                if p.alive and p.name in members and (p.role == Role.WORKER or p.assigned == gen):
                    self._queue_join(ag, p, gen)
        self.gen_running = gen
        self.next_commit = time.monotonic() + self.step_s

    def _queue_join(self, ag: SimAgent, p: SimProc, gen: int) -> None:
        self.work.append(("join", ag, p, gen))

    def _join(self, ag: SimAgent, p: SimProc, gen: int) -> None:
        """``member._enter``: the rank, the generation, the committed step (a replacement's after
        its transfer), phase idle; the group's formation is not simulated."""
        plan = self.plans.get(gen)
        if ag.dead or not p.alive or plan is None or p.gen == gen:
            return
        rank = plan.rank_of(p.name)
        if rank is None:
            return
        if p.role == Role.SPARE:
            p.role, p.prio, p.assigned = Role.WORKER, "lo", None
            p.next_hb = time.monotonic() + self.hb_s
            self._push(self.lo, p.next_hb, "hb", p)
        p.rank, p.gen, p.phase = rank, gen, Phase.IDLE
        p.committed = plan.resume_step - 1
        self._heartbeat(ag, p, "join")


def _connect_many(addr: str, stats: SimStats, n: int) -> list[Conn]:
    """``n`` connections to the store, opened from a pool of threads."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(CONNECT_THREADS) as pool:
        return list(pool.map(lambda _: Conn(addr, stats), range(n)))


class AckLoad:
    """The ranks' lease checks of hosts ``first .. first+count-1`` (``ControlClient._ack``: a round
    trip every ``ack_s`` per process, on its generation's abort key), from a process of its own: a
    round trip blocks its caller, and in the simulator's process the waits fought its driver for the
    GIL. Its hosts' processes are named as the coordinator names them (``w<rank>``, the spare host's
    ``s<i>``); the generation is followed with a blocking wait on the next plan."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.addr, self.hosts = a.addr, a.hosts
        secret = read_secret_file(Path(a.secret_file))
        self.sealer = FastSealer(secret, job_namespace(secret))
        self.stats = SimStats()
        hang = a.hang_timeout
        self.ack_s = min(min(0.1, hang / 4), 0.5 * hang / 4)
        self.procs: list[tuple[int, str]] = []
        for h in range(a.first, a.first + a.count):
            for k in range(NPROC):
                self.procs.append(
                    (h, f"w{h * NPROC + k}" if h < a.hosts else f"s{(h - a.hosts) * NPROC + k}")
                )
        self.dead: set[int] = set()
        self.gen = 0
        self.stopped = threading.Event()
        self.lag = {"n": 0, "sum_s": 0.0, "max_s": 0.0, "late_0.5s": 0}
        self._out_lock = threading.Lock()

    def run(self) -> None:
        threading.Thread(target=self._control, name="acks-control", daemon=True).start()
        conn = Conn(self.addr, self.stats)
        threading.Thread(target=self._follow, name="acks-plans", daemon=True).start()
        heap = [(time.monotonic() + self.ack_s * random.random(), i) for i in range(len(self.procs))]
        heapq.heapify(heap)
        while not self.stopped.is_set():
            due, i = heap[0]
            now = time.monotonic()
            if due > now:
                time.sleep(min(0.01, due - now))
                continue
            heapq.heappop(heap)
            host, name = self.procs[i]
            # a member checks its generation's abort; a waiting spare its own heartbeat key
            key = keys.heartbeat(name) if name[0] == "s" and self.gen == 0 else keys.abort(self.gen)
            if host in self.dead:
                continue  # a host without power sends nothing
            lag = now - due
            g = self.lag
            g["n"] += 1
            g["sum_s"] += lag
            g["max_s"] = max(g["max_s"], lag)
            if lag > 0.5:
                g["late_0.5s"] += 1
            try:
                conn.check("ack", self.sealer.name(key))
            except (RuntimeError, OSError) as e:
                self.stats.errors[f"ack {type(e).__name__}"] += 1
                if self.stopped.wait(0.05):
                    return
            heapq.heappush(heap, (due + self.ack_s if lag < self.ack_s else time.monotonic() + self.ack_s, i))

    def _follow(self) -> None:
        try:
            conn = Conn(self.addr, self.stats)
        except (RuntimeError, OSError):
            return
        for gen in itertools.count(1):
            try:
                conn.wait("instr", self.sealer.name(keys.plan(gen)), _ORDER_WAIT)
            except (RuntimeError, OSError):
                return
            self.gen = gen

    def _control(self) -> None:
        for line in sys.stdin:
            cmd = json.loads(line)
            out: dict[str, Any] = {"id": cmd.get("id")}
            if cmd.get("cmd") == "stop":
                self.stopped.set()
                self._reply(out)
                break
            if cmd.get("cmd") == "kill":
                host = next((h for h, _ in self.procs if host_name(h) == cmd["host"]), None)
                if host is not None:
                    self.dead.add(host)
                out["t"] = time.time()
            elif cmd.get("cmd") == "stats":
                ru = resource.getrusage(resource.RUSAGE_SELF)
                lag, self.lag = self.lag, {"n": 0, "sum_s": 0.0, "max_s": 0.0, "late_0.5s": 0}
                out.update(
                    t=time.time(), cpu_s=ru.ru_utime + ru.ru_stime, ack_lag=lag, **self.stats.snapshot()
                )
            self._reply(out)
        self.stopped.set()

    def _reply(self, obj: dict[str, Any]) -> None:
        _reply_line(self._out_lock, obj)


def acker_main(a: argparse.Namespace) -> int:
    _raise_nofile()
    with contextlib.suppress(OSError):
        os.nice(a.nice)
    try:
        AckLoad(a).run()
    except Exception:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def simulator_main(a: argparse.Namespace) -> int:
    _raise_nofile()
    with contextlib.suppress(OSError):
        os.nice(a.nice)
    sim = Simulator(a)
    prof = cProfile.Profile() if os.environ.get("CONTROL_SCALE_PROFILE_SIM") else None
    try:
        if prof is not None:
            prof.enable()
        sim.run()
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        # keep answering the bench (its stats say what failed) until it stops this process
        sim.timing["failed"] = time.time()
        while not sim.stopped.is_set():
            sim._drain()
            time.sleep(0.05)
    if prof is not None:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(30)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # threads blocked in store waits: no interpreter teardown under them


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


class EventTail:
    """Follows the coordinator's ``events.jsonl`` as it is appended; keeps the rare events."""

    SKIP = (b'"step_committed"', b'"host_usage"', b'"failure_reported"')

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


def protocol_rates(hosts: int, hang: float, step_s: float) -> dict[str, float]:
    """Store calls per second the protocol asks of the hosts and their processes (the simulators'
    target): per purpose, from the job's intervals (``heartbeat_interval_s``, the lease checks,
    ``status_interval``) and the step pace."""
    ranks, spares = hosts * NPROC, SPARE_NODES * NPROC
    hb_s = min(0.1, hang / 4)
    ack_s = min(hb_s, 0.5 * hang / 4)
    status_s = max(hb_s, 4 * hang / 5)
    return {
        "status": 2 * (hosts + SPARE_NODES) / status_s,  # the status, the lease round trip
        "hb": ranks * (1 / hb_s - 1 / step_s) + spares / hb_s,  # the thread's beats (a commit is one)
        "ack": (ranks + spares) / ack_s,
        "commit": 2 * ranks / step_s,  # the event chunk, the heartbeat
    }


def _steady(a: dict[str, Any], b: dict[str, Any], hosts: int, hang: float, step_s: float) -> dict[str, Any]:
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
    target = protocol_rates(hosts, hang, step_s)
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
             ("status", "heartbeat", "chunk", "plan", "report")}  # fmt: skip
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
            "heartbeats": round((hosts + SPARE_NODES) * NPROC * (sizes["heartbeat"] or 0)),
        },
    }  # fmt: skip


def statistics_mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _failure(
    hosts: int, victim: int, owner: SimHandle, sims: list[SimHandle], tail: EventTail,
    alive: Callable[[], None], timeout: float,
) -> dict[str, Any]:  # fmt: skip
    """Power off host ``victim``; time the coordinator's detection, its plan, the recovery."""
    victim_host = host_name(victim)
    procs = {f"w{victim * NPROC + k}" for k in range(NPROC)}
    tail.read()
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
    sims: int | None = None  # simulator processes (None: 1 up to 100 hosts, else 2)
    nice: int = SIM_NICE


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
                           "connections": 2 * (hosts + SPARE_NODES), "simulators": n_sims, "ok": False}  # fmt: skip
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
            [common.PYTHON, str(_SELF), "--role", "coordinator", "--hosts", str(hosts), "--secret-file",
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
                           "--nice", str(params.nice)]  # fmt: skip
            sims.append(SimHandle(
                [common.PYTHON, str(_SELF), "--role", "simulator", *common_args, "--step-s", str(params.step_s),
                 "--join-timeout", str(join_timeout)], log, env))  # fmt: skip
            ackers.append(SimHandle([common.PYTHON, str(_SELF), "--role", "acker", *common_args], log, env))
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
        res["steady"] = _steady(a, b, hosts, params.hang_timeout, params.step_s)
        if params.profile_s > 0:
            (ctl / "profile_on").touch()
            time.sleep(params.profile_s)
            (ctl / "profile_off").touch()
            with contextlib.suppress(TimeoutError):
                _wait_until("the coordinator's profile", lambda: (ctl / "profile.json").exists(), 60 + 0.05 * hosts,
                            alive)  # fmt: skip
            res["profile"] = {"window_s": params.profile_s, **_read_json(ctl / "profile.json")}
        tail = EventTail(d / "run" / "events.jsonl")
        victim = hosts // 2
        k = next(k for k, (first, count) in enumerate(_split(hosts + SPARE_NODES, n_sims))
                 if first <= victim < first + count)  # fmt: skip
        ackers[k].request({"cmd": "kill", "host": host_name(victim)})
        res["failure"] = _failure(hosts, victim, sims[k], sims, tail, alive, timeout)
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
        for f in logs:
            f.close()
    res["coordinator_result"] = _read_json(ctl / "result.json")
    final = _read_json(ctl / "stats.json")
    res["coordinator_final"] = {"loop_iterations": final.get("iters"), "events": final.get("events"),
                                "store_calls": _g(final, "ops", "calls"), "store_seconds": _g(final, "ops", "seconds"),
                                "run_s": round(float(final.get("t", t_start)) - t_start, 1)}  # fmt: skip
    res["profile_whole_run"] = _read_json(ctl / "profile_all.json")
    res["coordinator_log"] = _log_summary(d / "coordinator.log")
    res["wall_s"] = round(time.time() - t_start, 1)
    return res


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

    _raise_nofile()
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
        row = measure(hosts, dest, dataclasses.replace(params, hang_timeout=hang))
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
        "quick": quick, "nproc_per_node": NPROC, "spare_nodes": SPARE_NODES, "heartbeats": HEARTBEAT_MODES[0],
        "params": {"series_hang_timeout_s": SERIES_HANG_S, "step_s": params.step_s, "warmup_s": params.warmup_s,
                   "window_s": params.window_s, "profile_s": params.profile_s, "sim_nice": params.nice},
        "protocol_target_per_s": {f"{h}@{t:g}": protocol_rates(h, t, params.step_s) for h, t in cases},
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
    target = protocol_rates(r["hosts"], r.get("hang_timeout_s", SERIES_HANG_S), res["params"]["step_s"])
    hosts = r["hosts"] + SPARE_NODES
    per_rank = (target["hb"] + target["ack"] + target["commit"]) / hosts
    offered = _g(r, "steady", "simulators", "offered_frac") or {}
    return [
        ["new plan within 1 s of detection (host_lost → gen 1 plan)", "≤ 1 s",
         f(plan, 2) + " s" if plan is not None
         else f"no host_lost, no plan: {_outcome(r)} ({_loop_note(r)})",
         "**not met**" if plan is None or plan > 1 else "met"],
        ["coordinator process CPU", "< 1 core",
         f"{f(cpu, 2)} cores (2 cores shared with the simulators)"
         + (f"; under a core only because its loop was blocked on the store: {_loop_note(r)}" if stuck else ""),
         "–" if cpu is None else "**not met**" if stuck or cpu >= 1 else "met"],
        ["coordinator process memory", "< 1 GB",
         f"{f(peak, 0)} MB at its peak (the run lasted minutes), growing {f(growth, 0)} MB/min",
         "–" if peak is None else "**not met**" if peak >= 1024 or (growth or 0) * 60 + peak >= 1024
         else "met"],
        ["steady store traffic linear in hosts", "linear",
         f"by construction: {sum(target.values()) / hosts:,.0f} store calls/s per host, {per_rank:,.0f} of them "
         "from its 8 ranks (heartbeats, lease checks, commits), so linear with a large constant "
         f"({sum(target.values()):,.0f}/s at 2,000 hosts, one store thread); measured: the simulators offered "
         f"{f(offered.get('hb'), 3)} of the heartbeats and {f(offered.get('ack'), 3)} of the lease checks at "
         "2,000 hosts",
         "linear, but **not met** as a load one store thread carries (finding 3)"],
    ]  # fmt: skip


def markdown(res: dict[str, Any]) -> str:
    rows = res.get("rows", [])
    if not rows:
        return "FAILED: no case measured"
    f = common.fmt
    g = _g

    def label(r: dict[str, Any]) -> str:
        return f"{r['hosts']:,} ({r['ranks']:,})" + ("" if r.get("hang_timeout_s") == SERIES_HANG_S
                                                     else f", hang {r.get('hang_timeout_s'):g} s")  # fmt: skip

    failure = common.md_table(
        ["hosts (ranks)", "first `fault_detected` s", "`host_lost` s", "gen 1 plan s", "plan − host_lost s",
         "of which after the last report s", "`recovery_done` s", "outcome"],
        [[label(r), f(g(r, "failure", "first_fault_s"), 2), f(g(r, "failure", "host_lost_s"), 2),
          f(g(r, "failure", "plan_s"), 2), f(g(r, "failure", "plan_after_detection_s"), 2),
          f(g(r, "failure", "plan_after_reports_s"), 2), f(g(r, "failure", "recovery_done_s"), 2), _outcome(r)]
         for r in rows],
    )  # fmt: skip
    steady = common.md_table(
        ["hosts (ranks)", "coordinator CPU, cores: process / main / store thread", "loop iterations/s · p95 s",
         "RSS MB window start → end · peak · growth MB/min", "store calls/s: all · per host · coordinator's",
         "offered: hb / lease checks / commits", "machine CPU busy · load avg"],
        [[label(r),
          " / ".join(f(g(r, "steady", "coordinator", *k), 2) for k in
                     (("cpu_core_frac",), ("threads_core_frac", "main"), ("threads_core_frac", "store"))),
          f"{f(g(r, 'steady', 'coordinator', 'loop_iterations_per_s'), 2)} · "
          f"{f(g(r, 'steady', 'coordinator', 'loop_iteration_s', 'p95'), 2)}",
          f"{f(g(r, 'steady', 'coordinator', 'rss_mb_start'), 0)} → {f(g(r, 'steady', 'coordinator', 'rss_mb_end'), 0)}"
          f" · {f(r.get('rss_mb_max'), 0)} · {f(g(r, 'steady', 'coordinator', 'rss_growth_mb_per_min'), 0)}",
          f"{f(g(r, 'steady', 'store_calls_per_s_total'), 0)} · {f(g(r, 'steady', 'store_calls_per_host_per_s'), 1)}"
          f" · {f(g(r, 'steady', 'coordinator', 'store_calls_per_s_total'), 0)}",
          " / ".join(f(g(r, "steady", "simulators", "offered_frac", k), 2) for k in ("hb", "ack", "commit")),
          f"{f(g(r, 'steady', 'machine_cpu_busy_frac'), 2)} · {r.get('loadavg_start', ['–'])[0]}"]
         for r in rows if g(r, "steady")],
    )  # fmt: skip
    traffic = common.md_table(
        ["hosts (ranks)", "status value B", "heartbeat value B", "per poll: statuses B (hosts × status)",
         "per poll: heartbeats B (ranks × hb)", "coordinator reads B/s", "events/s into the log",
         "protocol's calls/s (target)"],
        [[label(r), f(g(r, "steady", "sizes_bytes", "status"), 0), f(g(r, "steady", "sizes_bytes", "heartbeat"), 0),
          f"{g(r, 'steady', 'per_poll_bytes', 'statuses') or 0:,}", f"{g(r, 'steady', 'per_poll_bytes', 'heartbeats') or 0:,}",
          f"{sum((g(r, 'steady', 'coordinator', 'bytes_in_per_s') or {}).values()):,.0f}",
          f(g(r, "steady", "coordinator", "events_per_s"), 0),
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
        f"{res['nproc_per_node']} ranks per host, one spare host, {res['params']['step_s']:g} step/s, heartbeats "
        f"{res['heartbeats']} (today's protocol); the series at hang timeout "
        f"{res['params']['series_hang_timeout_s']:g} s (the method says why), the job's default 0.5 s at 100 hosts. "
        f"Steady window {res['params']['window_s']:g} s after {res['params']['warmup_s']:g} s of warm-up; then "
        f"{res['params']['profile_s']:g} s of sampling profile; then one worker host loses power (t = 0 below). "
        "Alone: `OMP_NUM_THREADS=1 python bench/control_scale.py` (every case) or `--quick` (10 and 100 hosts); "
        "`--hosts 10,100 --hang-timeout 0.5` for other cases.",
        "",
        "**A host's power loss** (seconds from the loss, on one clock: the events' times are the coordinator's):",
        "",
        failure,
        "",
        "**Steady state** (the window before the loss):",
        "",
        steady,
        "",
        "**Bytes per coordinator tick.** The coordinator reads every host's status at each loop iteration and "
        "every process's heartbeat at each heartbeat poll (0.1 s), each in one `multi_get`:",
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
    rows = res["rows"]
    f = common.fmt
    series = [r for r in rows if r.get("hang_timeout_s") == SERIES_HANG_S]
    step_s = res["params"]["step_s"]

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.0f}%"

    def each(fn: Callable[[dict[str, Any]], str]) -> str:
        return ", ".join(f"{fn(r)} at {r['hosts']:,} hosts" for r in series)

    mid = next((r for r in series if r["hosts"] == 100), series[0] if series else None)
    rtt_check = _rtt_us(mid, "check") if mid else None
    rtt_del = _rtt_us(mid, "delete_key") if mid else None
    ranks = 2000 * NPROC
    deletes = ranks / step_s
    checks = (4 * (ranks + SPARE_NODES * NPROC) + 2 * ranks) / 5.0  # _check_intruders, every 5 s
    costs = [(r["hosts"], _store_us_per_call(r)) for r in series if _store_us_per_call(r)]
    us = min((c for _, c in costs), default=None)
    full = protocol_rates(2000, SERIES_HANG_S, step_s)
    full_default = protocol_rates(2000, HANG_TIMEOUT_S, step_s)
    crashed = [r for r in rows if "DistNetworkError" in str(_g(r, "coordinator_result", "error") or "")]

    def loop(r: dict[str, Any]) -> str:
        fin = r.get("coordinator_final") or {}
        rate = _g(r, "steady", "coordinator", "loop_iterations_per_s")
        if fin.get("loop_iterations") is not None and fin["loop_iterations"] < 20:
            return f"{fin['loop_iterations']} iteration(s) in {f(fin.get('run_s'), 0)} s"
        return f"{f(rate, 1)} iterations/s"

    lines = [
        "**Findings** (what limits the control plane, with the evidence; the profile shares are of the loop's "
        "sampled wall time):",
        "",
        "1. **The coordinator's loop breaks first, between 100 and 300 hosts here: it makes serial store round "
        "trips in proportion to the ranks.** Every step it deletes each rank's event chunk, one `delete_key` "
        "round trip each (`Launcher._record_chunk`); every 5 s `Membership._check_intruders` checks about six "
        "plain key names per process, one `check` each; during a failure `Coordinator._check_reports` reads each "
        "member's report (a check and a get) every tick. Each round trip waits behind the hosts' traffic on "
        "the one store thread"
        + (
            f" ({f(rtt_check, 0)} µs a `check`, {f(rtt_del, 0)} µs a `delete_key` at 100 hosts)"
            if rtt_del
            else ""
        )
        + ". Blocked in store round trips: "
        + each(lambda r: pct(_share(r, "store ")))
        + " of the loop's time in the profile window (the largest part each time in the list above: the event "
        "chunks' deletes and reads, the intruder checks). The loop: "
        + each(loop)
        + ". Once an iteration outlasts a step the unread chunks pile up and the next read of them is larger "
        "still (over the 300-host run, the `multi_get` of that backlog was "
        + pct(
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
        "= 32 million steps at 2,000 hosts. `Detection._check_processes` asks `Plan.rank_of` the rank of every "
        "worker each tick, and `rank_of` scans every member: 16,000 x 16,000 = 256 million steps per tick "
        f"({pct(_share(mid, 'rank_of')) if mid else '–'} of the loop's time already at 100 hosts)."
    )
    slow = [r for r in rows if r["hosts"] == 100 and _g(r, "failure", "first_fault_s") is not None]
    if slow:
        lines.append(
            "5. **A busy coordinator postpones its own detections.** `Membership._forgive_own_stall` credits each "
            "of the coordinator's stalls to every process's silence clock, the dead host's too: at 100 hosts the "
            "first `fault_detected` came "
            + " and ".join(
                f"{f(_g(r, 'failure', 'first_fault_s'), 1)} s after the power loss with a hang timeout of "
                f"{r['hang_timeout_s']:g} s (the coordinator logged {_g(r, 'coordinator_log', 'stall_warnings')} "
                f"stalls in that run, up to {f(_g(r, 'coordinator_log', 'worst_stall_s'), 1)} s)"
                for r in slow
            )
            + ". Right for a stall of the coordinator alone; under sustained load it delays every detection by "
            "the sum of the stalls."
        )
    lines.append(
        "6. **The hang rule's CPU exemption does not hold for a remote process** (from the code; a development "
        "run at 100 hosts and the 0.5 s default, with the simulators' heartbeats up to 0.6 s late, lost 16 "
        "healthy ranks and the job this way). `Detection._hung` spares a silent process that used CPU in a "
        "window of `hang_timeout_s / 2`; a remote process's CPU time changes only when its agent's status does, "
        "every `0.8 x hang_timeout_s`, so a window often sees none and a busy process whose heartbeats are late "
        "is killed as stopped."
    )
    growth = [(r["hosts"], _g(r, "steady", "coordinator", "rss_growth_mb_per_min"), r.get("rss_mb_max"))
              for r in series if _g(r, "steady")]  # fmt: skip
    lines.append(
        "7. **Memory grows with every step.** The launcher keeps every event in memory (`Launcher._events`), "
        "every rank sends one per step, and chunks the loop has not deleted stay in the store, in the same "
        "process: "
        + ", ".join(f"{f(gr, 0)} MB/min at {h:,} hosts (peak {f(pk, 0)} MB)" for h, gr, pk in growth)
        + ". A day at 2,000 hosts x 8 ranks and 1 step/s is 1.4 billion events."
    )
    return "\n".join(lines)


def _on_paper(res: dict[str, Any]) -> str:
    """What forming the next generation's process groups costs at 2,000 hosts x 8 ranks, from what was
    measured here and published figures."""
    rows = res["rows"]
    f = common.fmt
    ranks = 2000 * NPROC
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
        + ". Every rank reads it (`ControlClient.wait_plan`): "
        f"{plan_bytes * ranks / 1e9:.1f} GB out of the store per recovery"
        + (
            f", {ranks * plan_get:.1f} s of the store thread at the rate above (0.6 s if each host read it once "
            "for its ranks)"
            if plan_get
            else ""
        )
        + ".",
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
        "detection, once the control plane itself keeps up (the findings above: today it does not). What "
        "it needs: groups that do not rebuild over every rank (NCCL's `ncclCommShrink` / `ncclCommGrow` "
        "[nccl-api], or a hierarchy: groups within a replica set, a small group across), one plan read per "
        "host, heartbeats folded into each host's status (one key per host, not eight), event chunks batched "
        "and deleted in one call, no per-process round trips in the coordinator's loop, and a store that is "
        "not one thread (sharded, or agents relaying their hosts' traffic).",
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
    p.add_argument("--no-results", action="store_true", help="do not write bench/results/control_scale.json")
    p.add_argument(
        "--role",
        choices=("bench", "coordinator", "simulator", "acker"),
        default="bench",
        help=argparse.SUPPRESS,
    )
    for flag in ("--addr", "--secret-file", "--out"):
        p.add_argument(flag, default=None, help=argparse.SUPPRESS)
    for flag, kind, default in (("--first", int, 0), ("--count", int, 0), ("--step-s", float, STEP_S),
                                ("--hang-timeout", float, None), ("--join-timeout", float, 300.0),
                                ("--timeout", float, 7200.0), ("--nice", int, SIM_NICE)):  # fmt: skip
        p.add_argument(flag, type=kind, default=default, help=argparse.SUPPRESS)
    a, _ = p.parse_known_args(argv)
    if a.role == "coordinator":
        a.hosts = int(a.hosts)
        return coordinator_main(a)
    if a.role == "simulator":
        a.hosts = int(a.hosts)
        return simulator_main(a)
    if a.role == "acker":
        a.hosts = int(a.hosts)
        return acker_main(a)
    hang = a.hang_timeout if a.hang_timeout is not None else SERIES_HANG_S
    cases = tuple((int(x), hang) for x in a.hosts.split(",")) if a.hosts else None
    params = Params(sims=a.sims, profile_s=0.0 if a.no_profile else PROFILE_S)
    git = common.git_state()
    res = run(a.quick, common.OUT, cases, params)
    res["_command"] = "OMP_NUM_THREADS=1 python bench/control_scale.py" + "".join(
        f" {x}" for x in (argv or sys.argv[1:])
    )
    res["_date"] = res["machine"]["date"]
    res["_commit"], res["_dirty"] = git["commit"], git["dirty"]
    common.write_json(common.OUT / "control_scale.json", res)
    if not a.no_results:
        common.write_json(common.RESULTS / "control_scale.json", res)
    print(markdown(res))
    return 0 if all(r.get("ok") for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
