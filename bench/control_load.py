"""What the control plane takes from the cores the ranks train on, counted by the kernel.

A steady-state overhead of a few percent is hard to see in wall-clock step times on a shared
2-core machine (pairs of runs differ by several percent on their own), so this counts it: one
``checkpointless run`` of the ``llama-tiny`` recipe, FSDP2 HSDP 2x2 on 4 workers with one idle
spare, and the plain FSDP2 HSDP baseline (``baselines/fsdp2_plain.py``) on the same layout.
Once rank 0 has committed ``SKIP`` steps, every thread of the job is read from ``/proc`` (CPU
time, voluntary context switches: a thread that blocks and is woken again), and again
``WINDOW_S`` later. Reported per second and per step of the window:

- the launcher (coordinator and the control store's server thread): CPU and wake-ups;
- the workers' Python threads besides the main one (the heartbeat and the data prefetcher);
- the idle spare;
- each worker's main thread: CPU and wake-ups per step, against the plain baseline's.

And the cost of a process layout: plain FSDP2 HSDP 2x2 with its ranks in one session against a
session each (``fsdp2_plain.py --session-each``; with Linux's scheduling autogroups, a group
each: how the launcher started its children before it gave them a process group each instead),
``AB_STEPS`` steps, alternating ``AB_REPS`` pairs, the median gap between rank 0's steps.

Usage: ``python -m bench.control_load [--quick]`` -> ``bench/out/control_load.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from checkpointless.protocol.vocab import Event

RECIPE = common.REPO / "recipes" / "llama-tiny.yaml"
SETS = ["data.eval_every=0", "optim.warmup_steps=2"]
STEPS, QUICK_STEPS = 400, 200
SKIP = 20
WINDOW_S, QUICK_WINDOW_S = 40.0, 15.0
AB_STEPS, AB_REPS, QUICK_AB_REPS = 80, 4, 1
WARMUP = 10
_TICK = os.sysconf("SC_CLK_TCK")


def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _threads(pid: int) -> dict[int, tuple[str, float, int]]:
    """Every thread of ``pid``: (name, CPU seconds, voluntary context switches)."""
    out: dict[int, tuple[str, float, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / _TICK
        vol = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt"))
        out[int(tid)] = (name, cpu, vol)
    return out


def _role(pid: int) -> str | None:
    """``w0``.. / ``s0``.. for a checkpointless process, ``r0``.. for a plain rank, else None.

    A process forked by the fork server keeps the fork server's ``/proc/PID/environ`` (the child
    sets ``os.environ``, which the kernel's copy does not follow), but the fork server names it
    ``cpl-w3``, ``cpl-s0``.. (``/proc/PID/comm``); one started the usual way has its role in its
    environment."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    named = re.fullmatch(r"cpl-([ws]\d+)", comm)
    if named:
        return named.group(1)
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"CHECKPOINTLESS_PROC="):
            return item.split(b"=", 1)[1].decode()
    for item in env:
        if item.startswith(b"RANK="):
            return "r" + item.split(b"=", 1)[1].decode()
    return None


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid``: the workers are the fork server's children, not the launcher's."""
    out, todo = [], _children(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(_children(child))
    return out


def _snapshot(root: int) -> dict[str, dict[int, tuple[str, float, int]]]:
    """Threads of the root process (``launcher``) and of every process under it with a role."""
    snap = {"launcher": _threads(root)}
    for child in _descendants(root):
        role = _role(child)
        if role is not None:
            snap[role] = {**_threads(child), 0: ("pid", float(child), 0)}
    return snap


def _delta(
    a: dict[int, tuple[str, float, int]], b: dict[int, tuple[str, float, int]]
) -> dict[str, list[float]]:
    """Per thread kind (``main``, ``python``: other Python threads, ``gloo``, ``store``): CPU s, wake-ups.

    A thread is named as the thread that started it, unless it names itself: the Python threads
    carry the main thread's name (``python``, or ``cpl-w3``.. in a process the fork server named)."""
    main = int(b[0][1]) if 0 in b else min((t for t in b if t), default=0)
    main_name = b[main][0] if main in b else "python"
    kinds: dict[str, list[float]] = {}
    for tid, (name, cpu, vol) in b.items():
        if tid == 0 or tid not in a:
            continue
        kind = (
            "main" if tid == main
            else "gloo" if "gloo" in name
            else "store" if "tcpstore" in name
            else "python" if name == main_name
            else "other"
        )  # fmt: skip
        acc = kinds.setdefault(kind, [0.0, 0.0])
        acc[0] += cpu - a[tid][1]
        acc[1] += vol - a[tid][2]
    return kinds


def _committed(out: Path, plain: bool) -> list[float]:
    """Times of rank 0's commits so far."""
    try:
        if plain:
            return []  # the baseline writes its times at the end
        lines = (out / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    times = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line being written
        if e.get("kind") == Event.STEP_COMMITTED and e.get("rank") == 0:
            times.append(float(e["t"]))
    return times


def measure(system: str, steps: int, window: float, out: Path) -> dict[str, Any]:
    plain = system == "plain"
    if plain:
        cmd = [common.PYTHON, str(common.BENCH_DIR / "baselines" / "fsdp2_plain.py"), str(RECIPE), "--workers", "4",
               "--shards", "2", "--out", str(out), *_sets([*SETS, f"train.steps={steps}"])]  # fmt: skip
    else:
        cmd = [common.PYTHON, "-m", "checkpointless", "run", str(RECIPE), "--quiet", "--workers", "4",
               "--spares", "1", "--out", str(out),
               *_sets([*SETS, f"train.steps={steps}", "parallel.shards=2"])]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen(cmd, env=common.child_env(), cwd=common.REPO, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        root = p.pid
        deadline = time.monotonic() + 600
        if plain:  # no live progress: start the window once the ranks have run for a while
            time.sleep(25.0)
        else:
            while len(_committed(out, plain)) < SKIP and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
        a, t0 = _snapshot(root), time.time()
        time.sleep(window)
        b, t1 = _snapshot(root), time.time()
        _, err = p.communicate(timeout=900)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    if p.returncode != 0:
        return {"system": system, "ok": False, "error": (err or "")[-2000:]}
    times = (
        json.loads((out / "times.json").read_text()) if plain else _committed(out, plain)
    )  # rank 0's commits
    n = sum(1 for t in times if t0 <= t <= t1)
    per = {role: _delta(a[role], b[role]) for role in b if role in a}
    dt = t1 - t0

    def rate(role_prefix: str, kind: str, i: int) -> float:
        return sum(d.get(kind, [0.0, 0.0])[i] for r, d in per.items() if r.startswith(role_prefix))

    workers = [r for r in per if r[0] in "wr"]
    return {
        "system": system,
        "ok": True,
        "window_s": dt,
        "steps": n,
        "step_s": dt / n if n else None,
        "launcher_cpu_pct": 100 * sum(v[0] for v in per.get("launcher", {}).values()) / dt,
        "launcher_wakeups_per_s": sum(v[1] for v in per.get("launcher", {}).values()) / dt,
        "worker_side_threads_cpu_pct": 100 * rate("w", "python", 0) / dt,
        "worker_side_threads_wakeups_per_s": rate("w", "python", 1) / dt,
        "spare_cpu_pct": 100
        * sum(v[0] for r, d in per.items() if r.startswith("s") for v in d.values())
        / dt,
        "main_cpu_ms_per_step": 1000 * sum(per[r].get("main", [0, 0])[0] for r in workers) / len(workers) / n
        if n and workers
        else None,
        "main_wakeups_per_step": sum(per[r].get("main", [0, 0])[1] for r in workers) / len(workers) / n
        if n and workers
        else None,
        "threads": {r: {k: [round(v[0], 3), int(v[1])] for k, v in d.items()} for r, d in per.items()},
    }


def plain_step(out: Path, session_each: bool) -> float | None:
    cmd = [common.PYTHON, str(common.BENCH_DIR / "baselines" / "fsdp2_plain.py"), str(RECIPE), "--workers", "4",
           "--shards", "2", "--out", str(out), *_sets([*SETS, f"train.steps={AB_STEPS}"])]  # fmt: skip
    if session_each:
        cmd.append("--session-each")
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env=common.child_env(), cwd=common.REPO
    )
    if p.returncode != 0:
        print(p.stderr[-2000:], file=sys.stderr)
        return None
    t = json.loads((out / "times.json").read_text())[WARMUP:]
    return statistics.median(b - a for a, b in itertools.pairwise(t))


def run(quick: bool, out: Path) -> dict[str, Any]:
    common.pin_threads()
    dest = common.fresh_dir(out / "control_load")
    steps, window = (QUICK_STEPS, QUICK_WINDOW_S) if quick else (STEPS, WINDOW_S)
    rows = [measure(system, steps, window, dest / system) for system in ("checkpointless", "plain")]
    pairs: list[dict[str, float | None]] = []
    for rep in range(QUICK_AB_REPS if quick else AB_REPS):
        order = [False, True] if rep % 2 == 0 else [True, False]
        pairs.append({("session_each" if s else "one_session"): plain_step(dest / f"ab-{int(s)}-{rep}", s)
                      for s in order})  # fmt: skip
    ratios = [p["session_each"] / p["one_session"] for p in pairs if p["session_each"] and p["one_session"]]
    return {"quick": quick, "model": "llama-tiny, FSDP2 HSDP 2x2 on 4 workers", "rows": rows,
            "sessions": {"steps": AB_STEPS, "pairs": pairs, "ratio": common.summary(ratios)},
            "machine": common.machine_info()}  # fmt: skip


def markdown(res: dict[str, Any]) -> str:
    by = {r["system"]: r for r in res["rows"]}
    cl, plain = by.get("checkpointless", {}), by.get("plain", {})
    if not cl.get("ok") or not plain.get("ok"):
        return "FAILED: " + str(cl.get("error") or plain.get("error"))
    f = common.fmt
    table = common.md_table(
        ["", "checkpointless (1 idle spare)", "plain FSDP2"],
        [
            ["step s in the window (rank 0)", f(cl["step_s"]), f(plain["step_s"])],
            ["launcher: CPU % of a core", f(cl["launcher_cpu_pct"]), "–"],
            ["launcher: wake-ups per s (all its threads)", f(cl["launcher_wakeups_per_s"]), "–"],
            ["workers' other Python threads: CPU % of a core (4 workers)", f(cl["worker_side_threads_cpu_pct"]),
             f(plain["worker_side_threads_cpu_pct"])],
            ["idle spare: CPU % of a core", f(cl["spare_cpu_pct"]), "–"],
            ["worker main thread: CPU ms per step", f(cl["main_cpu_ms_per_step"]), f(plain["main_cpu_ms_per_step"])],
            ["worker main thread: wake-ups per step", f(cl["main_wakeups_per_step"]),
             f(plain["main_wakeups_per_step"])],
        ],
    )  # fmt: skip
    text = f"{res['model']}; a {cl['window_s']:.0f} s window after rank 0's step {SKIP}.\n\n" + table + "\n"
    r = res["sessions"]["ratio"]
    if r.get("n"):
        text += (
            f"\nPlain FSDP2 HSDP 2x2, ranks in a session each / all in one session (step time, "
            f"{r['n']} alternating pairs of {res['sessions']['steps']} steps): median **{r['median']:.3f}** "
            f"(min {r['min']:.3f}, max {r['max']:.3f}).\n"
        )
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    res = run(a.quick, common.OUT)
    common.write_json(common.OUT / "control_load.json", res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
