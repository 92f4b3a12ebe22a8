"""Shared helpers of the benchmarks: statistics, machine description, output paths, process hygiene.

Every benchmark runs as a module from the repository's root (``python -m bench.NAME``) and
imports this one as ``from bench import common``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
OUT = BENCH_DIR / "out"  # scratch: logs, plots, full raw data (git-ignored)
RESULTS = (
    BENCH_DIR / "results"
)  # committed: one small JSON per benchmark, what docs/benchmarks.md is made from
PYTHON = sys.executable

# Every process of every benchmark runs with one intra-op thread (the Makefile sets it too).
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def pin_threads() -> None:
    """One intra-op thread in this process, as in every worker."""
    import torch

    os.environ.update(THREAD_ENV)
    torch.set_num_threads(1)


def child_env(**extra: str) -> dict[str, str]:
    """A child process's environment: one intra-op thread, unbuffered output, and the repository's
    root on ``PYTHONPATH`` (a worker started as ``python -m bench.NAME`` imports ``bench``)."""
    env = dict(os.environ)
    env.update(THREAD_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


# -- statistics -----------------------------------------------------------------
def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    if len(s) == 1:
        return float(s[0])
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def summary(xs: Iterable[float | None]) -> dict[str, float | int]:
    vals = [float(x) for x in xs if x is not None]
    if not vals:
        return {"n": 0}
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "p95": percentile(vals, 95),
        "min": min(vals),
        "max": max(vals),
        "mean": statistics.fmean(vals),
    }


# two-sided 95% quantiles of Student's t, by degrees of freedom (1..30; beyond: the normal's)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)  # fmt: skip


def paired_interval(ratios: Sequence[float]) -> tuple[float, float, float] | None:
    """The paired per-repetition ratios' geometric mean and its 95% interval (a t interval on the
    logs: a ratio's log is symmetric around 0 where a ratio is not). None below two pairs."""
    import math

    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    n = len(logs)
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * sd / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def interval_verdict(lo: float, hi: float, limit: float) -> str:
    """``met`` only where the whole interval lies within ``limit`` (a ratio bound such as 1.01);
    ``not met`` where it lies beyond; else neither is established at this resolution."""
    if hi <= limit:
        return "met"
    if lo > limit:
        return "**not met**"
    return f"not established (interval {lo:.3f}-{hi:.3f} straddles {limit:g})"


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        if x != x:  # nan
            return "–"
        return f"{x:.{digits}f}"
    return str(x)


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |")
    return "\n".join(lines)


# -- output ---------------------------------------------------------------------
def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def rel(path: Path | str) -> str:
    """``path`` relative to the repository root (POSIX), or unchanged if it lies outside the repository.

    Every path written into ``docs/benchmarks.md`` goes through this: no machine's absolute path in the page.
    """
    p = Path(path)
    try:
        return p.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return p.as_posix()


#: what the benchmarks write into the tree (``git_state`` does not count them as changed code)
OUTPUTS = ("bench/results", "docs/benchmarks.md", "docs/bench-compare.png", "docs/bench-scale-goodput.png")


def git_state(repo: Path = REPO) -> dict[str, Any]:
    """The code a result was measured with: ``commit`` (``git rev-parse HEAD``) and ``dirty``
    (``git status --porcelain`` non-empty: uncommitted or untracked files in the tree, other than
    the benchmarks' own ``OUTPUTS``).

    ``None`` for either when git cannot tell (no git, not a repository). ``bench/run_all.py``
    stores them in every result as ``_commit`` and ``_dirty``.
    """

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                                 timeout=30, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    # the benchmarks' own outputs do not count: a run of several sections writes them as it goes
    status = git("status", "--porcelain", "--", ".", *(f":!{p}" for p in OUTPUTS))
    return {
        "commit": (commit.strip() or None) if commit is not None else None,
        "dirty": None if status is None else bool(status.strip()),
    }


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- machine ----------------------------------------------------------------------
def _run_text(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def machine_info() -> dict[str, Any]:
    import torch

    lscpu = _run_text(["lscpu"])
    keep = (
        "Architecture",
        "CPU(s):",
        "Model name",
        "Thread(s) per core",
        "Core(s) per socket",
        "Socket(s)",
        "L2 cache",
        "L3 cache",
        "Hypervisor vendor",
    )
    lscpu_lines = [ln for ln in lscpu.splitlines() if ln.startswith(keep) and "NUMA" not in ln]
    return {
        "date": _dt.datetime.now(_dt.UTC).astimezone().isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nproc": str(os.cpu_count()),  # `nproc` would honour OMP_NUM_THREADS=1
        "lscpu": lscpu_lines,
        "free": _run_text(["free", "-h"]),
        "loadavg": load_average(),
    }


# -- processes --------------------------------------------------------------------
def stop_process(p: subprocess.Popen[Any], timeout: float = 5.0) -> None:
    """End a process this benchmark started: wait briefly, then SIGKILL (also wakes a stopped one)."""
    if p.poll() is None:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=10)


def wait_all(procs: Sequence[subprocess.Popen[Any]], timeout: float) -> list[int]:
    """Wait for every process within ``timeout`` seconds in total; kill them all if one overruns."""
    deadline = time.monotonic() + timeout
    codes: list[int] = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return codes
