"""The simulated host agents of ``bench/control_scale.py`` (its module docstring says what they do
and what they leave out): ``Simulator`` (a process that plays many hosts and their processes) and
``AckLoad`` (the round trips of those hosts: their leases' checks, their ranks' job-stop checks, from
a process of its own), both driven by the bench over their stdin and stdout, one JSON line each way.

Two protocols (``PROTOCOLS``): ``relay``, today's (``launch/relay.py``: each host's agent forwards its
processes' heartbeats, events and leases, one value, one event chunk and one round trip per host per
beat), and ``per-rank``, the one before it (each process beats, writes its event chunks and renews
its lease on the coordinator's store itself), kept to compare the two.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import heapq
import itertools
import json
import math
import mmap
import os
import pstats
import queue
import random
import resource
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import DistStoreError, TCPStore

from bench import common
from checkpointless.control.auth import SignedStore, job_namespace, read_secret_file
from checkpointless.control.plan import Plan
from checkpointless.launch.relay import CHUNK_BYTES, HOLD_BYTES, STOP_EVERY, WINDOW_BYTES
from checkpointless.protocol import keys
from checkpointless.protocol.relay_wire import (
    forwarded_template,
    packed_row_template,
    packed_text,
    relay_value_text,
)
from checkpointless.protocol.vocab import Event, Phase, Reason, Role, event

NPROC = 8  # ranks per host
SPARE_NODES = 1
STEP_S = 1.0  # the simulated training's pace
TOTAL_STEPS = 10**9  # what the ranks' session.steps(total) says: the job never ends by itself
SIM_NICE = 0  # nice 5 starved the simulators on a loaded machine (their statuses late: false hang kills)
CONNECT_THREADS = 32  # c10d's client now and then takes 5 s to connect: many at once
RELAY, PER_RANK = "relay", "per-rank"
PROTOCOLS = (RELAY, PER_RANK)  # the first is today's
PID_BASE = 100_000  # the simulated agents' pids (only an identifier in the accept key)
_ORDER_WAIT = timedelta(hours=1)  # as node.py: a timed-out wait logs two c10d lines, so wait long
_SPARE_POLL = timedelta(seconds=30)  # as client.py's wait_assignment


def raise_nofile() -> None:
    """As many descriptors as the hard limit allows: the store holds two connections per host."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def intervals(hang: float) -> tuple[float, float, float]:
    """(heartbeat interval, a rank's lease check interval, an agent's status interval) of a job with
    ``hang_timeout_s`` ``hang``, as the coordinator command sets them (``heartbeat_interval_s``, the
    ``ack_every`` that ``ControlClient`` gives its ``HeartbeatThread``, ``cluster_spec.status_interval``).
    A relay beats and renews its host's lease at the heartbeat interval."""
    hb_s = min(0.1, hang / 4)
    return hb_s, min(hb_s, 0.5 * hang / 4), max(hb_s, 4 * hang / 5)


def protocol_rates(hosts: int, hang: float, step_s: float, protocol: str = RELAY) -> dict[str, float]:
    """Store calls per second the protocol asks of the hosts and their processes (the simulators'
    target): per purpose, from the job's intervals (``intervals``) and the step pace. Both protocols:
    each agent's status and the round trip after it. ``relay``: per host a relay value and a round
    trip per beat, an event chunk per step, a check of the job's stop every ``STOP_EVERY`` beats;
    ``per-rank``: per process a heartbeat and a lease check per beat, an event chunk and a heartbeat
    per step, a check of the job's stop per step (``Ending.leave_if_stopped``)."""
    ranks, spares = hosts * NPROC, SPARE_NODES * NPROC
    hb_s, ack_s, status_s = intervals(hang)
    both = {"status": 2 * (hosts + SPARE_NODES) / status_s}  # the status, the lease round trip
    if protocol == RELAY:
        return {
            **both,
            "stop": hosts / (STOP_EVERY * hb_s),  # the relay asks for the ranks (Relay._beat)
            "relay": (hosts + SPARE_NODES) / hb_s,  # node/<host>/relay
            "ack": (hosts + SPARE_NODES) / hb_s,  # the relay's round trip
            "events": hosts / step_s,  # a worker host's step_committed events, one chunk
            # the relay reads how many of its chunks the coordinator read (a check and a get once a
            # second) and deletes those (Relay._delete_read): a chunk a step
            "read": 2 * hosts / (STOP_EVERY * hb_s),
            "delete": hosts / step_s,
        }
    both["stop"] = ranks / step_s  # per-rank: a check of job/stop per rank and step
    return {
        **both,
        "hb": ranks * (1 / hb_s - 1 / step_s) + spares / hb_s,  # the thread's beats (a commit is one)
        "ack": (ranks + spares) / ack_s,
        "commit": 2 * ranks / step_s,  # the event chunk, the heartbeat
    }


# -- the simulated hosts ---------------------------------------------------------------
# a process's heartbeat (``ControlClient``'s fields), as json.dumps writes it: per-rank, on the
# coordinator's store (``tests/unit/test_bench_control_scale.py`` checks them against a real
# ``HeartbeatLink``'s and the relay's ``FORWARDED``)
_HB_BARE = '{"seq": %d, "phase": "%s", "t": %r, "chunks": %d}'
_HB_JOINED = '{"seq": %d, "phase": "%s", "rank": %d, "gen": %d, "committed": %d, "total": %d, "start": 0, "t": %r, "chunks": %d}'
_HB_STEPPING = (
    '{"seq": %d, "phase": "%s", "rank": %d, "gen": %d, "committed": %d, "total": %d, "start": 0, "step": %d, '
    '"attempt": %d, "step_time_s": %r, "loss": %r, "t": %r, "chunks": %d}'
)
# relayed: the fields its relay forwards (``relay_wire.forwarded``), a report last while it has one
_BARE = ("seq", "phase")
_JOINED = (*_BARE, "rank", "gen", "committed", "total")
_STEPPING = (*_JOINED, "step", "attempt", "step_time_s")
_FORWARDED = {
    (fields, reported): forwarded_template((*fields, "report") if reported else fields)
    for fields in (_BARE, _JOINED, _STEPPING)
    for reported in (False, True)
}


def json_template(obj: dict[str, Any], formats: dict[str, str]) -> str:
    """``json.dumps(obj)`` with the value of each key of ``formats`` left as that %-format (``%r``,
    ``"%s"``, ...): the package's own encoder decides the fields, their order and the rest."""
    text = json.dumps({k: f"@{k}@" if k in formats else v for k, v in obj.items()})
    for k, f in formats.items():
        text = text.replace(f'"@{k}@"', f)
    return text


# a rank's step_committed event as ``StepCommit.commit`` emits it (``vocab.event``, one line of a chunk)
# with the demo's one metric, and its row in a host's packed event (``relay_wire.pack_commits``)
_COMMIT = event(Event.STEP_COMMITTED, proc="", rank=0, gen=0, step=0, step_time_s=0.0, loss=0.0)
_COMMIT_FORMATS = {"t": "%r", "proc": '"%s"', "rank": "%d", "gen": "%d", "step": "%d", "step_time_s": "%r",
                   "loss": "%r"}  # fmt: skip
_STEP_EVENT = (
    json_template(_COMMIT, {k: f.replace("%", f"%({k})") for k, f in _COMMIT_FORMATS.items()}) + "\n"
)
_ROW_FIELDS = ("proc", "rank", "step_time_s", "loss")  # a row's arguments, in this order
_ROW_OWN = {k: v for k, v in _COMMIT.items() if k not in ("t", "kind", "gen", "step")}
assert tuple(_ROW_OWN) == _ROW_FIELDS, f"the commit's own fields are now {tuple(_ROW_OWN)}"
_ROW = packed_row_template(json_template(_ROW_OWN, _COMMIT_FORMATS)[1:-1])


def packed_commits(host: str, gen: int, step: int, rows: list[tuple[float, str, int, float, float]]) -> str:
    """The line a relay writes for its host's commits ``(t, proc, rank, step_time_s, loss)`` of one
    step (one commit: the rank's own ``step_committed`` line), as ``relay_wire.pack_commits`` and
    ``json.dumps`` make it (``tests/unit/test_bench_control_scale.py`` compares them)."""
    if len(rows) == 1:
        t, proc, rank, step_time, loss = rows[0]
        return _STEP_EVENT % {"t": t, "proc": proc, "rank": rank, "gen": gen, "step": step,
                              "step_time_s": step_time, "loss": loss}  # fmt: skip
    args = [(t, (proc, rank, st, loss)) for t, proc, rank, st, loss in rows]
    return packed_text(host, gen, step, _ROW, args) + "\n"


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
    """A simulator's own store calls by purpose (``status``, ``relay``, ``events``, ``hb``, ``ack``,
    ``stop``, ``commit``, ``report``, ``order``, ``join``, ``plan``, ``spare``; ``instr``: the bench's
    own watchers), value bytes, and the round trips' latencies since the last snapshot."""

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

    def append(self, purpose: str, name: str, value: str) -> None:
        self.raw.append(name, value)
        self.stats.op(purpose, "append", out=len(value))

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
    prio: str = "lo"  # per-rank: which schedule its heartbeats are on (spares: "hi")
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
    hb: str = ""  # relay: its latest heartbeat, as its relay forwards it
    report: str = ""  # relay: its failure report, in its heartbeats until it joins another generation

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
    conn: Conn | None = None  # its status connection, which also carries its relay's (or processes') writes
    procs: dict[str, SimProc] = field(default_factory=dict)
    seq: int = 0
    node: int = -1
    dead: bool = False
    stopping: bool = False
    next_status: float = 0.0
    exited_unreported: bool = False
    relay_seq: int = 0  # relay: the values written, the event chunks written, the lines not yet in one
    chunks: int = 0
    lines: deque[str] = field(default_factory=deque)
    held_bytes: int = 0  # the lines' bytes
    sizes: deque[int] = field(default_factory=deque)  # the chunks written and not known read: bytes
    unread: int = 0  # their sum
    known_read: int = 0  # chunks known read (the acker's count, ``read_counts``)
    dropped: int = 0  # step commits dropped past HOLD_BYTES
    # relay: the commits read since its last beat, per (gen, step): (t, proc, rank, step_time_s, loss)
    commits: dict[tuple[int, int], list[tuple[float, str, int, float, float]]] = field(default_factory=dict)
    next_relay: float = 0.0


def host_name(index: int) -> str:
    return f"h{index:04d}"


def read_counts(secret_file: str, first: int, count: int) -> memoryview:
    """Per host of a simulator's share, the count of its event chunks the coordinator read, as its
    acker last saw it (``Relay._delete_read``): shared memory between the two processes, so that the
    simulator keeps the relay's window (``launch/relay.py``) with the acker's look at the count."""
    path = Path(secret_file).parent / f"read-{first}.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 8 * count)
        return memoryview(mmap.mmap(fd, 8 * count)).cast("q")
    finally:
        os.close(fd)


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
    statuses, the spare host's relay values (``per-rank``: the spares' heartbeats); ``lo``: the worker
    hosts' relay values (``per-rank``: the workers' heartbeats)) and a work queue (commits, failure
    reports, joins), one thread per host blocks on its orders. The round trips are ``AckLoad``'s."""

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
        self.first = a.first
        self.read = read_counts(a.secret_file, a.first, a.count)
        self.by_index = {ag.index: ag for ag in self.agents}
        self.protocol = a.protocol
        self.relayed = a.protocol == RELAY
        self.hb_s, _, self.status_s = intervals(a.hang_timeout)
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
            k: [0, 0] for k in ("status", "relay", "heartbeat", "chunk", "plan", "report")
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
            if self.relayed:  # the agent's relay beats from its start (its processes' come later)
                ag.next_relay = time.monotonic() + self.hb_s * random.random()
                self._push(self.hi if ag.spare else self.lo, ag.next_relay, "relay", ag)
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
        real rank within its relay's next round trip and its own next lease check on its agent's store,
        about 0.2 s; per-rank, within its next lease check, 62.5 to 100 ms) and of a plan (a real rank:
        its own ``wait_plan``)."""
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
            "held_bytes": sum(ag.held_bytes for ag in self.agents),
            "unread_bytes": sum(ag.unread for ag in self.agents),
            "dropped_commits": sum(ag.dropped for ag in self.agents),
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
        if kind == "relay":
            ag = obj
            if ag.dead or due != ag.next_relay:
                return
            if not ag.spare:
                self._lo_lag(now - due)
            self._relay(ag)
            ag.next_relay = due + self.hb_s if now - due < self.hb_s else now + self.hb_s
            self._push(self.hi if ag.spare else self.lo, ag.next_relay, "relay", ag)
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
        if not self.relayed:  # relayed: in its agent's next relay value
            self._heartbeat(ag, p, "hb")
            p.next_hb = time.monotonic() + self.hb_s * random.random()
            self._push(self.hi if p.prio == "hi" else self.lo, p.next_hb, "hb", p)
        if p.role == Role.WORKER and 0 in self.plans and self.gen_running is not None:
            self._queue_join(ag, p, 0)

    def _hb_text(self, p: SimProc) -> str:
        """A new heartbeat of ``p``: the fields ``Session`` and ``member.py`` put in (the JSON
        ``json.dumps`` would write, from a template: a third of the simulator's time went there);
        relayed, the fields its relay forwards, as its relay value holds them."""
        p.seq += 1
        if self.relayed:
            return self._forwarded_text(p)
        if p.rank is None:
            return _HB_BARE % (p.seq, p.phase, time.time(), p.chunks)
        if not p.attempt:
            return _HB_JOINED % (p.seq, p.phase, p.rank, p.gen, p.committed, TOTAL_STEPS, time.time(),
                                 p.chunks)  # fmt: skip
        step = p.committed + 1 if p.phase == Phase.COMPUTE else p.committed
        return _HB_STEPPING % (p.seq, p.phase, p.rank, p.gen, p.committed, TOTAL_STEPS, step, p.attempt,
                               p.step_time, p.loss, time.time(), p.chunks)  # fmt: skip

    @staticmethod
    def _forwarded_text(p: SimProc) -> str:
        """``p``'s heartbeat as its relay forwards it (``relay_wire.forwarded_template``: the
        arguments in ``FORWARDED``'s order)."""
        report = (p.report,) if p.report else ()
        if p.rank is None:
            return _FORWARDED[_BARE, bool(report)] % (p.seq, p.phase, *report)
        if not p.attempt:
            return _FORWARDED[_JOINED, bool(report)] % (p.seq, p.phase, p.rank, p.gen, p.committed, TOTAL_STEPS,
                                                        *report)  # fmt: skip
        step = p.committed + 1 if p.phase == Phase.COMPUTE else p.committed
        return _FORWARDED[_STEPPING, bool(report)] % (p.seq, p.phase, p.rank, p.gen, p.committed, step, p.attempt,
                                                      p.step_time, TOTAL_STEPS, *report)  # fmt: skip

    def _heartbeat(self, ag: SimAgent, p: SimProc, purpose: str) -> None:
        """``per-rank``: ``HeartbeatLink.flush``'s heartbeat, on the coordinator's store. Relayed, a
        process beats into its agent's store (not simulated): its agent's next relay value carries it."""
        if self.relayed:
            return
        assert ag.conn is not None
        self._size("heartbeat", self._set(ag.conn, purpose, keys.heartbeat(p.name), self._hb_text(p)))

    def _event(self, ag: SimAgent, p: SimProc, ev: dict[str, Any], purpose: str) -> None:
        """One event chunk (``HeartbeatLink.flush``: written before the heartbeat that counts it);
        relayed, into its agent's store: a line of its host's next event chunk."""
        self._chunk(ag, p, json.dumps(ev) + "\n", purpose)

    def _chunk(self, ag: SimAgent, p: SimProc, text: str, purpose: str) -> None:
        p.chunks += 1
        if self.relayed:  # each line names its process (``proc``), as the relay's do (never dropped)
            ag.lines.append(text)
            ag.held_bytes += len(text)
            return
        assert ag.conn is not None
        self._size("chunk", self._set(ag.conn, purpose, keys.events(p.name, p.chunks - 1), text))

    def _relay(self, ag: SimAgent) -> None:
        """``Relay._beat``: the host's new events as one chunk (``node/<host>/events/<i>``), then one
        value with every process's latest heartbeat (``node/<host>/relay``, the chunk counted in it),
        both ``set``s; its round trip is ``AckLoad``'s. Its processes beat every heartbeat interval
        too: each forwarded heartbeat is a new one."""
        assert ag.conn is not None
        if ag.commits:  # ``Relay._packed``: a host's commits of one step, one line
            for (gen, step), rows in ag.commits.items():
                text = packed_commits(ag.host, gen, step, rows)
                if ag.held_bytes + len(text) > HOLD_BYTES:
                    ag.dropped += len(rows)
                    continue
                ag.lines.append(text)
                ag.held_bytes += len(text)
            ag.commits.clear()
        read = self.read[ag.index - self.first]
        while ag.known_read < read and ag.sizes:
            ag.unread -= ag.sizes.popleft()
            ag.known_read += 1
        while ag.lines and ag.unread < WINDOW_BYTES:  # ``Relay._write_chunks``
            parts: list[str] = []
            size = 0
            while ag.lines and (not parts or size + len(ag.lines[0]) <= CHUNK_BYTES):
                parts.append(ag.lines.popleft())
                size += len(parts[-1])
            ag.held_bytes -= size
            self._size(
                "chunk", self._set(ag.conn, "events", keys.node_events(ag.host, ag.chunks), "".join(parts))
            )
            ag.chunks += 1
            ag.sizes.append(size)
            ag.unread += size
        beats = []
        for p in ag.procs.values():
            if p.alive:
                p.hb = self._hb_text(p)
            beats.append((p.name, p.hb))  # an exited process: its last heartbeat
        if beats:
            self._size("heartbeat", len(ag.procs[next(iter(ag.procs))].hb))
        ag.relay_seq += 1
        value = relay_value_text(ag.relay_seq, time.time(), ag.chunks, beats)
        self._size("relay", self._set(ag.conn, "relay", keys.node_relay(ag.host), value))

    def _queue_commits(self, gen: int) -> None:
        for ag in self.agents:
            if ag.dead:
                continue
            for p in ag.procs.values():
                if p.alive and p.gen == gen and p.phase != Phase.RECOVERING:
                    self.work.append(("commit", ag, p, gen))
                    self.pending_commits += 1

    def _commit(self, ag: SimAgent, p: SimProc, gen: int) -> None:
        """``StepCommit.commit``: the heartbeat fields, a ``step_committed`` event, a sync flush (relayed:
        into its agent's store, which the host's next relay value forwards)."""
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
        if self.relayed:  # packed by the relay at its next beat (``_relay``)
            p.chunks += 1
            row = (time.time(), p.name, p.rank, p.step_time, p.loss)
            ag.commits.setdefault((gen, p.committed), []).append(row)
        else:
            text = _STEP_EVENT % {"t": time.time(), "proc": p.name, "rank": p.rank, "gen": gen, "step": p.committed,
                                  "step_time_s": p.step_time, "loss": p.loss}  # fmt: skip
            self._chunk(ag, p, text, "commit")
        self._heartbeat(ag, p, "commit")
        p.phase = Phase.COMPUTE  # the next step starts at once; the next beat shows it
        if not self.relayed:
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
        """A member released by the abort: ``fault_detected`` (collective error, a sync flush; relayed:
        into its agent's store), then ``ControlClient.report_failure``: relayed, in its heartbeat (its
        relay's next value carries it); per-rank, on the coordinator's store (the sealed report, the
        list, the counter, the bell)."""
        if ag.dead or not p.alive or p.gen != gen or p.reported == gen:
            return
        assert ag.conn is not None
        p.reported = gen
        self._event(ag, p, event(Event.FAULT_DETECTED, proc=p.name, rank=p.rank, gen=gen, step=p.committed + 1,
                                 reason=Reason.COLLECTIVE_ERROR,
                                 error="Connection closed by peer [10.0.0.1]:12345"), "report")  # fmt: skip
        self._heartbeat(ag, p, "report")
        p.phase = Phase.RECOVERING
        if self.relayed:
            p.report = json.dumps({"gen": gen, "rank": p.rank, "committed": p.committed,
                                   "reason": Reason.COLLECTIVE_ERROR, "has_state": True}, separators=(",", ":"))  # fmt: skip
            self._size("report", len(p.report))
            return
        report = json.dumps({"committed": p.committed, "reason": Reason.COLLECTIVE_ERROR, "proc": p.name,
                             "has_state": True})  # fmt: skip
        self._size("report", self._set(ag.conn, "report", keys.fail(gen, p.rank or 0), report))
        ag.conn.append("report", self.sealer.name(keys.fail_ranks(gen)), f"{p.rank or 0},")
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
            if not self.relayed:
                p.next_hb = time.monotonic() + self.hb_s
                self._push(self.lo, p.next_hb, "hb", p)
        p.rank, p.gen, p.phase, p.report = rank, gen, Phase.IDLE, ""
        p.committed = plan.resume_step - 1
        self._heartbeat(ag, p, "join")


def _connect_many(addr: str, stats: SimStats, n: int) -> list[Conn]:
    """``n`` connections to the store, opened from a pool of threads."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(CONNECT_THREADS) as pool:
        return list(pool.map(lambda _: Conn(addr, stats), range(n)))


class AckLoad:
    """The round trips of hosts ``first .. first+count-1``, from a process of its own (a round trip
    blocks its caller, and in the simulator's process the waits fought its driver for the GIL): the
    leases' (``relay``: ``Relay._beat``'s round trip, one per host per beat, on the abort key of its
    ranks' generation, ``gen/latest`` while it has none; ``per-rank``: the heartbeat thread's
    (``HeartbeatThread``, ``DirectTransport.lease``), one per process every ``ack_s``, on its
    generation's abort key) and each worker rank's check of the job's stop
    (``Ending.leave_if_stopped``: per-rank, at the step pace; relayed, the relay asks once every
    ``STOP_EVERY`` beats and the ranks read its answer on their host). Its hosts' processes are
    named as the coordinator names them (``w<rank>``, the spare host's ``s<i>``); the generation is
    followed with a blocking wait on the next plan."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.addr, self.hosts = a.addr, a.hosts
        secret = read_secret_file(Path(a.secret_file))
        self.sealer = FastSealer(secret, job_namespace(secret))
        self.stats = SimStats()
        hb_s, ack_s, _ = intervals(a.hang_timeout)
        self.relayed = a.protocol == RELAY
        # (host, what, process or host name, period): what is "lease" or "stop"
        self.checks: list[tuple[int, str, str, float]] = []
        for h in range(a.first, a.first + a.count):
            names = [
                f"w{h * NPROC + k}" if h < a.hosts else f"s{(h - a.hosts) * NPROC + k}" for k in range(NPROC)
            ]
            if self.relayed:  # the relay: the lease every beat, the job's stop every STOP_EVERY beats,
                self.checks.append((h, "lease", host_name(h), hb_s))  # and as often, the chunks the
                self.checks.append((h, "stop", host_name(h), hb_s * STOP_EVERY))  # coordinator read
                if h < a.hosts:
                    self.checks.append((h, "read", host_name(h), hb_s * STOP_EVERY))
            else:
                self.checks += [(h, "lease", name, ack_s) for name in names]
                self.checks += [(h, "stop", name, a.step_s) for name in names]
        self.dead: set[int] = set()
        self.deleted: dict[int, int] = {}  # relay: per host, its chunks deleted so far
        self.first = a.first
        self.read = read_counts(a.secret_file, a.first, a.count)  # the same, for the simulator
        self.gen = 0
        self.stopped = threading.Event()
        self.lag = {"n": 0, "sum_s": 0.0, "max_s": 0.0, "late_0.5s": 0}
        self._out_lock = threading.Lock()

    def _key(self, host: int, what: str, name: str) -> str | None:
        """The key of a check; None: none due (a spare does not step)."""
        spare_waits = host >= self.hosts and self.gen == 0
        if what == "stop":
            return None if spare_waits else keys.JOB_STOP
        if spare_waits:  # a relay of spares only asks for the newest generation; a spare its own heartbeat
            return keys.LATEST_GEN if self.relayed else keys.heartbeat(name)
        return keys.abort(self.gen)

    def run(self) -> None:
        threading.Thread(target=self._control, name="acks-control", daemon=True).start()
        conn = Conn(self.addr, self.stats)
        threading.Thread(target=self._follow, name="acks-plans", daemon=True).start()
        heap = [(time.monotonic() + c[3] * random.random(), i) for i, c in enumerate(self.checks)]
        heapq.heapify(heap)
        while not self.stopped.is_set():
            due, i = heap[0]
            now = time.monotonic()
            if due > now:
                time.sleep(min(0.01, due - now))
                continue
            heapq.heappop(heap)
            host, what, name, period = self.checks[i]
            if host in self.dead:
                continue  # a host without power sends nothing
            lag = now - due
            if what == "read":
                self._delete_read(conn, host, name)
                heapq.heappush(heap, (due + period if lag < period else time.monotonic() + period, i))
                continue
            key = self._key(host, what, name)
            if key is not None:
                if what == "lease":
                    g = self.lag
                    g["n"] += 1
                    g["sum_s"] += lag
                    g["max_s"] = max(g["max_s"], lag)
                    if lag > 0.5:
                        g["late_0.5s"] += 1
                try:
                    conn.check("ack" if what == "lease" else "stop", self.sealer.name(key))
                except (RuntimeError, OSError) as e:
                    self.stats.errors[f"{what} {type(e).__name__}"] += 1
                    if self.stopped.wait(0.05):
                        return
            heapq.heappush(heap, (due + period if lag < period else time.monotonic() + period, i))

    def _delete_read(self, conn: Conn, host: int, name: str) -> None:
        """``Relay._delete_read``: the count of chunks the coordinator read (a check, a get), then a
        delete per chunk below it."""
        key = self.sealer.name(keys.node_read(name))
        try:
            if not conn.check("read", key):
                return
            upto = int(conn.get("read", key).partition(b".")[2] or b"0")  # sealed: tag, then the value
            for i in range(self.deleted.get(host, 0), upto):
                conn.delete("delete", self.sealer.name(keys.node_events(name, i)))
            self.deleted[host] = max(self.deleted.get(host, 0), upto)
            self.read[host - self.first] = self.deleted[host]
        except (RuntimeError, OSError, ValueError) as e:
            self.stats.errors[f"read {type(e).__name__}"] += 1

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
                host = next((c[0] for c in self.checks if host_name(c[0]) == cmd["host"]), None)
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
    raise_nofile()
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
    raise_nofile()
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
