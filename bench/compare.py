"""checkpointless side by side with the alternatives: same model, data, world size (2) and fault.

Systems (``bench/baselines/``):

- ``checkpointless``: ``checkpointless.launch.launcher.Launcher`` + ``checkpointless.launch.demo.worker_command``,
  2 workers + 1 hot spare; the fault is its own ``kill:rank=1@step=S``;
- ``torchrun``: ``python -m torch.distributed.run --max-restarts K`` on a DDP script that saves
  with ``torch.distributed.checkpoint`` every N steps and resumes from the newest checkpoint;
  N=50 and N tuned (Young/Daly ``N* = sqrt(2 * C * MTBF) / step`` from the measured checkpoint
  cost C and the fault interval);
- ``torchft``: torchft 0.2.0 DDP, one replica group per worker, a lighthouse, the dead group
  restarted by the driver (skipped, with the reason, when torchft is missing);
- ``plain_ddp``: DDP without fault tolerance, the steady-state reference.

Every system writes the common JSONL log (``baselines.StepLog``); ``baselines.analyse`` computes
every metric from it. Experiments:

1. recovery: rank 1 SIGKILLed at step S after the forward pass (``reps`` jobs per system):
   kill -> next surviving commit of another rank (torchrun: of the restarted processes),
   kill -> every rank trains again, lost (redone) steps; medians and p95;
2. exactness: each faulted job's final SHA-256 (``digest_state``: parameters, optimizer
   state, step) against the same system's fault-free job, and the batch lineage: batch ids
   (step, dp_rank) that no surviving update read (skipped) or that two read (repeated);
3. goodput: a long run with rank 1 SIGKILLed from outside every ``interval`` seconds: useful
   committed steps per second (and global batches per second) against the system's own
   fault-free rate and plain DDP's.

Usage: ``python -m bench.compare [--quick]`` -> ``bench/out/compare/{compare.json,compare.md,compare.png}``.
The full mode takes about two hours on 2 cores (8 goodput jobs of 10 minutes; ``--goodput-s`` and
``--reps`` shorten it); ``--quick`` (one repetition, 12 s windows) about 4 minutes. ``--reanalyse`` recomputes the outputs from the
logs of an earlier run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import baselines, common, split
from bench.baselines import plain_ddp, torchft_ddp, torchrun_dcp
from checkpointless.protocol.vocab import Event

OUT = common.OUT / "compare"
TORCHFT_EXTRA = 300


@dataclass(frozen=True)
class Plan:
    reps: int
    rec_steps: int
    kill_step: int
    goodput_s: float
    intervals: tuple[float, ...]
    goodput_reps: int = 5  # every goodput cell (and its fault-free twin), interleaved by repetition
    every_rec: int = 50


#: make bench-quick's smoke (about 4 minutes; torchft at its short heartbeat is left out)
QUICK = Plan(reps=1, rec_steps=60, kill_step=40, goodput_s=12.0, intervals=(5.0,), goodput_reps=1)
FULL = Plan(reps=10, rec_steps=100, kill_step=75, goodput_s=120.0, intervals=(10.0, 30.0), goodput_reps=5)
#: torchft's lighthouse heartbeat timeouts: its default-like 2,000 ms and a short one (300 ms: every
#: fault-free torchft job of the make-bench run at this setting ran without a false failure; shorter
#: settings were not tried)
TORCHFT_FAST_HB_MS = 300


def model_spec(steps: int) -> Any:
    from checkpointless.launch.demo import DemoModel

    return DemoModel(steps=steps, eval_every=0)


# -- checkpointless driver -------------------------------------------------------------
def run_checkpointless(
    spec: Any,
    run_dir: Path,
    *,
    steps: int | None,
    kill_step: int | None = None,
    fault: str = "kill",
    duration_s: float | None = None,
    kill_every_s: float = 0.0,
    timeout_s: float = 900.0,
    recovery: Any = None,
) -> baselines.RunResult:
    """One Launcher job (``recovery``: a ``RecoveryConfig``, default settings if None); its events
    are rewritten into the common log format. ``fault``: what rank 1 does at ``kill_step`` (its
    own ``kill`` or ``hang`` fault)."""
    import shutil

    from checkpointless.config import JobConfig
    from checkpointless.control.coordinator import JobFailed
    from checkpointless.fault_grammar import parse_faults
    from checkpointless.launch.demo import worker_command
    from checkpointless.launch.launcher import Launcher

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    total = steps if steps is not None else 10**9
    faults = [f"{fault}:rank=1@step={kill_step}"] if kill_step is not None else []
    job = JobConfig(workers=baselines.WORLD, spares=1, faults=parse_faults(faults))
    if recovery is not None:
        job = replace(job, recovery=recovery)
    spec = replace(spec, steps=total)
    killer = baselines.PeriodicKiller(run_dir, kill_every_s, rank=1)
    holder: dict[str, Any] = {}

    def on_tick(coord: Any) -> None:
        if duration_s is None:
            return
        if killer.t0 is None:
            if any(int(hb.get("committed", -1)) >= 0 for hb in coord.member_status().values()):
                killer.t0 = time.time()
            return
        if time.time() >= killer.t0 + duration_s:
            raise JobFailed("benchmark window over")

        def find_pid() -> int | None:
            name = coord.members.get(1)
            child = holder["launcher"].children.get(name) if name else None
            return child.popen.pid if child is not None and child.alive() else None

        killer.tick(find_pid)

    launcher = Launcher(
        job, worker_command(spec), total_steps=total, out_dir=run_dir / "job",
        env=dict(baselines.THREAD_ENV), on_tick=on_tick, timeout_s=timeout_s,
    )  # fmt: skip
    holder["launcher"] = launcher
    t0 = time.time()
    try:
        res = launcher.run()
    finally:
        killer.close()
    recs: list[dict[str, Any]] = [{"ev": "start", "t": t0, "rank": -1, "pid": "launcher"}]
    for e in res.events:
        if e["kind"] == Event.STEP_COMMITTED:
            r, s = int(e["rank"]), int(e["step"])
            recs.append(
                {"ev": "commit", "t": e["t"], "rank": r, "pid": f"{e.get('proc')}/{e.get('gen')}", "step": s,
                 "batch": [s, r, baselines.WORLD]}
            )  # fmt: skip
        elif e["kind"] == Event.FAULT_INJECTED:
            recs.append({"ev": "fault", "t": e["t"], "rank": int(e["rank"]), "pid": e.get("proc"),
                         "step": e.get("step"), "how": "self"})  # fmt: skip
    if res.digest and steps is not None:
        recs.append({"ev": "final", "t": time.time(), "rank": 0, "pid": "coordinator", "digest": res.digest})
    baselines.write_records(run_dir / "log-checkpointless.jsonl", recs)
    ok = res.ok or (duration_s is not None and res.error == "benchmark window over")
    faults_rep = res.report.get("faults", [])
    # every fault, injected or the killer's (its own log): where each recovery's stall went
    struck = [(float(r["t"]), {int(r["rank"])}) for r in baselines.read_logs(run_dir) if r["ev"] == "fault"]
    return baselines.RunResult(
        "checkpointless", run_dir, ok, time.time() - t0, None if ok else res.error,
        {"kills": killer.kills, "report_faults": faults_rep, "step_time_s": res.report.get("step_time_s"),
         "split": split.stall_splits(res.events, sorted(struck, key=lambda f: f[0]))},
    )  # fmt: skip


# -- experiments ---------------------------------------------------------------------
def _runner(system: str) -> Any:
    return {
        "checkpointless": run_checkpointless,
        "torchrun": torchrun_dcp.run,
        "torchft": torchft_ddp.run,
        "torchft_fast": torchft_ddp.run,  # the same, with TORCHFT_FAST_HB_MS (see per-system settings)
        "plain_ddp": plain_ddp.run,
    }[system]


def _kind(system: str) -> str:
    """The system a variant is (torchft_fast is torchft: the analysis treats its lineage alike)."""
    return "torchft" if system.startswith("torchft") else system


def analyse_job(system: str, run_dir: Path, steps: int | None, duration_s: float | None) -> dict[str, Any]:
    system = _kind(system)
    recs = baselines.read_logs(run_dir)
    window = None
    if duration_s:
        first = min((float(r["t"]) for r in recs if r["ev"] == "commit"), default=None)
        window = (first, first + float(duration_s)) if first is not None else None
    return baselines.analyse(recs, system=system, total_steps=steps, window=window).to_json()


def one(
    system: str, name: str, out: Path, log: list[dict[str, Any]], label: str | None = None,
    interval_s: float | None = None, **kw: Any,
) -> dict[str, Any]:  # fmt: skip
    """Run one job and analyse its common log."""
    t0 = time.monotonic()
    res = _runner(system)(kw.pop("spec"), out / name, **kw)
    a = analyse_job(system, res.run_dir, kw.get("steps"), kw.get("duration_s"))
    info = {
        "name": name,
        "system": system,
        "label": label or system,
        "interval_s": interval_s,
        "steps": kw.get("steps"),
        "duration_s": kw.get("duration_s"),
        "ok": res.ok,
        "error": res.error,
        "wall_s": time.monotonic() - t0,
        "extra": res.extra,
        "analysis": a,
        "loadavg_after": common.load_average(),
    }
    log.append(info)
    f = a["faults"][0] if a["faults"] else {}
    print(
        f"  {name}: ok={res.ok} {res.error or ''} steps/s={common.fmt(a['steps_per_s'], 2)} "
        f"faults={len(a['faults'])} next={common.fmt(f.get('next_commit_s'), 2)} "
        f"all={common.fmt(f.get('all_ranks_s'), 2)} progress={common.fmt(f.get('progress_s'), 2)} "
        f"lost={f.get('lost_steps')} skipped={a['lineage']['skipped']} "
        f"digests={[d[:8] for d in a['final_digests']]} ({info['wall_s']:.0f}s)",
        flush=True,
    )
    return info


def young_daly(ckpt_s: float, mtbf_s: float, step_s: float) -> int:
    return max(1, round(math.sqrt(2 * ckpt_s * mtbf_s) / step_s)) if step_s > 0 else 50


def run(plan: Plan, systems: list[str], out: Path) -> dict[str, Any]:
    out = common.fresh_dir(out)
    jobs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    if any(_kind(s) == "torchft" for s in systems) and (why := torchft_ddp.available()) is not None:
        skipped.update({s: why for s in systems if _kind(s) == "torchft"})
        systems = [s for s in systems if _kind(s) != "torchft"]
    t_start = time.time()
    spec = model_spec(plan.rec_steps)
    per_system_kw: dict[str, dict[str, Any]] = {
        "checkpointless": {},
        "torchrun": {"every": plan.every_rec, "max_restarts": 3},
        "torchft": {},
        "torchft_fast": {"heartbeat_timeout_ms": TORCHFT_FAST_HB_MS},
        "plain_ddp": {},
    }
    # torchft's survivor trains on alone: its jobs get TORCHFT_EXTRA more steps after the kill, else it
    # finishes before the restarted group rejoins (which then trains from scratch, alone)
    steps_of = {s: plan.rec_steps + (TORCHFT_EXTRA if _kind(s) == "torchft" else 0) for s in systems}
    # 1 + 2: fault-free reference and faulted jobs of rec_steps steps
    refs: dict[str, dict[str, Any]] = {}
    for system in systems:
        kw = per_system_kw[system]
        refs[system] = one(system, f"{system}-ref", out, jobs, spec=spec, steps=steps_of[system], **kw)
        if system == "plain_ddp":
            continue
        for i in range(plan.reps):
            one(system, f"{system}-kill-{i}", out, jobs, spec=spec, steps=steps_of[system],
                kill_step=plan.kill_step, **kw)  # fmt: skip
    # torchrun: checkpoint cost and step time from its reference job -> tuned N
    tuned: dict[str, int] = {}
    if "torchrun" in systems:
        ckpt = [float(r["seconds"]) for r in baselines.read_logs(out / "torchrun-ref") if r["ev"] == "ckpt"]
        ckpt_s = statistics.median(ckpt) if ckpt else 0.1
        step_s = refs["torchrun"]["analysis"]["step_time_s"]
        for interval in plan.intervals:
            tuned[str(interval)] = young_daly(ckpt_s, interval, step_s)
        tuned_info = {"ckpt_s": ckpt_s, "step_s": step_s, "n_by_interval": tuned}
    else:
        tuned_info = {}
    # 3: goodput under periodic kills, each cell against its own fault-free twin of the same repetition
    restarts = int(plan.goodput_s / min(plan.intervals)) + 5
    variants: dict[str, tuple[str, dict[str, Any]]] = {}  # label -> (system, settings)
    by_interval: dict[float, list[str]] = {}
    for interval in plan.intervals:
        labels = []
        for system in systems:
            if system == "plain_ddp":
                continue
            if system == "torchrun":
                label = f"torchrun N={tuned[str(interval)]}"
                kw = {"every": tuned[str(interval)], "max_restarts": restarts}
            elif _kind(system) == "torchft":
                hb = per_system_kw[system].get("heartbeat_timeout_ms", 2000)
                label, kw = f"torchft hb={hb}ms", {**per_system_kw[system], "max_restarts": restarts}
            else:
                label, kw = system, {}
            variants.setdefault(label, (system, kw))
            labels.append(label)
        by_interval[interval] = labels
    if "plain_ddp" in systems:
        variants["plain_ddp"] = ("plain_ddp", {})
    for rep in range(plan.goodput_reps):  # interleaved: a drift in the machine's load hits every cell alike
        cells: list[tuple[str, float | None]] = [(label, None) for label in variants]
        cells += [(label, interval) for interval, labels in by_interval.items() for label in labels]
        for label, interval in cells:
            system, kw = variants[label]
            slug = label.replace(" ", "").replace("=", "")
            name = f"goodput-r{rep}-{f'{interval:g}s' if interval else 'free'}-{slug}"
            kills = {"kill_every_s": interval} if interval else {}
            info = one(system, name, out, jobs, label=label, interval_s=interval, spec=spec, steps=None,
                       duration_s=plan.goodput_s, timeout_s=plan.goodput_s + 300, **kills, **kw)  # fmt: skip
            info["rep"] = rep
    res: dict[str, Any] = {
        "quick": plan.reps == QUICK.reps and plan.goodput_s == QUICK.goodput_s,
        "plan": plan.__dict__,
        "model": json.loads(baselines.spec_to_json(spec)),
        "systems": systems,
        "settings": {s: per_system_kw[s] for s in systems},
        "not_run": skipped,
        "machine": common.machine_info(),
        "cpu_count": os.cpu_count(),
        "wall_s": time.time() - t_start,
        "torchrun_tuning": tuned_info,
        "jobs": jobs,
    }
    summarize(res)
    return res


def _spread(xs: list[float]) -> dict[str, Any]:
    """Median and range of a cell's repetitions."""
    return common.summary(xs)


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two cells' ranges overlap: with 5 repetitions, then not told apart (within noise)."""
    return bool(a.get("n") and b.get("n") and a["min"] <= b["max"] and b["min"] <= a["max"])


def summarize(res: dict[str, Any]) -> None:
    """(Re)compute the summary sections of ``res`` from its jobs' analyses, in place."""
    jobs = {j["name"]: j for j in res["jobs"]}
    systems = res["systems"]
    refs = {s: jobs[f"{s}-ref"] for s in systems if f"{s}-ref" in jobs}
    res["step_time_s"] = {s: j["analysis"]["step_time_s"] for s, j in refs.items()}
    recovery: dict[str, Any] = {}
    exact: dict[str, Any] = {}
    for s in systems:
        infos = [j for n, j in jobs.items() if n.startswith(f"{s}-kill-")]
        if not infos:
            continue
        faults = [f for i in infos for f in i["analysis"]["faults"]]
        recovery[s] = {
            "n": len(faults),
            **{
                k: common.summary(f.get(k) for f in faults)
                for k in ("next_commit_s", "all_ranks_s", "progress_s")
            },
            "lost_steps": common.summary(f["lost_steps"] for f in faults),
        }
        ref_d = refs[s]["analysis"]["final_digests"] if s in refs else []
        exact[s] = {
            "reference_digest": ref_d[0] if len(ref_d) == 1 else ref_d,
            "reference_skipped": refs[s]["analysis"]["lineage"]["skipped"] if s in refs else None,
            "jobs": [
                {
                    "job": i["name"],
                    "ok": i["ok"],
                    "digests": i["analysis"]["final_digests"],
                    "matches": len(ref_d) == 1 and i["analysis"]["final_digests"] == ref_d,
                    "skipped": i["analysis"]["lineage"]["skipped"],
                    "repeated": i["analysis"]["lineage"]["repeated"],
                    "redone": i["analysis"]["lineage"]["redone"],
                    "complete": i["analysis"]["lineage"]["complete"],
                }
                for i in infos
            ],
        }
    res["recovery"], res["exactness"] = recovery, exact
    # goodput: every faulted job against the fault-free job of the same setting and repetition
    goodput = [j for j in res["jobs"] if j["name"].startswith("goodput-")]
    free = {(j.get("label"), j.get("rep")): j for j in goodput if j.get("interval_s") is None}
    rows: list[dict[str, Any]] = []
    for j in goodput:
        own = free.get((j.get("label"), j.get("rep")))
        ddp = free.get(("plain_ddp", j.get("rep")))
        a = j["analysis"]
        sps, bps = a["steps_per_s"], a["samples_per_s"]
        own_sps = own["analysis"]["steps_per_s"] if own else None
        ddp_sps = ddp["analysis"]["steps_per_s"] if ddp else None
        rows.append(
            {
                "interval_s": j.get("interval_s"),
                "label": j.get("label", j["system"]),
                "system": j["system"],
                "rep": j.get("rep"),
                "job": j["name"],
                "ok": j["ok"],
                "kills": j["extra"].get("kills"),
                "steps_per_s": sps,
                "vs_own_fault_free": sps / own_sps if own_sps and sps else None,
                "batches_vs_own_fault_free": bps / own_sps if own_sps and bps else None,
                "fault_free_vs_plain_ddp": sps / ddp_sps if j.get("interval_s") is None and ddp_sps else None,
                "skipped_batches": a["lineage"]["skipped"],
                "redone_commits": a["lineage"]["redone"],
            }
        )
    res["goodput_jobs"] = rows
    cells: list[dict[str, Any]] = []
    for key in dict.fromkeys((r["interval_s"], r["label"]) for r in rows):
        rs = [r for r in rows if (r["interval_s"], r["label"]) == key]

        def col(k: str, rs: list[dict[str, Any]] = rs) -> dict[str, Any]:
            return _spread([r[k] for r in rs if r[k] is not None])

        cells.append(
            {
                "interval_s": key[0],
                "label": key[1],
                "reps": len(rs),
                "kills": col("kills"),
                "vs_own_fault_free": col("vs_own_fault_free"),
                "batches_vs_own_fault_free": col("batches_vs_own_fault_free"),
                "fault_free_vs_plain_ddp": col("fault_free_vs_plain_ddp"),
                "skipped_batches": max((r["skipped_batches"] or 0 for r in rs), default=0),
                "redone_commits": max((r["redone_commits"] or 0 for r in rs), default=0),
            }
        )
    res["goodput"] = cells
    # fault-free speed: the goodput twins' median when run, else the reference jobs
    rates: dict[str, float | None] = {}
    for s in systems:
        twins = [
            r["steps_per_s"]
            for r in rows
            if r["system"] == s and r["interval_s"] is None and r["steps_per_s"]
        ]
        rates[s] = (
            statistics.median(twins) if twins else (refs[s]["analysis"]["steps_per_s"] if s in refs else None)
        )
    res["fault_free_steps_per_s"] = rates


def reanalyse(res: dict[str, Any], out: Path) -> dict[str, Any]:
    """Recompute every job's analysis from the logs under ``out`` (after changing ``baselines.analyse``)."""
    res.setdefault("cpu_count", os.cpu_count())
    for j in res["jobs"]:
        j["analysis"] = analyse_job(j["system"], out / j["name"], j["steps"], j["duration_s"])
    summarize(res)
    return res


def plot(results: dict[str, Any], path: Path) -> None:
    """Committed step (rank 0, every commit incl. later rolled-back ones) vs time from the kill."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    kill_step = results["plan"]["kill_step"]
    x_max = 5.0
    for job in results["jobs"]:
        name = job["name"]
        if not (name.endswith("-kill-0") or name == "plain_ddp-ref"):
            continue
        a = job["analysis"]
        curve = a["curve"]
        if not curve:
            continue
        if a["faults"]:
            t0 = a["faults"][0]["t"]
        else:  # plain DDP: align its step kill_step with the others' kill
            t0 = next((t for t, s in curve if s >= kill_step), curve[0][0])
        xs: list[float] = []
        ys: list[float] = []
        for (t, step), prev in zip(curve, [None, *curve[:-1]], strict=True):
            if prev is not None and step < prev[1]:  # rolled back (restart from a checkpoint): break the line
                xs.append(float("nan"))
                ys.append(float("nan"))
            xs.append(t - t0)
            ys.append(step)
        ax.plot(xs, ys, ".-", ms=2, lw=1, label=job["system"])
        x_max = max(
            x_max, next((x for x, y in zip(xs, ys, strict=True) if y >= results["plan"]["rec_steps"] - 1), 0)
        )
    ax.axvline(0, color="grey", ls="--", lw=0.8)
    ax.set_xlim(-4, x_max + 1)
    ax.set_ylim(0, results["plan"]["rec_steps"] + 5)
    ax.set_xlabel(f"seconds from the SIGKILL of rank 1 at step {kill_step}")
    ax.set_ylabel("committed step (rank 0)")
    ax.set_title("Same model, data, world size 2, same fault")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ms(s: dict[str, Any], digits: int = 2) -> str:
    if not s or not s.get("n"):
        return "–"
    return f"{s['median']:.{digits}f} / {s['p95']:.{digits}f}"


def _goodput_settings(r: dict[str, Any]) -> dict[str, Any]:
    """Per goodput label, the settings its jobs ran with (from the jobs; ``res["settings"]`` holds
    the recovery jobs' settings, which differ: torchrun's ``every`` there is ``every_rec``)."""
    out: dict[str, Any] = {}
    for j in r.get("jobs", []):
        if j["name"].startswith("goodput-") and j.get("label") and j["label"] not in out:
            extra = j.get("extra") or {}
            out[j["label"]] = {
                k: extra[k] for k in ("every", "max_restarts", "heartbeat_timeout_ms") if k in extra
            }
    return out


def markdown(results: dict[str, Any]) -> str:
    """The comparison as a markdown section (tables + a short reading)."""
    r = results
    plan = r["plan"]
    lines = [
        f"Model {json.dumps(r['model'])}, data-parallel world size 2 (gloo, CPU, 1 thread per process), "
        f"{'quick' if r['quick'] else 'full'} mode, {r.get('cpu_count')} cores "
        f"(load after: {r['jobs'][-1]['loadavg_after'] if r['jobs'] else '–'}). "
        f"Fault: rank 1 SIGKILLed at step {plan['kill_step']} of {plan['rec_steps']} (torchft: +{TORCHFT_EXTRA} steps so the restarted group can rejoin; after the forward pass), "
        f"{plan['reps']} jobs per system. torchrun checkpoints every {plan['every_rec']} steps in these recovery "
        "and exactness jobs (in the goodput runs below: every N steps, N as labelled).",
        "",
    ]
    if r["not_run"]:
        for s, why in r["not_run"].items():
            lines.append(f"**{s} not run**: `{why}`\n")
    lines.append("**Recovery** (median / p95; seconds from the kill):\n")
    rows = []
    for s, v in r["recovery"].items():
        rows.append(
            [s, v["n"], _ms(v["next_commit_s"]), _ms(v["all_ranks_s"]), _ms(v.get("progress_s", {})),
             _ms(v["lost_steps"], 0)]
        )  # fmt: skip
    lines.append(
        common.md_table(
            [
                "system",
                "faults",
                "kill → next commit (survivor; torchrun: restarted)",
                "kill → all ranks train",
                "kill → new progress (a step beyond the kill)",
                "lost (redone) steps",
            ],
            rows,
        )
    )
    ours = [j for j in r["jobs"] if j["system"] == "checkpointless" and "-kill-" in j["name"]]
    text = split.describe(x for j in ours for x in (j.get("extra") or {}).get("split") or [])
    if text:
        lines += ["", text]
    lines.append("")
    lines.append("**Steady state** (fault-free, steps/s over the reference job; step = one global batch):\n")
    ddp = r["fault_free_steps_per_s"].get("plain_ddp")
    lines.append(
        common.md_table(
            ["system", "steps/s", "median step s", "vs plain DDP"],
            [
                [s, v, r["step_time_s"].get(s), (v / ddp) if v and ddp else None]
                for s, v in r["fault_free_steps_per_s"].items()
            ],
        )
    )
    lines.append("")
    if r["torchrun_tuning"]:
        t = r["torchrun_tuning"]
        lines.append(
            f"torchrun's tuned checkpoint interval (Young/Daly, N* = sqrt(2·C·MTBF)/step): C = {t['ckpt_s']:.3f} s "
            f"per DCP save, step {t['step_s']:.3f} s → N* = {t['n_by_interval']} by fault interval (s).\n"
        )
    lines.append(
        f"**Goodput under faults** ({plan['goodput_s']:.0f} s windows from the first commit, rank 1 SIGKILLed "
        f"from outside every interval; each faulted job against the fault-free job of the same system and "
        f"setting run in the same repetition, {plan.get('goodput_reps', 1)} repetitions interleaved; "
        f"median [min, max] over repetitions):\n"
    )
    settings = _goodput_settings(r) or r.get("settings", {})
    if settings:
        lines.append(
            "Settings of these runs: "
            + "; ".join(f"{s_}: `{json.dumps(v)}`" if v else f"{s_}: defaults" for s_, v in settings.items())
            + ".\n"
        )

    def rng(x: dict[str, Any], d: int = 3) -> str:
        return f"{x['median']:.{d}f} [{x['min']:.{d}f}, {x['max']:.{d}f}]" if x.get("n") else "–"

    lines.append(
        common.md_table(
            [
                "kill every s",
                "system",
                "reps",
                "kills per window",
                "goodput vs own fault-free",
                "global batches vs own fault-free",
                "skipped batches (max)",
                "redone commits (max)",
            ],
            [
                [
                    g["interval_s"],
                    g["label"],
                    g["reps"],
                    rng(g["kills"], 0),
                    rng(g["vs_own_fault_free"]),
                    rng(g["batches_vs_own_fault_free"]),
                    g["skipped_batches"],
                    g["redone_commits"],
                ]
                for g in r["goodput"]
                if g["interval_s"] is not None
            ],
        )
    )
    lines.append("")
    lines.append("Fault-free speed of the same windows against plain DDP (same repetition):\n")
    lines.append(
        common.md_table(
            ["system", "reps", "steps/s vs plain DDP"],
            [
                [g["label"], g["reps"], rng(g["fault_free_vs_plain_ddp"])]
                for g in r["goodput"]
                if g["interval_s"] is None and g["label"] != "plain_ddp"
            ],
        )
    )
    lines.append("")
    lines.append(
        "**Exactness**: final SHA-256 (`digest_state`: parameters + optimizer state + step) of each faulted "
        "job against the same system's fault-free job; batch lineage of the surviving updates:\n"
    )
    rows = []
    for s, v in r["exactness"].items():
        jobs = v["jobs"]
        rows.append(
            [s, f"{sum(j['matches'] for j in jobs)}/{len(jobs)}", f"`{str(v['reference_digest'])[:12]}…`",
             max((j["skipped"] for j in jobs), default=0), max((j["repeated"] for j in jobs), default=0),
             v["reference_skipped"], max((j["redone"] for j in jobs), default=0)]
        )  # fmt: skip
    lines.append(
        common.md_table(
            [
                "system",
                "faulted = fault-free",
                "fault-free digest",
                "skipped batches (max)",
                "repeated (max)",
                "skipped in fault-free job",
                "redone commits (max)",
            ],
            rows,
        )
    )
    lines.append("")
    lines.append(f"![committed step vs time]({results.get('image', 'compare.png')})\n")
    lines.append(reading(r))
    return "\n".join(lines) + "\n"


def reading(r: dict[str, Any]) -> str:
    """A short reading generated from the numbers (the caveats are fixed text)."""
    rec = r["recovery"]
    out = ["**Reading.**"]

    def med(s: str, k: str) -> float | None:
        v = rec.get(s, {}).get(k, {})
        return v.get("median") if v and v.get("n") else None

    cl, tr, tf = (med("checkpointless", "next_commit_s"), med("torchrun", "next_commit_s"),
                  med("torchft", "next_commit_s"))  # fmt: skip
    if cl is not None and tr is not None:
        out.append(
            f"After a SIGKILL, checkpointless' survivor commits again after {cl:.2f} s (median) against "
            f"{tr:.2f} s for torchrun's full restart (process start, rendezvous, DCP load), which then redoes "
            f"{med('torchrun', 'lost_steps') or 0:.0f} steps (those since its last checkpoint) and makes new "
            f"progress only after {med('torchrun', 'progress_s') or float('nan'):.2f} s."
        )
    if tf is not None:
        cmp = (
            ""
            if cl is None
            else (" (sooner than checkpointless)" if tf < cl else " (later than checkpointless)")
        )
        back = med("torchft", "all_ranks_s")
        out.append(
            f"torchft's survivor commits again after {tf:.2f} s{cmp}, bounded below by the lighthouse's "
            f"heartbeat timeout: it does not wait for a replacement but continues alone, so those steps use half "
            f"the global batch (the dead group's batches are skipped, see the lineage columns) and a faulted run "
            f"does not end in the fault-free parameters; the restarted group heals from the survivor and trains "
            f"again after {back if back is not None else float('nan'):.2f} s."
        )
    ex = r["exactness"]
    exact_s = [s for s, v in ex.items() if v["jobs"] and all(j["matches"] for j in v["jobs"])]
    inexact = [s for s in ex if s not in exact_s]
    out.append(
        f"Faulted runs bit-identical to their fault-free run: {', '.join(exact_s) or 'none'}"
        + (f"; not: {', '.join(inexact)}." if inexact else ".")
    )
    refs = [j for j in r["jobs"] if j["name"].endswith("-ref")]
    by_digest: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for j in refs:
        d = tuple(j["analysis"]["final_digests"])
        if len(d) == 1:
            by_digest.setdefault(d, []).append(j)
    groups = sorted((g for g in by_digest.values() if len(g) > 1), key=lambda g: -len(g))
    first_steps: list[Any] = []
    for i, g in enumerate(groups):
        names = ", ".join(sorted(j["system"] for j in g))
        steps = sorted({j.get("steps") for j in g if j.get("steps") is not None})
        length = f" ({steps[0]} steps each)" if len(steps) == 1 else ""
        if i == 0:
            first_steps = steps
            out.append(f"The fault-free runs of {names}{length} end in the same state bit for bit.")
        else:
            why = ": they ran a different number of steps" if steps and steps != first_steps else ""
            out.append(f"So do those of {names}{length}, in a state of their own{why}.")
    for interval in sorted({g["interval_s"] for g in r["goodput"] if g["interval_s"] is not None}):
        cells = [g for g in r["goodput"] if g["interval_s"] == interval and g["vs_own_fault_free"].get("n")]
        ours = next((g for g in cells if g["label"] == "checkpointless"), None)
        if not cells or ours is None:
            continue
        ranked = sorted(cells, key=lambda g: -g["vs_own_fault_free"]["median"])
        text = ", ".join(f"{g['label']} {g['vs_own_fault_free']['median']:.3f}" for g in ranked)
        noise = [g["label"] for g in cells if g is not ours and _overlap(g["vs_own_fault_free"],
                                                                          ours["vs_own_fault_free"])]  # fmt: skip
        apart = [g["label"] for g in cells if g is not ours and g["label"] not in noise]
        out.append(
            f"With a kill every {interval:g} s, goodput against each system's own fault-free rate (median): {text}."
            + (f" Within noise of checkpointless (the ranges of the repetitions overlap): {', '.join(noise)}." if noise else "")
            + (f" Told apart from checkpointless (no overlap): {', '.join(apart)}." if apart else "")
        )  # fmt: skip
        batches = [g for g in cells if g["batches_vs_own_fault_free"].get("n")]
        if batches:
            out.append(
                "Counted in global batches (torchft's survivor takes steps alone on half the global batch, "
                "so its steps/s can exceed its fault-free rate): "
                + ", ".join(f"{g['label']} {g['batches_vs_own_fault_free']['median']:.3f}"
                            for g in sorted(batches, key=lambda g: -g["batches_vs_own_fault_free"]["median"]))
                + "."
            )  # fmt: skip
    rates = r["fault_free_steps_per_s"]
    loses = ["it keeps a hot spare process (a third process for two ranks, memory for a full replica; on this "
             "2-core machine it competes for CPU)",
             "a recovery still costs a process-group rebuild plus the state transfer"]  # fmt: skip
    if rates.get("checkpointless") and rates.get("plain_ddp"):
        ratio = rates["checkpointless"] / rates["plain_ddp"]
        if ratio < 0.97:
            loses.insert(
                0,
                f"fault-free it runs at {ratio:.0%} of plain DDP's step rate (its own gradient all-reduce, "
                f"heartbeats and commit events instead of DDP's bucketed overlap)",
            )
        else:
            out.append(
                f"Fault-free, checkpointless runs at {ratio:.0%} of plain DDP's step rate (noise level)."
            )
    if tf is not None and cl is not None and tf < cl:
        loses.append("torchft's survivor resumes sooner (it trades exactness and half the batch for it)")
    out.append("Where checkpointless loses: " + "; ".join(loses) + ".")
    from checkpointless.config import RecoveryConfig

    hang = r.get("hang_timeout_s", RecoveryConfig().hang_timeout_s)
    out.append(
        "Caveats: a 2-core VM shared with other benchmarks (load average in the header), a tiny model (steps of "
        "tens of ms, so process start-up dominates every restart)"
        + (", one repetition (quick mode)" if r.get("quick") else "")
        + "; torchft runs with a fixed DDP comm hook (its 0.2.0 hook crashes the survivor on a failed "
        "all-reduce, see bench/baselines/torchft_ddp.py) at heartbeat_timeout_ms=2000 and "
        f"{TORCHFT_FAST_HB_MS} (no false failure in its fault-free runs; shorter was not tried); "
        f"checkpointless' hang timeout is {hang:g} s (its default). Hangs side by side at matched "
        "timeouts: the hang_compare section."
    )
    return " ".join(out) + "\n"


#: what ``bench/run_all.py`` runs in full mode: 30 s goodput windows and one kill interval, to stay near an hour
BENCH = replace(FULL, reps=6, goodput_s=30.0, intervals=(10.0,))


def run_bench(quick: bool, out: Path) -> dict[str, Any]:
    """Entry point for ``bench/run_all.py``: results; it copies ``compare.png`` beside the page."""
    common.pin_threads()
    os.environ.update(baselines.THREAD_ENV)
    dest = out / "compare"
    systems = ["checkpointless", "torchrun", "torchft", "torchft_fast", "plain_ddp"]
    res = run(QUICK if quick else BENCH, [s for s in systems if not (quick and s == "torchft_fast")], dest)
    common.write_json(dest / "compare.json", res)
    plot(res, dest / "compare.png")
    res["image"] = "bench-compare.png"  # where docs/benchmarks.md finds the plot
    res["image_src"] = str(dest / "compare.png")  # run_all copies it beside the page it writes
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run (~4 minutes)")
    p.add_argument("--systems", default="checkpointless,torchrun,torchft,torchft_fast,plain_ddp")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--goodput-s", type=float, help="override the goodput window (full: 120 s per job)")
    p.add_argument("--reps", type=int, help="override the faulted jobs per system (full: 10)")
    p.add_argument(
        "--reanalyse", action="store_true", help="recompute compare.json/md/png from the logs under --out"
    )
    a = p.parse_args(argv)
    if a.reanalyse:
        res = reanalyse(json.loads((a.out / "compare.json").read_text()), a.out)
        common.write_json(a.out / "compare.json", res)
        plot(res, a.out / "compare.png")
        (a.out / "compare.md").write_text(md := markdown(res))
        print(md)
        return 0

    def _term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # run the drivers' finally blocks: end every process

    signal.signal(signal.SIGTERM, _term)
    common.pin_threads()
    os.environ.update(baselines.THREAD_ENV)
    plan = QUICK if a.quick else FULL
    if a.goodput_s or a.reps:
        plan = replace(plan, goodput_s=a.goodput_s or plan.goodput_s, reps=a.reps or plan.reps)
    res = run(plan, [s.strip() for s in a.systems.split(",") if s.strip()], a.out)
    common.write_json(a.out / "compare.json", res)
    plot(res, a.out / "compare.png")
    md = markdown(res)
    (a.out / "compare.md").write_text(md)
    print(md)
    return 0 if all(j["ok"] for j in res["jobs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
