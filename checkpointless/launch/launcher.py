"""The launcher: the control plane of one job, and its host's node agent.

The control store (a ``TCPStore``), the ``Coordinator`` and the event sink live in the launcher
process, outside every worker, so any worker may die. The job's processes are started, watched
and stopped by a ``LocalSupervisor`` (``supervisor.py``); on one host it lives in this process and the
coordinator reaches the processes through it only (``ProcessHandle``). The spare pool refills:
the coordinator asks for a new spare each time one is consumed or lost.

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
  long job's events (``observe/event_log.py``); the file then stays in arrival order;
- SIGINT and SIGTERM stop the job: ``job/stop`` is set at once (the ranks stop at
  their next step boundary), children are ended after a grace period, a partial
  report with the reason is written, and ``JobResult.interrupted`` holds the signal
  number; a job whose ranks finished their last step meanwhile is reported finished,
  with its final digest;
- a previous run's files in ``out`` are moved aside first and the last complete run is
  never lost (``outputs.py``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import time
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
from checkpointless.control.coordinator import Coordinator, JobFailed
from checkpointless.control.processes import ProcessBackend, ProcessTable
from checkpointless.errors import JobInterrupted
from checkpointless.faults import unfired
from checkpointless.launch.events import EventCollector, Rejections
from checkpointless.launch.outputs import set_aside_previous_run, write_atomic, write_control_file
from checkpointless.launch.remote import ClusterSpec, RemoteNodes
from checkpointless.launch.runtime import steady_gc, stop_signals
from checkpointless.launch.store import open_store
from checkpointless.launch.supervisor import LocalSupervisor, Wakeups
from checkpointless.observe.event_log import EventLog
from checkpointless.observe.report import build_report
from checkpointless.observe.usage import UsageRecorder
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event, Role, event

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
        timeout_s: float = 3600.0,
        cluster: ClusterSpec | None = None,
        secret: bytes | None = None,
    ) -> None:
        """``cluster``: the job runs on several hosts, one ``checkpointless agent`` each
        (``remote.py``); None: every process on this host. ``secret``: the job's (the agents read it
        from a file); None: a new one."""
        self.job, self.command, self.total_steps = job, command, total_steps
        self.host, self.port = host, port
        self.out_dir = out_dir
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
        self._usage = UsageRecorder()
        self._log = EventLog()
        self._after_finish: dict[str, str] = {}  # a rank's process that failed after the job's end
        self._control_file: Path | None = None  # <out>/control.json while the job runs
        self._rejections = Rejections()  # values that failed their seal: the first of each key is an event
        self._collector = EventCollector(self._log, self._rejections)
        self._secret = secret or new_secret()
        self._own_logdir = out_dir is None
        self._logdir = Path(out_dir / "logs") if out_dir else Path(tempfile.gettempdir())  # see run()

    # -- processes ------------------------------------------------------------------
    @property
    def children(self) -> Mapping[str, Any]:
        """Every process started so far, by name: a ``ProcessHandle`` each (``_Child`` here, a
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
        self.store = SignedStore(
            open_store(self.host, self.port),
            self._secret,
            self._reject,
            namespace=job_namespace(self._secret),
        )
        if self._own_logdir:  # made only once the job can start, so a refused launch leaves nothing
            self._logdir = Path(tempfile.mkdtemp(prefix="checkpointless-logs-"))
        self._wakeups.open()  # a ring wakes the launcher before any local process exists
        table = ProcessTable()  # the coordinator's, which the hosts' side reads (several hosts)
        store_addr = f"{self.host}:{self.store.raw.port}"
        backend: ProcessBackend
        if self.cluster is None:
            backend = LocalSupervisor(
                self.job, self.command, job_id=self.job_id, secret=self._secret, store_addr=store_addr,
                logdir=self._logdir, env=self.env, wakeups=self._wakeups,
            )  # fmt: skip
        else:
            c = self.cluster
            backend = self.remote = RemoteNodes(
                self.store, self.job, nodes=c.nodes, nproc_per_node=c.nproc_per_node,
                spare_nodes=c.spare_nodes, spares_per_node=c.spares_per_node, job_id=self.job_id, table=table,
                emit=lambda kind, **f: self._record(event(
                    kind, proc="coordinator", gen=self._coord.plan.gen if self._coord and self._coord.plan else 0, **f)),
                spec=c, addr=store_addr,
            )  # fmt: skip
            # a host's usage every 2 s, at most 100 hosts' a second: at 2,000 hosts one sample of
            # each every 20 s (a Prometheus scrape's usual interval), not 1,000 events a second
            self._usage.every_s = max(self._usage.every_s, (c.nodes + c.spare_nodes) / USAGE_HOSTS_PER_S)
        self.backend = backend
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            set_aside_previous_run(self.out_dir)
            self._log.open(self.out_dir / "events.jsonl")
            self._control_file = write_control_file(
                self.out_dir, f"{self.host}:{self.store.raw.port}", control_token(self._secret), self.job_id
            )
        self._record(
            event(Event.JOB_STARTED, proc="launcher", gen=0, job_id=self.job_id, workers=self.job.workers,
                  spares=self.job.spares, steps=self.total_steps, faults=[str(f) for f in self.job.faults])
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
        )  # fmt: skip
        self._coord = coord
        error: str | None = None
        interrupted: int | None = None
        try:
            with stop_signals():
                try:
                    self._run(coord)
                except JobFailed as e:
                    error = str(e)
                except JobInterrupted as e:
                    interrupted = e.signum
                    error = f"interrupted by {signal.Signals(e.signum).name}"
                except KeyboardInterrupt:
                    interrupted = signal.SIGINT
                    error = "interrupted by SIGINT"
                finally:
                    self._cleanup()
                    if self._control_file is not None:
                        self._control_file.unlink(missing_ok=True)
                if interrupted is not None and self._finished_anyway(coord, interrupted):
                    error = None  # the training finished; a signal that stopped the scripts' own
                    if not self._after_finish:  # work after it still ends the run as interrupted
                        interrupted = None
        except JobInterrupted as e:  # a second signal during cleanup
            interrupted = e.signum
            error = error or f"interrupted by {signal.Signals(e.signum).name}"
        if error is not None:
            self._record(event(Event.JOB_FINISHED, proc="launcher", gen=0, ok=False, error=error))
        self._log.finish()
        self._log.retimed(coord.clocks.to_coordinator)
        events = sorted(self._log.events, key=lambda e: e["t"])
        self.total_steps = coord.total_steps  # the scripts' own, where --steps was not given
        report = build_report(
            events, total_steps=self.total_steps, digest=coord.digest, stats=self._log.stats
        )
        report["error"] = error
        report["job_id"] = self.job_id
        report["unfired_faults"] = unfired(self.job.faults, events)  # the CLI fails a run that has any
        report["after_finish"] = self._after_finish  # and one whose script failed after training
        report["rejected_messages"] = self._rejections.report()
        report["hosts"] = self._log.usage.result()
        if self._log.thinned:
            report["events_not_in_memory"] = self._log.thinned  # in events.jsonl (arrival order) only
        if self._log.dropped:  # never reached the log: the figures lack them
            report["step_commits_dropped"] = self._log.dropped
        report["clock_offsets"] = coord.clocks.shown()
        write_error = self._write_outputs(events, report)
        if error is None and self._own_logdir:
            shutil.rmtree(self._logdir, ignore_errors=True)
        elif error is not None:
            log.error("job failed: %s (process logs in %s)", error, self._logdir)
        return JobResult(
            ok=error is None, digest=coord.digest, report=report, events=events, error=error,
            out_dir=self.out_dir, logs=self._log_paths(), pids=self._pids(), interrupted=interrupted,
            write_error=write_error,
        )  # fmt: skip

    def _record_usage(self, coord: Coordinator, now: float) -> None:
        """One ``host_usage`` event per host: its CPU, memory and accelerators (its agent's last
        sample, or this host's own), and each of its ranks' CPU share."""
        assert self.backend is not None
        hosts: dict[str, dict[str, Any]] = {}
        ranks = {name: rank for rank, name in coord.members.items()}
        children = self.children
        for host, (usage, procs) in self.backend.usage(self._usage.local).items():
            hosts[host] = usage  # each host's ranks from its own list: no scan of every process
            for name in procs:
                if name in ranks:
                    self._rank_share(usage, now, ranks[name], name, children.get(name))
        for host, usage in hosts.items():
            self._record(event(Event.HOST_USAGE, proc="launcher", gen=coord.plan.gen if coord.plan else 0,
                               host=host, **usage))  # fmt: skip

    def _rank_share(self, usage: dict[str, Any], now: float, rank: int, name: str, handle: Any) -> None:
        share = self._usage.rank_cpu(now, rank, name, handle.cpu_seconds() if handle is not None else None)
        if share is not None:
            usage.setdefault("ranks", {})[str(rank)] = share

    def _log_paths(self) -> dict[str, Path]:
        return self.backend.log_paths() if self.backend is not None else {}

    def _pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.children.items() if p.pid}

    def _start(self, coord: Coordinator) -> None:
        """Start every worker and spare: here, or through the hosts' agents once they joined."""
        assert self.backend is not None
        workers, spares = self.backend.start_job()
        coord.start(list(workers), list(spares))

    def _run(self, coord: Coordinator) -> None:
        self._start(coord)
        with steady_gc():
            self._loop(coord)

    def _loop(self, coord: Coordinator) -> None:
        assert self.backend is not None
        backend = self.backend
        deadline = time.monotonic() + self.timeout_s
        last_collect = 0.0
        while not coord.finished:
            for spare in backend.refresh():  # a lost host came back: a spare host now
                coord.add_spare(spare)
            coord.tick()
            for name in self._wakeups.watched():  # exits the coordinator has handled
                proc = coord.procs.get(name)
                handled = proc.role == Role.GONE if proc is not None else not self.children[name].alive()
                if handled:
                    self._wakeups.forget(name)
            now = time.monotonic()
            if self._usage.due(now):
                self._record_usage(coord, now)
            if now - last_collect > 0.2:
                self._collect_events(coord.announced_chunks(), coord.relay_chunks())
                last_collect = now
            for callback in self.on_tick:
                callback(coord)
            if now > deadline:
                raise JobFailed(f"job did not finish within {self.timeout_s:.0f}s")
            self._wakeups.wait(min(coord.next_tick_s(), 0.2) if self._wakeups.complete else 0.01)
        self._wait_workers(coord, self.job.recovery.exit_timeout_s)

    def _write_outputs(self, events: list[dict[str, Any]], report: dict[str, Any]) -> str | None:
        """Rewrite events.jsonl in time order and write report.json, atomically; the error if that failed."""
        self._log.close()
        if self.out_dir is None:
            return None
        try:
            if self._log.in_memory():  # else the file the log streamed stays, in arrival order
                write_atomic(self.out_dir / "events.jsonl", "".join(json.dumps(ev) + "\n" for ev in events))
            write_atomic(self.out_dir / "report.json", json.dumps(report, indent=2) + "\n")
        except OSError as e:
            log.error("could not write the run's files to %s: %s", self.out_dir, e)
            return f"could not write {self.out_dir}: {e.strerror or e}"
        return self._log.stream_error

    def _wait_workers(self, coord: Coordinator, timeout_s: float) -> None:
        """Let the ranks exit (a script's work after training runs meanwhile, ``exit_timeout_s``);
        ``job/stop`` is re-asserted meanwhile (a stranger may overwrite it). What went wrong after
        the end goes into ``_after_finish``, by process: an exit code other than 0, a kill at the
        timeout, or a signal that stopped the work."""
        failed = self._after_finish
        children = self.children
        try:
            self._wait_each(coord, children, timeout_s, failed)
        except (JobInterrupted, KeyboardInterrupt) as e:  # Ctrl-C stops the scripts' own work too
            what = signal.Signals(e.signum).name if isinstance(e, JobInterrupted) else "SIGINT"
            for name in coord.members.values():
                if name not in failed and children[name].alive():
                    failed[name] = f"stopped by {what} after the job finished"
            raise

    def _wait_each(self, coord: Coordinator, children: Mapping[str, Any], timeout_s: float,
                   failed: dict[str, str]) -> None:  # fmt: skip
        assert self.backend is not None
        backend = self.backend
        start = time.monotonic()
        deadline, told = start + timeout_s, False
        for name in coord.members.values():
            child = children[name]
            while child.alive() and time.monotonic() < deadline:
                if not told and time.monotonic() > start + 5.0:
                    told = True
                    log.warning("the job finished; waiting up to %.0fs for the ranks' processes to end their "
                                "own work (recovery.exit_timeout_s, --exit-timeout)", timeout_s)  # fmt: skip
                if self.store.get(keys.JOB_STOP) is None:
                    self.store.set(keys.JOB_STOP, "1")
                backend.wait_exit(child, 0.2)
            if child.alive():
                log.warning("%s did not exit within %.0fs of the job's end (--exit-timeout); killing it",
                            name, timeout_s)  # fmt: skip
                failed[name] = f"killed {timeout_s:g}s after the job finished (--exit-timeout)"
            elif child.exitcode() is None:  # no exit came: its host was lost (or its agent went silent)
                log.warning("%s was lost after finishing: %s", name, child.log_tail())
                failed[name] = f"was lost after the job finished: {child.log_tail()}"
            elif child.exitcode() != 0:
                log.warning("%s exited with code %s after finishing", name, child.exitcode())
                failed[name] = f"exited with code {child.exitcode()} after the job finished"

    def _finished_anyway(self, coord: Coordinator, signum: int) -> bool:
        """Whether the job finished although a signal stopped it: the ranks completed the last
        step during the grace period (or the signal came as they exited). Then it is reported as
        finished, with its final digest: every member reported the last step done, and the
        coordinator's end-of-job check passes on their reports."""
        if not coord.finished:
            if self.total_steps is None or coord.plan is None:
                return False  # without a step count, a rank that stopped early looks done
            try:
                for rank, name in coord.members.items():
                    text = self.store.get(keys.done(rank))
                    if text is None:
                        return False
                    done = json.loads(text)
                    if done.get("proc") != name or done.get("step") != self.total_steps - 1:
                        return False
                coord.check_done()  # the replicas agree: the digest, and the job_finished event
            except (JobFailed, RuntimeError, OSError, ValueError) as e:
                log.warning("the job's final reports do not add up (%s); it stays interrupted", e)
                return False
        if coord.finished:
            log.warning(
                "%s came, but the job had finished all its steps; reported as finished",
                signal.Signals(signum).name,
            )
        return coord.finished

    def _spare_ready(self, name: str) -> bool:
        return self._coord is not None and name in self._coord.ready_spares()

    def _wake_waiting_spares(self) -> None:
        """Give every spare never assigned the ``stop`` assignment (a ready one waits on that key);
        one still starting (importing torch, building its model) holds no state and would see the
        key only seconds later: it is killed at once."""
        for name in self.backend.spares if self.backend is not None else []:
            try:
                if self.store.get(keys.assign(name)) is None:
                    self.store.set(keys.assign(name), keys.STOP)
                    child = self.children.get(name)
                    if child is not None and child.alive() and not self._spare_ready(name):
                        child.kill()
            except (RuntimeError, OSError) as e:
                log.warning("could not wake the waiting spare %s (%s); it is stopped by signal", name, e)
                return

    def _cleanup(self) -> None:
        """Stop every child (politely, then by force), collect their last events, free the node cache.

        ``job/stop`` is set first thing (on Ctrl-C, before anything else): the ranks stop at their
        next step boundary, while the grace period below lets them exit by themselves.
        """
        try:
            self.store.set(keys.JOB_STOP, "1")
        except (RuntimeError, OSError) as e:  # the store may be what failed (DistError is a RuntimeError)
            log.warning("could not tell the processes to stop (%s); they are stopped by signal", e)
        else:
            self._wake_waiting_spares()
        if self._bell is not None:
            self._bell.close()
        if self.backend is not None:
            self.backend.stop()
        try:  # the relays' last counts first: a backlog is read in bulk, then probed to its end
            self._collect_events(relayed=self._coord.relay_chunks() if self._coord is not None else None)
        except (RuntimeError, OSError) as e:
            log.warning("could not collect the processes' last events (%s); the event log may miss them", e)
        # after every child is gone, so that none can create the directory again
        if self.backend is not None:
            self.backend.close()
        self._wakeups.close()
