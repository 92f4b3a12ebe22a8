"""The launcher: starts workers and spares as OS processes and hosts the control plane.

The control store (a ``TCPStore``) and the ``Coordinator`` live in the launcher
process, outside every worker, so any worker may die. The spare pool refills:
the coordinator asks for a new spare each time one is consumed or lost.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from torch.distributed import TCPStore

from checkpointless.config import JobConfig
from checkpointless.control import keys
from checkpointless.control.client import ENV_CONFIG, ENV_JOB_ID, ENV_PROC, ENV_ROLE, ENV_STORE
from checkpointless.control.coordinator import Coordinator, JobFailed
from checkpointless.report import build_report

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """The job could not be started (bad port, ...): a user-facing, one-line message."""


class _Child:
    """A started process, as the coordinator sees it."""

    def __init__(self, name: str, popen: subprocess.Popen[bytes], log_file: IO[bytes]) -> None:
        self.name, self.popen, self.log_file = name, popen, log_file

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.popen.kill()


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


def open_store(host: str, port: int) -> TCPStore:
    """Host the control store; ``port`` 0 picks a free port."""
    try:
        return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    except Exception as e:
        raise LaunchError(f"cannot listen on {host}:{port} for the control store (port in use?): {e}") from e


class Launcher:
    """Runs one job: ``command`` is started once per worker and once per spare.

    Every process gets ``CHECKPOINTLESS_*`` environment variables naming the
    store, its process name, its role and the job config; the command's
    ``Session`` does the rest.
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
        self._events: list[dict[str, Any]] = []
        self._own_logdir = out_dir is None
        self._logdir = (
            Path(out_dir / "logs") if out_dir else Path(tempfile.mkdtemp(prefix="checkpointless-logs-"))
        )

    def _spawn(self, name: str, role: str) -> _Child:
        env = dict(os.environ)
        env.update(self.env)
        env.update(
            {
                ENV_STORE: f"{self.host}:{self.store.port}",
                ENV_PROC: name,
                ENV_ROLE: role,
                ENV_CONFIG: self.job.to_json(),
                ENV_JOB_ID: self.job_id,
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        self._logdir.mkdir(parents=True, exist_ok=True)
        log_file = open(self._logdir / f"{name}.log", "wb")  # noqa: SIM115 (closed in _cleanup)
        popen = subprocess.Popen(self.command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        child = _Child(name, popen, log_file)
        self.children[name] = child
        return child

    def _spawn_spare(self) -> _Child:
        name = f"s{self._next_spare}"
        self._next_spare += 1
        return self._spawn(name, "spare")

    def run(self) -> JobResult:
        self.store = open_store(self.host, self.port)
        t_start = time.time()
        self._events.append(
            {"t": t_start, "kind": "job_started", "proc": "launcher", "rank": None, "gen": 0, "step": None,
             "workers": self.job.workers, "spares": self.job.spares, "steps": self.total_steps,
             "faults": [str(f) for f in self.job.faults]}
        )  # fmt: skip
        coord = Coordinator(self.store, self.job, self.total_steps, self._spawn_spare, self._events.append)
        error: str | None = None
        try:
            workers = [self._spawn(f"w{r}", "worker") for r in range(self.job.workers)]
            spares = [self._spawn_spare() for _ in range(self.job.spares)]
            coord.start(list(workers), list(spares))
            deadline = time.monotonic() + self.timeout_s
            while not coord.finished:
                coord.tick()
                for callback in self.on_tick:
                    callback(coord)
                if time.monotonic() > deadline:
                    raise JobFailed(f"job did not finish within {self.timeout_s:.0f}s")
                time.sleep(0.01)
            self._wait_workers(coord)
        except JobFailed as e:
            error = str(e)
            self._events.append(
                {"t": time.time(), "kind": "job_finished", "proc": "launcher", "rank": None, "gen": 0,
                 "step": None, "ok": False, "error": error}
            )  # fmt: skip
        finally:
            self._cleanup()
        events = sorted(self._events + self._collect_events(), key=lambda e: e["t"])
        report = build_report(events, total_steps=self.total_steps, digest=coord.digest)
        report["error"] = error
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "events.jsonl", "w") as f:
                for ev in events:
                    f.write(json.dumps(ev) + "\n")
            (self.out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        if error is None and self._own_logdir:
            shutil.rmtree(self._logdir, ignore_errors=True)
        elif error is not None:
            log.error("job failed: %s (process logs in %s)", error, self._logdir)
        return JobResult(
            ok=error is None, digest=coord.digest, report=report, events=events, error=error,
            out_dir=self.out_dir, logs={n: self._logdir / f"{n}.log" for n in self.children},
            pids={n: c.popen.pid for n, c in self.children.items()},
        )  # fmt: skip

    def _wait_workers(self, coord: Coordinator, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for name in coord.members.values():
            child = self.children[name]
            try:
                child.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit after the job finished; killing it", name)
            if child.popen.returncode not in (0, None):
                log.warning("%s exited with code %s after finishing", name, child.popen.returncode)

    def _collect_events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for name in self.children:
            key = keys.events(name)
            if not self.store.check([key]):
                continue
            for line in self.store.get(key).decode().splitlines():
                if line.strip():
                    events.append(json.loads(line))
        return events

    @property
    def events(self) -> list[dict[str, Any]]:
        """Launcher and coordinator events so far (process events are collected at the end)."""
        return self._events

    def _cleanup(self) -> None:
        from checkpointless.data.shm_cache import ShmBatchCache

        ShmBatchCache(self.job_id, cleanup_on_exit=False).cleanup()  # the node-local batch cache
        try:
            self.store.set(keys.JOB_STOP, "1")
        except Exception:
            pass
        deadline = time.monotonic() + 5
        for child in self.children.values():
            try:
                child.popen.wait(timeout=max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.popen.wait(timeout=5)
            child.log_file.close()
