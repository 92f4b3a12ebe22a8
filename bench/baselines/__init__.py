"""Baselines that ``bench/compare.py`` runs side by side with checkpointless.

Every system trains the same model (``TinyGPT`` at ``DemoModel`` sizes, AdamW), on the same
data (``SyntheticTokens``: a batch is a pure function of (seed, step, dp_rank, dp_size)),
with the same per-(step, rank) RNG reseed as ``checkpointless.Session`` (dropout is
re-executable), at data-parallel world size 2.

This module holds what every baseline shares:

- ``build``: model, optimizer and data from a ``DemoModel`` spec;
- ``StepLog``: the common JSONL log every system writes (one file per process), so one
  analysis function (``analyse``) computes every metric for every system;
- ``analyse``: commit curves, per-fault recovery, lineage (lost, skipped and repeated
  batches), goodput;
- process helpers (environment, free ports, ending process groups).

The common log format, one JSON object per line, every record with ``ev``, ``t``
(``time.time()``), ``rank`` (data-parallel rank) and ``pid``:

``start``     a process started (``attempt``: torchrun restart count, or replacement index)
``resume``    the first step this process executes (``step``; ``source``: init/checkpoint/peer)
``commit``    a step committed by this rank (``step``: the step of the model state it was
              applied to, ``batch``: ``[step, dp_rank, dp_size]`` actually read,
              ``participating``: False when the rank's gradient was not part of the update)
``fault``     a worker was SIGKILLed (``how``: self/external; the killed ``rank``)
``ckpt``      a checkpoint was written (``step``: next step to run after loading it, ``seconds``)
``final``     the last state (``step``, ``digest``: ``checkpointless.state.digest_state``)
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BASELINES_DIR = Path(__file__).resolve().parent
BENCH_DIR = BASELINES_DIR.parent
REPO = BENCH_DIR.parent
PYTHON = sys.executable
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
WORLD = 2


# -- model, data, RNG -------------------------------------------------------------
def spec_from_json(text: str) -> Any:
    from checkpointless.launch.demo import DemoModel

    return DemoModel(**json.loads(text))


def spec_to_json(spec: Any) -> str:
    return json.dumps(asdict(spec))


def build(spec: Any) -> tuple[Any, Any, Any]:
    """(model, optimizer, data) exactly as ``checkpointless.launch.demo.train`` builds them."""
    from checkpointless.launch.demo import build as build_demo

    return build_demo(spec)


def reseed(seed: int, step: int, rank: int) -> None:
    import torch

    from checkpointless.session import step_seed

    torch.manual_seed(step_seed(seed, step, rank))


def digest(model: Any, optimizer: Any, step: int) -> str:
    """``checkpointless.state.digest_state``: model + optimizer state + last committed step."""
    from checkpointless.state import digest_state

    return digest_state(model, optimizer, step)


# -- the common log -------------------------------------------------------------------
class StepLog:
    """Append-only JSONL, line-buffered: every record reaches the kernel before a SIGKILL."""

    def __init__(self, run_dir: Path | str, rank: int, system: str) -> None:
        self.rank, self.system, self.pid = rank, system, os.getpid()
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / f"log-{system}-r{rank}-p{self.pid}.jsonl"
        self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 (closed in close)

    def write(self, ev: str, **fields: Any) -> None:
        rec = {"ev": ev, "t": time.time(), "rank": self.rank, "pid": self.pid, **fields}
        self._f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        self._f.close()


def read_logs(run_dir: Path) -> list[dict[str, Any]]:
    """Every record of every ``log-*.jsonl`` under ``run_dir``, time-sorted (a torn last line is skipped)."""
    recs: list[dict[str, Any]] = []
    for p in sorted(Path(run_dir).glob("log-*.jsonl")):
        for line in p.read_text().splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    recs.sort(key=lambda r: r["t"])
    return recs


def write_records(path: Path, records: Iterable[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


# -- analysis -----------------------------------------------------------------------
def _lineage(commits: list[dict[str, Any]]) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Replay one rank's commits in time order; a commit of step s rolls back every kept commit >= s.

    Returns (kept commits by step, rolled-back commits). A commit that did not contribute a
    gradient (``participating`` False) still moves the state forward but keeps no batch.
    """
    kept: dict[int, dict[str, Any]] = {}
    dropped: list[dict[str, Any]] = []
    for c in sorted(commits, key=lambda r: r["t"]):
        s = int(c["step"])
        for k in [k for k in kept if k >= s]:
            dropped.append(kept.pop(k))
        kept[s] = c
    return kept, dropped


@dataclass
class Analysis:
    system: str
    step_time_s: float
    steps_per_s: float | None
    useful_steps: int
    window_s: float | None
    samples_per_s: float | None
    pre_fault_steps_per_s: float | None
    faults: list[dict[str, Any]]
    lineage: dict[str, Any]
    curve: list[tuple[float, int]] = field(default_factory=list)
    final_digests: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["curve"] = [(round(t, 3), s) for t, s in self.curve]
        return d


def analyse(
    records: Sequence[dict[str, Any]],
    *,
    system: str,
    total_steps: int | None = None,
    world: int = WORLD,
    window: tuple[float, float] | None = None,
) -> Analysis:
    """Every metric of one run, from the common log alone.

    - step time: median gap between consecutive commits (step s, s+1) of one process;
    - per fault (``fault`` records): ``next_commit_s`` kill -> first commit of another rank
      that is never rolled back (torchrun restarts every rank: then it is the restarted
      processes' first commit), ``all_ranks_s`` kill -> every rank has such a commit,
      ``progress_s`` kill -> first such commit of a step beyond every step committed before
      the kill (new progress: after torchrun's redone steps),
      ``lost_steps`` commits made before the kill that were rolled back (worst rank);
    - lineage: per rank the commits that survive to the end; ``skipped`` batch ids (step,
      dp_rank) of [0, last step] that no surviving commit read, ``repeated`` batch ids read
      by more than one surviving commit, ``redone`` rolled-back commits;
    - goodput in ``window`` (default first commit -> last commit): distinct global steps whose
      surviving commits fall in the window per second, and the same weighted by the share of
      the global batch that contributed (``samples_per_s`` in units of global batches/s), and the
      rate before the first fault of the same job (``pre_fault_steps_per_s``: a baseline taken
      under the same machine load).
    """
    commits = [r for r in records if r["ev"] == "commit"]
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for c in commits:
        by_rank[int(c["rank"])].append(c)
    # step time
    gaps: list[float] = []
    for cs in by_rank.values():
        cs.sort(key=lambda r: r["t"])
        for a, b in itertools.pairwise(cs):
            if a["pid"] == b["pid"] and int(b["step"]) == int(a["step"]) + 1:
                gaps.append(float(b["t"]) - float(a["t"]))
    step_time = statistics.median(gaps) if gaps else 0.0
    # lineage
    kept: dict[int, dict[int, dict[str, Any]]] = {}
    dropped: dict[int, list[dict[str, Any]]] = {}
    for rank, cs in by_rank.items():
        kept[rank], dropped[rank] = _lineage(cs)
    last_step = max((s for k in kept.values() for s in k), default=-1)
    if total_steps is not None:
        last_step = min(last_step, total_steps - 1) if last_step >= 0 else last_step
    else:  # a run stopped from outside: its last step may be half committed
        last_step -= 1
    batches: dict[tuple[int, int], int] = defaultdict(int)
    for k in kept.values():
        for c in k.values():
            if c.get("participating", True) and c.get("batch") is not None:
                b = c["batch"]
                batches[(int(b[0]), int(b[1]))] += 1
    expected = {(s, r) for s in range(last_step + 1) for r in range(world)}
    covered = set(batches)
    if system != "torchft":
        # synchronous data parallelism: a surviving commit of step s means the all-reduce of step s
        # completed, so every rank's batch of step s is in the update, even if the rank that read it
        # was killed before its own commit record reached the log (SIGKILL loses its last events)
        kept_steps = {s for k in kept.values() for s in k}
        covered |= {(s, r) for s in kept_steps for r in range(world)}
    skipped = sorted(expected - covered)
    repeated = sorted(b for b, n in batches.items() if n > 1)
    wrong = sorted(b for b in batches if b not in expected)
    lineage = {
        "last_step": last_step,
        "complete": last_step >= 0 and (total_steps is None or last_step == total_steps - 1),
        "skipped": len(skipped),
        "skipped_ids": [list(b) for b in skipped[:50]],
        "repeated": len(repeated),
        "repeated_ids": [list(b) for b in repeated[:50]],
        "unexpected": len(wrong),
        "redone": sum(len(d) for d in dropped.values()),
        "commits": len(commits),
    }
    # faults
    faults = []
    fault_recs = [r for r in records if r["ev"] == "fault"]
    for i, f in enumerate(fault_recs):
        t_f, killed = float(f["t"]), int(f["rank"])
        t_next_fault = float(fault_recs[i + 1]["t"]) if i + 1 < len(fault_recs) else float("inf")
        t_prev_fault = float(fault_recs[i - 1]["t"]) if i > 0 else float("-inf")
        firsts: dict[int, float] = {}
        for rank, k in kept.items():
            after = [
                float(c["t"]) for c in k.values() if float(c["t"]) > t_f and c.get("participating", True)
            ]
            if after:
                firsts[rank] = min(after)
        others = [t for r, t in firsts.items() if r != killed]
        nxt = min(others) if others else (min(firsts.values()) if firsts else None)
        all_back = max(firsts.values()) if len(firsts) == world else None
        # new progress: the first surviving commit of a step beyond every step committed before the kill
        high = max((int(c["step"]) for c in commits if float(c["t"]) <= t_f), default=-1)
        beyond = [
            float(c["t"])
            for k in kept.values()
            for c in k.values()
            if float(c["t"]) > t_f and int(c["step"]) > high
        ]
        progress = min(beyond) if beyond else None
        lost = 0
        for d in dropped.values():
            lost = max(lost, sum(1 for c in d if t_prev_fault < float(c["t"]) <= t_f))
        faults.append(
            {
                "t": t_f,
                "rank": killed,
                "step": f.get("step"),
                "how": f.get("how"),
                "next_commit_s": None if nxt is None or nxt > t_next_fault else nxt - t_f,
                "all_ranks_s": None if all_back is None or all_back > t_next_fault else all_back - t_f,
                "progress_s": None if progress is None or progress > t_next_fault else progress - t_f,
                "lost_steps": lost,
            }
        )
    # goodput and curve: per global step, the time its last surviving commit landed
    step_done: dict[int, float] = {}
    step_share: dict[int, float] = defaultdict(float)
    for k in kept.values():
        for s, c in k.items():
            step_done[s] = max(step_done.get(s, 0.0), float(c["t"]))
            if c.get("participating", True):
                step_share[s] += 1.0 / world
    curve = sorted((t, s) for s, t in step_done.items())
    # all commits (including later rolled-back ones) for the plot: what a dashboard would show
    raw_curve = sorted((float(c["t"]), int(c["step"])) for c in commits if int(c["rank"]) == 0)
    steps_per_s = samples_per_s = pre_fault = None
    useful = 0
    win_len = None
    if curve:
        w0, w1 = window if window is not None else (curve[0][0], curve[-1][0])
        inside = [s for t, s in curve if w0 <= t <= w1]
        useful = len(inside)
        win_len = w1 - w0
        if win_len > 0:
            steps_per_s = useful / win_len
            samples_per_s = sum(step_share[s] for s in inside) / win_len
        if fault_recs and w0 < float(fault_recs[0]["t"]) <= w1:
            t_f0 = float(fault_recs[0]["t"])
            pre_fault = sum(1 for t, _ in curve if w0 <= t <= t_f0) / (t_f0 - w0)
    return Analysis(
        system=system,
        step_time_s=step_time,
        steps_per_s=steps_per_s,
        useful_steps=useful,
        window_s=win_len,
        samples_per_s=samples_per_s,
        pre_fault_steps_per_s=pre_fault,
        faults=faults,
        lineage=lineage,
        curve=raw_curve,
        final_digests=sorted({str(r["digest"]) for r in records if r["ev"] == "final"}),
    )


# -- processes ------------------------------------------------------------------------
def child_env(**extra: str) -> dict[str, str]:
    """A child process's environment: one intra-op thread, unbuffered output, and the repository's
    root on ``PYTHONPATH`` (a worker started as ``python -m bench.NAME`` imports ``bench``)."""
    env = dict(os.environ)
    env.update(THREAD_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], log_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A child in its own process group, output to ``log_path``. Not its own session: it stays in
    the caller's scheduling autogroup (Linux), as checkpointless's workers stay in their launcher's
    (ranks in an autogroup each wait longer for one another at every collective)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0)


def end_group(p: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """SIGTERM the child's process group, then SIGKILL it; reap the child."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(timeout=wait)
            if sig == signal.SIGTERM:
                # the leader is gone; make sure nothing of its group survives it
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            return
        except subprocess.TimeoutExpired:
            continue


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def current_pid(run_dir: Path, rank: int, after: float = 0.0) -> int | None:
    """The live process that most recently logged ``start`` for ``rank``."""
    best: tuple[float, int] | None = None
    for r in read_logs(run_dir):
        if (
            r["ev"] == "start"
            and int(r["rank"]) == rank
            and float(r["t"]) >= after
            and pid_alive(int(r["pid"]))
        ) and (best is None or float(r["t"]) > best[0]):
            best = (float(r["t"]), int(r["pid"]))
    return best[1] if best else None


def first_commit_time(run_dir: Path) -> float | None:
    ts = [float(r["t"]) for r in read_logs(run_dir) if r["ev"] == "commit"]
    return min(ts) if ts else None


@dataclass
class RunResult:
    """What a driver returns: where the logs are and how the run ended."""

    system: str
    run_dir: Path
    ok: bool
    wall_s: float
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    window: tuple[float, float] | None = None

    def records(self) -> list[dict[str, Any]]:
        return read_logs(self.run_dir)


class PeriodicKiller:
    """Kill rank ``rank``'s current process every ``every_s`` seconds after ``t0`` (time-based faults).

    ``find_pid`` returns the live process holding the rank (None while it is being restarted:
    the kill is then postponed until one exists). Each kill is logged as a ``fault`` record.
    """

    def __init__(self, run_dir: Path, every_s: float, rank: int = 1) -> None:
        self.run_dir, self.every_s, self.rank = run_dir, every_s, rank
        self.t0: float | None = None
        self.kills = 0
        self._log: StepLog | None = None
        self._last_kill = 0.0

    def tick(self, find_pid: Any) -> None:
        if self.every_s <= 0 or self.t0 is None:
            return
        due = self.t0 + (self.kills + 1) * self.every_s
        if time.time() < due:
            return
        pid = find_pid()
        if pid is None:
            return
        if self._log is None:
            self._log = StepLog(self.run_dir, -1, "killer")
        self._log.write("fault", rank=self.rank, how="external", killed_pid=pid, step=None)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.kills += 1
        self._last_kill = time.time()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
