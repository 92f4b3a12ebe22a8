"""The local supervisor: the job's processes on one host (the ``ProcessBackend`` of a job on one
host, and the part of a host's agent that runs its processes on several).

It starts every worker and spare of its host (the environment contract of ``protocol/env.py``,
the job's secret on a private pipe, the process's slot on the host), sees their exits at once
(a pidfd each), kills them when told, reads their log tails and CPU time for the coordinator,
stops them all at the end (politely, then by force) and frees the node's shared-memory batch
cache. The coordinator sees each process through ``control.processes.ProcessHandle`` and never
touches one directly; on one host the supervisor lives in the launcher's process.

Children die with the launcher at any moment (``PR_SET_PDEATHSIG`` is set between fork and exec,
before the child runs any code) and live in their own process group, so a terminal's Ctrl-C
reaches the launcher alone, which stops them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

from checkpointless.config import JobConfig
from checkpointless.errors import LaunchError
from checkpointless.launch.forkserver_client import ForkServer, forkable
from checkpointless.launch.wakeups import Wakeups
from checkpointless.protocol.env import (
    ENV_CONFIG,
    ENV_FORK_SERVER,
    ENV_JOB_ID,
    ENV_LOCAL_INDEX,
    ENV_PROC,
    ENV_ROLE,
    ENV_SECRET_FD,
    ENV_STORE,
)
from checkpointless.protocol.vocab import Role

log = logging.getLogger(__name__)

_LIBC: Any = None
_LAUNCHER_PID = 0  # set before each fork: the parent a child must still have after prctl
_CHILD_NICE = 0  # set before each fork: the nice value the child starts at


def _before_fork(nice: int) -> None:
    """Set what the pre-exec hooks below read: libc, this process's pid, the child's nice value."""
    global _LIBC, _LAUNCHER_PID, _CHILD_NICE
    if _LIBC is None:
        _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
    _LAUNCHER_PID, _CHILD_NICE = os.getpid(), nice


def _die_with_launcher_at_normal_priority() -> None:
    """Runs in the child between fork and exec: SIGKILL it when the launcher dies, from its first
    instruction; its nice value stays (the fork server's: each of its children sets its own)."""
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != _LAUNCHER_PID:  # the launcher died before prctl took effect (reparented)
        os._exit(1)


def _die_with_launcher() -> None:
    """As above, at the nice value the child starts at (``_CHILD_NICE``)."""
    _die_with_launcher_at_normal_priority()
    if _CHILD_NICE or os.getpriority(os.PRIO_PROCESS, 0) != 0:  # absolute: an agent may run at another
        os.setpriority(os.PRIO_PROCESS, 0, _CHILD_NICE)


def fork_server_enabled() -> bool:
    """Whether the job's Python processes are forked from a fork server (``launch/forkserver.py``):
    on unless ``CHECKPOINTLESS_FORK_SERVER=0`` is in the launcher's (or agent's) environment."""
    return os.environ.get(ENV_FORK_SERVER, "1") != "0"


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


class Started(Protocol):
    """A started process as ``subprocess.Popen`` or ``forkserver_client.Forked`` gives it."""

    @property
    def pid(self) -> int: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...


class Child:
    """A started process, as the coordinator sees it."""

    relayed = False  # on the coordinator's host, it beats into the control store itself
    leaving = False  # (this host is the launcher's: never drained)

    def __init__(
        self,
        name: str,
        popen: Started,
        log_file: IO[bytes],
        log_path: Path,
        slot: int = 0,
        host: str = "",
    ) -> None:
        self.name, self.popen, self.log_file, self.log_path = name, popen, log_file, log_path
        self.host = host or socket.gethostname()  # the agent's host
        self.slot = slot  # its place on the host (``protocol.env.ENV_LOCAL_INDEX``): which GPU it uses

    @property
    def pid(self) -> int:
        return int(self.popen.pid)

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

    def cpu_age(self) -> float:
        return 0.0  # read now

    def log_tail(self) -> str:
        with contextlib.suppress(OSError, ValueError):  # ValueError: the log is closed (stopped)
            if not self.log_file.closed:
                self.log_file.flush()
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 4096))
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
                # the exception that ended it, if any: a line after it (a C++ runtime's "terminate
                # called ..." as gloo's threads die at exit) would hide the cause
                raised = [ln for ln in lines if _EXCEPTION_LINE.match(ln)]
                return (raised or lines or [""])[-1][:300]
        return ""


class LocalSupervisor:
    """Starts, watches and stops the job's processes on this host (see the module docstring)."""

    def __init__(
        self,
        job: JobConfig,
        command: list[str],
        *,
        job_id: str,
        secret: bytes,
        store_addr: str,
        logdir: Path,
        env: dict[str, str],
        wakeups: Wakeups,
        host: str = "",
    ) -> None:
        self.job, self.command, self.job_id, self.env = job, command, job_id, env
        self._secret, self.store_addr, self._logdir, self.wakeups = secret, store_addr, logdir, wakeups
        self.children: dict[str, Child] = {}
        self.host = host or socket.gethostname()  # this host's name in the job's topology
        self._next_spare = 0
        self.spares: list[str] = []  # every spare started, in order
        self._forkable = forkable(command)  # how the fork server would run the command, if it can
        self._forks = (
            ForkServer(
                dict(os.environ) | env, _die_with_launcher_at_normal_priority, logdir / "forkserver.log"
            )
            if fork_server_enabled() and self._forkable is not None
            else None
        )
        if self._forks is not None:
            _before_fork(0)
            self._forks.start()  # its imports overlap the rest of the launcher's start

    def spawn(self, name: str, role: str) -> Child:
        """Start ``name`` (``w<rank>`` or ``s<n>``) in ``role`` with the job's environment and secret."""
        nice = self.job.recovery.spare_start_nice if role == Role.SPARE else 0
        _before_fork(nice if nice and can_restore_priority() else 0)
        env = dict(os.environ)
        env.update(self.env)
        slot = self._free_slot()
        read_end, write_end = os.pipe()
        env.update(
            {
                ENV_STORE: self.store_addr,
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
            popen = self._fork(env, log_file.fileno(), read_end) or self._popen(env, log_file, read_end)
            os.write(write_end, self._secret)  # 32 bytes: fits the pipe buffer, never blocks
        except OSError as e:
            log_file.close()
            raise LaunchError(f"cannot start {self.command[0]!r}: {e.strerror or e}") from e
        finally:
            os.close(read_end)
            os.close(write_end)
        child = Child(name, popen, log_file, log_path, slot, self.host)
        self.children[name] = child
        self.wakeups.watch(child)
        return child

    def _fork(self, env: dict[str, str], log_fd: int, secret_fd: int) -> Started | None:
        """The process forked by the host's fork server, or None where it cannot be (not this
        interpreter running a script or a module, the fork server turned off or gone)."""
        if self._forkable is None or self._forks is None or self._forks.broken:
            return None
        kind, target, args = self._forkable
        try:
            return self._forks.spawn(kind, target, args, env=env, cwd=os.getcwd(), nice=_CHILD_NICE,
                                     log_fd=log_fd, secret_fd=secret_fd, title=" ".join(self.command))  # fmt: skip
        except OSError as e:
            log.warning("the fork server failed (%s): starting processes the usual way", e)
            return None

    def _popen(self, env: dict[str, str], log_file: IO[bytes], secret_fd: int) -> Started:
        # Its own process group, not its own session: the terminal's Ctrl-C reaches the launcher
        # only, which ends the job; and every child stays in the launcher's scheduling autogroup
        # (Linux, CONFIG_SCHED_AUTOGROUP): ranks in a group each, as a session each gives them,
        # wait longer for one another at every collective (bench/control_load.py measures it)
        return subprocess.Popen(
            self.command, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            pass_fds=(secret_fd,), preexec_fn=_die_with_launcher, process_group=0,
        )  # fmt: skip

    def _free_slot(self) -> int:
        """The lowest slot on this host that no live process holds: workers get 0..N-1 at the start,
        spares the next ones, and a refilled spare the slot (the GPU) a dead process freed."""
        held = {c.slot for c in self.children.values() if c.alive()}
        return next(i for i in range(len(held) + 1) if i not in held)

    def spawn_spare(self) -> Child:
        name = f"s{self._next_spare}"
        self._next_spare += 1
        self.spares.append(name)
        return self.spawn(name, Role.SPARE)

    # -- the process backend (``control.processes.ProcessBackend``) on one host ----------------
    def start_job(self) -> tuple[list[Child], list[Child]]:
        workers = [self.spawn(f"w{r}", Role.WORKER) for r in range(self.job.workers)]
        return workers, [self.spawn_spare() for _ in range(self.job.spares)]

    def probe(self, names: list[str]) -> None:
        """Nothing to ask: an exit here is seen at once (its pidfd)."""

    def refresh(self) -> list[Child]:
        return []

    def wait_exit(self, handle: Any, timeout_s: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.children[handle.name].popen.wait(timeout=timeout_s)

    def usage(self, local: Callable[[], dict[str, Any]]) -> dict[str, tuple[dict[str, Any], list[str]]]:
        return {socket.gethostname(): (local(), list(self.children))}

    def log_paths(self) -> dict[str, Path]:
        return {n: c.log_path for n, c in self.children.items()}

    def close(self) -> None:
        if self._forks is not None:
            self._forks.close()
        self.free_node_cache()

    def stop(self) -> None:
        """Let every child exit within a grace period, then kill the rest; close their logs."""
        deadline = time.monotonic() + 5
        for child in self.children.values():
            try:
                child.popen.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.popen.wait(timeout=5)
            child.log_file.close()

    def free_node_cache(self) -> None:
        """Remove the job's shared-memory batch cache on this host (once every child is gone, so
        that none can create it again)."""
        from checkpointless.corpus.shm_cache import ShmBatchCache

        ShmBatchCache(self.job_id, cleanup_on_exit=False).cleanup()
