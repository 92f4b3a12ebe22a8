"""The launcher: starts workers and spares as OS processes and hosts the control plane.

The control store (a ``TCPStore``) and the ``Coordinator`` live in the launcher
process, outside every worker, so any worker may die. The spare pool refills:
the coordinator asks for a new spare each time one is consumed or lost.

What the launcher guarantees around a job:

- the store listens on the launcher's address only (127.0.0.1 by default), and
  every control message is sealed with a per-job secret that each child reads
  from a private pipe (``control/auth.py``): a stranger or a process of another
  job cannot steer this one;
- children die with the launcher at any moment (``PR_SET_PDEATHSIG`` is set
  between fork and exec, before the child runs any code) and live in their own
  session, so a terminal's Ctrl-C reaches the launcher alone, which stops them;
- events reach ``<out>/events.jsonl`` while the job runs (appended and flushed
  every tick), so a crash of the launcher keeps what happened up to it; at the
  end the file is rewritten in time order and ``report.json`` is written, both
  atomically (temporary file, then rename);
- SIGINT and SIGTERM stop the job: ``job/stop`` is set at once (the ranks stop at
  their next step boundary), children are ended after a grace period, a partial
  report with the reason is written, and ``JobResult.interrupted`` holds the signal
  number; a job whose ranks finished their last step meanwhile is reported finished,
  with its final digest;
- a previous run's files in ``out`` are moved aside first, so they never pass for
  this run's, and the last complete run (one with its ``report.json``) is never lost:
  a complete run goes to ``out/previous/``, one whose launcher was killed before its
  report to ``out/unfinished/`` (``previous/`` stays); see ``set_aside_previous_run``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import IO, Any

from torch.distributed import TCPStore

from checkpointless.config import JobConfig
from checkpointless.control import keys
from checkpointless.control.auth import ENV_SECRET_FD, SignedStore, job_namespace, new_secret
from checkpointless.control.bell import ReportBell
from checkpointless.control.client import ENV_CONFIG, ENV_JOB_ID, ENV_PROC, ENV_ROLE, ENV_STORE
from checkpointless.control.coordinator import Coordinator, JobFailed
from checkpointless.control.vocab import Event, Role, event
from checkpointless.devices import ENV_LOCAL_INDEX
from checkpointless.errors import JobInterrupted, LaunchError
from checkpointless.faults import unfired
from checkpointless.observe.report import build_report

log = logging.getLogger(__name__)

RUN_FILES = ("events.jsonl", "report.json", "timeline.png", "summary.txt", "logs", "reference")
MAX_REJECTED_KEYS = 64
"""Messages not sealed with the job's secret are all counted (``report.json``'s ``rejected_messages``),
and the first one of each key is kept as a ``message_rejected`` event, for at most this many keys:
a stranger writing junk for as long as a job runs must not grow the launcher without bound."""


_LIBC: Any = None
_LAUNCHER_PID = 0  # set before each fork: the parent a child must still have after prctl
_CHILD_NICE = 0  # set before each fork: the nice value the child starts at


def _die_with_launcher() -> None:
    """Runs in the child between fork and exec: SIGKILL it when the launcher dies, from its first instruction."""
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != _LAUNCHER_PID:  # the launcher died before prctl took effect (reparented)
        os._exit(1)
    if _CHILD_NICE:
        os.nice(_CHILD_NICE)


def can_restore_priority() -> bool:
    """Whether a process of this user may lower its nice value back to 0 (root, or RLIMIT_NICE >= 20)."""
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit)\b(?::|$)")
"""A Python exception's last traceback line (``ValueError: ...``, ``torch.OutOfMemoryError: ...``)."""


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) used by ``pid`` and the live processes below it; None if ``pid``
    cannot be read (gone, or no ``/proc``). A stopped process's count does not move."""
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            # the name (field 2) may hold spaces: count from the closing parenthesis
            fields = stat[stat.rindex(")") + 2 :].split()
            total += (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime
        except (OSError, ValueError, IndexError):
            if p == pid:
                return None
            continue
        with contextlib.suppress(OSError, ValueError):  # no CONFIG_PROC_CHILDREN: the process alone
            for task in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
    return total


class _Child:
    """A started process, as the coordinator sees it."""

    def __init__(
        self, name: str, popen: subprocess.Popen[bytes], log_file: IO[bytes], log_path: Path, slot: int = 0
    ) -> None:
        self.name, self.popen, self.log_file, self.log_path = name, popen, log_file, log_path
        self.slot = slot  # its place on the host (``devices.ENV_LOCAL_INDEX``): which GPU it uses

    def alive(self) -> bool:
        return self.popen.poll() is None

    def exit_fd(self) -> int | None:
        """A descriptor that becomes readable when the process exits (a pidfd), or None."""
        try:
            return os.pidfd_open(self.popen.pid)
        except (AttributeError, OSError):  # Linux < 5.3, or not Linux
            return None

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()

    def exitcode(self) -> int | None:
        return self.popen.poll()

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the process and its descendants (``/proc``), None where unreadable."""
        return _tree_cpu_seconds(self.popen.pid)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            self.log_file.flush()
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 4096))
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
                # the exception that ended it, if any: a line after it (a C++ runtime's "terminate
                # called ..." as gloo's threads die at exit) would hide the cause
                raised = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
                return (raised or lines or [""])[-1][:300]
        return ""


class _Wakeups:
    """What ends the launcher's wait between two ticks besides the clock: a child's exit (its
    pidfd becomes readable) or a failure report (the report bell writes a byte to a pipe). In
    steady state the launcher then ticks at the heartbeat pace, not every 10 ms: each wake-up on a
    machine the workers keep busy delays one of them (1.5% of an HSDP 2x2 step here). Without
    pidfds (Linux < 5.3) it ticks every 10 ms as before."""

    def __init__(self) -> None:
        self._selector: selectors.BaseSelector | None = None  # opened with the first child
        self._read = self._write = -1
        self._exits: dict[str, int] = {}
        self._lock = threading.Lock()  # ``ring`` comes from the bell's thread
        self.complete = True  # every child's exit ends a wait

    def _open(self) -> selectors.BaseSelector:
        if self._selector is None:
            self._selector = selectors.DefaultSelector()
            self._read, self._write = os.pipe()
            os.set_blocking(self._read, False)
            os.set_blocking(self._write, False)
            self._selector.register(self._read, selectors.EVENT_READ)
        return self._selector

    def watch(self, child: _Child) -> None:
        selector = self._open()
        fd = child.exit_fd()
        if fd is None:
            self.complete = False
            return
        self._exits[child.name] = fd
        selector.register(fd, selectors.EVENT_READ)

    def watched(self) -> list[str]:
        return list(self._exits)

    def forget(self, name: str) -> None:
        """Stop watching a child whose exit was handled (its pidfd stays readable)."""
        fd = self._exits.pop(name, None)
        if fd is not None and self._selector is not None:
            self._selector.unregister(fd)
            os.close(fd)

    def ring(self) -> None:
        with self._lock:
            if self._selector is not None:
                with contextlib.suppress(BlockingIOError):  # the pipe is full: a wake-up is pending
                    os.write(self._write, b"x")

    def wait(self, timeout: float) -> None:
        if self._selector is None:
            time.sleep(timeout)
            return
        for key, _ in self._selector.select(timeout):
            if key.fd == self._read:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._read, 4096):
                        pass

    def close(self) -> None:
        with self._lock:
            for name in list(self._exits):
                self.forget(name)
            if self._selector is not None:
                self._selector.close()
                os.close(self._read)
                os.close(self._write)
                self._selector = None


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


def open_store(host: str, port: int) -> TCPStore:
    """Host the control store on ``host`` only; ``port`` 0 picks a free port.

    c10d's server binds every interface when asked for a port, so the launcher
    binds the listening socket itself and hands it over.
    """
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as e:
        raise LaunchError(f"cannot listen on {host}:{port} for the control store (port in use?): {e}") from e
    bound_port = sock.getsockname()[1]
    fd = sock.detach()  # the store's server owns the descriptor from here on
    try:
        return TCPStore(
            host, bound_port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=30), master_listen_fd=fd,
        )  # fmt: skip
    except Exception as e:
        os.close(fd)
        raise LaunchError(f"cannot start the control store on {host}:{port}: {e}") from e


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


PREVIOUS = "previous"
"""``<out>/previous/``: the last complete run (it has its ``report.json``) before the one in ``<out>``."""
UNFINISHED = "unfinished"
"""``<out>/unfinished/``: a run whose launcher was killed before it wrote its report."""
_STAGING = ".into-"  # <out>/.into-<target>/: a run on its way into <out>/<target>/
_OLD = ".old-"  # <out>/.old-<target>/: what <out>/<target>/ held, deleted once replaced


def set_aside_previous_run(out_dir: Path) -> None:
    """Move the run in ``out_dir`` aside for a new one, never losing the last complete run.

    A complete run (it has its ``report.json``) moves to ``previous/``, replacing the older one
    there; an unfinished one (its launcher was killed before the report) moves to ``unfinished/``
    and ``previous/`` is kept: after any number of reruns killed at their start, the last complete
    run is still there. A move is a staging directory filled file by file (``report.json`` last),
    then two renames; a launcher killed in between leaves the staging directory, and the next one
    completes that move first. So at every moment the last complete run is whole, in ``out_dir``,
    in the staging directory or in ``previous/``.
    """
    for target in (PREVIOUS, UNFINISHED):
        if (out_dir / f"{_STAGING}{target}").is_dir():  # a move that a killed launcher left half done
            _move_run(out_dir, target)
        old = out_dir / f"{_OLD}{target}"
        if old.is_dir():
            if (out_dir / target).exists():
                shutil.rmtree(old)
            else:  # (cannot happen without a staging directory, which was completed above)
                os.replace(old, out_dir / target)
    if any(os.path.lexists(out_dir / name) for name in RUN_FILES):
        _move_run(out_dir, PREVIOUS if (out_dir / "report.json").is_file() else UNFINISHED)


def _move_run(out_dir: Path, target: str) -> None:
    """Move the run files in ``out_dir`` to ``out_dir/target/``, replacing what it held (see
    ``set_aside_previous_run``); picks up where a killed launcher left the same move."""
    staging = out_dir / f"{_STAGING}{target}"
    staging.mkdir(exist_ok=True)
    for name in sorted(RUN_FILES, key=lambda n: n == "report.json"):  # the report last: it marks a whole run
        if os.path.lexists(out_dir / name):
            os.replace(out_dir / name, staging / name)
    dest, old = out_dir / target, out_dir / f"{_OLD}{target}"
    if dest.exists():
        if old.exists():  # left by a launcher killed after its last move's renames
            shutil.rmtree(old)
        os.replace(dest, old)
    os.replace(staging, dest)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _stop_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into ``JobInterrupted`` in the main thread while a job runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise JobInterrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


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
    ) -> None:
        self.job, self.command, self.total_steps = job, command, total_steps
        self.host, self.port = host, port
        self.out_dir = out_dir
        self.env = env or {}
        self.on_tick = on_tick if isinstance(on_tick, list) else [on_tick] if on_tick else []
        self.job_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        self.children: dict[str, _Child] = {}
        self._next_spare = 0
        self._spares: list[str] = []  # every spare started, in order
        self._coord: Coordinator | None = None
        self._bell: ReportBell | None = None
        self._wakeups = _Wakeups()
        self._events: list[dict[str, Any]] = []
        self._rejections = 0  # messages rejected (every one); the first of each key is in the events
        self._rejected_keys: set[str] = set()
        self._chunks_read: dict[str, int] = {}
        self._stream: IO[str] | None = None
        self._stream_error: str | None = None
        self._secret = new_secret()
        self._own_logdir = out_dir is None
        self._logdir = Path(out_dir / "logs") if out_dir else Path(tempfile.gettempdir())  # see run()

    # -- processes ------------------------------------------------------------------
    def _spawn(self, name: str, role: str) -> _Child:
        global _LIBC, _LAUNCHER_PID, _CHILD_NICE
        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
        _LAUNCHER_PID = os.getpid()
        nice = self.job.recovery.spare_start_nice if role == Role.SPARE else 0
        _CHILD_NICE = nice if nice and can_restore_priority() else 0
        env = dict(os.environ)
        env.update(self.env)
        slot = self._free_slot()
        read_end, write_end = os.pipe()
        env.update(
            {
                ENV_STORE: f"{self.host}:{self.store.raw.port}",
                ENV_PROC: name,
                ENV_ROLE: role,
                ENV_CONFIG: self.job.to_json(),
                ENV_JOB_ID: self.job_id,
                ENV_SECRET_FD: str(read_end),
                ENV_LOCAL_INDEX: str(slot),
                "LOCAL_RANK": str(slot),
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        self._logdir.mkdir(parents=True, exist_ok=True)
        log_path = self._logdir / f"{name}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 (closed in _cleanup)
        try:
            # Its own process group, not its own session: the terminal's Ctrl-C reaches the launcher
            # only, which ends the job; and every child stays in the launcher's scheduling
            # autogroup (Linux, CONFIG_SCHED_AUTOGROUP): ranks in a group each, as a session each
            # gives them, wait longer for one another at every collective (bench/control_load.py
            # measures it on plain FSDP2)
            popen = subprocess.Popen(
                self.command, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                pass_fds=(read_end,), preexec_fn=_die_with_launcher, process_group=0,
            )  # fmt: skip
            os.write(write_end, self._secret)  # 32 bytes: fits the pipe buffer, never blocks
        except OSError as e:
            log_file.close()
            raise LaunchError(f"cannot start {self.command[0]!r}: {e.strerror or e}") from e
        finally:
            os.close(read_end)
            os.close(write_end)
        child = _Child(name, popen, log_file, log_path, slot)
        self.children[name] = child
        self._wakeups.watch(child)
        return child

    def _free_slot(self) -> int:
        """The lowest slot on this host that no live process holds: workers get 0..N-1 at the start,
        spares the next ones, and a refilled spare the slot (the GPU) a dead process freed."""
        held = {c.slot for c in self.children.values() if c.alive()}
        return next(i for i in range(len(held) + 1) if i not in held)

    def _spawn_spare(self) -> _Child:
        name = f"s{self._next_spare}"
        self._next_spare += 1
        self._spares.append(name)
        return self._spawn(name, Role.SPARE)

    # -- events ---------------------------------------------------------------------
    def _record(self, ev: dict[str, Any]) -> None:
        if ev.get("kind") == Event.MESSAGE_REJECTED and not self._first_rejection(str(ev.get("key"))):
            return
        self._events.append(ev)
        if self._stream is not None:
            try:
                self._stream.write(json.dumps(ev) + "\n")
            except OSError as e:
                self._stream_failed(e)

    def _stream_failed(self, e: OSError) -> None:
        """The disk filled up (or went away): keep the events in memory, say so at the end."""
        log.error("cannot append to %s/events.jsonl (%s); events are kept in memory", self.out_dir, e)
        self._stream_error = (
            f"could not write {self.out_dir}/events.jsonl while the job ran: {e.strerror or e}"
        )
        stream, self._stream = self._stream, None
        with contextlib.suppress(OSError):
            assert stream is not None
            stream.close()

    def _first_rejection(self, key: str) -> bool:
        """Count one rejected message on ``key``; whether it is the first of its key to be kept (at
        most ``MAX_REJECTED_KEYS`` keys: the rest are only counted)."""
        self._rejections += 1
        if key in self._rejected_keys or len(self._rejected_keys) >= MAX_REJECTED_KEYS:
            return False
        self._rejected_keys.add(key)
        return True

    def _reject(self, key: str) -> None:
        if key not in self._rejected_keys:
            log.warning("ignored a value on %r that is not sealed with this job's secret (later ones are "
                        "counted, not logged)", key)  # fmt: skip
        self._record(event(Event.MESSAGE_REJECTED, proc="coordinator", key=key))

    def _collect_events(self, announced: dict[str, int] | None = None) -> None:
        """Move the processes' new event chunks from the store into the log (and the file).

        ``announced``: how many chunks each process's last heartbeat says it wrote. Those are
        read in one round trip for every process (they exist: a process writes its chunks before
        the heartbeat that counts them); a process not in it (at the end, or not heartbeating)
        is probed chunk by chunk until a gap.
        """
        announced = announced or {}
        known: list[tuple[str, int]] = [
            (name, i)
            for name in self.children
            if name in announced
            for i in range(self._chunks_read.get(name, 0), announced[name])
        ]
        raws = self.store.get_sealed_present([keys.events(name, i) for name, i in known])
        for (name, i), raw in zip(known, raws, strict=True):
            self._record_chunk(name, keys.events(name, i), raw)
            self._chunks_read[name] = i + 1
        for name in self.children:
            if name in announced:
                continue
            seen = self._chunks_read.get(name, 0)
            while True:  # chunks are numbered from 0 and written in order: read until a gap
                key = keys.events(name, seen)
                sealed = self.store.get_sealed(key)
                if sealed is None or not self._record_chunk(name, key, sealed):
                    break  # not written yet, or forged (the real chunk will overwrite it)
                seen += 1
            self._chunks_read[name] = seen
        if self._stream is not None:
            try:
                self._stream.flush()
            except OSError as e:
                self._stream_failed(e)

    def _record_chunk(self, name: str, key: str, raw: bytes) -> bool:
        """Record the events of one sealed chunk of process ``name`` and delete it; False if forged."""
        text = self.store.open(key, raw)
        if text is None:
            return False
        for line in text.splitlines():
            if line.strip():
                ev = json.loads(line)
                ev["proc"] = name  # a chunk speaks for the process whose key it is under
                self._record(ev)
        self.store.delete(key)
        return True

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event collected so far (launcher, coordinator and processes), in arrival order."""
        return self._events

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
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            set_aside_previous_run(self.out_dir)
            self._stream = open(self.out_dir / "events.jsonl", "w")  # noqa: SIM115 (closed below)
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
        coord = Coordinator(self.store, self.job, self.total_steps, self._spawn_spare, self._record,
                            report_bell=self._bell.rung if self._bell is not None else None)  # fmt: skip
        self._coord = coord
        error: str | None = None
        interrupted: int | None = None
        try:
            with _stop_signals():
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
                if interrupted is not None and self._finished_anyway(coord, interrupted):
                    interrupted = error = None
        except JobInterrupted as e:  # a second signal during cleanup
            interrupted = e.signum
            error = error or f"interrupted by {signal.Signals(e.signum).name}"
        if error is not None:
            self._record(event(Event.JOB_FINISHED, proc="launcher", gen=0, ok=False, error=error))
        events = sorted(self._events, key=lambda e: e["t"])
        self.total_steps = coord.total_steps  # the scripts' own, where --steps was not given
        report = build_report(events, total_steps=self.total_steps, digest=coord.digest)
        report["error"] = error
        report["job_id"] = self.job_id
        report["unfired_faults"] = unfired(self.job.faults, events)  # the CLI fails a run that has any
        report["rejected_messages"] = {"count": self._rejections, "keys": sorted(self._rejected_keys)}
        write_error = self._write_outputs(events, report)
        if error is None and self._own_logdir:
            shutil.rmtree(self._logdir, ignore_errors=True)
        elif error is not None:
            log.error("job failed: %s (process logs in %s)", error, self._logdir)
        return JobResult(
            ok=error is None, digest=coord.digest, report=report, events=events, error=error,
            out_dir=self.out_dir, logs={n: c.log_path for n, c in self.children.items()},
            pids={n: c.popen.pid for n, c in self.children.items()}, interrupted=interrupted,
            write_error=write_error,
        )  # fmt: skip

    def _run(self, coord: Coordinator) -> None:
        workers = [self._spawn(f"w{r}", Role.WORKER) for r in range(self.job.workers)]
        spares = [self._spawn_spare() for _ in range(self.job.spares)]
        coord.start(list(workers), list(spares))
        deadline = time.monotonic() + self.timeout_s
        last_collect = 0.0
        while not coord.finished:
            coord.tick()
            for name in self._wakeups.watched():  # exits the coordinator has handled
                proc = coord.procs.get(name)
                handled = proc.role == Role.GONE if proc is not None else not self.children[name].alive()
                if handled:
                    self._wakeups.forget(name)
            now = time.monotonic()
            if now - last_collect > 0.2:
                self._collect_events(coord.announced_chunks())
                last_collect = now
            for callback in self.on_tick:
                callback(coord)
            if now > deadline:
                raise JobFailed(f"job did not finish within {self.timeout_s:.0f}s")
            self._wakeups.wait(min(coord.next_tick_s(), 0.2) if self._wakeups.complete else 0.01)
        self._wait_workers(coord)

    def _write_outputs(self, events: list[dict[str, Any]], report: dict[str, Any]) -> str | None:
        """Rewrite events.jsonl in time order and write report.json, atomically; the error if that failed."""
        if self._stream is not None:
            with contextlib.suppress(OSError):
                self._stream.close()
            self._stream = None
        if self.out_dir is None:
            return None
        try:
            _write_atomic(self.out_dir / "events.jsonl", "".join(json.dumps(ev) + "\n" for ev in events))
            _write_atomic(self.out_dir / "report.json", json.dumps(report, indent=2) + "\n")
        except OSError as e:
            log.error("could not write the run's files to %s: %s", self.out_dir, e)
            return f"could not write {self.out_dir}: {e.strerror or e}"
        return self._stream_error

    def _wait_workers(self, coord: Coordinator, timeout_s: float = 30.0) -> None:
        """Let the ranks exit; ``job/stop`` is re-asserted meanwhile (a stranger may overwrite it)."""
        deadline = time.monotonic() + timeout_s
        for name in coord.members.values():
            child = self.children[name]
            while child.alive() and time.monotonic() < deadline:
                if self.store.get(keys.JOB_STOP) is None:
                    self.store.set(keys.JOB_STOP, "1")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.popen.wait(timeout=0.2)
            if child.alive():
                log.warning("%s did not exit after the job finished; killing it", name)
            elif child.popen.returncode != 0:
                log.warning("%s exited with code %s after finishing", name, child.popen.returncode)

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
                coord._check_done()  # the replicas agree: the digest, and the job_finished event
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
        for name in self._spares:
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
        deadline = time.monotonic() + 5
        for child in self.children.values():
            try:
                child.popen.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.popen.wait(timeout=5)
            child.log_file.close()
        try:
            self._collect_events()
        except (RuntimeError, OSError) as e:
            log.warning("could not collect the processes' last events (%s); the event log may miss them", e)
        # after every child is gone, so that none can create the directory again
        from checkpointless.data.shm_cache import ShmBatchCache

        ShmBatchCache(self.job_id, cleanup_on_exit=False).cleanup()
        self._wakeups.close()
