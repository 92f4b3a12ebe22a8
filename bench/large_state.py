"""Side by side where recovery matters: 1.5 GB of training state, a step of about 2 s.

``compare`` measures on a model whose state is 5 MB and whose step is 30 ms: any restart is cheap
there. Here the same systems train a 126.6M-parameter model (``SPEC``: d_model 1024, 10 layers;
fp32 parameters and AdamW's two moments = 1.52 GB of state per replica), world size 2 with
one sample per rank and step, and rank 1 is SIGKILLed from outside every ``interval`` seconds:

- ``checkpointless``: 2 workers + 1 hot spare; the spare receives the 1.5 GB from the survivor;
- ``torchrun N=…``: DDP + a DCP checkpoint every N steps, N from Young/Daly
  (``sqrt(2 * C * MTBF) / step``) with the checkpoint cost C measured by a short calibration
  job first; every kill restarts both processes, which reload the newest checkpoint;
- ``torchft hb=300ms``: torchft at its shortest stable lighthouse heartbeat; the restarted group
  heals over torchft's HTTP checkpoint transport.

Each system runs a fault-free window (``free_s``) and a faulted one (``window_s``), one after the
other, the systems in turn. Reported: fault-free step time, useful steps per second and useful
global batches per second against the system's own fault-free rate, seconds of training lost per
kill (``window x (1 - ratio) / kills``), and each kill's recovery (kill -> next commit of a
surviving or restarted rank, lost steps). One repetition per cell (a cell costs minutes here):
read differences under about 10% as noise (``compare``'s 5-repetition ranges on the small model
are that wide).

Usage: ``python -m bench.large_state [--quick]`` -> ``bench/out/large_state.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import baselines, common, compare, split
from bench.baselines import torchft_ddp


@dataclass(frozen=True)
class Plan:
    free_s: float
    window_s: float
    interval_s: float


FULL = Plan(free_s=45.0, window_s=120.0, interval_s=40.0)
#: a smoke run for ``make bench-quick`` (checkpointless only, short windows)
QUICK = Plan(free_s=10.0, window_s=20.0, interval_s=10.0)
#: (d_model 1024, 10 layers, 16 heads, vocab 256, 64 tokens, 1 sample per rank and step)
SPEC_FIELDS: dict[str, int] = {
    "vocab_size": 256, "d_model": 1024, "n_layer": 10, "n_head": 16, "seq_len": 64, "global_batch": 2,
}  # fmt: skip
SYSTEMS = ["checkpointless", "torchrun", "torchft_fast"]


def spec() -> Any:
    return replace(compare.model_spec(10), **SPEC_FIELDS)


def state_bytes(s: Any) -> int:
    """Parameters + AdamW's exp_avg and exp_avg_sq, fp32 (what every replica holds and moves)."""
    from checkpointless.launch.demo import build

    model, _, _ = build(s)
    return sum(p.numel() for p in model.parameters()) * 4 * 3


def calibrate_torchrun(s: Any, out: Path, jobs: list[dict[str, Any]], steps: int) -> dict[str, float]:
    """A short fault-free torchrun job checkpointing every 2 steps: the DCP save cost and the step time."""
    info = compare.one(
        "torchrun", "torchrun-calibrate", out, jobs, spec=s, steps=steps, every=2, max_restarts=0
    )
    ckpt = [float(r["seconds"]) for r in baselines.read_logs(out / "torchrun-calibrate") if r["ev"] == "ckpt"]
    return {"ckpt_s": statistics.median(ckpt) if ckpt else 0.0, "step_s": info["analysis"]["step_time_s"]}


def run(plan: Plan, out: Path) -> dict[str, Any]:
    out = common.fresh_dir(out)
    s = spec()
    jobs: list[dict[str, Any]] = []
    systems = [x for x in SYSTEMS if compare._kind(x) != "torchft" or torchft_ddp.available() is None]
    if plan is QUICK:
        systems = ["checkpointless"]
    cal = (
        calibrate_torchrun(s, out, jobs, steps=12)
        if "torchrun" in systems
        else {"ckpt_s": 0.0, "step_s": 0.0}
    )
    n_star = compare.young_daly(cal["ckpt_s"], plan.interval_s, cal["step_s"])
    restarts = int(plan.window_s / plan.interval_s) + 5
    settings: dict[str, tuple[str, dict[str, Any]]] = {
        "checkpointless": ("checkpointless", {}),
        "torchrun": (f"torchrun N={n_star}", {"every": n_star, "max_restarts": restarts}),
        "torchft_fast": (
            f"torchft hb={compare.TORCHFT_FAST_HB_MS}ms",
            {"heartbeat_timeout_ms": compare.TORCHFT_FAST_HB_MS, "max_restarts": restarts},
        ),
    }
    rows: list[dict[str, Any]] = []
    for system in systems:
        label, kw = settings[system]
        slug = label.replace(" ", "").replace("=", "")
        free = compare.one(system, f"free-{slug}", out, jobs, label=label, spec=s, steps=None,
                           duration_s=plan.free_s, timeout_s=plan.free_s + 300, **kw)  # fmt: skip
        hit = compare.one(system, f"kill-{slug}", out, jobs, label=label, interval_s=plan.interval_s, spec=s,
                          steps=None, duration_s=plan.window_s, timeout_s=plan.window_s + 400,
                          kill_every_s=plan.interval_s, **kw)  # fmt: skip
        rows.append(row(label, system, free, hit, plan.window_s))
    ours = [j for j in jobs if j["system"] == "checkpointless" and j["name"].startswith("kill-")]
    return {
        "split": [x for j in ours for x in (j.get("extra") or {}).get("split") or []],
        "quick": plan is QUICK,
        "plan": plan.__dict__,
        "model": {**SPEC_FIELDS, "state_bytes": state_bytes(s)},
        "torchrun_tuning": {**cal, "interval_s": plan.interval_s, "n": n_star},
        "systems": systems,
        "rows": rows,
        "jobs": [
            {k: v for k, v in j.items() if k != "analysis"} | {"analysis": _slim(j["analysis"])} for j in jobs
        ],
        "machine": common.machine_info(),
    }


def _slim(a: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in a.items() if k != "curve"}


def row(
    label: str, system: str, free: dict[str, Any], hit: dict[str, Any], window_s: float
) -> dict[str, Any]:
    fa, ha = free["analysis"], hit["analysis"]
    own, sps, bps = fa["steps_per_s"], ha["steps_per_s"], ha["samples_per_s"]
    ratio = sps / own if own and sps else None
    kills = hit["extra"].get("kills") or len(ha["faults"]) or 0
    faults = ha["faults"]
    return {
        "label": label,
        "system": system,
        "ok": bool(free["ok"] and hit["ok"]),
        "step_time_s": fa["step_time_s"],
        "fault_free_steps_per_s": own,
        "steps_per_s": sps,
        "vs_own_fault_free": ratio,
        "batches_vs_own_fault_free": bps / own if own and bps else None,
        "kills": kills,
        "lost_s_per_kill": window_s * (1 - ratio) / kills if ratio is not None and kills else None,
        "next_commit_s": common.summary(f.get("next_commit_s") for f in faults),
        "lost_steps": common.summary(f.get("lost_steps") for f in faults),
        "skipped_batches": ha["lineage"]["skipped"],
    }


def markdown(res: dict[str, Any]) -> str:
    p, m, t = res["plan"], res["model"], res["torchrun_tuning"]

    def med(x: dict[str, Any], d: int = 2) -> str:
        return (
            "–"
            if not x.get("n")
            else f"{common.fmt(x['median'], d)} ({common.fmt(x['min'], d)}–{common.fmt(x['max'], d)})"
        )

    table = common.md_table(
        ["system", "fault-free step s", "useful steps vs own fault-free", "useful global batches vs own",
         "kills", "training lost per kill s", "kill → next commit s (median, range)", "lost steps per kill"],
        [
            [r["label"] + ("" if r["ok"] else " (FAILED)"), common.fmt(r["step_time_s"], 2),
             common.fmt(r["vs_own_fault_free"]), common.fmt(r["batches_vs_own_fault_free"]), r["kills"],
             common.fmt(r["lost_s_per_kill"], 1), med(r["next_commit_s"]), med(r["lost_steps"], 0)]
            for r in res["rows"]
        ],
    )  # fmt: skip
    return (
        f"{m['state_bytes'] / 1e9:.2f} GB of state per replica (d_model {m['d_model']}, {m['n_layer']} layers, "
        f"fp32 parameters + AdamW moments), world size 2, one sample per rank and step. Per system a "
        f"{p['free_s']:g} s fault-free window, then a {p['window_s']:g} s window with rank 1 SIGKILLed every "
        f"{p['interval_s']:g} s; one repetition per cell, so differences under about 10% are noise. "
        + (
            f"torchrun's N={t['n']} is Young/Daly for a DCP save of {t['ckpt_s']:.2f} s (measured), a "
            f"{t['step_s']:.2f} s step and a fault every {t['interval_s']:g} s. "
            if "torchrun" in res.get("systems", [])
            else "Quick mode: checkpointless only. "
        )
        + "torchft's survivor trains on alone while the killed group "
        "restarts: its useful steps count steps, the global-batch column counts the data they read.\n\n"
        + table
        + "\n"
        + (f"\n{text}\n" if (text := split.describe(res.get("split") or [])) else "")
    )


def run_bench(quick: bool, out: Path) -> dict[str, Any]:
    """Entry point for ``bench/run_all.py`` (about 11 minutes; quick: about 1.5)."""
    common.pin_threads()
    return run(QUICK if quick else FULL, out / "large_state")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    common.pin_threads()
    res = run(QUICK if a.quick else FULL, common.OUT / "large_state")
    common.write_json(common.OUT / "large_state.json", res)
    print(markdown(res))
    return 0 if all(r["ok"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
