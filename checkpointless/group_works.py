"""The works of a ``comm.Group`` in flight: how a wait on one gives up once its group is released,
the aborted groups kept aside until their collectives have ended, and the groups still formed when
the interpreter exits, aborted by then (``_abort_at_exit``).

Shutting the sockets down is not enough on its own for gloo: a send whose bytes did not all fit
in the socket when the peer stopped reading (a peer cut off or stopped mid-transfer) waits for
gloo's timeout (its pair notifies the pending receives, not an unbound buffer's queued write).
So a wait on a gloo collective never blocks for long: it waits in slices of ``RELEASE_POLL_S``
and gives up as soon as its group is released (``Works.wait``); and a group aborted while one of its
collectives still runs in gloo's worker thread is not destroyed (its destructor would join that
thread, holding the GIL, until the timeout): it is kept aside, its sockets shut down, and dropped
once that work has ended (``comm.Group.abort``, ``sweep``). A point-to-point transfer's wait (a state
transfer's) cannot wait in slices (a timed wait on a gloo send ends the send, and torch does not
expose its abort): its plain wait runs in a thread of the group's own, from the moment the
transfer is posted, while the caller looks every ``RELEASE_POLL_S`` whether the group was released
(``_Waiter``). A wait given up leaves its work and tensor to that thread until gloo's timeout ends
them; the work holds the group's context, so the group may go meanwhile. A sharded generation's
group, which ``comm`` only wraps, gives up the same way when its owner releases it.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from checkpointless.errors import CollectiveError

if TYPE_CHECKING:
    from checkpointless.comm import Group

RELEASE_POLL_S = 0.05  # how often a gloo wait looks whether its group was released
graveyard: list[tuple[Any, list[Any]]] = []  # (aborted gloo group, its collectives still running)


def sweep() -> None:
    """Drop the aborted groups whose last collective has ended (their destructors are quick now)."""
    graveyard[:] = [(pg, works) for pg, works in graveyard if not all(w.is_completed() for w in works)]


live: weakref.WeakSet[Group] = weakref.WeakSet()  # the groups comm formed, until aborted
EXIT_WAIT_S = 2.0  # how long the exit waits for aborted groups' collectives to end


@atexit.register
def _abort_at_exit() -> None:
    """Abort the groups still formed when the interpreter exits, while it can still run their
    destructors: a gloo group destroyed during finalization, with work still holding tensors,
    can abort the process (``terminate called without an active exception``). Runs after the
    non-daemon threads have ended; a daemon thread blocked in one of them sees it fail."""
    for group in list(live):
        with contextlib.suppress(Exception):
            group.release()
            group.abort()
    deadline = time.monotonic() + EXIT_WAIT_S
    while graveyard and time.monotonic() < deadline:
        sweep()
        time.sleep(RELEASE_POLL_S)


_Ticket = tuple[threading.Event, list[str]]  # a submitted wait: set once it ended, and its error


class _Waiter:
    """Waits a group's point-to-point works one at a time, in submission order, in a daemon thread
    of its own, while the caller looks whether the group was released (module doc). A transfer's
    works are submitted as they are posted, so the thread runs ahead of the caller, who then finds
    most of them ended (no thread switch per message). A wait given up leaves the thread inside it
    until gloo's timeout ends the work; the group is unusable by then."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, threading.Event, list[str]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, work: Any) -> _Ticket:
        """Wait for ``work`` in the thread, after those submitted before it."""
        done, failed = threading.Event(), list[str]()
        self._queue.put((work, done, failed))
        return done, failed

    @staticmethod
    def wait(ticket: _Ticket, released: Callable[[], bool], gen: int) -> None:
        """Until the ticket's work ended; ``CollectiveError`` once ``released()``, a gloo error as
        ``RuntimeError``."""
        done, failed = ticket
        while not done.wait(RELEASE_POLL_S):
            if released():
                raise CollectiveError(f"gen {gen}: the group was released while a transfer waited")
        if failed:
            raise RuntimeError(failed[0])

    def close(self) -> None:
        """The thread ends after the waits submitted so far."""
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, done, failed = item
            del item
            try:
                work.wait()
            except RuntimeError as e:
                failed.append(str(e))  # its message only: no frame of this thread, which holds the work
            finally:
                del work
                done.set()


class Works:
    """One group's works not yet waited for (collectives and point-to-point transfers), waited for
    so that a wait gives up as soon as the group is released (module doc), and those an abort
    leaves running (``writing``). The group starts them and hands each over (``track``)."""

    def __init__(self, gen: int, backend: str, *, owned: bool, released: Callable[[], bool]) -> None:
        """``owned``: the group is one ``comm`` formed (else it only wraps its owner's: a collective's
        wait is the plain one). ``released()``: whether the group was released, by itself or its owner."""
        self.gen, self.backend = gen, backend
        self._owned = owned
        self._is_released = released
        self._pending: dict[int, tuple[Any, bool]] = {}  # works not yet waited for: (work, p2p), by id
        self._orphans: list[Any] = []  # the collectives still running when it was aborted
        self._waiter: _Waiter | None = None  # started at the first point-to-point transfer
        self._tickets: dict[int, _Ticket] = {}  # transfers posted, their waits submitted: by id

    def track(self, work: Any, p2p: bool = False) -> Any:
        self._pending[id(work)] = (work, p2p)
        if p2p and self.backend == "gloo":  # its wait starts now, in the waiter's thread
            self._tickets[id(work)] = self._submit(work)
        return work

    def _submit(self, work: Any) -> _Ticket:
        if self._waiter is None:
            self._waiter = _Waiter(f"cpl-p2p-gen{self.gen}")
        return self._waiter.submit(work)

    def wait(self, work: Any, what: str, *, p2p: bool | None = None) -> None:
        """Wait for one of the group's works, giving up as soon as the group is released (see the
        module doc): a gloo collective in slices, a gloo transfer in a thread of its own. NCCL (whose
        abort ends its works) or a collective of a group this one only wraps: the plain wait."""
        if p2p is None:
            p2p = self._pending.get(id(work), (None, False))[1]
        try:
            if self.backend == "gloo" and p2p:
                self._wait_p2p(work)
            elif self.backend == "gloo" and self._owned:
                self._wait_gloo(work)
            else:
                work.wait()
        except CollectiveError:
            raise
        except RuntimeError as e:  # gloo and NCCL errors (torch.distributed.DistError is one)
            raise CollectiveError(f"gen {self.gen}: {what} failed: {e}") from None
        self._pending.pop(id(work), None)

    def _wait_gloo(self, work: Any) -> None:
        poll = timedelta(seconds=RELEASE_POLL_S)
        while True:
            try:
                work.wait(poll)
                return
            except RuntimeError:
                if work.is_completed():
                    work.wait()  # ended just now, or failed: its own outcome
                    return
            if self._is_released():
                raise CollectiveError(f"gen {self.gen}: the group was released while a collective waited")

    def _wait_p2p(self, work: Any) -> None:
        ticket = self._tickets.pop(id(work), None) or self._submit(work)
        _Waiter.wait(ticket, self._is_released, self.gen)

    def writing(self) -> bool:
        """Whether a collective of this group may still write into its tensors: one not yet
        waited for, or one still running when the group was aborted, that has not ended."""
        self._orphans = [w for w in self._orphans if not w.is_completed()]  # no Work kept past its end
        return bool(self._orphans) or not all(
            w.is_completed() for w, p2p in list(self._pending.values()) if not p2p
        )

    def abandon(self) -> list[Any]:
        """The group is aborted: the transfers' thread ends after the waits submitted so far, and
        every work is forgotten but the collectives still running, which are returned (``writing``
        watches them until they end)."""
        waiter, self._waiter = self._waiter, None
        self._tickets = {}
        if waiter is not None:
            waiter.close()
        running = [w for w, p2p in self._pending.values() if not p2p and not w.is_completed()]
        self._pending = {}
        self._orphans = running
        return running
