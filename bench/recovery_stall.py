"""Survivor stall after a real ``kill`` (SIGKILL) and a real ``hang`` (SIGSTOP), 2 workers + 1 spare.

Model: the demo's TinyGPT at ~10.9M parameters with AdamW (state moved per recovery: parameters
+ two Adam moments, ~130 MB). Each job injects several faults, spaced ``SPACING`` steps apart so
the refilled spare has finished starting before the next fault (checked per fault from the
``spare_ready`` event); faults alternate between rank 1 and rank 0. Jobs of one kind are
repeated until ``n`` faults (10, quick: 3) were measured.

Per fault, from ``report.json`` (``checkpointless.observe.report``): ``detection_s`` (injection to the
first ``fault_detected``), ``stall_s`` (worst survivor: last commit before the fault to the next
commit after it, minus one normal step) and ``lost_steps``; from the events: the coordinator's
``recovery_done`` seconds, the bytes of ``transfer_ended``, and the time split of the survivor's
gap between its two commits:

    pre-fault  survivor's last commit -> injection (work of the faulted step, lost)
    detect     injection -> first ``fault_detected``
    plan       -> coordinator publishes the next generation (``generation_started``)
    join       -> the replacement starts receiving (``transfer_begun``; group formation)
    transfer   -> ``transfer_ended`` (send_state/recv_state incl. hashing)
    resume     -> survivor's next commit (re-executing the faulted step)

whose sum minus one normal step is the stall. Every faulted job's ``final_state_sha256`` is
compared with a fault-free job of the same length.

Usage: ``python -m bench.recovery_stall [--quick]`` (writes ``bench/out/recovery_stall.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import common, split
from checkpointless.protocol.vocab import Event, Reason

MODEL = {
    "seed": 0,
    "vocab_size": 256,
    "seq_len": 64,
    "d_model": 384,
    "n_layer": 6,
    "n_head": 6,
    "global_batch": 8,
    "lr": 1e-3,
    "eval_every": 0,
}
FIRST = 15  # first fault (the initial spare starts with the job)
SPACING = 25  # steps between faults: the refilled spare starts in the meantime
TAIL = 10
PHASES = split.PHASES


def schedule(kind: str, per_job: int) -> tuple[list[str], int]:
    steps = [FIRST + i * SPACING for i in range(per_job)]
    faults = [f"{kind}:rank={1 - i % 2}@step={s}" for i, s in enumerate(steps)]
    return faults, steps[-1] + TAIL


# The fault-free reference runs with a long hang timeout: on this loaded 2-core machine the
# coordinator's no-progress detector (allowance max(hang_timeout_s, 3 normal steps), and no normal
# step is known yet at step 0) has killed a healthy worker in a slow first step, failing a job that
# has no spare. The timeout only affects detection, never the final state.
REFERENCE_HANG_TIMEOUT_S = 10.0


def run_job(faults: list[str], total_steps: int, spares: int, out: Path) -> Any:
    from checkpointless.config import JobConfig, RecoveryConfig
    from checkpointless.fault_grammar import parse_faults
    from checkpointless.launch.demo import DemoModel, worker_command
    from checkpointless.launch.launcher import Launcher

    spec = DemoModel(steps=total_steps, **MODEL)  # type: ignore[arg-type]
    rc = RecoveryConfig(hang_timeout_s=REFERENCE_HANG_TIMEOUT_S) if not faults else RecoveryConfig()
    job = JobConfig(workers=2, spares=spares, faults=parse_faults(faults), recovery=rc)
    launcher = Launcher(
        job, worker_command(spec), total_steps=total_steps, out_dir=out, env=common.THREAD_ENV, timeout_s=900
    )
    return launcher.run()


def _first(events: list[dict[str, Any]], pred: Any) -> dict[str, Any] | None:
    return next((e for e in events if pred(e)), None)


def analyse(events: list[dict[str, Any]], report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per injected fault: report fields plus the event-derived split (``split.py``)."""
    events = sorted(events, key=lambda e: e["t"])
    step_time = float(report["step_time_s"])
    injections: dict[Any, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == Event.FAULT_INJECTED:
            injections.setdefault(e.get("index"), e)
    injected = [f for f in report["faults"] if f.get("injected")]  # real faults have no injection to time
    struck = [(float(inj["t"]), set(inj.get("ranks") or [inj["rank"]])) for inj in injections.values()]
    rows = []
    for (t_inj, ranks), rep, cut in zip(struck, injected, split.stall_splits(events, struck), strict=True):
        g = cut["gen"]
        det = _first(events, lambda e, t=t_inj: e["kind"] == Event.FAULT_DETECTED and e["t"] >= t)
        te = _first(events, lambda e, g=g: e["kind"] == Event.TRANSFER_ENDED and e.get("gen") == g)
        done = _first(events, lambda e, g=g: e["kind"] == Event.RECOVERY_DONE and e.get("gen") == g)
        assigned = _first(
            events,
            lambda e, t=t_inj, rs=ranks: (
                e["kind"] == Event.SPARE_ASSIGNED and e["t"] >= t and e["rank"] in rs
            ),
        )
        spare_ready_t = None
        if assigned is not None:
            sr = _first(
                events, lambda e, p=assigned["target"]: e["kind"] == Event.SPARE_READY and e["proc"] == p
            )
            spare_ready_t = float(sr["t"]) if sr else None
        rows.append(
            {
                **rep,
                "gen": g,
                "step_time_s": step_time,
                "detected_by": det.get("reason") if det else None,
                "recovery_done_s": float(done["seconds"]) if done else None,
                "bytes": cut["bytes"],
                "transfer_seconds": float(te["seconds"]) if te else None,
                "spare_ready_before_fault": spare_ready_t is not None and spare_ready_t < t_inj,
                "spare_ready_margin_s": None if spare_ready_t is None else t_inj - spare_ready_t,
                "survivor_gap_s": cut["gap_s"],  # the worst survivor's, as the report defines the stall
                "split": cut["split"],
            }
        )
    return rows


def kill_floor(rows: list[dict[str, Any]], out_dir: Path, quick: bool) -> dict[str, Any]:
    """Each kill's survivor gap against its floor, measured in the same run: the faulted step's lost
    work + detection + plan + group formation (this fault's own) + the bytes it moved at raw gloo speed
    into the same kind of tensors (``bench/transfer.py``'s ``wire_into``, measured right after the
    jobs between two processes of the same size of state) + one normal step. Also the transfer inside
    each recovery against that raw speed. Per fault ratios; their geometric mean with a 95% interval."""
    from bench import transfer

    sized = [r for r in rows if r.get("bytes") and r.get("survivor_gap_s")]
    if not sized:
        return {}
    nbytes = int(statistics.median(r["bytes"] for r in sized))
    raw = transfer.run(quick, out_dir / "recovery_floor", sizes=[nbytes], reps=3 if quick else 5)["rows"][0][
        "wire_into_gbps"
    ]
    per: list[dict[str, Any]] = []
    for r in sized:
        sp = r["split"]
        if any(sp[p] is None for p in ("pre_fault", "detect", "plan", "join")):
            continue
        wire_s = r["bytes"] / (raw * 1e9)
        fl = sp["pre_fault"] + sp["detect"] + sp["plan"] + sp["join"] + wire_s + r["step_time_s"]
        per.append({"gap_s": r["survivor_gap_s"], "floor_s": fl, "ratio": r["survivor_gap_s"] / fl,
                    "transfer_vs_raw": wire_s / r["transfer_seconds"] if r.get("transfer_seconds") else None})  # fmt: skip
    return {
        "bytes": nbytes,
        "raw_gbps": raw,
        "faults": per,
        "ratio": common.paired_interval([p["ratio"] for p in per]),
        "transfer_vs_raw": common.paired_interval(
            [p["transfer_vs_raw"] for p in per if p["transfer_vs_raw"]]
        ),
    }


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    n = 3 if quick else 10
    per_job = 3 if quick else 5
    work = common.fresh_dir(out_dir / "recovery")
    t_start = time.time()
    _, total = schedule("kill", per_job)
    jobs: list[dict[str, Any]] = []

    def one(name: str, faults: list[str], spares: int) -> dict[str, Any]:
        t0 = time.monotonic()
        res = run_job(faults, total, spares, work / name)
        retried = None
        if not res.ok:  # one retry (the failure is recorded)
            retried = res.error
            print(f"  recovery {name}: failed ({res.error}); retrying once", flush=True)
            res = run_job(faults, total, spares, work / f"{name}-retry")
        wall = time.monotonic() - t0
        info = {
            "name": name,
            "faults": faults,
            "steps": total,
            "ok": res.ok,
            "error": res.error,
            "failed_first_try": retried,
            "unplanned_detections": [
                {"reason": e.get("reason"), "target": e.get("target"), "step": e.get("step")}
                for e in res.events
                if e["kind"] == Event.FAULT_DETECTED and e.get("reason") == Reason.NO_PROGRESS
            ],
            "digest": res.digest,
            "steps_completed": res.report["steps_completed"],
            "step_time_s": res.report["step_time_s"],
            "wall_s": wall,
            "rows": analyse(res.events, res.report) if res.ok else [],
            "loadavg_after": common.load_average(),
        }
        print(
            f"  recovery {name}: ok={res.ok} {len(info['rows'])} faults, step {info['step_time_s']:.3f}s, "
            f"stalls {[round(r['stall_s'], 2) for r in info['rows']]} ({wall:.0f}s)",
            flush=True,
        )
        jobs.append(info)
        return info

    ref = one("reference", [], 0)
    kinds: dict[str, list[dict[str, Any]]] = {}
    for kind in ("kill", "hang"):
        faults, _ = schedule(kind, per_job)
        rows: list[dict[str, Any]] = []
        for j in range(math.ceil(n / per_job)):
            info = one(f"{kind}-{j}", faults, 1)
            rows += [{**r, "job": info["name"]} for r in info["rows"]]
        kinds[kind] = rows
    for job in jobs:
        job["digest_matches_reference"] = job["digest"] is not None and job["digest"] == ref["digest"]
    summary: dict[str, Any] = {}
    for kind, rows in kinds.items():
        summary[kind] = {
            "n": len(rows),
            "detection_s": common.summary(r["detection_s"] for r in rows),
            "stall_s": common.summary(r["stall_s"] for r in rows),
            "recovery_done_s": common.summary(r["recovery_done_s"] for r in rows),
            "lost_steps_max": max((r["lost_steps"] for r in rows), default=None),
            "bytes": common.summary(r["bytes"] for r in rows),
            "transfer_gbps": common.summary(
                r["bytes"] / r["transfer_seconds"] / 1e9 for r in rows if r["bytes"] and r["transfer_seconds"]
            ),
            "split_median": {
                p: statistics.median(v)
                if (v := [r["split"][p] for r in rows if r["split"][p] is not None])
                else None
                for p in PHASES
            },
            "spare_ready_before_every_fault": all(r["spare_ready_before_fault"] for r in rows),
            "detected_by": sorted({str(r["detected_by"]) for r in rows}),
        }
    floor = kill_floor(kinds.get("kill", []), out_dir, quick)
    from checkpointless.config import RecoveryConfig

    rc = RecoveryConfig()
    return {
        "floor": floor,
        "quick": quick,
        "faults_per_kind": n,
        "faults_per_job": per_job,
        "steps_per_job": total,
        "model": MODEL,
        "recovery_config": {
            "hang_timeout_s": rc.hang_timeout_s,
            "heartbeat_interval_s": rc.heartbeat_interval_s,
        },
        "wall_s": time.time() - t_start,
        "reference_digest": ref["digest"],
        "all_digests_match": all(j["digest_matches_reference"] for j in jobs),
        "all_ok": all(j["ok"] for j in jobs),
        "summary": summary,
        "jobs": jobs,
    }


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    head = ["fault", "n", "detection median / p95 s", "stall median / p95 s", "recovery_done median / p95 s",
            "lost steps (max)", "state moved MB", "transfer GB/s (median)"]  # fmt: skip
    rows = []
    for kind in ("kill", "hang"):
        k = s[kind]
        if not k["n"]:
            rows.append([kind, 0, "–", "–", "–", "–", "–", "–"])
            continue
        rows.append(
            [
                kind,
                k["n"],
                f"{k['detection_s']['median']:.3f} / {k['detection_s']['p95']:.3f}",
                f"**{k['stall_s']['median']:.3f}** / {k['stall_s']['p95']:.3f}",
                f"{k['recovery_done_s']['median']:.3f} / {k['recovery_done_s']['p95']:.3f}",
                k["lost_steps_max"],
                f"{k['bytes']['median'] / 1e6:.1f}",
                common.fmt(k["transfer_gbps"].get("median")),
            ]
        )
    phases = common.md_table(
        ["fault", *PHASES, "normal step"],
        [
            [kind, *[s[kind]["split_median"][p] for p in PHASES],
             statistics.median(r["step_time_s"] for r in _rows(res, kind)) if _rows(res, kind) else None]
            for kind in ("kill", "hang")
        ],
    )  # fmt: skip
    per_fault = common.md_table(
        ["job", "fault", "detected by", "detection s", "stall s", "recovery_done s", "lost", "MB", "spare ready (s before)",
         *PHASES],
        [
            [r["job"], f"{r['kind']}:rank={r['ranks'][0]}@step={r['step']}", str(r["detected_by"]), r["detection_s"],
             r["stall_s"], r["recovery_done_s"], r["lost_steps"], f"{(r['bytes'] or 0) / 1e6:.1f}",
             common.fmt(r["spare_ready_margin_s"], 1), *[r["split"][p] for p in PHASES]]
            for kind in ("kill", "hang") for r in _rows(res, kind)
        ],
    )  # fmt: skip
    digests = common.md_table(
        ["job", "faults", "ok", "steps", "final_state_sha256", "= fault-free"],
        [
            [j["name"], ", ".join(j["faults"]) or "none", str(j["ok"]), j["steps_completed"],
             f"`{(j['digest'] or '–')[:16]}…`", "yes" if j["digest_matches_reference"] else "**NO**"]
            for j in res["jobs"]
        ],
    )  # fmt: skip
    rc = res["recovery_config"]
    return (
        f"{res['faults_per_kind']} faults per kind, {res['faults_per_job']} per job of {res['steps_per_job']} "
        f"steps (first at step {FIRST}, then every {SPACING}), 2 workers + 1 spare, default `RecoveryConfig` "
        f"(hang_timeout_s={rc['hang_timeout_s']}, heartbeat_interval_s={rc['heartbeat_interval_s']}). "
        f"Model {json.dumps(res['model'])}.\n\n"
        f"{common.md_table(head, rows)}\n\n"
        f"Where the survivor's time goes (medians, seconds; the phases sum to the survivor's gap between "
        f"two commits, and stall = gap − one normal step):\n\n{phases}\n\n"
        f"{_floor_text(res.get('floor') or {})}"
        f"Spare had reported ready before every fault: kill {s['kill']['spare_ready_before_every_fault']}, "
        f"hang {s['hang']['spare_ready_before_every_fault']}.\n\n"
        f"The fault-free reference runs with hang_timeout_s={REFERENCE_HANG_TIMEOUT_S:g} (see "
        f"`REFERENCE_HANG_TIMEOUT_S`). Jobs that failed on the first try and were rerun: "
        f"{[j['name'] for j in res['jobs'] if j.get('failed_first_try')] or 'none'}; no-progress "
        f"detections (a healthy-but-slow worker killed): "
        f"{sum(len(j.get('unplanned_detections', [])) for j in res['jobs'])}.\n\n"
        f"Exactness: every job's final state against the fault-free run of the same length "
        f"(all match: **{res['all_digests_match']}**):\n\n{digests}\n\n"
        f"<details><summary>Every fault</summary>\n\n{per_fault}\n\n</details>\n"
    )


def _floor_text(fl: dict[str, Any]) -> str:
    """The kill floor paragraph (empty for results measured before it existed)."""
    if not fl.get("ratio"):
        return ""
    g, lo, hi = fl["ratio"]
    text = (
        f"Against its floor (`kill_floor`: this fault's lost work, detection, plan and group formation, the "
        f"{fl['bytes'] / 1e6:.1f} MB at raw gloo speed into the same kind of tensors, {fl['raw_gbps']:.2f} GB/s "
        f"measured in this run, and one normal step), each kill's survivor gap is {g:.3f}x it (geometric mean, "
        f"95% interval [{lo:.3f}, {hi:.3f}], n={len(fl['faults'])}; goal ≤ 1.2x: "
        f"{common.interval_verdict(lo, hi, 1.2)})"
    )
    if fl.get("transfer_vs_raw"):
        g, lo, hi = fl["transfer_vs_raw"]
        text += (
            f"; the transfer inside the recovery runs at {g:.2f}x that raw speed ([{lo:.2f}, {hi:.2f}]; goal ≥ 0.8x: "
            f"{'met' if lo >= 0.8 else ('**not met**' if hi < 0.8 else 'not established')})"
        )
    return text + ".\n\n"


def _rows(res: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [{**r, "job": j["name"]} for j in res["jobs"] if j["name"].startswith(kind) for r in j["rows"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    res = run(a.quick, common.OUT)
    common.write_json(common.OUT / "recovery_stall.json", res)
    print(markdown(res))
    return 0 if res["all_ok"] and res["all_digests_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
