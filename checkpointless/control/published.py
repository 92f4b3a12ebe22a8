"""What the coordinator keeps on the control store against strangers.

``Published``: the sealed values someone still waits for (the current plan, the latest generation,
an abort, a spare's assignment), re-published when a stranger overwrites them (a worker would wait
for a plan, a spare for its assignment, a finished rank for an abort, forever) and forgotten once no
one waits for them.

``IntruderWatch``: writes to the protocol's plain key names. The job's own keys live under its
namespace (``auth.job_namespace``), so a value there comes from a process without the job's secret:
each is recorded as a ``message_rejected`` event and deleted. This check looks at existence on
purpose: nothing is decided from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from checkpointless.control.auth import SignedStore
from checkpointless.control.plan import Plan
from checkpointless.control.processes import ProcessTable
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event, Role

log = logging.getLogger(__name__)

INTRUDER_KEYS = 256
"""Plain key names an intruder check probes at most (a store round trip each); the next check goes on."""


class Published:
    """The sealed values the coordinator keeps written (see the module docstring)."""

    def __init__(self, store: SignedStore, table: ProcessTable) -> None:
        self._store, self._table = store, table
        self._values: dict[str, str] = {}

    def publish(self, key: str, value: str) -> None:
        """Seal and write ``key``, and keep re-publishing it while someone may still wait for it."""
        self._store.set(key, value)
        self._values[key] = value

    def check(self) -> None:
        """Write again what a stranger overwrote."""
        for key, value in list(self._values.items()):
            if self._store.get(key) != value:
                self._store.set(key, value)

    def prune(self, plan: Plan) -> None:
        """Forget values no one waits for any more (an older plan, an abort of an older generation,
        an assignment its spare has acted on)."""
        current = {keys.plan(plan.gen), keys.LATEST_GEN, keys.abort(plan.gen)}
        for key in list(self._values):
            if key in current:
                continue
            if key.startswith("assign/"):
                p = self._table.get(key.split("/", 1)[1])
                if p is not None and p.live and p.hb.get("gen", -1) < int(self._values[key]):
                    continue
            del self._values[key]


class IntruderWatch:
    """Records and clears strangers' writes to the plain key names (see the module docstring)."""

    def __init__(self, store: SignedStore, table: ProcessTable, emit: Callable[..., None]) -> None:
        self._store, self._table, self._emit = store, table, emit
        self._cursor = 0  # where the next check starts in its list of names
        self._seen: set[str] = set()  # plain key names a stranger wrote (logged once each)

    def check(self, plan: Plan) -> None:
        if not self._store.namespace:
            return
        # What someone may still read: bounded by the live processes and the generations around
        # the current one, not by every process and generation the job has seen (a long job's
        # check would otherwise grow with its failures, one store round trip per key)
        gen = plan.gen
        names = [keys.LATEST_GEN, keys.JOB_STOP, keys.FATAL_COUNT, keys.abort(gen), keys.fail_count(gen)]
        names += [keys.plan(g) for g in range(max(0, gen - 1), gen + 2)]  # checks are seconds apart
        names += [keys.done(r) for r in plan.members] + [keys.fail(gen, r) for r in plan.members]
        hosts: set[str] = set()
        for proc, p in self._table.procs.items():
            if p.role == Role.GONE:
                continue
            names += [keys.assign(proc), keys.fatal(proc)]
            if p.handle.relayed:
                hosts.add(p.handle.host)
            else:
                names += [keys.heartbeat(proc), keys.events(proc, 0)]
        names += [keys.node_relay(h) for h in sorted(hosts)]
        # a round trip per key: at most INTRUDER_KEYS a check, the rest in the next ones, in turn
        start = self._cursor % len(names)
        window = (names + names)[start : start + min(len(names), INTRUDER_KEYS)]
        self._cursor = start + len(window)
        for key in window:
            if self._store.raw.check([key]):
                # every write is an event (the launcher counts them and keeps the first of each key);
                # the log says it once per key, not every few seconds for as long as a stranger writes
                self._emit(Event.MESSAGE_REJECTED, key=key, why="written outside the job's secret namespace")
                if key not in self._seen:
                    self._seen.add(key)
                    log.warning("a process without this job's secret wrote %r; ignored (and from now "
                                "on counted, not logged)", key)  # fmt: skip
                self._store.raw.delete_key(key)
