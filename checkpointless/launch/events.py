"""The processes' events on their way into the job's event log: each process's (or, on several
hosts, each host's relay's) sealed event chunks read from the control store in order, verified,
put on the coordinator's clock and recorded; and the count of values that failed their seal.

Read in bounded passes while the job runs (the coordinator's decisions must not wait for its log),
to the end once it is over. A process's chunks are numbered from 0 and written in order: those its
heartbeat announces are read in one round trip, the rest probed until a gap; a process that exited
is read to its end once, then never probed again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from checkpointless.control.auth import SignedStore
from checkpointless.observe.event_log import EventLog
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event

if TYPE_CHECKING:
    from checkpointless.control.coordinator import Coordinator

MAX_REJECTED_KEYS = 64
"""Messages not sealed with the job's secret are all counted (``report.json``'s ``rejected_messages``),
and the first one of each key is kept as a ``message_rejected`` event, for at most this many keys:
a stranger writing junk for as long as a job runs must not grow the launcher without bound."""


RELAYED_CHUNKS_PER_PASS = 1024
"""Hosts' event chunks one collection reads at most while the job runs. A chunk of a host's beat
carries its ranks' commits of a step as one event (``relay_wire.pack_commits``), about 1 KB for 8 ranks:
the bytes below bind first (at 256 chunks a pass the log fell behind the commits of many hosts,
``bench/control_scale.py``)."""
RELAYED_SECONDS_PER_PASS = 0.15
"""...and the time one collection spends on them while the job runs, checked after each slice of
``RELAYED_SLICE`` chunks: the coordinator's decisions wait for it, its log may fall behind."""
RELAYED_SLICE = 128
RELAYED_BYTES_PER_PASS = 1 << 20
"""...and their bytes, as estimated from the chunks read so far: a relay the coordinator falls behind
merges its events into larger chunks (``launch/relay.py``), up to 32 KB each."""


class Rejections:
    """Values that failed their seal: every one counted, the first of each key kept as an event
    (at most ``MAX_REJECTED_KEYS`` keys: the rest are only counted)."""

    def __init__(self) -> None:
        self.count = 0
        self.keys: set[str] = set()

    def first(self, key: str) -> bool:
        """Count one rejected message on ``key``; whether it is the first of its key to be kept."""
        self.count += 1
        if key in self.keys or len(self.keys) >= MAX_REJECTED_KEYS:
            return False
        self.keys.add(key)
        return True

    def report(self) -> dict[str, Any]:
        """``report.json``'s ``rejected_messages``."""
        return {"count": self.count, "keys": sorted(self.keys)}


class EventCollector:
    """Moves the processes' event chunks from the store into ``log`` (see the module docstring)."""

    def __init__(self, log: EventLog, rejections: Rejections) -> None:
        self._log, self._rejections = log, rejections
        self._store: SignedStore | None = None
        self._coord: Coordinator | None = None
        self._chunks_read: dict[str, int] = {}  # process (or "@host") -> its chunks read
        self._next_host = 0  # where the next collection pass starts when hosts' chunks wait
        self._chunk_bytes = 4096.0  # the relayed chunks' mean size (a moving average), for a pass's budget
        self._drained: set[str] = set()  # exited processes whose every chunk was read

    @property
    def _s(self) -> SignedStore:
        assert self._store is not None, "collect() first"
        return self._store

    def collect(
        self,
        store: SignedStore,
        children: Mapping[str, Any],
        hosts: Iterable[str] | None,
        coord: Coordinator | None,
        announced: dict[str, int] | None = None,
        relayed: dict[str, int] | None = None,
    ) -> None:
        """Move the processes' new event chunks from the store into the log (and the file).

        ``announced``: how many chunks each process's last heartbeat says it wrote; ``relayed``:
        how many each host's relay says it wrote (several hosts: ``launch/relay.py``). Those are
        read in one round trip (they exist: chunks are written before the value that counts them);
        a process or host not in them (at the end, or not heartbeating) is probed chunk by chunk
        until a gap.
        """
        self._store, self._coord = store, coord
        if hosts is not None:
            self._collect_relayed(hosts, relayed or {}, final=announced is None)
        announced = announced or {}
        known: list[tuple[str, int]] = [
            (name, i)
            for name in children
            if name in announced
            for i in range(self._chunks_read.get(name, 0), announced[name])
        ]
        raws = self._s.get_sealed_present([keys.events(name, i) for name, i in known])
        for (name, i), raw in zip(known, raws, strict=True):
            self._record_chunk(name, keys.events(name, i), raw)
            self._chunks_read[name] = i + 1
        for name, child in children.items():
            if name in announced or name in self._drained or child.relayed:
                continue
            gone = not child.alive()  # seen before reading: a process that is gone writes no more
            seen = self._chunks_read.get(name, 0)
            while True:  # chunks are numbered from 0 and written in order: read until a gap
                key = keys.events(name, seen)
                sealed = self._s.get_sealed(key)
                if sealed is None or not self._record_chunk(name, key, sealed):
                    break  # not written yet, or forged (the real chunk will overwrite it)
                seen += 1
            self._chunks_read[name] = seen
            if gone:  # read to its end once after its exit: never probed again (a long job's
                self._drained.add(name)  # dead processes would cost a round trip each, 5 times a second)
        self._log.flush()

    def _collect_relayed(self, hosts: Iterable[str], relayed: dict[str, int], *, final: bool) -> None:
        """The hosts' relayed event chunks: those announced in one round trip; at the end (no
        announcement) each live host's probed until a gap."""
        unread = [(h, self._chunks_read.get(f"@{h}", 0), n) for h, n in sorted(relayed.items())]
        unread = [(h, first, n) for h, first, n in unread if n > first]
        cap = max(1, min(RELAYED_CHUNKS_PER_PASS, int(RELAYED_BYTES_PER_PASS / self._chunk_bytes)))
        each = max(1, cap // max(1, len(unread))) if not final else 1 << 62
        start = 0
        if not final and unread:
            # an overloaded coordinator lets its event log fall behind, not its decisions: a
            # host's oldest unread chunk, from each host in turn (a host's chunks stay in order),
            # up to the pass's bounds in chunks, bytes and time; the next hosts at the next pass
            start = self._next_host % len(unread)
            unread = (unread[start:] + unread[:start])[:cap]
        known = [(h, i) for h, first, n in unread for i in range(first, min(n, first + each))]
        advanced: dict[str, str] = {}
        forged: set[str] = set()
        began = time.monotonic()
        touched: set[str] = set()
        # a slice at a time: the last collection reads every host's backlog (up to 64 KB each, 128 MB
        # at 2,000 hosts), which read in one call stood in memory whole, as bytes and as events
        for lo in range(0, len(known), RELAYED_SLICE):
            if not final and lo and time.monotonic() - began > RELAYED_SECONDS_PER_PASS:
                break
            part = known[lo : lo + RELAYED_SLICE]
            touched.update(h for h, _ in part)
            raws = self._s.get_sealed_present([keys.node_events(h, i) for h, i in part])
            if raws:
                self._chunk_bytes = 0.8 * self._chunk_bytes + 0.2 * sum(map(len, raws)) / len(raws)
            for (host, i), raw in zip(part, raws, strict=True):
                if host in forged or not self._record_chunk(host, keys.node_events(host, i), raw, relay=True):
                    forged.add(host)  # the real chunk overwrites it: read from there at the next pass
                    continue
                self._chunks_read[f"@{host}"] = i + 1
                advanced[keys.node_read(host)] = str(i + 1)
        if final:
            for host in hosts:
                seen = self._chunks_read.get(f"@{host}", 0)
                while True:
                    key = keys.node_events(host, seen)
                    sealed = self._s.get_sealed(key)
                    if sealed is None or not self._record_chunk(host, key, sealed, relay=True):
                        break
                    seen += 1
                self._chunks_read[f"@{host}"] = seen
        else:  # the relays delete what was read (one write for every host, not a delete per chunk)
            self._s.multi_set(advanced)
            self._next_host = start + len(touched)

    def _record_chunk(self, name: str, key: str, raw: bytes, *, relay: bool = False) -> bool:
        """Record the events of one sealed chunk of process ``name`` (``relay``: of host ``name``'s
        relay, whose lines name their processes) and delete it; False if forged."""
        text = self._s.open(key, raw)
        if text is None:
            return False
        lines = [line for line in text.splitlines() if line.strip()]
        try:  # one decode a chunk: its events share their keys' strings (a third less memory kept)
            evs = json.loads("[" + ",".join(lines) + "]")
        except ValueError:
            evs = [json.loads(line) for line in lines]  # says which line is wrong
        for ev in evs:
            if not relay:
                ev["proc"] = name  # a chunk speaks for the process whose key it is under
            if ev.get("kind") == Event.MESSAGE_REJECTED and not self._rejections.first(str(ev.get("key"))):
                continue  # counted (a process's or a relay's rejection as the coordinator's own)
            clock: str | None = None
            sent: float | None = None
            if self._coord is not None and isinstance(ev.get("t"), (int, float)):
                # on the coordinator's clock (control/clock.py); again at the end, when the
                # estimate is at its best. A relayed process keeps its host's clock
                clock, sent = name if relay else self._coord.clock_of(name), float(ev["t"])
                ev["t"] = self._coord.clocks.to_coordinator(clock, sent)
            self._log.record(ev, clock, sent)
        if not relay:  # a relay deletes its own, once told they were read (``keys.node_read``)
            self._s.delete(key)
        return True
