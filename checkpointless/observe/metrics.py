"""Prometheus metrics endpoint served by the job coordinator while a job runs.

Every :class:`JobMetrics` owns a private :class:`prometheus_client.CollectorRegistry`, so several
jobs (or tests) in one process never clash over metric names in the global registry.

Exposed metrics (all prefixed ``checkpointless_``):

* ``checkpointless_last_committed_step`` (gauge): highest step committed by any rank.
* ``checkpointless_step_commits_total`` (counter): number of per-rank step commits seen.
* ``checkpointless_tokens_per_second`` (gauge): tokens committed per second, all ranks together,
  over a recent sliding window; computed at scrape time, so it decays to 0 while the job stalls.
* ``checkpointless_goodput`` (gauge): fraction of wall time spent on useful training, 0..1.
* ``checkpointless_faults_total{kind,cause}`` (counter): faults detected, by what was detected
  (``kind``: crash, hang, stuck, exception, start_failure) and the detection reason (``cause``:
  process_exit, heartbeat_timeout, no_progress, exception, start_failure, start_timeout). One fault counts once,
  as ``report.json`` lists it (:func:`checkpointless.observe.fault_list.derive_faults`): a hang the
  coordinator then kills is one ``hang``, not also a ``crash``.
* ``checkpointless_recovery_seconds`` (histogram): recovery durations, buckets 0.05 s .. 30 s.
* ``checkpointless_step_time_seconds{rank}`` (gauge): last step time reported by each rank.
* ``checkpointless_generation`` (gauge): current generation (bumped after every recovery).
* ``checkpointless_replicas`` (gauge): data-parallel replicas of the current generation (an elastic
  job's shrinks lower it).

Example::

    metrics = JobMetrics(port=9400)
    metrics.start()
    metrics.step_committed(rank=0, step=12, step_time_s=0.21, tokens=4096)
    ...
    metrics.stop()
"""

from __future__ import annotations

import errno
import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["RECOVERY_BUCKETS", "JobMetrics"]

#: Histogram buckets for recovery durations, suited to roughly 0.05 s .. 30 s.
RECOVERY_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0)

_PREFIX = "checkpointless_"


class JobMetrics:
    """Prometheus metrics for one training job, served over HTTP from a background thread.

    Args:
        port: TCP port to listen on; ``0`` picks a free port (read it back from :attr:`port`).
        addr: address to bind, loopback by default.
        window_s: length of the sliding window used for the tokens-per-second gauge.
        clock: monotonic time source in seconds (injectable for tests).

    The update methods are thread-safe and may be called before :meth:`start` or after
    :meth:`stop`; they only change in-memory values.
    """

    def __init__(
        self,
        port: int,
        addr: str = "127.0.0.1",
        *,
        window_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be an int in 0..65535, got {port!r}")
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self._requested_port = port
        self._addr = addr
        self._window_s = float(window_s)
        self._clock = clock
        self._lock = threading.Lock()
        # (time, tokens) of recent commits, oldest first; start of activity for the rate.
        self._recent: deque[tuple[float, int]] = deque()
        self._active_since: float | None = None
        self._max_step: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._last_step = Gauge(
            _PREFIX + "last_committed_step", "Highest training step committed by any rank.", registry=reg
        )
        self._last_step.set(-1)
        self._commits = Counter(
            _PREFIX + "step_commits", "Number of per-rank step commits observed.", registry=reg
        )
        self._tokens_per_s = Gauge(
            _PREFIX + "tokens_per_second",
            f"Tokens committed per second over all ranks, over a sliding window of {self._window_s:g} s.",
            registry=reg,
        )
        self._tokens_per_s.set_function(self._tokens_rate)
        self._goodput = Gauge(
            _PREFIX + "goodput", "Fraction of wall time spent on useful training (0..1).", registry=reg
        )
        self._faults = Counter(
            _PREFIX + "faults", "Faults detected, by kind and cause.", ["kind", "cause"], registry=reg
        )
        self._recovery = Histogram(
            _PREFIX + "recovery_seconds",
            "Time from fault detection to training resumed.",
            buckets=RECOVERY_BUCKETS,
            registry=reg,
        )
        self._step_time = Gauge(
            _PREFIX + "step_time_seconds", "Last step time reported by each rank.", ["rank"], registry=reg
        )
        self._host_cpu = Gauge(
            _PREFIX + "host_cpu_percent",
            "CPU in use on a host, percent of all its cores.",
            ["host"],
            registry=reg,
        )
        self._host_mem = Gauge(
            _PREFIX + "host_memory_used_bytes", "Memory in use on a host.", ["host"], registry=reg
        )
        self._rank_cpu = Gauge(
            _PREFIX + "rank_cpu_percent", "CPU used by a rank's process, percent of one core.", ["host", "rank"],
            registry=reg,
        )  # fmt: skip
        self._gpu_util = Gauge(
            _PREFIX + "gpu_utilization_percent",
            "An accelerator's utilisation (NVML).",
            ["host", "gpu"],
            registry=reg,
        )
        self._gpu_mem = Gauge(
            _PREFIX + "gpu_memory_used_bytes",
            "An accelerator's memory in use (NVML).",
            ["host", "gpu"],
            registry=reg,
        )
        self._generation = Gauge(
            _PREFIX + "generation", "Current generation (incremented on each recovery).", registry=reg
        )
        self._replicas = Gauge(
            _PREFIX + "replicas", "Data-parallel replicas of the current generation.", registry=reg
        )

    # ------------------------------------------------------------------ server lifecycle

    def start(self) -> None:
        """Start serving ``/metrics`` on ``addr:port`` from a daemon thread.

        Raises:
            OSError: the port is already in use (the message names the address and port).
            RuntimeError: the server is already running.
        """
        if self._server is not None:
            raise RuntimeError(f"metrics server already running on port {self.port}")
        try:
            result = start_http_server(self._requested_port, self._addr, registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(
                    errno.EADDRINUSE,
                    f"checkpointless metrics: port {self._requested_port} on {self._addr} is already in use",
                ) from exc
            raise OSError(
                exc.errno,
                f"checkpointless metrics: cannot serve on {self._addr}:{self._requested_port}: {exc}",
            ) from exc
        # prometheus_client >= 0.17 returns (server, thread); older versions return None.
        if isinstance(result, tuple) and len(result) == 2:
            self._server, self._thread = result
        else:  # pragma: no cover - very old prometheus_client
            raise RuntimeError("prometheus_client >= 0.17 is required (start_http_server returned no server)")

    @property
    def port(self) -> int:
        """The port actually bound (resolves a requested ``0``); the requested port before start."""
        if self._server is not None:
            return int(self._server.server_address[1])
        return self._requested_port

    @property
    def addr(self) -> str:
        """The address the server binds to."""
        return self._addr

    @property
    def running(self) -> bool:
        """Whether the HTTP server is currently serving."""
        return self._server is not None

    @property
    def url(self) -> str:
        """The scrape URL, e.g. ``http://127.0.0.1:9400/metrics``."""
        host = f"[{self._addr}]" if ":" in self._addr else self._addr
        return f"http://{host}:{self.port}/metrics"

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the HTTP server and free the port. Safe to call more than once."""
        server, thread = self._server, self._thread
        self._server, self._thread = None, None
        if server is None:
            return
        try:
            server.shutdown()
        finally:
            server.server_close()
        if thread is not None:
            thread.join(timeout)

    def __enter__(self) -> JobMetrics:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ updates

    def step_committed(self, rank: int, step: int, step_time_s: float, tokens: int) -> None:
        """Record that ``rank`` committed ``step``, which took ``step_time_s`` and processed ``tokens``."""
        now = self._clock()
        with self._lock:
            if self._active_since is None:
                # The first step's tokens were produced during the step, not at the commit instant.
                self._active_since = now - max(float(step_time_s), 0.0)
            self._recent.append((now, int(tokens)))
            self._prune(now)
            if self._max_step is None or step > self._max_step:
                self._max_step = int(step)
                self._last_step.set(step)
        self._commits.inc()
        self._step_time.labels(rank=str(rank)).set(float(step_time_s))

    def fault(self, kind: str, cause: str = "unknown") -> None:
        """Count one fault of ``kind`` (e.g. ``"crash"``, ``"hang"``) detected as ``cause``
        (e.g. ``"process_exit"``, ``"heartbeat_timeout"``)."""
        self._faults.labels(kind=str(kind), cause=str(cause)).inc()

    def recovery(self, seconds: float) -> None:
        """Observe one recovery that took ``seconds``."""
        self._recovery.observe(float(seconds))

    def generation(self, n: int, replicas: int | None = None) -> None:
        """Set the current generation number (and its data-parallel replicas, if given)."""
        self._generation.set(n)
        if replicas is not None:
            self._replicas.set(replicas)

    def goodput(self, x: float) -> None:
        """Set the goodput fraction (useful training time / wall time)."""
        self._goodput.set(float(x))

    def host_usage(self, usage: dict[str, Any]) -> None:
        """Set a host's gauges from one ``host_usage`` event (``observe/usage.py``)."""
        host = str(usage.get("host"))
        if isinstance(usage.get("cpu_percent"), int | float):
            self._host_cpu.labels(host=host).set(float(usage["cpu_percent"]))
        if isinstance(usage.get("mem_used_bytes"), int):
            self._host_mem.labels(host=host).set(usage["mem_used_bytes"])
        for rank, cpu in (usage.get("ranks") or {}).items():
            self._rank_cpu.labels(host=host, rank=str(rank)).set(float(cpu))
        for g in usage.get("gpus") or []:
            self._gpu_util.labels(host=host, gpu=str(g["index"])).set(float(g["util_percent"]))
            self._gpu_mem.labels(host=host, gpu=str(g["index"])).set(int(g["mem_used_bytes"]))

    # ------------------------------------------------------------------ internals

    def _prune(self, now: float) -> None:
        horizon = now - self._window_s
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()

    def _tokens_rate(self) -> float:
        """Tokens per second over the window; called by prometheus_client at scrape time."""
        now = self._clock()
        with self._lock:
            self._prune(now)
            if self._active_since is None or not self._recent:
                return 0.0
            start = max(now - self._window_s, self._active_since)
            elapsed = now - start
            if elapsed <= 0:
                return 0.0
            return sum(tok for _, tok in self._recent) / elapsed
