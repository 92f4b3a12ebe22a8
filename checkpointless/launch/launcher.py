"""The launcher: the control plane of one job, and its host's node agent.

The control store (a ``TCPStore``), the ``Coordinator`` and the event sink live in the launcher
process, outside every worker, so any worker may die. The job's processes are started, watched
and stopped by a ``LocalSupervisor`` (``supervisor.py``); on one host it lives in this process and the
coordinator reaches the processes through it only (``ProcessHandle``). The spare pool refills:
the coordinator asks for a new spare each time one is consumed or lost. The launcher holds its
parts: the job's run folder and report (``run_folder.py``), the coordinator's tick loop
(``tick_loop.py``) and the job's stop, on a signal or at the end (``job_stop.py``).

What the launcher guarantees around a job:

- the store listens on the launcher's address only (127.0.0.1 by default), and
  every control message is sealed with a per-job secret that each child reads
  from a private pipe (``control/auth.py``): a stranger or a process of another
  job cannot steer this one;
- children die with the launcher at any moment (``supervisor.py``), and a terminal's
  Ctrl-C reaches the launcher alone, which stops them;
- events reach ``<out>/events.jsonl`` while the job runs (appended and flushed
  every tick), so a crash of the launcher keeps what happened up to it; at the
  end the file is rewritten in time order and ``report.json`` is written, both
  atomically (temporary file, then rename). Memory holds a bounded share of a
  long job's events (``observe/event_log.py``); the file then stays in arrival order
  (``run_folder.py``);
- SIGINT and SIGTERM stop the job: ``job/stop`` is set at once (the ranks stop at
  their next step boundary), children are ended after a grace period, a partial
  report with the reason is written, and ``JobResult.interrupted`` holds the signal
  number; a job whose ranks finished their last step meanwhile is reported finished,
  with its final digest (``job_stop.py``);
- a previous run's files in ``out`` are moved aside first and the last complete run is
  never lost (``outputs.py``).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any

from torch.distributed import TCPStore

from checkpointless.config import JobConfig
from checkpointless.control.auth import SignedStore, control_token, job_namespace, new_secret
from checkpointless.control.bell import ReportBell
from checkpointless.control.coordinator import Coordinator
from checkpointless.control.processes import ProcessBackend, ProcessTable
from checkpointless.control.size_requests import SizeRequests
from checkpointless.errors import LaunchError
from checkpointless.launch.cluster_spec import ClusterSpec
from checkpointless.launch.control_http import ControlServer
from checkpointless.launch.drains import DrainRequests
from checkpointless.launch.events import EventCollector, Rejections
from checkpointless.launch.job_stop import JobStop
from checkpointless.launch.remote import RemoteNodes
from checkpointless.launch.run_folder import RunFolder, job_report
from checkpointless.launch.runtime import steady_gc
from checkpointless.launch.store import open_store
from checkpointless.launch.supervisor import LocalSupervisor
from checkpointless.launch.tick_loop import TickLoop
from checkpointless.launch.wakeups import Wakeups
from checkpointless.observe.event_log import EventLog
from checkpointless.observe.usage import UsageRecorder
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event, event

log = logging.getLogger(__name__)


@dataclass
class JobResult:
    ok: bool
    digest: str | None
    report: dict[str, Any]
    events: list[dict[str, Any]]
    error: str | None = None
    out_dir: Path | None = None
    logs: dict[str, Path] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    interrupted: int | None = None  # the signal that stopped the job
    write_error: str | None = None  # report.json / events.jsonl could not be written


USAGE_HOSTS_PER_S = 100.0
"""``host_usage`` samples a second at most, across the job's hosts (each host's every 2 s below 200)."""


class Launcher:
    """Runs one job: ``command`` is started once per worker and once per spare.

    Every process gets ``CHECKPOINTLESS_*`` environment variables naming the
    store, its process name, its role, the job config and its slot on the host
    (``CHECKPOINTLESS_LOCAL_INDEX`` and ``LOCAL_RANK``: which GPU it trains on, see
    ``checkpointless.devices``), plus a private pipe holding the job's secret; the
    command's ``Session`` does the rest.
    """

    def __init__(
        self,
        job: JobConfig,
        command: list[str],
        *,
        total_steps: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        out_dir: Path | None = None,
        env: dict[str, str] | None = None,
        on_tick: Callable[[Coordinator], None] | list[Callable[[Coordinator], None]] | None = None,
        event_log: EventLog | None = None,
        timeout_s: float = 3600.0,
        cluster: ClusterSpec | None = None,
        secret: bytes | None = None,
        control_port: int | None = None,
    ) -> None:
        """``cluster``: the job runs on several hosts, one ``checkpointless agent`` each
        (``remote.py``); None: every process on this host. ``secret``: the job's (the agents read it
        from a file); None: a new one. ``control_port``: where the coordinator serves ``POST /scale``
        on every interface (``control_http.py``); None: a free port on loopback, named in
        ``<out>/control.json`` (no ``out``: none). ``event_log``: where the job's events are
        recorded (a caller that reads them as they come, the live console, gives its own); None: a
        new one."""
        self.job, self.command, self.total_steps = job, command, total_steps
        self.host, self.port = host, port
        self.folder = RunFolder(out_dir)  # <out>/ and the processes' logs
        self.env = env or {}
        self.on_tick = on_tick if isinstance(on_tick, list) else [on_tick] if on_tick else []
        self.job_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self.cluster = cluster
        # the job's processes (made in run()): a LocalSupervisor on one host, the hosts' agents
        # (RemoteNodes, kept as ``remote`` too: their relayed events are collected by host) on several
        self.backend: ProcessBackend | None = None
        self.remote: RemoteNodes | None = None
        self._coord: Coordinator | None = None
        self._bell: ReportBell | None = None
        self._wakeups = Wakeups()
        # a host's usage every 2 s, at most 100 hosts' a second: at 2,000 hosts one sample of
        # each every 20 s (a Prometheus scrape's usual interval), not 1,000 events a second
        hosts = 0 if cluster is None else cluster.nodes + cluster.spare_nodes
        self._usage = UsageRecorder(every_s=max(2.0, hosts / USAGE_HOSTS_PER_S))
        self._log = event_log if event_log is not None else EventLog()
        self._rejections = Rejections()  # values that failed their seal: the first of each key is an event
        self._collector = EventCollector(self._log, self._rejections)
        self._secret = secret or new_secret()
        self._sizes = SizeRequests(job.min_size, job.max_size, job.workers, shards=job.shards)
        self._drains = DrainRequests(self._drain_refusal)
        self._control_port = control_port
        self._http: ControlServer | None = None

    # -- processes ------------------------------------------------------------------
    @property
    def children(self) -> Mapping[str, Any]:
        """Every process started so far, by name: a ``ProcessHandle`` each (``Child`` here, a
        ``RemoteProcess`` on another host). A read-only view, not a copy (16,000 entries at 2,000
        hosts): not to be iterated across a call that starts a process."""
        return MappingProxyType(self.backend.children) if self.backend is not None else {}

    # -- events ---------------------------------------------------------------------
    def _record(self, ev: dict[str, Any]) -> None:
        if ev.get("kind") == Event.MESSAGE_REJECTED and not self._rejections.first(str(ev.get("key"))):
            return
        self._log.record(ev)

    def _reject(self, key: str) -> None:
        if key not in self._rejections.keys:
            log.warning("ignored a value on %r that is not sealed with this job's secret (later ones are "
                        "counted, not logged)", key)  # fmt: skip
        self._record(event(Event.MESSAGE_REJECTED, proc="coordinator", key=key))

    def _collect_events(
        self, announced: dict[str, int] | None = None, relayed: dict[str, int] | None = None
    ) -> None:
        """Move the processes' new event chunks from the store into the log (``EventCollector``)."""
        hosts = list(self.remote.hosts) if self.remote is not None else None
        self._collector.collect(self.store, self.children, hosts, self._coord, announced, relayed)

    @property
    def events(self) -> list[dict[str, Any]]:
        """The events collected so far (launcher, coordinator and processes), in arrival order:
        every one, or, in a long job of many ranks, those ``observe/event_log.py`` keeps."""
        return self._log.events

    def listen(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener`` with every event as it is recorded (the live console, the metrics)."""
        self._log.listeners.append(listener)

    # -- the job ----------------------------------------------------------------------
    def run(self) -> JobResult:
        self._http = self._control_server()  # first: a taken --control-port leaves nothing behind
        try:
            raw = open_store(self.host, self.port)
        except BaseException:
            self._close_control()
            raise
        self.store = SignedStore(raw, self._secret, self._reject, namespace=job_namespace(self._secret))
        self.folder.make_logdir()
        self._wakeups.open()  # a ring wakes the launcher before any local process exists
        store_addr = f"{self.host}:{self.store.raw.port}"
        table = ProcessTable()  # the coordinator's, which the hosts' side reads (several hosts)
        token = control_token(self._secret)
        if self._http is not None:
            self._http.start()
        self.folder.open(
            self._log, store_addr, token, self.job_id, self._http.address if self._http else None
        )
        backend = self.backend = self._backend(table, store_addr)  # after open: it may write logs
        self._record(
            event(Event.JOB_STARTED, proc="launcher", gen=0, job_id=self.job_id, workers=self.job.workers,
                  shards=self.job.shards, spares=self.job.spares, steps=self.total_steps, faults=[str(f) for f in self.job.faults])
        )  # fmt: skip
        try:
            self._bell = ReportBell(
                lambda: TCPStore(self.host, self.store.raw.port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=30)),
                self.store.name(keys.REPORT_BELL),
                on_ring=self._wakeups.ring,
            )  # fmt: skip
        except RuntimeError as e:  # the coordinator then reads failure reports every tick
            log.warning("no report bell (%s); failure reports are polled", e)
        coord = Coordinator(
            self.store, self.job, self.total_steps, backend.spawn_spare, self._record,
            report_bell=self._bell.rung if self._bell is not None else None, table=table, probe=backend.probe,
            sizes=self._sizes,
        )  # fmt: skip
        self._coord = coord
        stop = JobStop(
            self.store, backend, coord, bell=self._bell, wakeups=self._wakeups, collect=self._collect_events,
            total_steps=self.total_steps,
        )  # fmt: skip
        loop = TickLoop(
            coord, backend, wakeups=self._wakeups, usage=self._usage, record=self._record,
            collect=self._collect_events, on_tick=self.on_tick, timeout_s=self.timeout_s,
        )  # fmt: skip
        error, interrupted = stop.drive(lambda: self._run(loop, stop), self._close_control)
        if error is not None:
            self._record(event(Event.JOB_FINISHED, proc="launcher", gen=0, ok=False, error=error))
        self._log.finish()
        self._log.retimed(coord.clocks.to_coordinator)
        events = sorted(self._log.events, key=lambda e: e["t"])
        self.total_steps = coord.total_steps  # the scripts' own, where --steps was not given
        report = job_report(
            events, coord=coord, event_log=self._log, error=error, job_id=self.job_id, faults=self.job.faults,
            after_finish=stop.after_finish, rejections=self._rejections,
        )  # fmt: skip
        write_error = self.folder.write(self._log, events, report)
        self.folder.finish(error)
        self.store.close()  # the server's thread and sockets end now, not at some later collection
        return JobResult(
            ok=error is None, digest=coord.digest, report=report, events=events, error=error,
            out_dir=self.folder.out_dir, logs=self._log_paths(), pids=self._pids(), interrupted=interrupted,
            write_error=write_error,
        )  # fmt: skip

    def _control_server(self) -> ControlServer | None:
        """The control endpoint (``POST /scale``, ``POST /drain``), bound: on every interface at
        ``--control-port``, else on a free loopback port where the run folder's ``control.json`` can
        name it."""
        if self._control_port is None and self.folder.out_dir is None:
            return None
        host = "0.0.0.0" if self._control_port is not None else "127.0.0.1"
        try:
            return ControlServer(
                self._sizes, control_token(self._secret), host, self._control_port or 0, drains=self._drains
            )
        except OSError as e:
            raise LaunchError(f"--control-port {self._control_port}: {e.strerror or e}") from e

    def _drain_refusal(self, node: int) -> str | None:
        """Why host ``node`` cannot be drained now (``DrainRequests``; the control server's thread)."""
        if self.cluster is None:
            return (
                "the job runs on one host: drain is for a job on several hosts (to hand one worker's rank "
                "over, send that worker SIGTERM)"
            )
        remote = self.remote
        if remote is None:
            return "the job's hosts have not joined yet: try again in a moment"
        return remote.drain_refusal(node)

    def _close_control(self) -> None:
        """The job is over: nobody can steer it any more."""
        self._drains.finish()
        self.folder.remove_control_file()
        if self._http is not None:
            self._http.close()

    def _backend(self, table: ProcessTable, store_addr: str) -> ProcessBackend:
        """The job's processes: a ``LocalSupervisor`` on this host, or the hosts' agents (``cluster``)."""
        if self.cluster is None:
            return LocalSupervisor(
                self.job, self.command, job_id=self.job_id, secret=self._secret, store_addr=store_addr,
                logdir=self.folder.logdir, env=self.env, wakeups=self._wakeups,
            )  # fmt: skip
        c = self.cluster
        self.remote = RemoteNodes(
            self.store, self.job, nodes=c.nodes, nproc_per_node=c.nproc_per_node,
            spare_nodes=c.spare_nodes, spares_per_node=c.spares_per_node, job_id=self.job_id, table=table,
            emit=lambda kind, **f: self._record(event(
                kind, proc="coordinator", gen=self._coord.plan.gen if self._coord and self._coord.plan else 0, **f)),
            spec=c, addr=store_addr, drains=self._drains,
        )  # fmt: skip
        return self.remote

    def _run(self, loop: TickLoop, stop: JobStop) -> None:
        """The job, from its processes' start to their exits after the last step."""
        loop.start()
        with steady_gc():
            loop.run()
            stop.wait_workers(self.job.recovery.exit_timeout_s)

    def _log_paths(self) -> dict[str, Path]:
        return self.backend.log_paths() if self.backend is not None else {}

    def _pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.children.items() if p.pid}
