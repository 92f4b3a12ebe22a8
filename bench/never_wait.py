"""The survivor's stall after a kill: today's replacement against never-wait, at 130 MB and 1.5 GB.

Jobs: the demo (TinyGPT with AdamW; its step computes the replica's shares), 2 workers and 1
spare, gloo on loopback, one intra-op thread per process, run by ``Launcher`` as
``checkpointless demo`` does. Two states: 130 MB (``bench/recovery_stall.py``'s model: 10.9M
parameters, global batch 8) and 1.5 GB (``bench/large_state.py``'s: 126.6M parameters, one sample
per rank). Two modes:

- ``replace``: the spare that is ready takes the lost rank; the survivor waits while the spare
  receives the whole state from it;
- ``never_wait``: ``--min-workers 1 --never-wait``: the survivor takes the lost share at once and
  trains alone with both shares, while the spare catches up in the background and then joins.

Each job SIGKILLs rank 1 ``KILLS`` times (``kill:rank=1@step=S``), ``SPACING`` steps apart, so
that the job is back at two replicas and the pool's next spare is ready before the next kill
(checked per kill). Per kill, on the survivor's (rank 0's, the same process throughout) commits:

- ``stall_s``: its gap between the commit before the kill and the next one, minus one normal step
  at its new share count: for ``replace``, the job's median step before its first kill; for
  ``never_wait``, the median step of a calibration job of the same model with one worker holding
  both shares (run just before, fault-free: the survivor alone has both cores);
- ``full_s``: kill -> the job trains at two replicas again (``recovery_done`` of the replacement;
  ``resize_done`` of the catch-up's join);
- ``join_stall_s`` (never-wait): the survivor's gap around the join, minus one normal step.

The peers (full mode; ``bench.never_wait_peers``): torchft at its shortest stable heartbeat and
torchrun + DCP on the same models, rank 1 killed from outside every few seconds, their rank 0's
stall measured the same way.

Pairs: the i-th kill of each system at the same state size; the paired ratios never-wait/replace,
never-wait/torchft and never-wait/torchrun of the stalls, each with a 95% interval
(``common.paired_interval``). Goal (issue 42): at 1.5 GB the survivor's stall at most 0.3 s and
at most a third of torchft's, and not growing with the state. Every job's final state digest is
reported (the two modes' differ: a shrink changes the rounding without ``--exact-resize``).

Usage: ``python -m bench.never_wait [--quick]`` (writes ``bench/out/never_wait.json``).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import common, never_wait_peers
from checkpointless.protocol.vocab import Event

SIZES: dict[str, dict[str, Any]] = {
    "130MB": {"vocab_size": 256, "seq_len": 64, "d_model": 384, "n_layer": 6, "n_head": 6, "global_batch": 8},
    "1.5GB": {
        "vocab_size": 256,
        "seq_len": 64,
        "d_model": 1024,
        "n_layer": 10,
        "n_head": 16,
        "global_batch": 2,
    },
}
MODES = ("replace", "never_wait")
FIRST = 8
SPACING = {"130MB": 40, "1.5GB": 14}
KILLS, QUICK_KILLS = 10, 2
TAIL = 6
CALIBRATION_STEPS, WARMUP = 10, 2
STALL_GOAL_S = 0.3  # at 1.5 GB
TORCHFT_SHARE_GOAL = 1 / 3  # of torchft's stall, at 1.5 GB


def calibrate(size: str, out: Path) -> float:
    """The median step of one worker holding both shares (what never-wait's survivor trains)."""
    from checkpointless.config import JobConfig, RecoveryConfig
    from checkpointless.launch.demo import DemoModel, worker_command
    from checkpointless.launch.launcher import Launcher

    total = CALIBRATION_STEPS
    spec = DemoModel(steps=total, seed=0, lr=1e-3, eval_every=0, **SIZES[size])
    job = JobConfig(workers=1, spares=0, recovery=RecoveryConfig(shares=2))
    result = Launcher(job, worker_command(spec), total_steps=total, out_dir=out, env=common.THREAD_ENV,
                      timeout_s=1800).run()  # fmt: skip
    if not result.ok:
        raise RuntimeError(f"{size} calibration failed: {result.error}")
    w0 = _commits(result.events, "w0")[WARMUP:]
    return statistics.median(b[0] - a[0] for a, b in itertools.pairwise(w0))


def run_job(size: str, mode: str, kills: int, out: Path) -> Any:
    from checkpointless.config import JobConfig, RecoveryConfig
    from checkpointless.fault_grammar import parse_faults
    from checkpointless.launch.demo import DemoModel, worker_command
    from checkpointless.launch.launcher import Launcher

    steps = [FIRST + i * SPACING[size] for i in range(kills)]
    total = steps[-1] + TAIL
    spec = DemoModel(steps=total, seed=0, lr=1e-3, eval_every=0, **SIZES[size])
    extra = {"min_workers": 1, "never_wait": True, "resize_interval_s": 1.0} if mode == "never_wait" else {}
    job = JobConfig(workers=2, spares=1, faults=parse_faults([f"kill:rank=1@step={s}" for s in steps]),
                    recovery=RecoveryConfig(**extra))  # fmt: skip
    launcher = Launcher(job, worker_command(spec), total_steps=total, out_dir=out, env=common.THREAD_ENV,
                        timeout_s=3600)  # fmt: skip
    return launcher.run()


def _commits(events: list[dict[str, Any]], proc: str) -> list[tuple[float, int, int]]:
    """``proc``'s commits: (time, step, generation), in time order."""
    return sorted(
        (float(e["t"]), int(e["step"]), int(e.get("gen") or 0))
        for e in events
        if e["kind"] == Event.STEP_COMMITTED and e.get("proc") == proc
    )


def _gap_around(commits: list[tuple[float, int, int]], t: float) -> tuple[float, int] | None:
    """The gap between the last commit before ``t`` and the next one, and the generation of that one."""
    before = [c for c in commits if c[0] < t]
    after = [c for c in commits if c[0] > t]
    if not before or not after:
        return None
    return after[0][0] - before[-1][0], after[0][2]


def analyse(events: list[dict[str, Any]], mode: str, alone_step: float) -> dict[str, Any]:
    events = sorted(events, key=lambda e: float(e["t"]))
    w0 = _commits(events, "w0")
    kills = sorted(float(e["t"]) for e in events if e["kind"] == Event.FAULT_INJECTED)
    normal = statistics.median(b[0] - a[0] for a, b in itertools.pairwise(w0) if b[0] < kills[0])
    rows = []
    for i, t in enumerate(kills):
        gap = _gap_around(w0, t)
        if gap is None:
            continue
        seconds, _gen = gap
        new_step = alone_step if mode == "never_wait" else normal
        row: dict[str, Any] = {
            "kill": i,
            "gap_s": seconds,
            "new_step_s": new_step,
            "stall_s": seconds - new_step,
        }
        ready = [float(e["t"]) for e in events if e["kind"] == Event.SPARE_READY and float(e["t"]) < t]
        row["spare_ready_before"] = bool(ready)
        if mode == "replace":
            done = next((e for e in events if e["kind"] == Event.RECOVERY_DONE and float(e["t"]) > t), None)
            row["full_s"] = None if done is None else float(done["t"]) - t
            sent = next((e for e in events if e["kind"] == Event.TRANSFER_ENDED and float(e["t"]) > t), None)
            row["bytes"] = None if sent is None else int(sent["bytes"])
        else:
            grow = next((e for e in events if e["kind"] == Event.RESIZED and e.get("why") == "catch_up"
                         and float(e["t"]) > t), None)  # fmt: skip
            done = None if grow is None else next(
                (e for e in events if e["kind"] == Event.RESIZE_DONE and float(e["t"]) > float(grow["t"])), None
            )  # fmt: skip
            row["full_s"] = None if done is None else float(done["t"]) - t
            sent = next((e for e in events if e["kind"] == Event.CATCH_UP_SENT and float(e["t"]) > t), None)
            row["bytes"] = None if sent is None else int(sent["bytes"])
            row["copy_send_s"] = None if sent is None else float(sent["seconds"])
            started = next(
                (e for e in events if e["kind"] == Event.RESIZE_STARTED and float(e["t"]) > t), None
            )
            join = None if started is None else _gap_around(w0, float(started["t"]))
            row["join_stall_s"] = None if join is None else join[0] - normal
        rows.append(row)
    return {"normal_step_s": normal, "kills": rows}


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from checkpointless.launch.demo import DemoModel, build
    from checkpointless.models.tiny_gpt import n_params

    kills = QUICK_KILLS if quick else KILLS
    work = common.fresh_dir(out_dir / "never_wait")
    t_start = time.time()
    jobs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for size in SIZES:
        params = n_params(build(DemoModel(**SIZES[size]))[0])  # type: ignore[arg-type]
        alone = calibrate(size, common.fresh_dir(work / f"{size}-alone"))
        print(f"  never_wait {size} one worker, two shares: median step {alone:.3f}s", flush=True)
        for mode in MODES:
            t0 = time.time()
            result = run_job(size, mode, kills, common.fresh_dir(work / f"{size}-{mode}"))
            if not result.ok:
                raise RuntimeError(f"{size} {mode} failed: {result.error} (logs in {work})")
            a = analyse(result.events, mode, alone)
            jobs.append({"size": size, "mode": mode, "params": params, "state_bytes": params * 12, "alone_step_s": alone,
                         "digest": result.digest, "wall_s": time.time() - t0, **a})  # fmt: skip
            stalls = [r["stall_s"] for r in a["kills"]]
            print(f"  never_wait {size} {mode:10s} stall median {statistics.median(stalls):.3f}s "
                  f"(n={len(stalls)}, {time.time() - t0:.0f}s)", flush=True)  # fmt: skip
        for peer in () if quick else never_wait_peers.PEERS:
            if (why := never_wait_peers.available(peer)) is not None:
                skipped[peer] = why
                continue
            t0 = time.time()
            spec = DemoModel(steps=1, seed=0, lr=1e-3, eval_every=0, **SIZES[size])
            a = never_wait_peers.run_peer(peer, spec, size, kills, common.fresh_dir(work / f"{size}-{peer}"))
            jobs.append({"size": size, "mode": peer, "params": params, "state_bytes": params * 12,
                         "digest": None, "wall_s": time.time() - t0, **a})  # fmt: skip
            stalls = [r["stall_s"] for r in a["kills"]]
            print(f"  never_wait {size} {peer:10s} stall median {statistics.median(stalls):.3f}s "
                  f"(n={len(stalls)}, {time.time() - t0:.0f}s)", flush=True)  # fmt: skip
    summary: dict[str, Any] = {}
    for size in SIZES:
        by = {j["mode"]: j for j in jobs if j["size"] == size}
        s: dict[str, Any] = {mode: never_wait_peers.summary(job) for mode, job in by.items()}
        for other in ("replace", *never_wait_peers.PEERS):
            if other not in by:
                continue
            pairs = list(zip(by["never_wait"]["kills"], by[other]["kills"], strict=False))
            ratios = [a["stall_s"] / b["stall_s"] for a, b in pairs if a["stall_s"] > 0 and b["stall_s"] > 0]
            key = "" if other == "replace" else f"_{other}"
            s[f"paired_ratios{key}"] = ratios
            s[f"interval_ratio{key}"] = common.paired_interval(ratios)
        summary[size] = s
    return {"quick": quick, "kills_per_job": kills, "spacing": SPACING, "goal_stall_s": STALL_GOAL_S,
            "goal_torchft_share": TORCHFT_SHARE_GOAL, "peers_skipped": skipped,
            "kill_every_s": never_wait_peers.KILL_EVERY_S, "wall_s": time.time() - t_start,
            "summary": summary, "jobs": jobs}  # fmt: skip


def verdict_rows(res: dict[str, Any]) -> list[list[Any]]:
    """The summary table's rows (``run_all.targets``)."""
    big = res["summary"].get("1.5GB")
    if not big:
        return []
    st = big["never_wait"]["stall_s"]
    ok = None if not st.get("n") else st["p95"] <= res["goal_stall_s"]
    rows = [["never-wait: survivor's stall after a kill at 1.5 GB, median (p95)", f"≤ {res['goal_stall_s']:g} s",
             f"{st['median']:.3f} s ({st['p95']:.3f} s), n={st['n']}",
             "–" if ok is None else ("met" if ok else "**not met**")]]  # fmt: skip
    share = res.get("goal_torchft_share", TORCHFT_SHARE_GOAL)
    for key, what, limit, goal in (("", "replacement", 1.0, "< 1"),
                                   ("_torchft", "torchft", share, f"≤ {share:.3g}")):  # fmt: skip
        pi = big.get(f"interval_ratio{key}")
        if pi:
            g, lo, hi = pi
            rows.append([f"never-wait / {what} stall at 1.5 GB, paired ratio (geometric mean, 95% interval)",
                         goal, f"{g:.3f} [{lo:.3f}, {hi:.3f}], n={len(big[f'paired_ratios{key}'])}",
                         common.interval_verdict(lo, hi, limit)])  # fmt: skip
    return rows


def markdown(res: dict[str, Any]) -> str:
    rows = []
    for size, s in res["summary"].items():
        for mode in (*MODES, *never_wait_peers.PEERS):
            if mode not in s:
                continue
            m = s[mode]
            key = "" if mode == "replace" else f"_{mode}"
            pi = s.get(f"interval_ratio{key}") if mode != "never_wait" else None
            ratio = "–" if not pi else f"{pi[0]:.3f} [{pi[1]:.3f}, {pi[2]:.3f}]"
            rows.append([size, mode, m["stall_s"].get("n"), m["stall_s"].get("median"), m["stall_s"].get("p95"),
                         m["full_s"].get("median"), m["join_stall_s"].get("median"), ratio])  # fmt: skip
    table = common.md_table(
        ["state", "system", "kills", "stall s (median)", "stall s (p95)", "kill -> two replicas s (median)",
         "join stall s (median)", "never-wait's stall / this one's, paired (95% interval)"],
        rows,
    )  # fmt: skip
    jobs = common.md_table(
        ["state", "system", "normal step s", "one worker, two shares: step s", "bytes of the copy / transfer",
         "settings", "wall s", "final digest"],
        [[j["size"], j["mode"], j["normal_step_s"], j.get("alone_step_s"),
          next((k["bytes"] for k in j["kills"] if k.get("bytes")), None),
          ", ".join(f"{k}={v}" for k, v in (j.get("settings") or {}).items()) or "–", j["wall_s"],
          str(j["digest"])[:16] if j.get("digest") else "–"]
         for j in res["jobs"]],
    )  # fmt: skip
    alone = {j["size"]: j["alone_steps"] for j in res["jobs"] if j["mode"] == "torchft"}
    peers = (
        " torchft and torchrun + DCP: rank 1 killed from outside every"
        f" {', '.join(f'{v:g} s at {k}' for k, v in (res.get('kill_every_s') or {}).items())};"
        " their stall is rank 0's gap around the kill minus its normal step. torchft's survivor trains"
        " on alone with half the batch (steps trained alone, the other half's samples dropped: "
        + ", ".join(f"{n} at {k}" for k, n in alone.items())
        + "); torchrun restarts both processes from the newest checkpoint."
        if alone or any(j["mode"] == "torchrun" for j in res["jobs"])
        else " Peers not run" + (" (quick run)." if res.get("quick") else ".")
    )
    skipped = "".join(f" {p} skipped: {why}." for p, why in (res.get("peers_skipped") or {}).items())
    return (
        f"2 workers + 1 spare, {res['kills_per_job']} kills of rank 1 per job"
        + (" (quick run)" if res.get("quick") else "")
        + ". Stall = the survivor's gap between its commits around the kill, minus one normal step at"
        " its new share count (two shares alone under never-wait). The join stall is the second stop,"
        " when the replacement takes its rank back." + peers + skipped + f"\n\n{table}\n\n{jobs}\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    res = run(a.quick, common.OUT)
    common.write_json(common.OUT / "never_wait.json", res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
