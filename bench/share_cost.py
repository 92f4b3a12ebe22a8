"""Steady-state step cost of the share loop and of ``--exact-resize`` against the plain step.

Three ways to reduce the same gradient, world size 2, no spare, no faults, gloo on loopback, the
same model (TinyGPT, ~10.9M parameters, dropout 0.1, AdamW), the same data (``SyntheticTokens``,
global batch 8, 4 per rank) and the same per-step RNG reseeding, one intra-op thread everywhere.
Every job is this file's worker (``--worker``) run by ``Launcher`` in-process, as
``bench/steady_state.py`` runs the demo:

- ``plain``: the demo's loop, ``session.reduce_gradients()`` after one forward and backward pass
  (the default job: one share per replica, the overlapped bucketed all-reduce);
- ``shares``: the same step written with the share loop, ``for share in session.shares():`` around
  the forward and backward passes, then ``session.reduce_gradients()`` (one share per replica: the
  same bits as ``plain``);
- ``exact``: the share loop with ``RecoveryConfig(exact_resize=True)`` (``--exact-resize``): each
  share's gradient kept apart and summed in share order through an all-to-all and an all-gather
  (``exact_sum``) after the backward pass, instead of the all-reduce overlapped with it;
- ``never_wait``: the share loop with ``--min-workers 1 --never-wait``: the all-reduce after the
  backward pass instead of overlapped with it, and one more all-reduce of one element at the end of
  the shares (the check that lets survivors keep their passes: ``checkpointless/takeover.py``).

Step time is the interval between consecutive ``step_committed`` events of a rank, the first
``WARMUP`` steps of every run dropped; a run's step time is the median over both ranks' kept
intervals. A repetition runs every variant once, the order rotating (each variant goes first in a
quarter of them) so that the drift of this shared 2-core machine falls on all alike; its ratios are
each variant's run median over ``plain``'s. The repetitions' ratios give a
geometric mean with a 95% t interval on their logs (``common.paired_interval``). Goal: within 1%
(the whole interval at or below 1.01). Peak RSS is each worker's own (``ru_maxrss``, read at the
end of its loop); the final state digests say whether the variants computed the same thing.

Usage: ``python -m bench.share_cost [--quick]`` (writes ``bench/out/share_cost.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.steady_state import HANG_TIMEOUT_S, MODEL, WARMUP
from checkpointless.protocol.vocab import Event

VARIANTS = ("plain", "shares", "exact", "never_wait")
#: each repetition's order: the rotations, so that each variant goes first as often as the others
ORDERS = tuple(VARIANTS[i:] + VARIANTS[:i] for i in range(len(VARIANTS)))
STEPS, QUICK_STEPS = 32, 20
"""Per run, the first ``WARMUP`` dropped: 23 intervals per rank in the full run (80 runs: ~28 min)."""
REPS, QUICK_REPS = 20, 4
GOAL = 1.01
RSS_EVENT = "bench_peak_rss"
"""The custom event a worker emits after its loop: its own peak RSS (``ru_maxrss``, KiB)."""


# -- the worker (one process per rank, started by the Launcher) --------------------------------
def worker(spec_json: str) -> None:
    """A rank's training script: the demo's model and loop, with or without the share loop."""
    import checkpointless as cl
    from checkpointless.launch.demo import DemoModel, build

    cfg = json.loads(spec_json)
    share_loop = bool(cfg.pop("share_loop"))
    spec = DemoModel(**cfg)
    model, optimizer, data = build(spec)
    session = cl.Session(model, optimizer, seed=spec.seed)
    for step in session.steps(spec.steps):
        with session.attempt():
            if share_loop:
                for _share in session.shares():
                    inputs, targets = data.batch(step, session.dp_rank, session.dp_size)
                    loss = model(inputs, targets)
                    loss.backward()
                    session.log(loss=loss.item(), tokens=inputs.numel())
            else:
                inputs, targets = data.batch(step, session.dp_rank, session.dp_size)
                loss = model(inputs, targets)
                loss.backward()
                session.log(loss=loss.item(), tokens=inputs.numel())
            session.reduce_gradients()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    session.emit(RSS_EVENT, maxrss_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    session.finish()


def worker_command(steps: int, share_loop: bool) -> list[str]:
    spec = {**MODEL, "steps": steps, "share_loop": share_loop}
    return [common.PYTHON, "-m", "bench.share_cost", "--worker", json.dumps(spec)]


# -- one run -----------------------------------------------------------------------------------
def run_variant(variant: str, steps: int, work: Path) -> dict[str, Any]:
    from checkpointless.config import JobConfig, RecoveryConfig
    from checkpointless.launch.launcher import Launcher

    # hang_timeout_s only sets failure detection (as in steady_state: a slow first step on this
    # loaded machine is not a hang)
    never_wait = {"min_workers": 1, "never_wait": True} if variant == "never_wait" else {}
    recovery = RecoveryConfig(hang_timeout_s=HANG_TIMEOUT_S, exact_resize=variant == "exact", **never_wait)
    job = JobConfig(workers=2, spares=0, faults=[], recovery=recovery)
    command = worker_command(steps, share_loop=variant != "plain")
    retried = None
    for attempt in range(2):
        launcher = Launcher(
            job, command, total_steps=steps, out_dir=work / f"try{attempt}", env=common.THREAD_ENV,
            timeout_s=60 + 5 * steps,
        )  # fmt: skip
        t0 = time.monotonic()
        result = launcher.run()
        if result.ok:
            break
        retried = result.error
        print(f"  {variant} run failed ({result.error}); retrying once", flush=True)
    if not result.ok:
        raise RuntimeError(f"{variant} run failed: {result.error} (logs in {work})")
    intervals: list[float] = []
    inner: list[float] = []
    for rank in (0, 1):
        commits = sorted(
            (e for e in result.events if e["kind"] == Event.STEP_COMMITTED and e["rank"] == rank),
            key=lambda e: e["t"],
        )
        for a, b in itertools.pairwise(commits):
            if b["step"] <= WARMUP or b["step"] != a["step"] + 1:
                continue
            intervals.append(b["t"] - a["t"])
            inner.append(float(b["step_time_s"]))
    rss = [int(e["maxrss_kb"]) for e in result.events if e["kind"] == RSS_EVENT]
    return {
        "median_s": statistics.median(intervals),
        "inner_median_s": statistics.median(inner),
        "intervals": intervals,
        "inner": inner,
        "peak_rss_mb": max(rss) / 1024 if rss else None,
        "wall_s": time.monotonic() - t0,
        "digest": result.digest,
        "failed_first_try": retried,
    }


# -- orchestration -----------------------------------------------------------------------------
def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from checkpointless.launch.demo import DemoModel, build
    from checkpointless.models.tiny_gpt import n_params

    steps, reps = (QUICK_STEPS, QUICK_REPS) if quick else (STEPS, REPS)
    work = common.fresh_dir(out_dir / "share_cost")
    params = n_params(build(DemoModel(**MODEL))[0])  # type: ignore[arg-type]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    orders: list[list[str]] = []
    t_start = time.time()
    for rep in range(reps):
        order = ORDERS[rep % len(ORDERS)]
        orders.append(list(order))
        for v in order:
            r = run_variant(v, steps, common.fresh_dir(work / f"rep{rep}-{v}"))
            r["rep"] = rep
            r["loadavg_after"] = common.load_average()
            runs[v].append(r)
            print(f"  share_cost rep {rep} {v:6s} median step {r['median_s']:.4f}s "
                  f"(n={len(r['intervals'])}, {r['wall_s']:.0f}s)", flush=True)  # fmt: skip
    summary: dict[str, Any] = {}
    for v in VARIANTS:
        rss = [r["peak_rss_mb"] for r in runs[v] if r["peak_rss_mb"] is not None]
        summary[v] = {
            "interval": common.summary(x for r in runs[v] for x in r["intervals"]),
            "inner": common.summary(x for r in runs[v] for x in r["inner"]),
            "run_median": common.summary(r["median_s"] for r in runs[v]),
            "peak_rss_mb": max(rss) if rss else None,
            "digests": sorted({str(r["digest"]) for r in runs[v]}),
        }
    base = {r["rep"]: r["median_s"] for r in runs["plain"]}
    for v in VARIANTS[1:]:
        ratios = [r["median_s"] / base[r["rep"]] for r in runs[v]]
        summary[v]["paired_ratios"] = ratios
        summary[v]["interval_ratio"] = common.paired_interval(ratios)
    return {
        "quick": quick,
        "params": params,
        "model": MODEL,
        "steps_per_run": steps,
        "warmup_dropped": WARMUP,
        "reps": reps,
        "orders": orders,
        "goal": GOAL,
        "wall_s": time.time() - t_start,
        "summary": summary,
        "runs": runs,
    }


_TITLES = {
    "shares": "share loop (one share per replica) step time vs the plain step",
    "exact": "`--exact-resize` step time vs the plain step",
    "never_wait": "`--never-wait` step time vs the plain step",
}


def verdict_rows(res: dict[str, Any]) -> list[list[Any]]:
    """The summary table's rows (``run_all.targets``): one per variant against ``plain``."""
    rows = []
    for v, title in _TITLES.items():
        pi = res["summary"].get(v, {}).get("interval_ratio")
        if not pi:
            continue
        g, lo, hi = pi
        rows.append([f"{title}, paired ratio (geometric mean, 95% interval)", f"≤ {res['goal']:g}",
                     f"{g:.3f} [{lo:.3f}, {hi:.3f}], n={len(res['summary'][v]['paired_ratios'])}",
                     common.interval_verdict(lo, hi, res["goal"])])  # fmt: skip
    return rows


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    variants = [v for v in VARIANTS if v in s]  # a result from before a variant was added lacks it
    rows = []
    for v in variants:
        iv, inner, rm = s[v]["interval"], s[v]["inner"], s[v]["run_median"]
        pi = s[v].get("interval_ratio")
        ratio = "1 (baseline)" if v == "plain" else f"{pi[0]:.3f} [{pi[1]:.3f}, {pi[2]:.3f}]" if pi else "–"
        verdict = "–" if v == "plain" or not pi else common.interval_verdict(pi[1], pi[2], res["goal"])
        rss = s[v].get("peak_rss_mb")
        rows.append([v, iv["n"], rm["median"], iv["p95"], inner["median"], ratio, verdict,
                     "–" if rss is None else f"{rss:.0f}"])  # fmt: skip
    table = common.md_table(
        ["variant", "steps (both ranks)", "median step s (median of runs)", "p95 step s", "median in-step s",
         f"paired ratio to plain (geometric mean, 95% interval, n={res['reps']})",
         f"within {100 * (res['goal'] - 1):g}%", "peak RSS MB (worker)"],
        rows,
    )  # fmt: skip
    by_rep = {v: {r["rep"]: r["median_s"] for r in res["runs"][v]} for v in variants}
    per_rep = common.md_table(
        ["rep", "order", *(f"{v} s" for v in variants), *(f"{v}/plain" for v in variants[1:])],
        [[i, " ".join(order), *(by_rep[v].get(i) for v in variants),
          *(by_rep[v][i] / by_rep["plain"][i] for v in variants[1:])]
         for i, order in enumerate(res["orders"])],
    )  # fmt: skip
    digests = {v: s[v]["digests"] for v in variants}
    same_shares = digests["shares"] == digests["plain"] and len(digests["plain"]) == 1
    same_exact = digests["exact"] == digests["plain"] and len(digests["plain"]) == 1
    same_never = digests.get("never_wait") == digests["plain"] and len(digests["plain"]) == 1
    retried = sum(1 for v in variants for r in res["runs"][v] if r.get("failed_first_try"))
    return (
        f"Model: TinyGPT, {res['params'] / 1e6:.1f}M parameters ({json.dumps(res['model'])}), AdamW, "
        f"world size 2, no spare; {res['reps']} interleaved repetitions of {res['steps_per_run']} steps "
        f"per variant (first {res['warmup_dropped']} steps of each run dropped)"
        + (" (quick run)" if res.get("quick") else "")
        + ". Step = interval between consecutive commits of one rank; in-step = batch + forward + "
        "backward + reduction + optimizer.\n\n"
        f"{table}\n\nMedian step time per repetition (seconds) and its ratios:\n\n{per_rep}\n\n"
        f"Final state (model + AdamW, ``digest_state``) after the same steps: share loop "
        f"{'bitwise identical to' if same_shares else 'different from'} the plain step; "
        f"``--exact-resize`` {'bitwise identical to' if same_exact else 'different from'} the plain step "
        + (
            ""
            if "never_wait" not in digests
            else f"; ``--never-wait`` {'bitwise identical to' if same_never else 'different from'} the plain step"
        )
        + f" (distinct digests: plain {len(digests['plain'])}, shares {len(digests['shares'])}, "
        f"exact {len(digests['exact'])}). Jobs ran with hang_timeout_s={HANG_TIMEOUT_S:g} (detection "
        f"only); runs that failed and were retried: {retried}.\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        worker(a.worker)
        return 0
    res = run(a.quick, common.OUT)
    common.write_json(common.OUT / "share_cost.json", res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
