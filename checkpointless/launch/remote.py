"""The coordinator's side of a job on several hosts: one host agent per host (``host_agent.py``), reached
through the control store only.

The coordinator never touches a process on another host. It sees each one through a
``RemoteProcess`` (the ``ProcessHandle`` of ``control/processes.py``, in ``remote_host.py``), whose
state is what the process's agent last reported; a kill is an order to that agent, confirmed when
the agent reports the exit. Per tick the coordinator reads one status key per host (one round trip
for all hosts), never one per process. The agents join through ``host_admission.py``; the hosts'
timings and ``ClusterSpec`` are ``cluster_spec.py``.

The protocol (every value sealed with the job's secret, ``protocol/keys.py``):

1. The launcher publishes ``job/config`` and a hello under a plain key name (``keys.CLUSTER_HELLO``),
   sealed: an agent with another secret finds it and stops at once ("wrong secret").
2. Each agent takes a ticket (``agents/count``) and writes its hello (``agents/<i>``: host name,
   address, processes per node, spare or not). The coordinator accepts as many worker and spare
   hosts as the job has (``node/<host>/accept``: its node index) and refuses the rest in one line
   (a second agent on one host, one too many).
3. Orders go to ``node/<host>/order/<i>`` in sequence (spawn a process, kill one, stop all); the
   agent carries them out and reports in ``node/<host>/status``: a sequence number, its processes
   (alive, exit code, log tail, CPU seconds). A process exit is reported at once and rings the
   coordinator's report bell.
4. A host whose status has not moved for ``host_timeout`` is lost: every process on it is dead to
   the coordinator (its ranks are replaced by a spare host's). Its agent gave up before that (its
   lease is half as long), and stopped its processes: a partitioned host stops training first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpointless.config import JobConfig
from checkpointless.control.auth import SignedStore
from checkpointless.control.processes import ProcessTable
from checkpointless.launch.cluster_spec import ClusterSpec, answer_window, host_timeout, status_interval
from checkpointless.launch.drains import DrainRequests
from checkpointless.launch.host_admission import HostAdmission
from checkpointless.launch.remote_host import Host, RemoteProcess
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event, Role

log = logging.getLogger(__name__)


class RemoteNodes:
    """The job's hosts, each with its agent: registration, orders, statuses, lost hosts."""

    def __init__(
        self,
        store: SignedStore,
        job: JobConfig,
        *,
        nodes: int,
        nproc_per_node: int,
        spare_nodes: int,
        job_id: str,
        emit: Callable[..., None],
        clock: Callable[[], float] = time.monotonic,
        spares_per_node: int = 0,
        table: ProcessTable | None = None,
        spec: ClusterSpec | None = None,
        addr: str = "",
        drains: DrainRequests | None = None,
    ) -> None:
        """``drains``: where ``checkpointless drain`` asks for a host's drain (taken each ``poll``).
        ``table``: the coordinator's process table, read for when a process was last heard
        (a host whose agent is slow but whose processes still beat is not lost) and whether it
        holds a rank (where spares go). ``spec``: how the hosts' agents start and where their
        logs go; ``addr``: the coordinator's store, as the agents dial it (``start_job``)."""
        if nodes * nproc_per_node != job.workers or (
            spare_nodes * nproc_per_node + nodes * spares_per_node != job.spares
        ):
            raise ValueError(
                f"{nodes} node(s) x {nproc_per_node} process(es), {spare_nodes} spare node(s) and "
                f"{spares_per_node} spare(s) per node do not make {job.workers} worker(s) and {job.spares} spare(s)"
            )
        self.local_spares = spares_per_node
        self.store, self.job, self.job_id = store, job, job_id
        self.nodes, self.nproc, self.spare_nodes = nodes, nproc_per_node, spare_nodes
        self._emit, self._clock = emit, clock
        self._table = table if table is not None else ProcessTable()
        self._spec, self._addr = spec, addr
        self.hosts: dict[str, Host] = {}
        self._admission = HostAdmission(store, job, job_id, nodes=nodes, nproc=nproc_per_node,
                                        spare_nodes=spare_nodes, hosts=self.hosts, clock=clock)  # fmt: skip
        self.children: dict[str, RemoteProcess] = {}
        self._next_spare = 0
        self.spares: list[str] = []
        self._timeout = host_timeout(job)
        self._answer_s = answer_window(job)
        self.beat_s = status_interval(job)
        self._drains = drains

    # -- registration (``host_admission.py``) ------------------------------------------------
    def publish_job(self) -> None:
        """What an agent reads first: the job's configuration and id."""
        self._admission.publish_job()

    def publish_hello(self, plain: SignedStore) -> None:
        """The hello an agent reads first, sealed (``HostAdmission.publish_hello``)."""
        self._admission.publish_hello(plain)

    def accept(self, timeout_s: float, alive: Callable[[], None] | None = None) -> None:
        """Wait until every worker and spare host has an agent (``HostAdmission.accept``)."""
        self._admission.accept(timeout_s, alive)

    # -- processes --------------------------------------------------------------------
    def start(self) -> tuple[list[RemoteProcess], list[RemoteProcess]]:
        """Start every worker (host n: ranks n*P .. n*P+P-1) and every spare of the spare hosts."""
        by_node = sorted(self.hosts.values(), key=lambda h: h.node)
        workers = [self.spawn(f"w{h.node * self.nproc + k}", Role.WORKER, h)
                   for h in by_node if not h.spare for k in range(self.nproc)]  # fmt: skip
        spares = [self.spawn_spare_on(h) for h in by_node if h.spare for _ in range(self.nproc)]
        spares += [self.spawn_spare_on(h) for h in by_node if not h.spare for _ in range(self.local_spares)]
        return workers, spares

    def spawn(self, name: str, role: str, host: Host) -> RemoteProcess:
        self.order(host, {"op": "spawn", "name": name, "role": str(role), "node": host.node})
        proc = RemoteProcess(name, host, self)
        self.children[name] = proc
        return proc

    def spawn_spare_on(self, host: Host) -> RemoteProcess:
        name = f"s{self._next_spare}"
        self._next_spare += 1
        self.spares.append(name)
        return self.spawn(name, Role.SPARE, host)

    def spawn_spare(self) -> RemoteProcess | None:
        """A new spare on a spare host (a live host that runs no rank) with a free slot, the
        fullest first (a spare host is taken whole when a host is lost); else nowhere (None: as
        after a spare host took a lost host's ranks). A worker host keeps no spares: its lost
        process is replaced by a spare host's."""

        def procs(h: Host) -> list[RemoteProcess]:
            return [p for p in self.children.values() if p.on_host is h and p.alive()]

        if self.local_spares:  # a worker host short of its own spares first (it used one, or is new)
            short = [
                h for h in self.hosts.values()
                if not h.lost and not h.status.get("draining") and any(self._table.is_worker(p.name) for p in procs(h))
                and sum(not self._table.is_worker(p.name) for p in procs(h)) < self.local_spares
            ]  # fmt: skip
            if short:
                return self.spawn_spare_on(min(short, key=lambda h: h.node))

        spare_hosts = [
            h for h in self.hosts.values()
            if not h.lost and not h.status.get("draining")
            and not any(self._table.is_worker(p.name) for p in procs(h)) and len(procs(h)) < h.nproc
        ]  # fmt: skip
        spare_hosts.sort(key=lambda h: (h.nproc - len(procs(h)), h.node))
        return self.spawn_spare_on(spare_hosts[0]) if spare_hosts else None

    def order(self, host: Host, order: dict[str, Any]) -> None:
        self.store.set(keys.node_order(host.name, host.orders), json.dumps(order))
        host.ordered(order["op"], self._clock)

    def drain_refusal(self, node: int) -> str | None:
        """Why host ``node`` cannot be drained now (one line), or None. Reads only: any thread."""
        try:
            hosts = list(self.hosts.values())
        except RuntimeError:  # a host joining in the launcher's thread right now
            return "the job's hosts are joining: try again in a moment"
        host = next((h for h in hosts if h.node == node), None)
        if host is None:
            known = sorted(h.node for h in hosts)
            return f"no node {node} in this job (its nodes: {', '.join(map(str, known)) or 'none yet'})"
        if host.lost:
            return f"node {node} ({host.name}) has left the job: {host.lost}"
        if host.status.get("draining"):
            return f"node {node} ({host.name}) is being drained already"
        return None

    def _drain_asked(self) -> None:
        """Order each host asked for by ``checkpointless drain`` to drain (its agent does what its
        SIGTERM would: ``host_agent.py``)."""
        for node in self._drains.take() if self._drains is not None else ():
            host = next((h for h in self.hosts.values() if h.node == node), None)
            if host is None or host.lost:
                continue  # gone since the request was taken
            log.warning("host %s (node %d): drain asked", host.name, node)
            self.order(host, {"op": "drain"})
            self._emit(Event.DRAIN_ASKED, host=host.name, node=node)

    def probe(self, names: list[str]) -> None:
        """Ask the agents of these processes' hosts for a sign of life (the coordinator waits for
        these processes to report a failure): a host that does not answer within the answer
        window is lost, long before its silence reaches the host timeout. Once per window."""
        now = self._clock()
        for host in {
            self.children[n].on_host.name: self.children[n].on_host for n in names if n in self.children
        }.values():
            if not host.lost and host.asked is None and now - host.last_ping > self._answer_s:
                host.pinged(now)
                self.order(host, {"op": "ping"})

    # -- statuses -----------------------------------------------------------------------
    def age(self, host: Host) -> float:
        """Seconds since ``host``'s status last moved (the coordinator's clock)."""
        return self._clock() - host.heard

    def poll(self) -> list[Host]:
        """Read every host's status in one round trip; declare silent hosts lost. The lost hosts
        that came back (their processes gone): each serves as a spare host now, for the caller
        to fill (``spawn_spare_on``)."""
        self._drain_asked()
        now = self._clock()
        live = [h for h in self.hosts.values() if not h.lost]
        back = [h for h in self.hosts.values() if h.lost and h.reset is not None]  # may come back
        rejoined: list[Host] = []
        if not live and not back:
            return rejoined
        names = [keys.node_status(h.name) for h in live + back]
        present = [
            h for h, k in zip(live + back, names, strict=True)
            if h.raw or self.store.raw.check([self.store.name(k)])
        ]  # fmt: skip
        raws = self.store.get_sealed_present([keys.node_status(h.name) for h in present])
        for h, raw in zip(present, raws, strict=True):
            if raw == h.raw:
                continue
            text = self.store.open(keys.node_status(h.name), raw)
            if text is None:
                continue
            status = json.loads(text)
            if int(status.get("seq", -1)) <= h.seq:
                continue  # a replay of an older status must not hide a lost host
            draining = status.get("draining") and not h.status.get("draining")
            h.hear(raw, status, now)
            if h.lost and status.get("reset") == h.reset:
                self._rejoin(h, now)
                rejoined.append(h)
            elif status.get("drained") and not h.lost:
                self._drained(h)
            elif draining and not h.lost:
                self._release_spares(h)
        quiet = {h.name for h in live if now - h.heard > self._timeout}  # agents silent too long
        heard: dict[str, float] = {}  # the latest heartbeat of any process of each of those hosts
        for n, p in self.children.items() if quiet else ():
            if p.host in quiet:
                heard[p.host] = max(heard.get(p.host, float("-inf")), self._table.heard_from(n))
        for h in live:
            silent = now - max(h.heard, heard.get(h.name, float("-inf")))
            if h.asked is not None and now - h.asked > self._answer_s:
                self._lose(h, f"its agent did not answer an order for {now - h.asked:.1f}s (answer window "
                              f"{self._answer_s:g}s)", now - h.heard)  # fmt: skip
            elif silent > self._timeout:
                self._lose(
                    h, f"its agent was silent for {silent:.1f}s (host timeout {self._timeout:g}s)", silent
                )
        return rejoined

    def _release_spares(self, h: Host) -> None:
        """A host being drained: its spares (no rank, none given from now on: ``leaving``) are told
        to leave now, as at the job's end; each exits with status 0, which is no fault. A spare
        waiting on the store would see its own SIGTERM only when its wait ends."""
        for name, p in self.children.items():
            if p.on_host is h and not self._table.is_worker(name):
                with contextlib.suppress(RuntimeError, OSError):
                    self.store.set(keys.assign(name), keys.STOP)

    def _drained(self, h: Host) -> None:
        """A host drained on a notice (its agent's SIGTERM) has no process left and its agent exits:
        it is gone from the job, not lost (no fault)."""
        h.leave("drained on a notice", self._clock())
        log.warning("host %s drained: its ranks were handed over, its agent exits", h.name)
        self._emit(Event.HOST_DRAINED, host=h.name, node=h.node)

    def _lose(self, h: Host, why: str, silent: float) -> None:
        h.leave(why, self._clock())
        log.warning("host %s lost: %s", h.name, why)
        procs = sorted(n for n, p in self.children.items() if p.on_host is h and not p.lost)
        for n in procs:
            self.children[n].lose(why)
        self._emit(Event.HOST_LOST, host=h.name, node=h.node, silent_s=round(silent, 3), why=why, procs=procs)
        # an agent cut off for less than its lease reads this once it is back: it kills what is
        # left of its processes (they gave up their ranks by their own lease) and says so; the
        # host then rejoins as a spare host (``_rejoin``). One that fenced itself is gone for good.
        with contextlib.suppress(RuntimeError, OSError):
            self.order(h, {"op": "reset", "index": h.reset_order()})

    def _rejoin(self, h: Host, now: float) -> None:
        """A lost host's agent answered its reset: none of its old processes lives (their ranks
        went to others, nothing of theirs is accepted: they are no longer members), so the host
        takes spares as a spare host does."""
        away = now - h.lost_at
        log.warning(
            "host %s is back after %.1fs, its processes gone: it serves as a spare host", h.name, away
        )
        h.rejoin(now)
        self._emit(Event.HOST_REJOINED, host=h.name, node=h.node, away_s=round(away, 3))

    # -- the process backend (``control.processes.ProcessBackend``) on several hosts -----------
    def start_job(self) -> tuple[list[RemoteProcess], list[RemoteProcess]]:
        """Publish the hello and the job, start the agents (``cluster``), accept them, then start
        every worker and spare through them."""
        self.publish_hello(SignedStore(self.store.raw, self.store.secret))
        self.publish_job()
        spec = self._spec
        if spec is not None and spec.start_agents is not None:
            spec.start_agents(self._addr)
        self.accept(spec.join_timeout_s if spec is not None else 120.0)
        for h in sorted(self.hosts.values(), key=lambda h: h.node):
            self._emit(Event.HOST_JOINED, host=h.name, node=h.node, addr=h.addr, spare=h.spare, pid=h.pid)
        return self.start()

    def refresh(self) -> list[RemoteProcess]:
        """The hosts' statuses (``poll``); a lost host that came back serves as a spare host:
        spares on each of its slots."""
        return [self.spawn_spare_on(h) for h in self.poll() for _ in range(h.nproc)]

    def wait_exit(self, handle: Any, timeout_s: float) -> None:
        """An exit comes with its host's status: look again after a short while."""
        time.sleep(min(timeout_s, 0.1))
        self.poll()

    def usage(self, local: Callable[[], dict[str, Any]]) -> dict[str, tuple[dict[str, Any], list[str]]]:
        """Each live host's last sample (its agent's status) and its processes."""
        out: dict[str, tuple[dict[str, Any], list[str]]] = {}
        for h in self.hosts.values():
            if h.lost or not isinstance(h.status.get("usage"), dict):
                continue
            procs = h.status.get("procs")
            out[h.name] = (dict(h.status["usage"]), list(procs) if isinstance(procs, dict) else [])
        return out

    def log_paths(self) -> dict[str, Path]:
        spec = self._spec
        if spec is None or spec.log_dir_of is None:
            return {}
        return {n: spec.log_dir_of(p.host) / f"{n}.log" for n, p in self.children.items()}

    def close(self) -> None:
        """Each host's agent frees its own node cache."""

    def stop(self, timeout_s: float = 8.0) -> None:
        """Order every live agent to stop its processes (politely, then by force) and wait until
        each reports none alive, or ``timeout_s``."""
        live = [h for h in self.hosts.values() if not h.lost]
        for h in live:
            try:
                self.order(h, {"op": "stop"})
            except (RuntimeError, OSError) as e:
                log.warning("could not tell the agent of %s to stop (%s)", h.name, e)
                return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.poll()
            except (RuntimeError, OSError):
                return
            if all(h.lost or h.status.get("stopped") for h in live):
                return
            time.sleep(0.05)
        left = [h.name for h in live if not (h.lost or h.status.get("stopped"))]
        if left:
            log.warning("the agents of %s did not confirm their processes stopped", ", ".join(left))
