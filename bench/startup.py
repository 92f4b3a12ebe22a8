"""What a job's start costs with and without the fork server (``launch/forkserver.py``): the same
fault-free demo job, started the usual way and from the fork server, interleaved ``reps`` times.

Per job: its wall time, the CPU seconds of its whole process tree (the launcher's children as it
waits for them), and its start (the launcher's ``job_started`` to the first commit). Each is given
per setting and as the paired per-repetition ratio fork server / usual, with a 95% interval.

Usage: ``python -m bench.startup [--reps N] [--workers W] [--steps K]`` ->
``bench/out/startup/startup.json`` (the commit and the machine recorded in it).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from checkpointless.protocol.env import ENV_FORK_SERVER
from checkpointless.protocol.vocab import Event

OUT = common.OUT / "startup"
SETTINGS = {"usual": "0", "fork server": "1"}


def one(out: Path, workers: int, steps: int, fork: str) -> dict[str, Any]:
    """One fault-free demo job; its wall time, its tree's CPU seconds and its start."""
    cmd = [sys.executable, "-m", "checkpointless", "demo", "--workers", str(workers), "--spares", "1",
           "--steps", str(steps), "--fault", "none", "--quiet", "--out", str(out)]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=common.child_env(**{ENV_FORK_SERVER: fork}), capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"the demo failed ({fork=}): {proc.stderr[-2000:]}")
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    started = min(e["t"] for e in events if e["kind"] == Event.JOB_STARTED)
    first = min(e["t"] for e in events if e["kind"] == Event.STEP_COMMITTED or "ranks" in e)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "start_s": first - started}


def run(reps: int, workers: int, steps: int, out: Path) -> dict[str, Any]:
    out = common.fresh_dir(out)
    rows: list[dict[str, Any]] = []
    for rep in range(reps):  # interleaved, the order alternating: a drift in load hits both alike
        order = list(SETTINGS.items()) if rep % 2 == 0 else list(SETTINGS.items())[::-1]
        for label, fork in order:
            rows.append({"rep": rep, "setting": label, **one(out / f"r{rep}-{fork}", workers, steps, fork)})
    result: dict[str, Any] = {"reps": reps, "workers": workers, "spares": 1, "steps": steps,
                              "machine": common.machine_info(), "git": common.git_state(), "rows": rows}  # fmt: skip
    for metric in ("wall_s", "cpu_s", "start_s"):
        by = {label: {r["rep"]: r[metric] for r in rows if r["setting"] == label} for label in SETTINGS}
        ratios = [by["fork server"][i] / by["usual"][i] for i in range(reps) if by["usual"][i] > 0]
        result[metric] = {
            **{label: common.summary(by[label].values()) for label in SETTINGS},
            "ratio": common.paired_interval(ratios),  # (geometric mean, low, high)
        }
    return result


LABELS = {"wall_s": "job wall time, s", "cpu_s": "CPU of the job's processes, s",
          "start_s": "start (job_started -> first commit), s"}  # fmt: skip


def markdown(res: dict[str, Any]) -> str:
    rows = []
    for metric, label in LABELS.items():
        m = res[metric]
        ratio = m.get("ratio")
        cell = f"{ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]" if ratio else "–"
        rows.append([label, f"{m['usual']['median']:.2f}", f"{m['fork server']['median']:.2f}", cell])
    return "\n".join([
        f"The demo, {res['workers']} workers + {res['spares']} spare, {res['steps']} fault-free steps, started the "
        f"usual way (each process a fresh interpreter) and from the fork server, interleaved; {res['reps']} "
        "repetitions. Medians, and the paired ratio fork server / usual with its 95% interval.",
        "",
        common.md_table(["", "usual", "fork server", "fork server / usual"], rows),
    ])  # fmt: skip


def run_bench(quick: bool, out: Path) -> dict[str, Any]:
    """Entry point for ``bench/run_all.py``: 6 repetitions (quick: 2), 4 workers, 10 steps."""
    return run(2 if quick else 6, 4, 10, out / "startup")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    result = run(a.reps, a.workers, a.steps, a.out / "jobs")
    common.write_json(a.out / "startup.json", result)
    for metric in ("wall_s", "cpu_s", "start_s"):
        ratio = result[metric]["ratio"]
        line = f"{metric}: " + ", ".join(f"{k} median {v['median']:.2f}" for k, v in result[metric].items()
                                         if k != "ratio")  # fmt: skip
        if ratio:
            line += f"; fork server / usual {ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]"
        print(line)


if __name__ == "__main__":
    main()
