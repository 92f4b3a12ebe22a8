"""The launcher's main loop while a job runs: the coordinator's ticks, and what comes with them.

Each pass takes in the hosts' news (a lost host that came back serves as a spare host), ticks the
coordinator, forgets the exits it has handled, samples the hosts' usage when due, collects the
processes' events (every 0.2 s at most), calls the ``on_tick`` callbacks and checks the job's
deadline; then it sleeps until a process exits, a failure report rings, or the coordinator's next
tick is due.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from checkpointless.control.coordinator import Coordinator, JobFailed
from checkpointless.control.processes import ProcessBackend
from checkpointless.launch.wakeups import Wakeups
from checkpointless.observe.usage import UsageRecorder
from checkpointless.protocol.vocab import Event, Role, event

COLLECT_EVERY_S = 0.2
"""The processes' events are collected this often at most while the job runs."""


class TickLoop:
    """Ticks ``coord`` until the job finishes (or its ``timeout_s`` passes: ``JobFailed``).

    ``record`` puts an event into the job's log; ``collect(announced, relayed)`` moves the
    processes' new event chunks into it (``EventCollector.collect``); ``on_tick`` is called with
    the coordinator after every tick.
    """

    def __init__(
        self,
        coord: Coordinator,
        backend: ProcessBackend,
        *,
        wakeups: Wakeups,
        usage: UsageRecorder,
        record: Callable[[dict[str, Any]], None],
        collect: Callable[[dict[str, int] | None, dict[str, int] | None], None],
        on_tick: list[Callable[[Coordinator], None]],
        timeout_s: float,
    ) -> None:
        self.coord, self.backend = coord, backend
        self.wakeups, self.usage = wakeups, usage
        self.record, self.collect = record, collect
        self.on_tick = on_tick
        self.timeout_s = timeout_s

    def start(self) -> None:
        """Start every worker and spare: here, or through the hosts' agents once they joined."""
        workers, spares = self.backend.start_job()
        self.coord.start(list(workers), list(spares))

    def run(self) -> None:
        """Until the coordinator says the job finished."""
        coord, backend = self.coord, self.backend
        deadline = time.monotonic() + self.timeout_s
        last_collect = 0.0
        while not coord.finished:
            for spare in backend.refresh():  # a lost host came back: a spare host now
                coord.add_spare(spare)
            coord.tick()
            for name in self.wakeups.watched():  # exits the coordinator has handled
                proc = coord.procs.get(name)
                handled = proc.role == Role.GONE if proc is not None else not backend.children[name].alive()
                if handled:
                    self.wakeups.forget(name)
            now = time.monotonic()
            if self.usage.due(now):
                self._record_usage(now)
            if now - last_collect > COLLECT_EVERY_S:
                self.collect(coord.announced_chunks(), coord.relay_chunks())
                last_collect = now
            for callback in self.on_tick:
                callback(coord)
            if now > deadline:
                raise JobFailed(f"job did not finish within {self.timeout_s:.0f}s")
            self.wakeups.wait(min(coord.next_tick_s(), 0.2) if self.wakeups.complete else 0.01)

    def _record_usage(self, now: float) -> None:
        """One ``host_usage`` event per host: its CPU, memory and accelerators (its agent's last
        sample, or this host's own), and each of its ranks' CPU share."""
        coord = self.coord
        hosts: dict[str, dict[str, Any]] = {}
        ranks = {name: rank for rank, name in coord.members.items()}
        children = self.backend.children
        for host, (usage, procs) in self.backend.usage(self.usage.local).items():
            hosts[host] = usage  # each host's ranks from its own list: no scan of every process
            for name in procs:  # every process marked, so that a spare given a rank has a share at once
                self._rank_share(usage, now, ranks.get(name), name, children.get(name))
        for host, usage in hosts.items():
            self.record(event(Event.HOST_USAGE, proc="launcher", gen=coord.plan.gen if coord.plan else 0,
                              host=host, **usage))  # fmt: skip

    def _rank_share(
        self, usage: dict[str, Any], now: float, rank: int | None, name: str, handle: Any
    ) -> None:
        share = self.usage.rank_cpu(now, name, handle.cpu_seconds() if handle is not None else None)
        if share is not None and rank is not None:
            usage.setdefault("ranks", {})[str(rank)] = share
