"""Evaluation time of the Hugging Face ``Trainer`` during training: the batches shared by the
ranks (checkpointless), against ``torchrun`` (HF's own distributed evaluation) and against one
process evaluating the whole set (what every rank did before the evaluation was shared).

``bench/baselines/hf_eval.py`` (``hf_trainer.py``'s model, 512 evaluation sequences of 64 tokens
in batches of 16, the loss and a ``compute_metrics`` over argmax-reduced logits) evaluates after
each of ``STEPS`` steps, three ways: ``checkpointless launch --workers 2 --spares 0``,
``torchrun --standalone --nproc-per-node 2 ... --plain`` and ``python ... --plain`` (one process).
A run's time is the median of its evaluations' ``eval_runtime`` (HF's timing of ``evaluate``:
the forward passes, the exchange or gather, the metrics), the first left out. The three run one
after the other in a round, their order turning from round to round; per round the ratios
checkpointless / torchrun and checkpointless / one process, over the rounds a geometric mean with
a 95% t interval on the logs (``common.paired_interval``). The metrics are printed; they differ a
little between the three, as their training does (the sample order of ``session.loader`` and of a
``DistributedSampler`` differ, one process trains on batches of its own).

Usage: ``python -m bench.hf_eval [--quick]`` -> ``bench/out/hf_eval.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench import common
from bench.baselines import child_env, end_group, start

SCRIPT = common.BENCH_DIR / "baselines" / "hf_eval.py"
WORKERS = 2
SYSTEMS = ("checkpointless", "torchrun", "alone")
STEPS, ROUNDS, QUICK_ROUNDS = 6, 8, 2
RUN_TIMEOUT_S = 600.0


def _command(system: str, out: Path) -> list[str]:
    script = [str(SCRIPT), str(out), str(STEPS)]
    if system == "alone":
        return [common.PYTHON, *script, "--plain"]
    if system == "torchrun":
        return [common.PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORKERS}",
                *script, "--plain"]  # fmt: skip
    return [common.PYTHON, "-m", "checkpointless", "launch", "--workers", str(WORKERS), "--spares", "0",
            "--quiet", "--out", str(out / "launch"), "--", common.PYTHON, *script]  # fmt: skip


def _one(system: str, out: Path) -> dict[str, Any]:
    proc = start(_command(system, out), out / "run.log", child_env())
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        end_group(proc)
    path = out / "evals.json"
    if rc != 0 or not path.is_file():
        log = out / "run.log"
        return {
            "ok": False,
            "rc": rc,
            "error": log.read_text(errors="replace")[-2000:] if log.is_file() else "",
        }
    evals = json.loads(path.read_text())
    times = [e["eval_runtime"] for e in evals[1:]]
    metrics = {k: v for k, v in evals[-1].items() if k in ("eval_loss", "eval_accuracy")}
    return {"ok": bool(times), "median_s": statistics.median(times) if times else None, "n": len(times),
            "metrics": metrics}  # fmt: skip


def run(quick: bool, out: Path) -> dict[str, Any]:
    common.pin_threads()
    if importlib.util.find_spec("transformers") is None:
        return {"measured": False, "reason": "not measured: transformers is not installed"}
    dest = common.fresh_dir(out / "hf_eval")
    rounds: list[dict[str, Any]] = []
    for i in range(QUICK_ROUNDS if quick else ROUNDS):
        order = SYSTEMS[i % 3 :] + SYSTEMS[: i % 3]
        runs = {s: _one(s, dest / f"{i}-{s}") for s in order}
        rounds.append({"order": list(order), **runs})
    good = [r for r in rounds if all(r[s]["ok"] for s in SYSTEMS)]
    ratios = {
        b: [r["checkpointless"]["median_s"] / r[b]["median_s"] for r in good] for b in ("torchrun", "alone")
    }
    return {
        "measured": True,
        "quick": quick,
        "steps": STEPS,
        "rounds": rounds,
        "ratio": {b: common.summary(v) for b, v in ratios.items()},
        "interval": {b: common.paired_interval(v) for b, v in ratios.items()},
        "failed": sum(1 for r in rounds for s in SYSTEMS if not r[s]["ok"]),
        "machine": common.machine_info(),
    }


def markdown(res: dict[str, Any]) -> str:
    if not res.get("measured"):
        return f"{res['reason']}.\n"
    rows = []
    for i, r in enumerate(res["rounds"]):
        cells = [f"{r[s]['median_s'] * 1e3:.0f}" if r[s]["ok"] else "failed" for s in SYSTEMS]
        rows.append([i, " → ".join(r["order"]), *cells])
    table = common.md_table(["round", "order", "checkpointless ms", "torchrun ms", "one process ms"], rows)
    parts = [
        f"2 ranks (one process for the last column), {res['steps']} evaluations per run, the first not "
        f"counted; per run the median `eval_runtime`.\n\n{table}\n"
    ]
    for b, name in (("torchrun", "torchrun"), ("alone", "one process, the whole set")):
        iv = res["interval"].get(b)
        if iv:
            g, lo, hi = iv
            parts.append(
                f"checkpointless / {name}: geometric mean **{g:.3f}**, 95% interval [{lo:.3f}, {hi:.3f}].\n"
            )
    metrics = {s: r[s].get("metrics") for r in res["rounds"][-1:] for s in SYSTEMS}
    parts.append(f"Metrics of the last round's last evaluation: {metrics}.\n")
    if res.get("failed"):
        parts.append(f"**{res['failed']} run(s) failed** (logs in `bench/out/hf_eval/`).\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    res = run(a.quick, common.OUT)
    common.write_json(common.OUT / "hf_eval.json", res)
    print(markdown(res))
    return 1 if res.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
