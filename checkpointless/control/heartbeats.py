"""The heartbeat reader: every live process's latest verified heartbeat, in as few round trips
as the store allows, into the process table.

A process on the coordinator's host beats into its own key (``keys.heartbeat``); a process on
another host beats into its host's relay, which forwards one value per host
(``keys.node_relay``, ``launch/relay.py``). Every value is opened with the job's secret; a
forgery or a replay of an older real heartbeat is ignored (it must not hide a hang). The reader
also learns each sender's clock offset (``control/clock.py``) and keeps the coordinator's own
stalls off the processes' silence clocks.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from checkpointless.config import RecoveryConfig
from checkpointless.control.auth import SignedStore
from checkpointless.control.clock import ClockOffsets
from checkpointless.control.processes import ProcessTable, ProcessView
from checkpointless.protocol import keys
from checkpointless.protocol.relay_wire import RelayValue, read_relay_value

log = logging.getLogger(__name__)

News = tuple[str, ProcessView, dict[str, Any]]
"""A process whose heartbeat moved: (its name, its view holding the new heartbeat, the old one)."""


class HeartbeatReader:
    """Reads the heartbeats of ``table``'s live processes from ``store`` (see the module doc)."""

    def __init__(
        self,
        store: SignedStore,
        table: ProcessTable,
        settings: RecoveryConfig,
        clock: Callable[[], float],
    ) -> None:
        self._store, self._table, self._settings, self._clock = store, table, settings, clock
        self.clocks = ClockOffsets()  # each process's (or host's) clock against the coordinator's
        self._last_read: float | None = None  # when the last read returned (``_forgive_own_stall``)
        self._fresh = 0  # processes whose heartbeat the current read brought
        # host -> (raw relay value, its parsed value, when the coordinator last read it)
        self._relays: dict[str, tuple[bytes, RelayValue, float]] = {}

    def read(self, now: float) -> list[News]:
        """One read of every live process's heartbeat; the processes whose heartbeat moved."""
        began = self._clock()
        self._fresh = 0
        news: list[News] = []
        live = self._table.live()
        direct = [(name, p) for name, p in live if not p.handle.relayed]
        by_host: dict[str, list[tuple[str, ProcessView]]] = {}
        for name, p in live:
            if p.handle.relayed:
                by_host.setdefault(p.handle.host, []).append((name, p))
        if by_host:
            self._read_relays(by_host, now, news)
        if direct:
            self._read_direct(direct, now, news)
        self._forgive_own_stall(now, self._clock() - began)
        return news

    def read_exited(self, name: str, p: ProcessView, now: float) -> list[News]:
        """One more read for process ``name``, which exited before any read brought a heartbeat of
        it (a fast script may join, train and fail between two reads): whether it joined is in the
        store. Its host's other processes come along (a relay value is read whole)."""
        news: list[News] = []
        if not p.handle.relayed:
            self._read_direct([(name, p)], now, news)
            return news
        host = p.handle.host
        same = [
            (n, q) for n, q in self._table.live() if n != name and q.handle.relayed and q.handle.host == host
        ]
        self._read_relays({host: [*same, (name, p)]}, now, news)
        return news

    def relay_chunks(self) -> dict[str, int]:
        """How many event chunks each host's relay says it has written (several hosts)."""
        return {h: v[1].chunks for h, v in self._relays.items()}

    def _read_direct(self, direct: list[tuple[str, ProcessView]], now: float, news: list[News]) -> None:
        began = time.time()  # wall clock: heartbeats carry their senders' (ClockOffsets)
        # a heartbeat key, once written, stays: those read before come in one round trip
        known = [name for name, p in direct if p.raw_hb]
        raws = dict(
            zip(known, self._store.get_sealed_present([keys.heartbeat(n) for n in known]), strict=True)
        )
        for name, p in direct:
            key = keys.heartbeat(name)
            raw = raws[name] if name in raws else self._store.get_sealed(key)
            after = p.reading(began)  # a new heartbeat was written after ``after``
            if raw is not None and raw != p.raw_hb:
                text = self._store.open(key, raw)
                if text is None:
                    continue  # forged: keep the last real heartbeat
                hb = json.loads(text)
                if isinstance(hb.get("t"), (int, float)) and int(hb.get("seq", 0)) > int(p.hb.get("seq", 0)):
                    self.clocks.observe(name, float(hb["t"]), after, time.time())
                self._take(name, p, hb, raw, now, news)

    def _read_relays(
        self, by_host: dict[str, list[tuple[str, ProcessView]]], now: float, news: list[News]
    ) -> None:
        """Several hosts: each host's processes' heartbeats, in the one value its agent's relay
        forwards every heartbeat interval (``protocol.relay_wire.read_relay_value``): a key per host, not per rank. A
        host's clock offset is learnt from the relay's own time and holds for its processes."""
        began = time.time()
        known = [h for h in by_host if h in self._relays]
        raws = dict(
            zip(known, self._store.get_sealed_present([keys.node_relay(h) for h in known]), strict=True)
        )
        for host, procs in by_host.items():
            key = keys.node_relay(host)
            raw = raws[host] if host in raws else self._store.get_sealed(key)
            old = self._relays.get(host)
            after = old[2] if old is not None else began - 3600.0  # a new value was written after ``after``
            if raw is None or (old is not None and raw == old[0]):
                if old is not None:
                    self._relays[host] = (old[0], old[1], began)
                continue
            text = self._store.open(key, raw)
            if text is None:
                continue  # forged: keep the last real one
            value = read_relay_value(text)
            if old is not None and value.seq <= old[1].seq:
                continue  # a replay must not hide a hang
            self._relays[host] = (raw, value, began)
            if value.t is not None:
                self.clocks.observe(host, value.t, after, time.time())
            for name, p in procs:
                hb = value.procs.get(name)
                if isinstance(hb, dict) and int(hb.get("seq", 0)) > int(p.hb.get("seq", 0)):
                    self._take(name, p, hb, b"relayed", now, news)

    def _take(
        self, name: str, p: ProcessView, hb: dict[str, Any], raw: bytes, now: float, news: list[News]
    ) -> None:
        """A process's new (verified) heartbeat, unless it replays an older real one (which must
        not hide a hang)."""
        if p.hb and int(hb.get("seq", 0)) <= int(p.hb.get("seq", 0)):
            return
        old = p.hb
        p.heard(hb, raw, now)
        self._fresh += 1
        news.append((name, p, old))

    def _forgive_own_stall(self, now: float, read_s: float) -> None:
        """Silence the coordinator caused itself is not a process's. When this read came late (the
        launcher was not scheduled) or took long (the store, a thread of this same process, did not
        answer), no process's heartbeat could have been seen meanwhile: that time is credited to
        every silence clock, as a worker's lease loop forgives its own late runs. A stall of the
        launcher silences every process at once, and killing them all loses the job (seen on 2
        cores: a short stall of the launcher during a recovery killed every rank).

        Unless the read after the stall brought news from most processes: then the processes ran
        meanwhile and what the store holds is current, so a process still silent gets at most one
        hang timeout of credit since its own last heartbeat (one just late is spared, a dead one is
        found). A coordinator slower than its reads (2,000 hosts on 2 cores: a stall every loop)
        otherwise credited every stall to the dead host's processes too, and found them late."""
        rc = self._settings
        late = 0.0 if self._last_read is None else max(0.0, now - self._last_read - rc.heartbeat_interval_s)
        stall = late + read_s
        self._last_read = now + read_s
        if stall <= rc.hang_timeout_s / 4:
            return  # ordinary jitter
        live = [p for _, p in self._table.live()]
        current = 2 * self._fresh > len(live)  # most processes' heartbeats came in this read
        log.log(
            logging.DEBUG if current else logging.WARNING,
            "the coordinator or its store stalled for %.2fs; not counted as the processes' silence%s",
            stall,
            " (beyond one hang timeout: most processes' heartbeats are current)" if current else "",
        )
        for p in live:
            credit = min(stall, max(0.0, rc.hang_timeout_s - p.forgiven)) if current else stall
            if p.last_change >= now or credit <= 0.0:
                continue  # heard in this read, or credited enough
            p.forgive(credit, now)
