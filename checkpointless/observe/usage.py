"""What a host's resources do while the job runs: CPU and memory from ``/proc``, and each
accelerator's utilisation and memory through NVML where it is there (``pynvml``, installed with
NVIDIA's driver stack; absent on a CPU machine). Sampled by each host's agent into its status and
by the launcher for its own host; the launcher records them as ``host_usage`` events, which feed
the Prometheus endpoint and ``report.json`` (``hosts``), so a user sees idle accelerators during a
recovery."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from checkpointless.protocol.vocab import Event


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of every core since boot, from ``/proc/stat``."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        values = [int(v) for v in fields]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


def _memory() -> tuple[int, int] | None:
    """(used, total) bytes: total minus what the kernel says is available."""
    try:
        info = dict(
            line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line
        )
        total = int(info["MemTotal"].split()[0]) * 1024
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    return total - available, total


class UsageSampler:
    """``sample()``: the host's use since the previous sample (CPU) and now (memory, GPUs)."""

    def __init__(self) -> None:
        self._last = _cpu_times()
        self._nvml: Any = None
        with contextlib.suppress(Exception):  # no pynvml, no driver, no device: no GPU figures
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml

    def sample(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cpus": os.cpu_count() or 1}
        now = _cpu_times()
        if now is not None and self._last is not None and now[1] > self._last[1]:
            out["cpu_percent"] = round(100.0 * (now[0] - self._last[0]) / (now[1] - self._last[1]), 1)
        self._last = now
        mem = _memory()
        if mem is not None:
            out["mem_used_bytes"], out["mem_total_bytes"] = mem
        if self._nvml is not None:
            out["gpus"] = self._gpus()
        return out

    def _gpus(self) -> list[dict[str, Any]]:
        nv, gpus = self._nvml, []
        with contextlib.suppress(Exception):
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                util, mem = nv.nvmlDeviceGetUtilizationRates(h), nv.nvmlDeviceGetMemoryInfo(h)
                gpus.append({"index": i, "util_percent": float(util.gpu), "mem_used_bytes": int(mem.used),
                             "mem_total_bytes": int(mem.total)})  # fmt: skip
        return gpus


def summarize(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``report.json``'s ``hosts``: per host, the mean and peak CPU share, the peak memory, and
    each accelerator's mean utilisation and peak memory, over its ``host_usage`` events."""
    summary = UsageSummary()
    for e in events:
        summary.add(e)
    return summary.result()


class _Mean:
    __slots__ = ("n", "peak", "total")

    def __init__(self) -> None:
        self.n, self.total = 0, 0.0
        self.peak: float | None = None

    def add(self, x: float) -> None:
        self.n, self.total = self.n + 1, self.total + x
        self.peak = x if self.peak is None else max(self.peak, x)

    def mean(self) -> float | None:
        return round(self.total / self.n, 1) if self.n else None


class UsageSummary:
    """:func:`summarize`, fed one event at a time: its memory grows with hosts and accelerators, not
    with samples (the launcher's, fed every ``host_usage`` event of a job of any length)."""

    def __init__(self) -> None:
        self._hosts: dict[str, dict[str, Any]] = {}

    def add(self, e: dict[str, Any]) -> None:
        if e.get("kind") != Event.HOST_USAGE or not isinstance(e.get("host"), str):
            return
        h = self._hosts.setdefault(e["host"], {"samples": 0, "cpu": _Mean(), "mem": _Mean(), "gpus": {}})
        h["samples"] += 1
        if isinstance(cpu := e.get("cpu_percent"), int | float):
            h["cpu"].add(float(cpu))
        if isinstance(mem := e.get("mem_used_bytes"), int):
            h["mem"].add(mem)
        for g in e.get("gpus") or []:
            util, gmem = h["gpus"].setdefault(int(g["index"]), (_Mean(), _Mean()))
            util.add(float(g["util_percent"]))
            gmem.add(int(g["mem_used_bytes"]))

    def result(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for host, h in sorted(self._hosts.items()):
            mem_peak = h["mem"].peak
            entry: dict[str, Any] = {
                "samples": h["samples"],
                "cpu_percent_mean": h["cpu"].mean(),
                "cpu_percent_max": h["cpu"].peak,
                "mem_used_bytes_max": int(mem_peak) if mem_peak is not None else None,
            }
            if h["gpus"]:
                entry["gpus"] = [
                    {"index": i, "util_percent_mean": util.mean(), "mem_used_bytes_max": int(gmem.peak)}
                    for i, (util, gmem) in sorted(h["gpus"].items())
                ]
            out[host] = entry
        return out


class UsageRecorder:
    """The launcher's side: every ``every_s``, one ``host_usage`` event's fields per host, with
    each rank's CPU share (percent of one core) from its process's CPU time."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.every_s = every_s
        self._next = 0.0
        self._local: UsageSampler | None = None
        self._marks: dict[str, tuple[float, float]] = {}  # process -> (when, CPU seconds)

    def due(self, now: float) -> bool:
        if now < self._next:
            return False
        self._next = now + self.every_s
        return True

    def local(self) -> dict[str, Any]:
        """This host's usage (the launcher's own host: its processes run here on one host)."""
        if self._local is None:
            self._local = UsageSampler()
        return self._local.sample()

    def rank_cpu(self, now: float, name: str, cpu: float | None) -> float | None:
        """``name``'s CPU share since its last sample, percent of one core (None the first time)."""
        if cpu is None:
            return None
        last, self._marks[name] = self._marks.get(name), (now, cpu)
        if last is None or now <= last[0]:
            return None
        return round(100.0 * max(0.0, cpu - last[1]) / (now - last[0]), 1)
