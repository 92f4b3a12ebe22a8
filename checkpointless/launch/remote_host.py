"""A job's hosts and their processes as the coordinator sees them (``remote.py``): ``Host``, one
host's record (its agent's hello, the orders sent to it, its last status; changed by its methods
only), and ``RemoteProcess``, a process on it as its agent last reported it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpointless.launch.remote import RemoteNodes


@dataclass
class Host:
    """One host of the job, as the coordinator knows it; its fields change through its methods."""

    name: str
    node: int  # its index: worker hosts 0..N-1 (rank order), spare hosts after them
    addr: str
    nproc: int
    spare: bool
    pid: int
    seq: int = -1
    heard: float = 0.0  # the coordinator's clock when the status last moved
    lost: str = ""  # why the host is lost ("" while it lives)
    orders: int = 0
    status: dict[str, Any] = field(default_factory=dict)
    raw: bytes = b""
    asked: float | None = None  # when an order the agent has not answered yet was sent (kill, ping)
    asked_seq: int = -1  # its status's sequence number then: any later status is the answer
    last_ping: float = float("-inf")
    reset: int | None = None  # lost: the index of the order that resets its agent (``rejoin``)
    lost_at: float = 0.0  # the coordinator's clock when it was lost

    def place(self, node: int, now: float) -> None:
        """Accepted as node ``node`` at ``now`` (the coordinator's clock)."""
        self.node, self.heard = node, now

    def serve_as_spare(self) -> None:
        """One worker host too many: it serves as a spare host."""
        self.spare = True

    def ordered(self, op: str, clock: Callable[[], float]) -> None:
        """An order ``op`` was written: the next one gets the next index; a kill or a ping waits
        for the agent's answer (any later status)."""
        self.orders += 1
        if op in ("kill", "ping") and self.asked is None:
            # a live agent answers at once (its order thread wakes on the key, then it beats)
            self.asked, self.asked_seq = clock(), self.seq

    def pinged(self, now: float) -> None:
        """Asked for a sign of life at ``now`` (``RemoteNodes.probe``: once per answer window)."""
        self.last_ping = now

    def hear(self, raw: bytes, status: dict[str, Any], now: float) -> None:
        """A status newer than the last one (``raw`` as sealed), heard at ``now``."""
        self.raw, self.status, self.seq, self.heard = raw, status, int(status["seq"]), now
        if self.asked is not None and self.seq > self.asked_seq:
            self.asked = None  # answered

    def leave(self, why: str, now: float) -> None:
        """Gone from the job at ``now``: lost, or drained (``why``)."""
        self.lost, self.lost_at = why, now

    def reset_order(self) -> int:
        """The index of the order that resets its agent: the next one (``rejoin`` waits for it)."""
        self.reset = self.orders  # the index this order gets
        return self.reset

    def rejoin(self, now: float) -> None:
        """Its agent answered the reset at ``now``: it lives again, as a spare host."""
        self.lost, self.reset, self.spare, self.asked, self.heard = "", None, True, None, now


class RemoteProcess:
    """A process on another host, as its agent last reported it (a ``ProcessHandle``)."""

    relayed = True  # its heartbeats and events come through its agent's relay (launch/relay.py)

    def __init__(self, name: str, host: Host, nodes: RemoteNodes) -> None:
        self.name, self.on_host, self._nodes = name, host, nodes  # on_host: its host's record
        self.host = host.name
        self.lost = ""  # why its host was lost: dead to the job for good, even if the host comes back

    @property
    def leaving(self) -> bool:
        """Its host is being drained."""
        return bool(self.on_host.status.get("draining"))

    @property
    def pid(self) -> int:
        """Its pid on its host (0 until its agent reported it)."""
        report = self._report()
        return int(report.get("pid") or 0) if report else 0

    def _report(self) -> dict[str, Any] | None:
        procs = self.on_host.status.get("procs", {})
        report = procs.get(self.name)
        return report if isinstance(report, dict) else None

    def alive(self) -> bool:
        if self.on_host.lost or self.lost:
            return False
        report = self._report()
        return report is None or bool(report.get("alive"))  # not reported yet: being started

    def kill(self) -> None:
        """A request: the agent kills it and reports the exit."""
        if not self.on_host.lost and not self.lost:
            self._nodes.order(self.on_host, {"op": "kill", "name": self.name})

    def exitcode(self) -> int | None:
        report = self._report()
        if report is None or report.get("exit") is None:
            return None
        return int(report["exit"])

    def log_tail(self) -> str:
        if self.on_host.lost or self.lost:
            h = self.on_host
            return f"host {h.name} lost (its agent: pid {h.pid} at {h.addr}): {h.lost or self.lost}"
        report = self._report()
        return str(report.get("tail", "")) if report else ""

    def cpu_seconds(self) -> float | None:
        """The CPU time its agent last reported; None once that report is older than two of the
        agent's beats (a busy process must not look idle because its agent's news is late)."""
        report = self._report()
        if self.on_host.lost or self.lost or report is None or report.get("cpu") is None:
            return None
        if self._nodes.age(self.on_host) > 2 * self._nodes.beat_s:
            return None
        return float(report["cpu"])

    def cpu_age(self) -> float:
        return self._nodes.age(self.on_host)

    def lose(self, why: str) -> None:
        """Its host was lost (``why``): it is dead to the job for good."""
        self.lost = why
