"""The agent's relay: one host's heartbeats, events and leases, forwarded as one.

On one host every process beats into the control store itself. Across hosts that is traffic per
rank (a heartbeat ``set`` every 0.1 s, a lease round trip as often, an event chunk per commit, each
read and deleted by the coordinator), which a coordinator of 2,000 hosts x 8 ranks cannot keep up
with (``bench/control_scale.py``). So the agent hosts a small store of its own on the host's
loopback, its processes write their heartbeats and event chunks there and renew their leases
against it (``ControlClient(relay=...)``), and every heartbeat interval the relay:

1. reads its processes' new heartbeats and event chunks from that store (deleting the chunks);
2. writes the host's new events as one chunk (``node/<host>/events/<i>``, each line naming its
   process: the relay vouches for it, as the key of a process's own chunk did; its ranks' commits of
   one step packed into one ``steps_committed`` event, ``pack_commits``), then one value with
   every process's latest heartbeat (``node/<host>/relay``): both ``set``s, no reply awaited (both
   formats: ``protocol/relay_wire.py``);
3. makes one round trip to the coordinator's store: it renews the host's lease, proves that the
   writes before it arrived, and asks whether the generation its ranks are in was aborted, which it
   passes on in its own store where the ranks look for it (``ControlClient.watch_abort``); once a
   second, one more asks whether the job was stopped, which the ranks learn from the host's lease
   (``ControlClient.stop_requested``, read at every step boundary).

The coordinator thus reads one key per host per tick and one chunk per host per tick with events,
and takes in one commit event per host and step.
It deletes none: after each pass it writes every host's count of chunks read in one ``multi_set``
(``keys.node_read``), and once a second the relay deletes its chunks below its count.

The chunks wait in the coordinator's store, in the coordinator's process, until it reads them. A
coordinator that reads events more slowly than the ranks commit steps (2,000 hosts x 8 ranks on 2
cores, ``bench/control_scale.py``) grew without bound that way. So a relay keeps at most
``WINDOW_BYTES`` of its chunks unread there: beyond, it holds its host's new events itself and
writes them later, several beats' worth in one chunk of up to ``CHUNK_BYTES`` (fewer, larger chunks:
the coordinator's passes are bounded in chunks, so they carry more events). While it holds, it looks
at the count read every ``_READ_FAST`` beats, and every ``STOP_EVERY`` once the coordinator stops
reading it. What it holds is bounded too (``HOLD_BYTES``): past that, its ranks' ``step_committed``
events are dropped, counted, and said in an ``events_dropped`` event (the report's figures then
lack them); no other event is dropped. The last flush, once the host's processes have exited,
writes what it holds up to ``FINAL_BYTES`` beyond the window, and every event other than a commit
in any case: 2,000 hosts writing their backlogs at once at the job's end would have piled them into
the coordinator's store. The coordinator's store thus holds at most 64 KB per host
(128 MB at 2,000 hosts), whatever the rate.
The plans are read once per host too: the relay copies each one its processes wait for into the
host's store (``launch/relay_plans.py``).
Final digests and waits for a spare's assignment still go from each process to the coordinator's
store: they come once per job or generation, not per tick.

The lease: after each answered round trip the relay writes into its own store when that round trip
was sent and which generations it saw aborted (``keys.HOST_LEASE``); a relayed process reads it in
its own lease round trip, so its lease runs from the relay's last answer. A host cut off from the
coordinator (a partition) keeps the old value: its processes exit by their lease (code 3), exactly
as a process on one host does when its launcher stops answering, then the agent fences the host
(``launch/host_agent.py``). A process whose agent stops answering exits by its lease as well.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from checkpointless.control.auth import SignedStore, job_namespace
from checkpointless.control.client import redial
from checkpointless.launch.relay_plans import PlanCopier
from checkpointless.protocol import keys
from checkpointless.protocol.relay_wire import forwarded, pack_commits, relay_value
from checkpointless.protocol.vocab import Event, Phase

log = logging.getLogger(__name__)


STOP_EVERY = 10
"""Beats between two looks at the job's stop key (``keys.JOB_STOP``: a second at the default
interval), the relay's one round trip on behalf of its ranks, which read its answer from the host's
lease at every step boundary (the stop's grace period is seconds). Also the longest wait, in beats,
between two looks at the count of chunks read (``keys.node_read``). The scale simulator
(``bench/scale_sim.py``) asks the coordinator's store at this pace too."""
_READ_FAST = 2
"""Beats between two looks at the count of chunks read while the window is full and the coordinator
read some at the last look (a busy host's events wait less than a second for it)."""

WINDOW_BYTES = 32 * 1024
"""A host's event chunks the coordinator may have unread in its store (see the module docstring)."""
CHUNK_BYTES = 32 * 1024
"""The largest chunk (one event larger than this goes alone). A relay writes while under the window:
the coordinator's store holds at most ``WINDOW_BYTES + CHUNK_BYTES`` of a host's events (128 MB at
2,000 hosts); a host whose chunks the coordinator reads at once forwards 64 KB per look at the count
read (``_READ_FAST`` beats), 320 KB/s: 900 events a second."""
HOLD_BYTES = 32 * 2**20
"""The events a relay holds while the window is full, before it drops step commits (hours of a
host of 8 ranks at a step a second)."""
FINAL_BYTES = 64 * 1024
"""What the last flush (the host's processes have exited) may write beyond the window: the events
held past it are the step commits of a coordinator that fell behind, which every host writing at
once at the job's end would pile into its store (32 MB a host: 64 GB at 2,000 hosts); the
commits that do not fit are dropped and counted, every other event is written."""


def _is_commit(line: str) -> bool:
    """Whether an event line (``json.dumps`` of the event) is a ``step_committed`` event or a
    ``steps_committed`` one (``pack_commits``)."""
    return f'"kind": "{Event.STEP_COMMITTED}"' in line or f'"kind": "{Event.STEPS_COMMITTED}"' in line


class Relay:
    """Forwards its host's processes' heartbeats and events (see the module docstring)."""

    def __init__(
        self,
        host: str,
        coordinator: str,
        secret: bytes,
        *,
        names: Callable[[], list[str]],
        interval: float,
        lease_s: float,
        clock_skew_s: float = 0.0,
    ) -> None:
        """``names``: the processes of this host (the agent's children, alive or not); ``lease_s``:
        how long one attempt to reconnect to the control store may take."""
        from checkpointless.launch.store import open_store

        self.host, self.coordinator, self._secret = host, coordinator, secret
        self._names, self._interval, self._lease = names, interval, lease_s
        self._skew = clock_skew_s
        self._ns = job_namespace(secret)
        self._server = open_store("127.0.0.1", 0)  # this host's processes only
        self.addr = f"127.0.0.1:{self._server.port}"
        self._local = SignedStore(self._server, secret, self._rejected, namespace=self._ns)
        self._up: SignedStore | None = None  # to the coordinator, connected by the thread
        self._seen: dict[str, int] = {}  # process -> the heartbeat ``seq`` last forwarded
        self._hb: dict[str, dict[str, Any]] = {}  # process -> its latest heartbeat
        self._chunks_read: dict[str, int] = {}  # process -> event chunks taken from the local store
        self._chunks = 0  # the host's event chunks written to the coordinator
        self._deleted = 0  # of those, deleted once the coordinator had read them
        self._unacked: list[tuple[str, str]] = []  # chunks written since the last round trip
        # events read from the local store, not yet in a chunk: (process, its line)
        self._held: deque[tuple[tuple[str, ...], str]] = deque()  # (the processes it speaks for, line)
        self._held_bytes = 0
        self._held_by: Counter[str] = Counter()  # process -> its lines held
        self._late: list[tuple[str, dict[str, Any]]] = []  # commits held back a beat (``_packed``)
        self._sizes: deque[int] = deque()  # bytes of the chunks written and not known read, in order
        self._unread = 0  # their sum
        self._dropped = 0  # step commits dropped since the last ``events_dropped`` event
        self._read_every = STOP_EVERY  # beats between two looks at the count read
        self._read_at = STOP_EVERY // 2  # the beat of the next look
        self._acked: dict[str, int] = {}  # process -> its chunks known to have reached the coordinator
        self._aborted: list[int] = []  # generations seen aborted (the newest few)
        self._rejections: deque[str] = deque()  # keys of values that failed their seal, not yet sent
        self._stopped = False  # the job was stopped (``keys.JOB_STOP``)
        self._seq = 0
        self._last_ok = time.monotonic()
        self.forwarded = 0  # relay values written (tests, benchmarks)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="agent-relay", daemon=True)
        self.plans = PlanCopier(self._local, self._connect, interval, self._stop, host)

    def start(self) -> None:
        self._thread.start()
        self.plans.start()

    def _rejected(self, key: str) -> None:
        """A value that failed its seal (here or on the coordinator's store): logged, and sent up as
        a ``message_rejected`` event at the next beat, so the job's report counts it."""
        log.warning("relay %s: ignored a value on %r not sealed with this job's secret", self.host, key)
        self._rejections.append(key)  # any thread (the plan copier's too): drained by the beat

    # -- one beat ---------------------------------------------------------------------------
    def _read_local(self, names: list[str]) -> list[tuple[str, dict[str, Any]]]:
        """The new heartbeats and events of this host's processes (from the local store): each
        event with the process it speaks for."""
        evs: list[tuple[str, dict[str, Any]]] = []
        for name in names:
            key = keys.heartbeat(name)
            text = self._local.get(key)
            if text is None:
                continue  # not beating yet (or forged: the real one overwrites it)
            hb = json.loads(text)
            if not isinstance(hb, dict):
                continue
            seq = int(hb.get("seq", 0))
            if seq <= self._seen.get(name, 0):
                continue  # nothing new (or a replay)
            self._seen[name], self._hb[name] = seq, forwarded(hb)
            awaiting = hb.get("awaiting")
            if type(awaiting) is int and awaiting >= 0:
                self.plans.awaiting[name] = awaiting
            else:
                self.plans.awaiting.pop(name, None)
            first, upto = self._chunks_read.get(name, 0), int(hb.get("chunks", 0))
            for i in range(first, upto):  # written before the heartbeat that counts them
                chunk_key = keys.events(name, i)
                chunk = self._local.get(chunk_key)
                if chunk is None:
                    break  # forged or missing: read again at the next beat
                for line in chunk.splitlines():
                    if line.strip():
                        ev = json.loads(line)
                        if isinstance(ev, dict):
                            ev["proc"] = name  # a chunk speaks for the process whose key it is under
                            evs.append((name, ev))
                self._local.delete(chunk_key)
                self._chunks_read[name] = i + 1
        return evs

    def _packed(
        self, evs: list[tuple[str, dict[str, Any]]], final: bool
    ) -> list[tuple[tuple[str, ...], str]]:
        """The events read at this beat, the step commits packed (``pack_commits``), each line with
        the processes it speaks for. Each process ships its commits at its own heartbeat, so a
        beat sees some of a step's and the next beat the rest: a commit that came last from its
        process is held back one beat (never past the last flush) and goes with the step's others
        then (one event per host and step, not two)."""
        late, self._late = self._late, []
        self._held_by.subtract(name for name, _ in late)
        later: set[str] = set()  # processes with an event after the one looked at
        last = [False] * len(evs)  # a commit its process sent nothing after (this beat)
        for i in range(len(evs) - 1, -1, -1):
            name, ev = evs[i]
            last[i] = ev.get("kind") == Event.STEP_COMMITTED and name not in later
            later.add(name)
        going = {(ev.get("gen"), ev.get("step")) for _, ev in late}  # steps whose commits go now
        going.update((ev.get("gen"), ev.get("step")) for (_, ev), end in zip(evs, last, strict=True)
                     if ev.get("kind") == Event.STEP_COMMITTED and not end)  # fmt: skip
        now: list[tuple[str, dict[str, Any]]] = []
        for (name, ev), end in zip(evs, last, strict=True):
            held = end and not final and (ev.get("gen"), ev.get("step")) not in going
            (self._late if held else now).append((name, ev))
        self._held_by.update(name for name, _ in self._late)  # not forwarded yet (``keys.relayed``)
        return [(procs, json.dumps(ev)) for procs, ev in pack_commits(self.host, late + now)]

    def beat(self, final: bool = False) -> None:
        """Forward once (see the module docstring); raises for the coordinator's store. ``final``:
        the last flush (the processes have exited): what is held, past the window (``_fit_final``)."""
        with self._lock:  # the relay's thread, or the agent's last flush
            self._beat(final)

    def _rejection_events(self) -> list[tuple[tuple[str, ...], str]]:
        out: list[tuple[tuple[str, ...], str]] = []
        while self._rejections:
            key = self._rejections.popleft()
            ev = {"t": time.time() + self._skew, "kind": Event.MESSAGE_REJECTED, "proc": f"agent {self.host}",
                  "host": self.host, "key": key}  # fmt: skip
            out.append(((), json.dumps(ev)))
        return out

    def _hold(self, lines: list[tuple[tuple[str, ...], str]]) -> None:
        """Events taken from the local store: kept until written up (commits dropped past
        ``HOLD_BYTES``: the module docstring)."""
        for names, line in lines:
            if self._held_bytes + len(line) > HOLD_BYTES and _is_commit(line):
                self._dropped += len(names)  # a packed event: each of its ranks' commits
                continue
            self._held.append((names, line))
            self._held_bytes += len(line) + 1
            self._held_by.update(names)

    def _fit_final(self, up: SignedStore) -> None:
        """Before the last flush: what the coordinator read since the last look is deleted, then
        the held step commits that do not fit ``FINAL_BYTES`` beyond the window are dropped."""
        if self._deleted < self._chunks:
            self._delete_read(up)
        room = WINDOW_BYTES + FINAL_BYTES - self._unread
        kept: deque[tuple[tuple[str, ...], str]] = deque()
        for names, line in self._held:
            if room >= len(line) + 1 or not _is_commit(line):
                kept.append((names, line))
                room -= len(line) + 1
                continue
            self._dropped += len(names)
            self._held_bytes -= len(line) + 1
            self._held_by.subtract(names)
        self._held = kept

    def _write_chunks(self, up: SignedStore, *, final: bool) -> None:
        """The held events, in chunks, while the coordinator's unread share is under the window
        (``final``: all of them, after ``_fit_final``)."""
        if final and self._held:
            self._fit_final(up)
        if self._dropped and (final or self._unread < WINDOW_BYTES):
            note = {"kind": Event.EVENTS_DROPPED, "t": time.time() + self._skew, "host": self.host,
                    "proc": f"agent {self.host}", "dropped": self._dropped,
                    "why": "the coordinator read this host's events more slowly than its ranks committed steps"}  # fmt: skip
            self._held.appendleft(((), json.dumps(note)))
            self._held_bytes += len(self._held[0][1]) + 1
            self._dropped = 0
        while self._held and (final or self._unread < WINDOW_BYTES):
            parts: list[str] = []
            size = 0
            while self._held and (not parts or size + len(self._held[0][1]) + 1 <= CHUNK_BYTES):
                names, line = self._held.popleft()
                parts.append(line + "\n")
                size += len(line) + 1
                self._held_by.subtract(names)
            self._held_bytes -= size
            chunk = (keys.node_events(self.host, self._chunks), "".join(parts))
            self._chunks += 1
            self._unacked.append(chunk)
            self._sizes.append(size)
            self._unread += size
            up.set(*chunk)

    def _beat(self, final: bool = False) -> None:
        names = self._names()
        self._hold(self._packed(self._read_local(names), final))
        self._hold(self._rejection_events())
        up = self._up
        if up is None:
            up = self._up = self._connect()
            for key, text in self._unacked:  # lost with the old connection, maybe
                up.set(key, text)
        self._write_chunks(up, final=final)
        self._seq += 1
        value = relay_value(self._seq, time.time() + self._skew, self._chunks,
                            {n: self._hb[n] for n in names if n in self._hb})  # fmt: skip
        up.set(keys.node_relay(self.host), value)
        self.forwarded += 1
        # the round trip: the host's lease, and the aborts of its ranks' generations
        gens = sorted({int(hb["gen"]) for hb in self._hb.values()
                       if hb.get("gen") is not None and hb.get("phase") != Phase.SPARE})  # fmt: skip
        sent = time.monotonic()
        asked = [g for g in gens if g not in self._aborted] or [-1]
        for gen in asked:
            key = keys.abort(gen) if gen >= 0 else keys.LATEST_GEN
            # existence is the hint (one round trip, the lease's), the sealed value the decision:
            # anyone who reaches the store can list its keys and write an abort under the job's names
            if gen < 0:
                up.raw.check([up.name(key)])  # the round trip alone
            elif up.is_set(key):  # one ``check`` round trip while the key is absent
                self._aborted.append(gen)
        del self._aborted[:-8]  # a process watches its current generation only
        if not self._stopped and self._seq % STOP_EVERY == 1:  # in the lease the ranks read
            self._stopped = up.is_set(keys.JOB_STOP)
        if self._seq >= self._read_at:
            full = self._unread >= WINDOW_BYTES and bool(self._held)
            moved = self._delete_read(up) if self._deleted < self._chunks else False
            # the window full: look again soon while the coordinator reads, less often once it stops
            self._read_every = _READ_FAST if full and moved else min(STOP_EVERY, 2 * self._read_every)
            self._read_at = self._seq + self._read_every
        self._unacked.clear()
        self._last_ok = sent
        lease = {"acked": sent, "aborted": self._aborted, "stopped": self._stopped}
        self._local.set(keys.HOST_LEASE, json.dumps(lease))
        for name, n in self._chunks_read.items():  # what reached the coordinator (``ControlClient.drain``)
            if self._acked.get(name) != n and not self._held_by[name]:
                self._local.set(keys.relayed(name), str(n))
                self._acked[name] = n

    def _delete_read(self, up: SignedStore) -> bool:
        """Delete the host's event chunks the coordinator has read (``keys.node_read``): a count it
        sealed, so nobody else can make the relay drop unread events. Whether it read any since."""
        text = up.get(keys.node_read(self.host))
        upto = min(int(text), self._chunks) if text is not None and text.isdigit() else 0
        for i in range(self._deleted, upto):
            up.raw.delete_key(up.name(keys.node_events(self.host, i)))
            self._unread -= self._sizes.popleft()
        moved = upto > self._deleted
        self._deleted = max(self._deleted, upto)
        return moved

    def _connect(self) -> SignedStore:
        left = self._lease - (time.monotonic() - self._last_ok)
        raw = redial(self.coordinator, left, timedelta(seconds=max(0.2, self._lease)))
        return SignedStore(raw, self._secret, self._rejected, namespace=self._ns)

    def _loop(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.wait(max(0.0, next_beat - time.monotonic())):
            next_beat = time.monotonic() + self._interval
            try:
                self.beat()
            except (RuntimeError, OSError) as e:
                # the host's lease (``keys.HOST_LEASE``) stays as it was: its processes judge it
                self._up = None
                log.debug("relay %s: %s; reconnecting", self.host, e)
                next_beat = time.monotonic() + min(self._interval, 0.05)
            except Exception:  # a bug: the agent ends (its processes with it), loudly
                log.exception("relay %s failed", self.host)
                os._exit(4)

    def flush(self) -> None:
        """Forward what is left (the processes have exited): their last events reach the log."""
        with contextlib.suppress(RuntimeError, OSError):
            self.beat(final=True)

    def close(self) -> None:
        self._stop.set()
        for thread in (self._thread, self.plans.thread):
            if thread.is_alive():
                thread.join(timeout=2)
