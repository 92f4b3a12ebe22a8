"""The host agents joining a job (``remote.py``'s protocol, steps 1 and 2): the hello and the job
published, the agents' hellos read, who may join and who is refused, the node indices."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from checkpointless.config import JobConfig
from checkpointless.control.auth import SignedStore
from checkpointless.errors import JobFailed
from checkpointless.launch.remote_host import Host
from checkpointless.protocol import keys

log = logging.getLogger(__name__)

_ARRIVAL = 10**6
"""A hello without a node rank is placed by arrival: after every host that asked for one."""
HELLO_CHECK_S = 0.5  # how often the hello is looked at while agents join (``HostAdmission.accept``)


class HostAdmission:
    """The agents' registration, held by ``RemoteNodes``: it fills ``hosts`` (the nodes' own map)."""

    def __init__(
        self,
        store: SignedStore,
        job: JobConfig,
        job_id: str,
        *,
        nodes: int,
        nproc: int,
        spare_nodes: int,
        hosts: dict[str, Host],
        clock: Callable[[], float],
    ) -> None:
        self.store, self.job, self.job_id = store, job, job_id
        self.nodes, self.nproc, self.spare_nodes = nodes, nproc, spare_nodes
        self.hosts, self._clock = hosts, clock
        self._tickets = 0  # agents' hellos read so far
        self._plain: SignedStore | None = None  # the store without the job's namespace (the hello)

    def publish_job(self) -> None:
        """What an agent reads first: the job's configuration and id."""
        self.store.set(keys.JOB_CONFIG, json.dumps({"job": self.job.to_json(), "job_id": self.job_id}))

    def publish_hello(self, plain: SignedStore) -> None:
        """The hello an agent reads first, under a plain key name (``keys.CLUSTER_HELLO``), sealed:
        ``plain`` is the job's secret on the store without the job's namespace. ``accept`` writes it
        again whenever it does not open (a stranger overwrote it: agents joining then would think
        the coordinator had another secret, and the agent waits ``HELLO_SETTLE_S`` for this)."""
        self._plain = plain
        plain.set(keys.CLUSTER_HELLO, "checkpointless")

    def _keep_hello(self) -> None:
        plain = self._plain
        if plain is None:
            return
        sealed = plain.get_sealed(keys.CLUSTER_HELLO)
        if sealed is None or plain.open(keys.CLUSTER_HELLO, sealed) is None:
            log.warning(
                "the cluster hello was overwritten by a writer without this job's secret: written again"
            )
            plain.set(keys.CLUSTER_HELLO, "checkpointless")

    def accept(self, timeout_s: float, alive: Callable[[], None] | None = None) -> None:
        """Wait until every worker and spare host has an agent; raise ``JobFailed`` after
        ``timeout_s`` naming what is missing. ``alive`` is called between polls (the launcher's
        own checks)."""
        want = self.nodes + self.spare_nodes
        deadline = time.monotonic() + timeout_s
        next_hello = 0.0
        while len(self.hosts) < want:
            if time.monotonic() >= next_hello:
                self._keep_hello()
                next_hello = time.monotonic() + HELLO_CHECK_S
            self._read_hellos()
            if len(self.hosts) >= want:
                break
            if time.monotonic() > deadline:
                have = ", ".join(sorted(self.hosts)) or "none"
                raise JobFailed(
                    f"only {len(self.hosts)} of {want} host agent(s) joined within {timeout_s:.0f}s "
                    f"(joined: {have}): is `checkpointless agent` running on every host, with this job's "
                    "coordinator address and secret?"
                )
            if alive is not None:
                alive()
            time.sleep(0.05)
        # node indices: the worker hosts in the order they asked for (--node-rank, else arrival),
        # then the spare hosts
        now = self._clock()
        workers = sorted((h for h in self.hosts.values() if not h.spare), key=lambda h: h.node)
        spares = sorted((h for h in self.hosts.values() if h.spare), key=lambda h: h.node)
        for i, h in enumerate(workers + spares):
            h.place(i, now)
            self.store.set(keys.node_accept(h.name, h.pid), json.dumps({"node": i}))

    def _read_hellos(self) -> None:
        count = self.store.add(keys.AGENTS_COUNT, 0)
        while self._tickets < count:
            i = self._tickets
            text = self.store.get(keys.agent_hello(i))
            if text is None:
                return  # not written yet (or forged: the real one overwrites it)
            self._tickets += 1
            try:
                d = json.loads(text)
                host = Host(
                    name=str(d["host"]), node=int(d.get("node_rank", _ARRIVAL + i)), addr=str(d["addr"]),
                    nproc=int(d["nproc"]), spare=bool(d["spare"]), pid=int(d["pid"]),
                )  # fmt: skip
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignored a malformed agent hello (%s)", e)
                continue
            error = self._refusal(host)
            if error:
                log.warning("refused the agent of %s: %s", host.name, error)
                self.store.set(keys.node_accept(host.name, host.pid), json.dumps({"error": error}))
                continue
            self.hosts[host.name] = host

    def _refusal(self, host: Host) -> str:
        """Why an agent cannot join ("" if it can)."""
        if host.name in self.hosts:
            other = self.hosts[host.name]
            return f"host {host.name} already has an agent in this job (pid {other.pid} at {other.addr})"
        if host.nproc != self.nproc:
            return f"the job runs {self.nproc} process(es) per node, the agent of {host.name} offers {host.nproc}"
        if host.node < _ARRIVAL and not host.spare:  # it asked for a node rank (``agent --node-rank``)
            if host.node >= self.nodes:
                return f"node rank {host.node} is not one of this job's {self.nodes} node(s) (0 to {self.nodes - 1})"
            taken = next((h for h in self.hosts.values() if h.node == host.node), None)
            if taken is not None:
                return (f"node rank {host.node} is taken by the agent of {taken.name} (pid {taken.pid} at "
                        f"{taken.addr}): give each host its own --node-rank")  # fmt: skip
        workers = sum(not h.spare for h in self.hosts.values())
        spares = len(self.hosts) - workers
        if host.spare and spares >= self.spare_nodes:
            return f"the job has its {self.spare_nodes} spare node(s) already"
        if not host.spare and workers >= self.nodes:
            if spares < self.spare_nodes:
                host.serve_as_spare()  # one worker host too many: it serves as a spare host
                return ""
            return f"the job has its {self.nodes} node(s) and {self.spare_nodes} spare node(s) already"
        return ""
