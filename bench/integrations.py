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
  do not count), the first ``WARMUP`` steps left out.
- **Lightning**: ``bench/baselines/lightning_trainer.py`` (the shape of
  ``tests/scripts/lightning_train.py``: a ``LightningModule`` MLP classifier with batch norm and
  dropout, a shuffled ``DataLoader`` of 64 samples per rank x 2 accumulated micro-batches per
  optimizer step, AdamW with a per-step LR scheduler, clipping, ``self.log`` every step; no
  validation, checkpoints or logger) run two ways on 2 ranks: ``checkpointless launch --workers 2
  --spares 0 -- python lightning_trainer.py`` with ``strategy=CheckpointlessStrategy()``, and
  ``torchrun --standalone --nproc-per-node 2 lightning_trainer.py --plain`` with Lightning's
  ``DDPStrategy(process_group_backend="gloo")``. The step time of a run is the median gap between
  the ``on_train_batch_end`` callbacks of rank 0 that end an optimizer step (``time.perf_counter()``
  inside the script), the first ``WARMUP`` steps left out.

The two sides run as pairs, A/B alternating (``plain, checkpointless`` then ``checkpointless,
plain``, ...) to spread the machine's drifting load; the ratio checkpointless / plain is taken
within a pair, and the pairs' ratios give a geometric mean with a 95% t interval on their logs
(``common.paired_interval``). Goal: within 3% (interval at or below 1.03).

Usage: ``python bench/integrations.py [--quick]`` -> ``bench/out/integrations.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
from baselines import child_env, end_group, start

SCRIPTS = {
    "hf": common.BENCH_DIR / "baselines" / "hf_trainer.py",
    "lightning": common.BENCH_DIR / "baselines" / "lightning_trainer.py",
}
WORKERS = 2
STEPS, QUICK_STEPS = 100, 40
WARMUP = 10
PAIRS, QUICK_PAIRS = 5, 3
GOAL = 1.03
RUN_TIMEOUT_S = 600.0


def _command(kind: str, system: str, out: Path, steps: int) -> list[str]:
    script = [str(SCRIPTS[kind]), str(out), str(steps)]
    if system == "plain":
        return [common.PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORKERS}",
                *script, "--plain"]  # fmt: skip
    return [common.PYTHON, "-m", "checkpointless.launch.cli", "launch", "--workers", str(WORKERS), "--spares", "0",
            "--quiet", "--out", str(out / "launch"), "--", common.PYTHON, *script]  # fmt: skip


def one_run(kind: str, system: str, out: Path, steps: int) -> dict[str, Any]:
    """One run of the ``kind`` script (``hf``, ``lightning``); its per-step times (rank 0) after the warm-up."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "run.log"
    proc = start(_command(kind, system, out, steps), log, child_env())
    t0 = time.monotonic()
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        end_group(proc)
    wall = time.monotonic() - t0
    times_path = out / "times.json"
    # rank 0 writes its times once training is over: a rank aborted at exit after that (plain gloo
    # under torchrun does now and then: "terminate called without an active exception") leaves
    # them whole; the exit code is kept beside them
    if not times_path.is_file():
        tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
        return {"system": system, "ok": False, "rc": rc, "wall_s": wall, "error": tail}
    data = json.loads(times_path.read_text())
    gaps = [b - a for a, b in itertools.pairwise(data["times"][WARMUP:])]
    return {
        "system": system,
        "ok": len(gaps) > 0,
        "rc": rc,
        "wall_s": wall,
        "params": data["params"],
        "steps": len(data["times"]),
        "step_s": statistics.median(gaps) if gaps else None,
        "steps_s": common.summary(gaps),
    }


def paired(kind: str, quick: bool, dest: Path) -> dict[str, Any]:
    """The ``kind`` script's alternating pairs (module docstring)."""
    steps = QUICK_STEPS if quick else STEPS
    pairs: list[dict[str, Any]] = []
    for rep in range(QUICK_PAIRS if quick else PAIRS):
        order = ["plain", "checkpointless"] if rep % 2 == 0 else ["checkpointless", "plain"]
        runs = {system: one_run(kind, system, dest / f"{kind}-{rep}-{system}", steps) for system in order}
        pair: dict[str, Any] = {"order": order, **{s: runs[s]["step_s"] for s in order}, "runs": runs}
        if runs["plain"]["ok"] and runs["checkpointless"]["ok"]:
            pair["ratio"] = runs["checkpointless"]["step_s"] / runs["plain"]["step_s"]
        pairs.append(pair)
        print(
            f"   {kind} pair {rep}: plain {common.fmt(pair['plain'])} s, checkpointless "
            f"{common.fmt(pair['checkpointless'])} s, ratio {common.fmt(pair.get('ratio'))}",
            flush=True,
        )
    ratios = [p["ratio"] for p in pairs if "ratio" in p]
    params = next((r["params"] for p in pairs for r in p["runs"].values() if r["ok"]), None)
    return {
        "measured": True,
        "steps": steps,
        "warmup": WARMUP,
        "params": params,
        "pairs": pairs,
        "plain_s": common.summary([p["plain"] for p in pairs]),
        "checkpointless_s": common.summary([p["checkpointless"] for p in pairs]),
        "ratio": common.summary(ratios),
        "interval": common.paired_interval(ratios),
        "failed": sum(1 for p in pairs for r in p["runs"].values() if not r["ok"]),
    }


def run(quick: bool, out: Path) -> dict[str, Any]:
    common.pin_threads()
    dest = common.fresh_dir(out / "integrations")
    parts: dict[str, Any] = {}
    for key, kind, package in (("hf_trainer", "hf", "transformers"), ("lightning", "lightning", "lightning")):
        if importlib.util.find_spec(package) is None:
            parts[key] = {"measured": False, "reason": f"not measured: {package} is not installed"}
        else:
            parts[key] = paired(kind, quick, dest)
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
    rows = []
    for i, p in enumerate(part["pairs"]):
        cells: list[str] = []
        for system in ("plain", "checkpointless"):
            s = p["runs"][system]["steps_s"] if p["runs"][system]["ok"] else {}
            cells += [f"{s['median'] * 1e3:.1f}", f"{s['p95'] * 1e3:.1f}"] if s.get("n") else ["FAILED", ""]
        rows.append([i, " then ".join(p["order"]), *cells, common.fmt(p.get("ratio"))])
    table = common.md_table(
        ["pair", "order", f"{baseline} median ms", "p95 ms", "checkpointless median ms", "p95 ms", "ratio"],
        rows,
    )
    params = f"{part['params'] / 1e6:.2f}M parameters, " if part.get("params") else ""
    parts.append(
        f"{params}{part['steps']} optimizer steps per run, the first {part['warmup']} not counted, "
        f"{len(part['pairs'])} alternating pair(s); per run the median and p95 of its step times "
        f"(rank 0, measured inside the script).\n\n{table}\n"
    )
    r = part["ratio"]
    if part.get("interval"):
        g, lo, hi = part["interval"]
        parts.append(
            f"checkpointless / {baseline}, per pair: geometric mean **{g:.3f}**, 95% interval "
            f"[{lo:.3f}, {hi:.3f}] (pairs' ratios {_range(r)}); goal ≤ {res['goal']:g}: "
            f"{common.interval_verdict(lo, hi, res['goal'])}.\n"
        )
    elif r.get("n"):
        parts.append(f"checkpointless / {baseline}: {r['median']:.3f} (one pair: no interval).\n")
    if part.get("failed"):
        parts.append(f"**{part['failed']} run(s) failed** (logs in `bench/out/integrations/`).\n")
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
