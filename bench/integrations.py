"""Steady-state step time of each integration against the same script without checkpointless, paired.

- **Hugging Face ``Trainer``**: ``bench/baselines/hf_trainer.py`` (the shape of
  ``tests/scripts/hf_trainer.py``: a ``LlamaForCausalLM`` built from a config, sequences of 64
  tokens, 4 per rank x 2 accumulated micro-batches per optimizer step, clipping, a cosine schedule
  with warm-up, logging every 10 steps; no evaluation, no checkpoints) run two ways on 2 ranks: ``checkpointless launch --workers 2 --spares 0 -- python hf_trainer.py`` with
  ``checkpointless.integrations.transformers.Trainer``, and ``torchrun --standalone
  --nproc-per-node 2 hf_trainer.py --plain`` with ``transformers.Trainer`` (DDP through accelerate,
  gloo; ``ddp_find_unused_parameters=False`` on both sides, see the script). The step time of a
  run is the median gap between consecutive ``on_step_end`` callbacks of rank 0
  (``time.perf_counter()`` inside the script: start-up, model building and the end of the process
  do not count).
- **Lightning**: ``bench/baselines/lightning_trainer.py`` (the shape of
  ``tests/scripts/lightning_train.py``: a ``LightningModule`` MLP classifier with batch norm and
  dropout, a shuffled ``DataLoader`` of 64 samples per rank x 2 accumulated micro-batches per
  optimizer step, AdamW with a per-step LR scheduler, clipping, ``self.log`` every step; no
  validation, checkpoints or logger) run two ways on 2 ranks: ``checkpointless launch --workers 2
  --spares 0 -- python lightning_trainer.py`` with ``strategy=CheckpointlessStrategy()``, and
  ``torchrun --standalone --nproc-per-node 2 lightning_trainer.py --plain`` with Lightning's
  ``DDPStrategy(process_group_backend="gloo")``. The step time of a run is the median gap between
  the ``on_train_batch_end`` callbacks of rank 0 that end an optimizer step (``time.perf_counter()``
  inside the script).

The two sides run at once and take turns (``baselines/turns.py``): every ``TURN_S`` seconds the
benchmark gives the machine to the other job, whose ranks wait at their next optimizer step's end
while the turn is not theirs. Sequential runs compared the machine's moments as much as the
systems (its speed drifts by several percent within a minute: pairs of runs one after the other
gave ratios from 0.78 to 1.39 in one benchmark); turns a few seconds apart see the same machine. A
step counts when it lies inside its job's turn (no turn change between its start and its end),
the first ``WARMUP`` steps of each job left out. A round is a turn of the plain job and the
checkpointless job's next one: its ratio is the medians' ratio, and the rounds' ratios give a
geometric mean with a 95% t interval on their logs (``common.paired_interval``). Goal: within 3%
(interval at or below 1.03). While the plain job has its turn the checkpointless launcher's
coordinator and its waiting ranks' heartbeat threads still run (about 1% of a core,
``control_load.py``): a cost of checkpointless that lands on the plain side's steps, not its own.

Usage: ``python -m bench.integrations [--quick]`` -> ``bench/out/integrations.json``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.baselines import child_env, end_group, start

SCRIPTS = {
    "hf": common.BENCH_DIR / "baselines" / "hf_trainer.py",
    "lightning": common.BENCH_DIR / "baselines" / "lightning_trainer.py",
}
WORKERS = 2
SYSTEMS = ("plain", "checkpointless")
STEPS, QUICK_STEPS = 2400, 160
"""Per job. Rounds' ratios spread from 0.81 to 1.31 on this machine: 600 steps (16 and 12 rounds)
gave intervals of +-6% and +-8%, too wide to tell 3% apart; four times the rounds halve them."""
WARMUP = 10
TURN_S = 2.0  # each job's turn; a step is ~45 ms: some 40 steps a turn
MIN_STEPS_PER_TURN = 5
GOAL = 1.03
RUN_TIMEOUT_S = 900.0


def _command(kind: str, system: str, out: Path, steps: int, turns: Path) -> list[str]:
    script = [str(SCRIPTS[kind]), str(out), str(steps), "--turns", str(turns)]
    if system == "plain":
        return [common.PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORKERS}",
                *script, "--plain"]  # fmt: skip
    return [common.PYTHON, "-m", "checkpointless", "launch", "--workers", str(WORKERS), "--spares", "0",
            "--quiet", "--out", str(out / "launch"), "--", common.PYTHON, *script]  # fmt: skip


def _give_turn(turns: Path, who: str) -> None:
    tmp = turns.with_suffix(".tmp")
    tmp.write_text(who)
    os.replace(tmp, turns)  # a reader sees the old turn or the new one, never half of it


def _take_turns(turns: Path, procs: dict[str, subprocess.Popen[bytes]]) -> list[tuple[float, str]]:
    """Alternate the turn between the jobs until both have ended; the turn changes, as
    ``(time.perf_counter(), whose)``. The turns start once both jobs are built and past their first step."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not all(list(turns.parent.glob(f"{turns.name}.{s}.ready.*")) for s in SYSTEMS):
        if any(p.poll() is not None for p in procs.values()) or time.monotonic() > deadline:
            return []
        time.sleep(0.05)

    def done(s: str) -> bool:
        return procs[s].poll() is not None or bool(list(turns.parent.glob(f"{turns.name}.{s}.done.*")))

    flips: list[tuple[float, str]] = []
    for who in itertools.cycle(SYSTEMS):
        if any(done(s) for s in SYSTEMS) or time.monotonic() > deadline:
            break
        flips.append((time.perf_counter(), who))  # before the write: a step seeing the new turn ends after it
        _give_turn(turns, who)
        until = time.monotonic() + TURN_S
        while time.monotonic() < until and not done(who):
            time.sleep(0.01)
    # One job has run its last step: no more measured turns. It ends alone, then the other runs on.
    flips.append((time.perf_counter(), ""))
    first = next((s for s in SYSTEMS if done(s)), None)
    if first is not None:
        _give_turn(turns, first)
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[first].wait(timeout=max(1.0, deadline - time.monotonic()))
    for s in SYSTEMS:
        _give_turn(turns, s)
        while not done(s) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            procs[s].wait(timeout=max(1.0, deadline - time.monotonic()))
    return flips


def _turn_steps(times: list[float], flips: list[tuple[float, str]], system: str) -> dict[int, list[float]]:
    """``system``'s step times (rank 0) by turn: a step counts when it lies within one of its own turns
    (no turn change between its start and its end), past the job's first ``WARMUP`` steps."""
    starts = [t for t, _ in flips]
    out: dict[int, list[float]] = {}
    for a, b in itertools.pairwise(times[WARMUP:]):
        k = bisect.bisect_right(starts, a) - 1
        if k < 0 or flips[k][1] != system or (k + 1 < len(starts) and starts[k + 1] < b):
            continue
        out.setdefault(k, []).append(b - a)
    return out


def taking_turns(kind: str, quick: bool, dest: Path) -> dict[str, Any]:
    """Both sides of the ``kind`` script (``hf``, ``lightning``) at once, taking turns (``baselines/turns.py``)."""
    steps = QUICK_STEPS if quick else STEPS
    out = common.fresh_dir(dest / kind)
    turns = out / "turn"
    _give_turn(turns, "")  # nobody's until both are built
    procs = {
        s: start(_command(kind, s, out / s, steps, turns), out / s / "run.log", child_env()) for s in SYSTEMS
    }
    t0 = time.monotonic()
    try:
        flips = _take_turns(turns, procs)
        codes = {
            s: p.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - t0))) for s, p in procs.items()
        }
    except subprocess.TimeoutExpired:
        codes = {s: p.poll() for s, p in procs.items()}
    finally:
        for p in procs.values():
            end_group(p)
    runs: dict[str, Any] = {}
    for s in SYSTEMS:
        path = out / s / "times.json"
        if not path.is_file():
            log = out / s / "run.log"
            runs[s] = {
                "ok": False,
                "rc": codes[s],
                "error": log.read_text(errors="replace")[-2000:] if log.is_file() else "",
            }
            continue
        data = json.loads(path.read_text())
        by_turn = _turn_steps(data["times"], flips, s)
        counted = [x for xs in by_turn.values() for x in xs]
        runs[s] = {"ok": bool(counted), "rc": codes[s], "params": data["params"], "steps": len(data["times"]),
                   "by_turn": by_turn, "steps_s": common.summary(counted)}  # fmt: skip
    rounds: list[dict[str, Any]] = []
    if all(runs[s]["ok"] for s in SYSTEMS):
        # turn k (plain) and turn k + 1 (checkpointless) make a round: the machine a few seconds apart
        for k in range(0, len(flips) - 1, 2):
            a, b = runs["plain"]["by_turn"].get(k, []), runs["checkpointless"]["by_turn"].get(k + 1, [])
            if len(a) >= MIN_STEPS_PER_TURN and len(b) >= MIN_STEPS_PER_TURN:
                pm, cm = statistics.median(a), statistics.median(b)
                rounds.append({"plain": pm, "checkpointless": cm, "ratio": cm / pm, "n": [len(a), len(b)]})
    ratios = [r["ratio"] for r in rounds]
    params = next((runs[s]["params"] for s in SYSTEMS if runs[s].get("params")), None)
    return {
        "measured": True,
        "steps": steps,
        "warmup": WARMUP,
        "turn_s": TURN_S,
        "params": params,
        "runs": {s: {k: v for k, v in r.items() if k != "by_turn"} for s, r in runs.items()},
        "turns": len(flips),
        "rounds": rounds,
        "ratio": common.summary(ratios),
        "interval": common.paired_interval(ratios),
        "failed": sum(1 for r in runs.values() if not r["ok"]),
    }


def run(quick: bool, out: Path) -> dict[str, Any]:
    common.pin_threads()
    dest = common.fresh_dir(out / "integrations")
    parts: dict[str, Any] = {}
    for key, kind, package in (("hf_trainer", "hf", "transformers"), ("lightning", "lightning", "lightning")):
        if importlib.util.find_spec(package) is None:
            parts[key] = {"measured": False, "reason": f"not measured: {package} is not installed"}
        else:
            parts[key] = taking_turns(kind, quick, dest)
    return {"quick": quick, "goal": GOAL, **parts, "machine": common.machine_info()}


_VERDICT_TITLES = {
    "hf_trainer": "HF Trainer step time vs transformers.Trainer under torchrun",
    "lightning": "Lightning step time, CheckpointlessStrategy vs Lightning's DDP strategy under torchrun",
}


def verdict_rows(res: dict[str, Any]) -> list[list[Any]]:
    """The summary table's rows (``run_all.targets``): one per integration with two complete pairs."""
    rows = []
    for key, title in _VERDICT_TITLES.items():
        part = res.get(key) or {}
        if not part.get("measured") or not part.get("interval"):
            continue
        g, lo, hi = part["interval"]
        rows.append([f"{title}, paired ratio (geometric mean, 95% interval)", f"≤ {GOAL:g}",
                     f"{g:.3f} [{lo:.3f}, {hi:.3f}], n={part['ratio']['n']}",
                     common.interval_verdict(lo, hi, GOAL)])  # fmt: skip
    return rows


def _range(s: dict[str, Any]) -> str:
    return f"{common.fmt(s.get('min'))}-{common.fmt(s.get('max'))}" if s.get("n") else "–"


def _section(title: str, part: dict[str, Any], baseline: str, res: dict[str, Any]) -> list[str]:
    """One integration's table and verdict (``baseline``: what the plain side runs under)."""
    parts = [f"**{title}**" + (" (quick run)" if res.get("quick") else "") + "\n"]
    if not part.get("measured"):
        return [*parts, f"{part['reason']}.\n"]
    rows = [
        [
            i,
            f"{r['plain'] * 1e3:.1f}",
            r["n"][0],
            f"{r['checkpointless'] * 1e3:.1f}",
            r["n"][1],
            f"{r['ratio']:.3f}",
        ]
        for i, r in enumerate(part["rounds"])
    ]
    table = common.md_table(
        ["round", f"{baseline} median ms", "steps", "checkpointless median ms", "steps", "ratio"], rows
    )
    params = f"{part['params'] / 1e6:.2f}M parameters, " if part.get("params") else ""
    overall = []
    for s, name in (("plain", baseline), ("checkpointless", "checkpointless")):
        st = part["runs"][s].get("steps_s") or {}
        if st.get("n"):
            overall.append(f"{name} {st['median'] * 1e3:.1f} ms (p95 {st['p95'] * 1e3:.1f}, {st['n']} steps)")
    parts.append(
        f"{params}{part['steps']} optimizer steps per job, the first {part['warmup']} not counted; both jobs "
        f"at once, taking turns of {part['turn_s']:g} s ({part['turns']} turns); per round the median step "
        f"time (rank 0, measured inside the script) of the steps that lay inside the job's turn.\n\n{table}\n"
        + (f"\nAll counted steps: {'; '.join(overall)}.\n" if overall else "")
    )
    r = part["ratio"]
    if part.get("interval"):
        g, lo, hi = part["interval"]
        parts.append(
            f"checkpointless / {baseline}, per round: geometric mean **{g:.3f}**, 95% interval "
            f"[{lo:.3f}, {hi:.3f}] (rounds' ratios {_range(r)}); goal ≤ {res['goal']:g}: "
            f"{common.interval_verdict(lo, hi, res['goal'])}.\n"
        )
    elif r.get("n"):
        parts.append(f"checkpointless / {baseline}: {r['median']:.3f} (one round: no interval).\n")
    if part.get("failed"):
        parts.append(f"**{part['failed']} job(s) failed** (logs in `bench/out/integrations/`).\n")
    return parts


def markdown(res: dict[str, Any]) -> str:
    parts = _section("Hugging Face `Trainer`", res["hf_trainer"], "torchrun", res)
    parts += _section("Lightning", res["lightning"], "torchrun DDP", res)
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    res = run(a.quick, common.OUT)
    common.write_json(common.OUT / "integrations.json", res)
    print(markdown(res))
    return 1 if res["hf_trainer"].get("failed") or res["lightning"].get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
