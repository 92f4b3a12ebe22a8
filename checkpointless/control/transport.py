"""The two ways a process's heartbeats, events and lease round trips reach the control store.

``DirectTransport``: on one host, each process writes them into the control store itself.
``RelayedTransport`` (``ControlClient(relay=...)``, several hosts): into its host agent's relay
store, which forwards them (``launch/relay.py``): the control store's traffic then grows with hosts,
not ranks. The relay holds the host's lease and passes on what its round trips saw (the aborts of
its ranks' generations, the job's stop: ``keys.HOST_LEASE``), so a relayed process's lease is its
host's. ``ControlClient`` holds one ``Transport`` and the ``HeartbeatLink`` it writes on.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Protocol

from checkpointless.control import dial
from checkpointless.control.auth import SignedStore
from checkpointless.control.link import HeartbeatLink, LeaseAnswer
from checkpointless.protocol import keys


class Transport(Protocol):
    """What differs between a process that beats into the control store and one whose host's relay
    forwards its beats. The heartbeat thread calls ``lease``, the lease watchdog ``silent_store``,
    the main thread the others, through ``ControlClient``."""

    @property
    def stopped(self) -> bool:
        """Whether a lease round trip saw the job stopped (``keys.JOB_STOP``): once true, true."""
        ...

    def lease(self, store: SignedStore, sent: float, watch: str | None) -> LeaseAnswer:
        """The lease's round trip on the heartbeat connection ``store``, sent at ``sent`` (heartbeat
        thread, under the link's lock): whether ``watch`` (a generation's abort key; None: none) is
        set, and when the control store last answered. It looks for the job's stop too. The store's
        errors propagate: the link counts its connection lost."""
        ...

    def silent_store(self, stuck: bool, answered_ago: float) -> str | None:
        """The address of the store that left this process without an answer for a lease (lease
        watchdog); its listening socket tells whether it is only slow. ``stuck``: the heartbeat
        connection is broken, or its round trip has been under way for a quarter of a lease;
        ``answered_ago``: seconds since a round trip was last answered on it. None: no store is
        silent, the heartbeat thread is only slow to ask (a loaded machine): no exit."""
        ...

    def is_set(self, key: str) -> bool:
        """Whether the job set ``key`` (sealed), without blocking: safe while the main connection
        waits; False while the answer is out of reach (asked again soon)."""
        ...

    def plans(self, gen: int) -> AbstractContextManager[SignedStore]:
        """The store to wait on for generation ``gen``'s plan, while the main thread waits."""
        ...

    def report_failure(self, gen: int, rank: int, committed: int, reason: str, has_state: bool) -> None:
        """Report this member's part of generation ``gen``'s failure (``ControlClient.report_failure``)."""
        ...

    def keep_report(self) -> None:
        """While a plan is awaited: write the failure report again if a stranger overwrote it."""
        ...

    def drain(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` s) until the events emitted so far reached the control store;
        whether they did."""
        ...


class DirectTransport:
    """The heartbeat connection goes to the control store itself; so do the failure reports, on
    the main connection ``store``."""

    def __init__(self, store: SignedStore, link: HeartbeatLink) -> None:
        self._store, self._link = store, link
        self._stopped = False
        self._failure_report: tuple[str, str] | None = None

    @property
    def stopped(self) -> bool:
        return self._stopped

    def lease(self, store: SignedStore, sent: float, watch: str | None) -> LeaseAnswer:
        """Its own round trip is the control store's answer. A key's existence proves nothing
        (anyone can list and write the store's keys): it is the hint to open the value, and only a
        value sealed by this job decides (``is_set`` is one ``check`` round trip while the key is
        absent)."""
        aborted = watch is not None and store.is_set(watch)
        if not self._stopped:
            self._stopped = store.is_set(keys.JOB_STOP)
        return LeaseAnswer(aborted, sent)

    def silent_store(self, stuck: bool, answered_ago: float) -> str | None:
        return self._link.addr if stuck else None

    def is_set(self, key: str) -> bool:
        """On the heartbeat connection: False while it is broken (the heartbeat thread reconnects)."""
        return self._link.call(lambda store: store.is_set(key), False)

    @contextlib.contextmanager
    def plans(self, gen: int) -> Iterator[SignedStore]:
        yield self._store

    def report_failure(self, gen: int, rank: int, committed: int, reason: str, has_state: bool) -> None:
        """A sealed ``keys.fail`` value, the hints (the list of ranks, the counter) and the bell."""
        report = json.dumps(
            {"committed": committed, "reason": reason, "proc": self._link.proc, "has_state": has_state}
        )
        self._failure_report = (keys.fail(gen, rank), report)
        self._store.set(*self._failure_report)
        self._store.raw.append(self._store.name(keys.fail_ranks(gen)), f"{rank},")
        self._store.add(keys.fail_count(gen), 1)
        self._store.set(keys.REPORT_BELL, "1")

    def keep_report(self) -> None:
        if self._failure_report is not None and self._store.get(self._failure_report[0]) is None:
            self._store.set(*self._failure_report)  # a stranger overwrote it: the plan waits for it

    def drain(self, timeout: float) -> bool:
        """A sync ``emit`` already wrote them."""
        return True


class RelayedTransport:
    """The heartbeat connection goes to the host agent's relay store; the control store at ``addr``
    is asked only for what the relay does not hold (``is_set``, on a connection of its own)."""

    def __init__(
        self,
        addr: str,
        link: HeartbeatLink,
        seal: Callable[[Any], SignedStore],
        *,
        timeout: timedelta,
        lease: float,
    ) -> None:
        """``seal`` wraps a raw connection in the job's ``SignedStore``; ``lease``: the process's,
        in seconds."""
        self._addr, self._link, self._seal = addr, link, seal
        self._timeout, self._lease = timeout, lease
        self._stopped = False
        self._probe: SignedStore | None = None  # ``is_set`` on a connection of its own
        self._probe_lock = threading.Lock()
        self._plans: SignedStore | None = None  # the plans, from the relay's store

    @property
    def stopped(self) -> bool:
        return self._stopped

    def lease(self, store: SignedStore, sent: float, watch: str | None) -> LeaseAnswer:
        """The host's lease is this process's: the relay's value says when its last answered round
        trip with the control store was sent, and which generations it saw aborted."""
        text = store.get(keys.HOST_LEASE)
        if text is None:
            return LeaseAnswer(False, None)  # the relay has not reached the control store yet
        lease = json.loads(text)
        self._stopped = self._stopped or bool(lease.get("stopped"))
        aborted = watch is not None and any(keys.abort(int(g)) == watch for g in lease.get("aborted", []))
        return LeaseAnswer(aborted, float(lease["acked"]))

    def silent_store(self, stuck: bool, answered_ago: float) -> str | None:
        """The relay, when it does not answer; the control store, when the relay answers but no
        longer reaches it (its socket is then the one asked)."""
        if stuck:
            return self._link.addr
        return self._addr if answered_ago < self._lease / 2 else None

    def is_set(self, key: str) -> bool:
        """The job's stop (asked at every step boundary): the relay's answer, on this host. Any
        other key: on a connection of its own to the control store (the relay holds heartbeats
        only); made again at the next call after a failure (the lease decides)."""
        if key == keys.JOB_STOP:
            text = self._link.call(lambda store: store.get(keys.HOST_LEASE), None)
            return text is not None and bool(json.loads(text).get("stopped"))
        with self._probe_lock:
            try:
                if self._probe is None:
                    self._probe = self._seal(dial.connect(self._addr, self._timeout))
                return self._probe.is_set(key)
            except (RuntimeError, OSError):
                self._probe = None
                return False

    @contextlib.contextmanager
    def plans(self, gen: int) -> Iterator[SignedStore]:
        """From the host's relay, which copies each plan once for the host's processes
        (``launch/relay_plans.py``): a read per rank of a plan that grows with the ranks was too
        much for the control store's one thread at scale (``bench/control_scale.py``); one per
        host. The heartbeat says which generation the process awaits meanwhile."""
        if self._plans is None:
            self._plans = self._seal(dial.ReconnectingStore(self._link.addr, self._timeout, self._lease))
        self._link.update(awaiting=gen)
        self._link.flush()
        try:
            yield self._plans
        finally:
            self._link.update(awaiting=None)

    def report_failure(self, gen: int, rank: int, committed: int, reason: str, has_state: bool) -> None:
        """The report rides in this process's heartbeat until it is in another generation; its
        agent's relay forwards it in the host's one value (``launch/relay.py``) and the coordinator
        reads it at every poll: no call on the coordinator's store. Written there, the 16,000
        reports of 2,000 hosts x 8 ranks were 4 calls each on its one store thread, and the
        simulated hosts took seconds to make them (``bench/control_scale.py`` measures it)."""
        self._link.update(report={"gen": gen, "rank": rank, "committed": committed, "reason": reason,
                                  "has_state": has_state})  # fmt: skip
        self._link.flush()

    def keep_report(self) -> None:
        """The report rides in every heartbeat: nothing to keep."""

    def drain(self, timeout: float) -> bool:
        """The relay counts each process's chunks it forwarded (``keys.relayed``)."""
        self._link.flush()
        want, deadline = self._link.chunks, time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError, OSError):
                done = self._link.get(keys.relayed(self._link.proc))
                if done is not None and int(done) >= want:
                    return True
            time.sleep(0.01)
        return False
