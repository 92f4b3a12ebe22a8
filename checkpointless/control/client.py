"""Worker-side client of the control store.

Each worker and spare holds one ``ControlClient``. It owns two connections to the
launcher's ``TCPStore``: one for the main thread (plans, reports) and one for a
daemon heartbeat thread, which also ships the process's events. (Group
formation opens a third, see ``Session._form_group``.) A stopped (SIGSTOP)
process stops heartbeating, which is how the coordinator detects a hang.

Every value is sealed with the job's secret (``control/auth.py``): values that
do not verify are ignored and recorded as ``message_rejected`` events.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import DistNetworkError, TCPStore

from checkpointless.config import JobConfig, RecoveryConfig
from checkpointless.control.auth import SignedStore, job_namespace
from checkpointless.control.plan import Plan
from checkpointless.errors import JobStopped
from checkpointless.protocol import keys
from checkpointless.protocol.env import ENV_CONFIG
from checkpointless.protocol.vocab import Event, Phase, event, wall_clock

log = logging.getLogger(__name__)

_POLL = timedelta(seconds=0.5)
# A spare waits on its assignment key in long rounds: each timed-out wait makes c10d log two
# warning lines, and an idle spare may wait for hours. At job end the launcher wakes it (``keys.STOP``).
_SPARE_POLL = timedelta(seconds=30)


def connect(addr: str, timeout: timedelta) -> TCPStore:
    host, port = addr.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)


SLOW_STORE_CAP = 40  # leases of silence a slow but live store is waited for


def store_accepts(addr: str, timeout: float) -> bool:
    """Whether the store at ``addr`` (``host:port``) accepts a TCP connection within ``timeout``:
    its host is reachable and its process alive, even if not scheduled (the kernel accepts for it).
    A dead process refuses; a partition lets no handshake through (or has no route)."""
    host, port = addr.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


_DIAL_S = 0.5  # one attempt to reconnect; c10d's own back-off between tries can reach a second


def redial(addr: str, left: float, timeout: timedelta) -> TCPStore:
    """One attempt to reconnect within ``min(left, _DIAL_S)`` seconds (the caller retries until its
    lease runs out: a single long attempt sleeps through c10d's back-off while the store comes
    back), the connection then taking ``timeout`` for its operations."""
    attempt = min(max(left, 0.05), _DIAL_S)
    host, port = addr.rsplit(":", 1)
    # c10d's client sleeps its back-off (up to seconds) after a refused try even past its timeout:
    # connect only once the store accepts connections again, so that it succeeds at its first try
    with socket.create_connection((host.strip("[]"), int(port)), timeout=attempt):
        pass
    store = connect(addr, timedelta(seconds=attempt))
    store.set_timeout(timeout)
    return store


def _job_lease() -> float:
    """The job's ``heartbeat_lease_s`` (the launcher passes the job's config to every process)."""
    text = os.environ.get(ENV_CONFIG)
    return (JobConfig.from_json(text).recovery if text else RecoveryConfig()).lease_s


class _Redial:
    """A store connection that survives a transient network error: an operation that fails for the
    network (``DistNetworkError``: reset, broken pipe, refused) reconnects and is tried again, for
    up to ``lease`` seconds from the first failure. Other errors (a wait's timeout) pass through."""

    def __init__(self, addr: str, timeout: timedelta, lease: float) -> None:
        self._addr, self._timeout, self._lease = addr, timeout, lease
        self._store = connect(addr, timeout)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            deadline: float | None = None
            while True:
                try:
                    return getattr(self._store, name)(*args, **kwargs)
                except DistNetworkError:
                    deadline = deadline or time.monotonic() + self._lease
                    if time.monotonic() > deadline:
                        raise
                    log.warning("the control store at %s failed in %s; reconnecting", self._addr, name)
                while True:
                    left = deadline - time.monotonic()
                    try:
                        self._store = redial(self._addr, left, self._timeout)
                        break
                    except (RuntimeError, OSError):
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)

        return call


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its launcher dies (Linux).

    The launcher already sets this between fork and exec (``launch.py``); calling
    it again is harmless and covers processes started some other way.
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ControlClient:
    """A process's view of the control plane.

    Blocking calls take the store's timeout unless stated; ``wait_plan`` and
    ``wait_assignment`` take their own.
    """

    def __init__(
        self,
        addr: str,
        proc: str,
        secret: bytes,
        *,
        timeout: timedelta = timedelta(seconds=60),
        heartbeat_interval: float = 0.1,
        lease_s: float | None = None,
        relay: str | None = None,
    ) -> None:
        """``lease_s``: how long the control store may leave this process without an answer before
        it exits (``RecoveryConfig.heartbeat_lease_s``); None: the job's, from the environment.
        ``relay``: ``HOST:PORT`` of the host agent's relay store (``launch/relay.py``): heartbeats,
        events and the lease's round trips go there instead of to the control store, whose
        traffic then grows with hosts, not ranks; the agent holds the host's lease and mirrors the
        aborts of its ranks' generations."""
        self.proc, self.addr = proc, addr
        self._hb_addr = relay or addr  # where heartbeats, events and the lease's round trips go
        self._relayed = relay is not None
        self._probe: SignedStore | None = None  # relayed: ``is_set`` on a connection of its own
        self._probe_lock = threading.Lock()
        self._plans: SignedStore | None = None  # relayed: the plans, from the relay's store
        self.timeout = timedelta(seconds=min(timeout.total_seconds(), 30.0))
        self._lease = lease_s if lease_s is not None else _job_lease()
        ns = job_namespace(secret)
        main = _Redial(addr, self.timeout, self._lease)
        self.store = SignedStore(main, secret, self._rejected, namespace=ns)
        self._secret, self._ns = secret, ns
        self._hb_store = SignedStore(
            connect(self._hb_addr, self.timeout), secret, self._rejected, namespace=ns
        )
        self._hb_lock = threading.Lock()
        self._interval = heartbeat_interval
        # the lease: renewed by a round trip on the heartbeat connection at this pace
        self._ack_every = min(heartbeat_interval, self._lease / 4)
        self._last_ack = time.monotonic()  # when the last acknowledged round trip was sent
        self._local_ack = self._last_ack  # relayed: when the last round trip with the relay was sent
        self._in_flight: float | None = None  # when the round trip under way was sent
        self._broken = False  # the heartbeat connection failed: the heartbeat thread reconnects
        self._unacked: list[tuple[str, str]] = []  # event chunks written since the last round trip
        self._events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._chunks = 0
        self._last_flush = 0.0
        self._failure_report: tuple[str, str] | None = None
        self._status: dict[str, Any] = {"seq": 0, "phase": Phase.STARTING}
        # (abort key, what to call once it is set): the generation this process is a member of
        self._watch: tuple[str, Callable[[], None]] | None = None
        self._job_stopped = False  # ``keys.JOB_STOP`` seen by the lease's round trip (``stop_requested``)
        self._stop = threading.Event()
        self._flush()  # the first heartbeat: this process has joined the job
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name="checkpointless-heartbeat", daemon=True
        )
        self._thread.start()
        self._watchdog = threading.Thread(target=self._lease_loop, name="checkpointless-lease", daemon=True)
        self._watchdog.start()

    def _rejected(self, key: str) -> None:
        log.warning("%s: ignored a value on %r that is not sealed with this job's secret", self.proc, key)
        self.emit(Event.MESSAGE_REJECTED, key=key)

    # -- heartbeat and events -------------------------------------------------
    def update(self, **status: Any) -> None:
        """Merge fields into the heartbeat (rank, gen, committed, phase, loss, ...). A relayed
        failure report (``report_failure``) rides in it until the process is in another generation."""
        self._status.update(status)
        report = self._status.get("report")
        if report is not None and "gen" in status and status["gen"] != report.get("gen"):
            del self._status["report"]

    def emit(self, kind: str, *, sync: bool = False, **fields: Any) -> None:
        """Record an event; ``sync`` ships it before returning (commits, and before a fault fires)."""
        for key, default in (("rank", "rank"), ("gen", "gen"), ("step", "committed")):
            fields.setdefault(key, self._status.get(default))
        self._events.put(json.dumps(event(kind, proc=self.proc, **fields)))
        if sync:
            self._flush()

    def flush(self) -> None:
        """Ship the pending events (the step commits the heartbeat thread has not sent yet) now: a
        process that is about to exit calls it, so that its last commits reach the log."""
        self._flush()

    def _flush(self) -> None:
        """Publish the pending events and a heartbeat. Never raises for the store: a failed write
        leaves the connection to the heartbeat thread, which reconnects and writes them again."""
        # Drain and snapshot under the lock: two flushers must publish in order.
        with self._hb_lock:
            lines = []
            while True:
                try:
                    lines.append(self._events.get_nowait())
                except queue.Empty:
                    break
            # Only ``set``s: a store ``set`` is one message with no reply, so a commit's sync flush
            # never waits for the launcher (a counter ``add`` would be a round trip). The heartbeat
            # says how many event chunks came before it on this connection, which delivered them
            # first: the launcher reads exactly those, with no probe for the next one. A chunk is
            # kept until a round trip after it (``_ack``) proves it arrived.
            if lines:
                self._unacked.append(
                    (keys.events(self.proc, self._chunks), "".join(line + "\n" for line in lines))
                )
                self._chunks += 1
            status = dict(self._status)
            status["seq"] = self._status["seq"] = int(self._status["seq"]) + 1
            status["t"] = wall_clock()  # its own clock: the coordinator learns the offset (clock.py)
            status["chunks"] = self._chunks
            self._last_flush = time.monotonic()
            if self._broken:
                return
            try:
                if lines:
                    self._hb_store.set(*self._unacked[-1])
                self._hb_store.set(keys.heartbeat(self.proc), json.dumps(status))
            except (RuntimeError, OSError) as e:
                self._lost(e)

    def _lost(self, error: BaseException) -> None:
        """The heartbeat connection failed (the lock is held): retried until the lease runs out."""
        if not self._broken:
            self._broken = True
            log.warning("%s: the control store at %s failed (%s); reconnecting for up to %.1fs",
                        self.proc, self._hb_addr, str(error).splitlines()[0] if str(error) else type(error).__name__,
                        self._lease - (time.monotonic() - self._last_ack))  # fmt: skip

    def watch_abort(self, gen: int | None, on_abort: Callable[[], None] | None = None) -> None:
        """Call ``on_abort`` (once, from the heartbeat thread) as soon as the coordinator aborts
        generation ``gen``; None: watch nothing. The lease's round trip is the check, so watching
        costs no store traffic; the abort is seen within ``_ack_every``."""
        self._watch = None if gen is None or on_abort is None else (keys.abort(gen), on_abort)

    @property
    def stop_requested(self) -> bool:
        """Whether the job was stopped (``keys.JOB_STOP``: Ctrl-C, SIGTERM to the launcher), as the
        heartbeat thread's lease round trips last saw it (within ``_ack_every``): asked at every
        step boundary at no cost, where a store round trip of the main thread would wait for the
        launcher to be scheduled on the cores the ranks train on."""
        return self._job_stopped

    def _ack(self) -> None:
        """One acknowledged round trip on the heartbeat connection: renews the lease, proves that
        every write before it arrived (a ``set`` alone may vanish in a dead connection) and looks
        for the abort of the watched generation (``watch_abort``) and for the job's stop
        (``stop_requested``; relayed, both come in the host's lease)."""
        watch = self._watch
        with self._hb_lock:
            if self._broken:
                return
            sent = self._in_flight = time.monotonic()
            key = watch[0] if watch is not None else keys.heartbeat(self.proc)
            try:
                if self._relayed:
                    aborted, acked = self._relay_lease(watch)
                else:
                    # a key's existence proves nothing (anyone can list and write the store's keys):
                    # it is the hint to open the value, and only a value sealed by this job decides
                    # (``is_set`` is one ``check`` round trip while the key is absent)
                    aborted = watch is not None and self._hb_store.is_set(key)
                    acked = sent
                    if not self._job_stopped:
                        self._job_stopped = self._hb_store.is_set(keys.JOB_STOP)
            except (RuntimeError, OSError) as e:
                self._lost(e)
                return
            finally:
                self._in_flight = None
            self._unacked.clear()
            self._local_ack = sent
            self._last_ack = min(sent, acked)
        if aborted and watch is not None and self._watch is watch:
            self._watch = None
            try:
                watch[1]()
            except Exception:  # the main thread still sees the abort at its next store wait
                log.exception("%s: releasing the aborted generation failed", self.proc)

    def _relay_lease(self, watch: tuple[str, Callable[[], None]] | None) -> tuple[bool, float]:
        """Relayed: (whether the watched generation was aborted, when the relay's last answered
        round trip with the control store was sent): the host's lease is this process's."""
        text = self._hb_store.get(keys.HOST_LEASE)
        if text is None:
            return False, self._last_ack  # the relay has not reached the control store yet
        lease = json.loads(text)
        self._job_stopped = self._job_stopped or bool(lease.get("stopped"))
        aborted = watch is not None and any(keys.abort(int(g)) == watch[0] for g in lease.get("aborted", []))
        return aborted, float(lease["acked"])

    def _reconnect(self) -> None:
        """A new heartbeat connection; the events not yet acknowledged are written again on it."""
        left = self._lease - (time.monotonic() - self._last_ack)
        try:
            raw = redial(self._hb_addr, left, self.timeout)
        except (RuntimeError, OSError):
            return  # still unreachable: the next beat tries again, the lease decides
        with self._hb_lock:
            self._hb_store.raw, self._broken = raw, False
            try:
                for key, text in self._unacked:
                    self._hb_store.set(key, text)
            except (RuntimeError, OSError) as e:
                self._lost(e)
                return
        log.warning("%s: reconnected to the control store at %s", self.proc, self._hb_addr)
        self._flush()

    def _heartbeat_loop(self) -> None:
        # A commit's flush is a heartbeat too: the thread beats only when the main thread has not
        # for an interval (each beat wakes the launcher's store on the cores the ranks train on),
        # and renews the lease with a round trip once an ``_ack_every``.
        while not self._stop.wait(self._until_next_beat()):
            try:
                if self._broken:
                    self._reconnect()
                    continue
                if time.monotonic() - self._last_flush >= self._interval * 0.999:
                    self._flush()
                if time.monotonic() - self._local_ack >= self._ack_every * 0.999:
                    self._ack()
            except Exception:  # a bug here must not look like a lost launcher
                log.exception("the heartbeat thread failed")
                os._exit(4)

    def _until_next_beat(self) -> float:
        if self._broken:
            return self._ack_every / 2
        due = min(self._last_flush + self._interval, self._local_ack + self._ack_every)
        return max(0.0, due - time.monotonic())

    def _lease_loop(self) -> None:
        """Exit once the store has left this process without an answer for a lease: a round trip
        that has not returned (a partition) or a connection that cannot be re-made (the launcher
        is gone). The coordinator declares a silent process dead only later (``hang_timeout_s``),
        so a cut-off worker has given up its rank before a spare takes it. A heartbeat thread that
        is merely slow to run (a loaded machine) has no round trip under way, and a process that
        did not run (a pause holding the GIL) gets a period after it: no exit for either."""
        parent = os.getppid()
        period = self._ack_every / 2
        woke = time.monotonic()
        while not self._stop.wait(period):
            if os.getppid() != parent:
                os._exit(3)  # the launcher is gone
            now, last = time.monotonic(), woke
            woke = now
            if now - last > 2 * period:
                # This thread ran late: the process did not run (a full garbage collection or
                # native code holding the GIL, a stop), so the heartbeat thread could not take
                # the answer that may have arrived meanwhile: it gets a period to do so first.
                continue
            silent = now - self._last_ack
            sent = self._in_flight
            stuck = self._broken or (sent is not None and now - sent > self._lease / 4)
            # relayed: the agent's store answers, but the relay no longer reaches the control store
            upstream = self._relayed and not stuck and now - self._local_ack < self._lease / 2
            if silent > self._lease and (stuck or upstream) and not self._store_alive(silent, upstream):
                sys.stderr.write(
                    f"{self.proc}: no answer from the control store at {self.addr} for {silent:.1f}s "
                    f"(lease {self._lease:g}s): exiting\n"
                )
                sys.stderr.flush()
                os._exit(3)

    def _store_alive(self, silent: float, upstream: bool = False) -> bool:
        """Whether a store that has not answered for a lease is only slow: its listening socket still
        accepts a connection (the kernel accepts for a live process even while it is not scheduled:
        a launcher starved of CPU, or stopped), so the network to it works and the coordinator,
        which lives in that same process, is as late as its store. A dead launcher refuses, a
        partition times out: exit as before. Bounded: after ``_SLOW_STORE_CAP`` leases of silence
        the process gives up anyway. ``upstream``: the relay answers but its control store does
        not: the control store's socket is the one asked."""
        addr = self.addr if upstream else self._hb_addr
        return silent <= SLOW_STORE_CAP * self._lease and store_accepts(addr, self._lease / 2)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._flush()

    # -- protocol ---------------------------------------------------------------
    def claim(self, key: str) -> bool:
        """Atomic first-wins flag on the store (a counter: unauthenticated, used for fault injection)."""
        return self.store.add(key, 1) == 1

    def publish(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def read_json(self, key: str) -> Any:
        value = self.store.get(key)
        if value is None:
            raise RuntimeError(f"{key} is missing or not sealed by this job")
        return json.loads(value)

    def wait_json(self, key: str, timeout: timedelta) -> Any:
        """The value of ``key`` once a process of this job has published it (``TimeoutError`` after ``timeout``)."""
        value = self.store.wait(key, timeout)
        if value is None:
            raise TimeoutError(f"{key} was not published within {timeout.total_seconds():g} s")
        return json.loads(value)

    def _stopped(self) -> bool:
        return self.store.is_set(keys.JOB_STOP)

    def wait_plan(self, gen: int, timeout: timedelta) -> Plan:
        """Block until the coordinator publishes generation ``gen`` (or a later one).

        Returns the newest published plan at or after ``gen``. A forged plan is
        ignored (and recorded); the wait goes on until the real one arrives.
        """
        store = self.store
        if self._relayed:
            # read from the host's relay, which copies each plan once for the host's processes
            # (``launch/relay_plans.py``): a read per rank of a plan that grows with the ranks was too
            # much for the control store's one thread at scale (bench/control_scale.py); one per host
            if self._plans is None:
                main = _Redial(self._hb_addr, self.timeout, self._lease)
                self._plans = SignedStore(main, self._secret, self._rejected, namespace=self._ns)
            store = self._plans
            self.update(awaiting=gen)
            self._flush()
        try:
            deadline = time.monotonic() + timeout.total_seconds()
            while True:
                text = store.wait(keys.plan(gen), _POLL)
                if text is not None:
                    break
                if self._failure_report is not None and self.store.get(self._failure_report[0]) is None:
                    self.store.set(*self._failure_report)  # a stranger overwrote it: the plan waits for it
                if self._stopped():
                    raise JobStopped("job stopped while waiting for a plan")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no plan for generation {gen} within {timeout}")
                time.sleep(0.02)  # a key that exists but is forged returns at once
            latest = store.get(keys.LATEST_GEN)
            if latest is not None and int(latest) > gen:
                newer = store.get(keys.plan(int(latest)))
                if newer is not None:
                    text = newer
            return Plan.from_json(text)
        finally:
            if self._relayed:
                self.update(awaiting=None)

    def report_failure(self, gen: int, rank: int, committed: int, reason: str, has_state: bool) -> None:
        """Report this member's part of generation ``gen``'s failure (re-asserted by ``wait_plan``).

        Relayed (several hosts), the report rides in this process's heartbeat, which its agent's
        relay forwards in the host's one value (``launch/relay.py``) and the coordinator reads at
        every poll: no store call on the coordinator's store. Written there, the 16,000 reports of
        2,000 hosts x 8 ranks were 4 calls each on its one store thread, and the simulated hosts
        took 4.8 s to make them (``bench/control_scale.py``)."""
        if self._relayed:
            self.update(report={"gen": gen, "rank": rank, "committed": committed, "reason": reason,
                                "has_state": has_state})  # fmt: skip
            self._flush()
            return
        report = json.dumps(
            {"committed": committed, "reason": reason, "proc": self.proc, "has_state": has_state}
        )
        self._failure_report = (keys.fail(gen, rank), report)
        self.store.set(*self._failure_report)
        self.store.raw.append(self.store.name(keys.fail_ranks(gen)), f"{rank},")
        self.store.add(keys.fail_count(gen), 1)
        self.store.set(keys.REPORT_BELL, "1")

    def wait_assignment(self) -> int:
        """A spare blocks here until given a generation to join; ``JobStopped`` at job end."""
        while True:
            value = self.store.wait(keys.assign(self.proc), _SPARE_POLL)
            if value == keys.STOP:
                raise JobStopped("job ended before this spare was needed")
            if value is not None:
                return int(value)
            if self._stopped():
                raise JobStopped("job ended before this spare was needed")
            time.sleep(0.02)

    def is_set(self, key: str) -> bool:
        """Non-blocking check, on the heartbeat connection (safe while the main one blocks); relayed,
        on a connection of its own to the control store (the relay holds heartbeats only)."""
        if self._relayed:
            if key == keys.JOB_STOP:  # asked at every step boundary: the relay's answer, on this host
                return self._relay_stopped()
            return self._probe_is_set(key)
        with self._hb_lock:
            if self._broken:
                return False  # asked again soon; the heartbeat thread reconnects meanwhile
            try:
                return self._hb_store.is_set(key)
            except (RuntimeError, OSError) as e:
                self._lost(e)
                return False

    def drain(self, timeout: float) -> bool:
        """Relayed: wait (up to ``timeout`` s) until the events emitted so far reached the control
        store through the host's relay (a host fault is about to take the relay with it); whether
        they did. Direct: a sync ``emit`` already wrote them."""
        if not self._relayed:
            return True
        self._flush()
        want, deadline = self._chunks, time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._hb_lock, contextlib.suppress(RuntimeError, OSError):
                done = self._hb_store.get(keys.relayed(self.proc))
                if done is not None and int(done) >= want:
                    return True
            time.sleep(0.01)
        return False

    def _relay_stopped(self) -> bool:
        with self._hb_lock:
            if self._broken:
                return False
            try:
                text = self._hb_store.get(keys.HOST_LEASE)
            except (RuntimeError, OSError) as e:
                self._lost(e)
                return False
        return text is not None and bool(json.loads(text).get("stopped"))

    def _probe_is_set(self, key: str) -> bool:
        with self._probe_lock:
            try:
                if self._probe is None:
                    self._probe = SignedStore(connect(self.addr, self.timeout), self._secret, self._rejected,
                                              namespace=self._ns)  # fmt: skip
                return self._probe.is_set(key)
            except (RuntimeError, OSError):
                self._probe = None  # asked again soon: a new connection then (the lease decides)
                return False

    def report_done(
        self, rank: int, digest: str, step: int, entries: list[tuple[str, str]] | None = None
    ) -> None:
        """Training ended at ``step``: the final state's digest, and the per-entry digests of
        everything registered (``Session._registered_entries``) that the replicas compare."""
        value = {"digest": digest, "step": step, "proc": self.proc, "entries": entries or []}
        self.store.set(keys.done(rank), json.dumps(value))

    def report_fatal(self, rank: int, error: str) -> None:
        """A mistake no recovery can fix: the coordinator ends the job with ``error``."""
        self.emit(Event.FATAL, sync=True, rank=rank, error=error[:500])
        self.store.set(keys.fatal(self.proc), json.dumps({"rank": rank, "error": error}))
        self.store.add(keys.FATAL_COUNT, 1)
        self.store.set(keys.REPORT_BELL, "1")
