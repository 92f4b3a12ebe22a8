"""Steady-state step time: checkpointless against plain ``DistributedDataParallel``, world size 2.

Same model (TinyGPT, ~10.9M parameters, dropout 0.1), same AdamW, same synthetic data
(``SyntheticTokens``, global batch 8, 4 per rank), same per-step RNG reseeding (so dropout masks
are identical), one intra-op thread in every process, gloo on loopback.

Variants, run *interleaved* in one invocation (the first two alternate which runs first; the
third, whose runs are longer, joins every other repetition) so that the noise of this shared
2-core machine falls on all of them alike:

- ``ddp``: a plain script in this file (``--ddp-worker``): ``init_process_group("gloo")``,
  ``DistributedDataParallel(model)`` with default buckets (25 MB) and overlap, the same loop;
- ``checkpointless``: ``checkpointless.launch.demo`` workers through ``Launcher``, 2 workers, no spare,
  no faults (control plane, heartbeats and event shipping included);
- ``checkpointless+spare``: the same with one hot spare idling (what a real job runs); the spare's
  start-up (import torch, build the model) competes for the 2 cores, so steps committed before
  it reported ready are dropped.

Step time is the interval between consecutive step ends (``step_committed`` events for
checkpointless, a timestamp after the same loop body for DDP), per rank, with the first
``WARMUP`` steps of every run dropped; the median is over all kept intervals of all repetitions.
The in-step time (``step_time_s`` of ``step_committed``, the same span timed in the DDP script) is
reported too, and the paired per-repetition ratio.

Usage: ``python -m bench.steady_state [--quick]`` (writes ``bench/out/steady_state.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench import common
from checkpointless.protocol.vocab import Event

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
WARMUP = 8
HANG_TIMEOUT_S = 10.0
VARIANTS = ("ddp", "checkpointless", "checkpointless+spare")
# the two main variants alternate which goes first; the spare variant (longer runs) every other rep
ORDERS = (
    ("ddp", "checkpointless", "checkpointless+spare"),
    ("checkpointless", "ddp"),
    ("checkpointless+spare", "ddp", "checkpointless"),
    ("checkpointless", "ddp"),
)


# -- the DDP baseline (one process per rank) -----------------------------------------------
def ddp_worker(rank: int, world: int, port: int, steps: int, out: Path) -> None:
    common.pin_threads()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from checkpointless.control.client import connect
    from checkpointless.corpus.synthetic import SyntheticTokens
    from checkpointless.launch.demo import DemoModel
    from checkpointless.models.tiny_gpt import GPTConfig, TinyGPT
    from checkpointless.session import step_seed
    from checkpointless.state import digest_state

    spec = DemoModel(steps=steps, **MODEL)  # type: ignore[arg-type]
    store = connect(f"127.0.0.1:{port}", timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(spec.seed)
    cfg = GPTConfig(
        vocab_size=spec.vocab_size, seq_len=spec.seq_len, d_model=spec.d_model,
        n_layer=spec.n_layer, n_head=spec.n_head,
    )  # fmt: skip
    model = DistributedDataParallel(TinyGPT(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    data = SyntheticTokens(
        seed=spec.seed, vocab_size=spec.vocab_size, seq_len=spec.seq_len, global_batch=spec.global_batch
    )
    ends: list[float] = []
    inner: list[float] = []
    losses: list[float] = []
    for step in range(steps):
        torch.manual_seed(step_seed(spec.seed, step, rank))  # as Session.attempt does
        t0 = time.perf_counter()
        inputs, targets = data.batch(step, rank, world)
        loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        inner.append(time.perf_counter() - t0)
        losses.append(loss.item())
        ends.append(time.time())
    dist.barrier()
    dist.destroy_process_group()
    digest = digest_state(model.module, optimizer, steps - 1)  # the same digest Session.finish reports
    common.write_json(out, {"rank": rank, "ends": ends, "inner": inner, "losses": losses, "digest": digest})


def run_ddp(steps: int, work: Path) -> dict[str, Any]:
    from checkpointless.launch.launcher import open_store

    store = open_store("127.0.0.1", 0)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in (0, 1):
            cmd = [
                common.PYTHON, "-m", "bench.steady_state", "--ddp-worker", str(rank),
                "--port", str(store.port), "--steps", str(steps), "--out", str(work / f"ddp{rank}.json"),
            ]  # fmt: skip
            log = open(work / f"ddp{rank}.log", "wb")  # noqa: SIM115 (closed right after start)
            procs.append(subprocess.Popen(cmd, env=common.child_env(), stdout=log, stderr=subprocess.STDOUT))
            log.close()
        codes = common.wait_all(procs, timeout=60 + 5 * steps)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    if any(codes):
        raise RuntimeError(f"DDP workers exited with {codes}: see {work}/ddp*.log")
    per_rank = [json.loads((work / f"ddp{r}.json").read_text()) for r in (0, 1)]
    intervals: list[float] = []
    inner: list[float] = []
    for d in per_rank:
        ends = d["ends"]
        intervals += [b - a for a, b in zip(ends[WARMUP:], ends[WARMUP + 1 :], strict=False)]
        inner += d["inner"][WARMUP + 1 :]
    return {
        "intervals": intervals,
        "inner": inner,
        "final_loss": statistics.fmean(per_rank[0]["losses"][-5:]),
        "digest": per_rank[0]["digest"],
        "digests_agree": per_rank[0]["digest"] == per_rank[1]["digest"],
    }


# -- checkpointless ------------------------------------------------------------------------
def run_checkpointless(steps: int, spares: int, work: Path) -> dict[str, Any]:
    from checkpointless.config import JobConfig, RecoveryConfig
    from checkpointless.launch.demo import DemoModel, worker_command
    from checkpointless.launch.launcher import Launcher

    spec = DemoModel(steps=steps, **MODEL)  # type: ignore[arg-type]
    # hang_timeout_s only sets failure detection; a long one keeps the coordinator's no-progress
    # detector from killing a healthy worker in a slow first step on this loaded machine
    job = JobConfig(
        workers=2, spares=spares, faults=[], recovery=RecoveryConfig(hang_timeout_s=HANG_TIMEOUT_S)
    )
    retried = None
    for attempt in range(2):
        launcher = Launcher(
            job, worker_command(spec), total_steps=steps, out_dir=work / f"try{attempt}", env=common.THREAD_ENV,
            timeout_s=60 + 5 * steps,
        )  # fmt: skip
        cpu0, wall0 = time.process_time(), time.monotonic()
        result = launcher.run()
        if result.ok:
            break
        retried = result.error
        print(f"  checkpointless run failed ({result.error}); retrying once", flush=True)
    launcher_cpu = time.process_time() - cpu0
    wall = time.monotonic() - wall0
    if not result.ok:
        raise RuntimeError(f"checkpointless run failed: {result.error} (logs in {work})")
    events = result.events
    ready = [e["t"] for e in events if e["kind"] == Event.SPARE_READY]
    cutoff = max(ready) if ready else 0.0
    intervals: list[float] = []
    inner: list[float] = []
    dropped = 0
    for rank in (0, 1):
        commits = sorted(
            (e for e in events if e["kind"] == Event.STEP_COMMITTED and e["rank"] == rank),
            key=lambda e: e["t"],
        )
        for a, b in itertools.pairwise(commits):
            if b["step"] <= WARMUP or b["step"] != a["step"] + 1:
                continue
            if a["t"] <= cutoff:  # the spare was still starting: not steady state
                dropped += 1
                continue
            intervals.append(b["t"] - a["t"])
            inner.append(float(b["step_time_s"]))
    return {
        "intervals": intervals,
        "inner": inner,
        "dropped_before_spare_ready": dropped,
        "launcher_cpu_s": launcher_cpu,
        "launcher_cpu_share": launcher_cpu / wall if wall else 0.0,
        "wall_s": wall,
        "digest": result.digest,
        "failed_first_try": retried,
    }


# -- orchestration ---------------------------------------------------------------------------
def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from checkpointless.models.tiny_gpt import GPTConfig, TinyGPT, n_params

    measured = 30 if quick else 200
    reps = 2 if quick else 4
    per_rep = -(-measured // reps)
    steps = WARMUP + 1 + per_rep
    spare_extra = 15 if quick else 20  # steps committed while the spare starts are dropped
    work = common.fresh_dir(out_dir / "steady_state")
    cfg = GPTConfig(
        vocab_size=MODEL["vocab_size"], seq_len=MODEL["seq_len"], d_model=MODEL["d_model"],
        n_layer=MODEL["n_layer"], n_head=MODEL["n_head"],
    )  # fmt: skip
    params = n_params(TinyGPT(cfg))
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    order_log: list[str] = []
    t_start = time.time()
    for rep in range(reps):
        order = ORDERS[rep % len(ORDERS)]
        for v in order:
            d = common.fresh_dir(work / f"rep{rep}-{v.replace('+', '-')}")
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.monotonic()
            if v == "ddp":
                r = run_ddp(steps, d)
            elif v == "checkpointless":
                r = run_checkpointless(steps, 0, d)
            else:
                r = run_checkpointless(steps + spare_extra, 1, d)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            r["children_cpu_s"] = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
            r["run_s"] = time.monotonic() - t0
            r["rep"] = rep
            r["loadavg_after"] = common.load_average()
            runs[v].append(r)
            order_log.append(v)
            print(
                f"  steady_state rep {rep} {v:22s} median step {statistics.median(r['intervals']):.4f}s "
                f"(n={len(r['intervals'])}, {r['run_s']:.0f}s)",
                flush=True,
            )
    summary: dict[str, Any] = {}
    for v in VARIANTS:
        iv = [x for r in runs[v] for x in r["intervals"]]
        inner = [x for r in runs[v] for x in r["inner"]]
        summary[v] = {
            "interval": common.summary(iv),
            "inner": common.summary(inner),
            "per_rep_median": {r["rep"]: statistics.median(r["intervals"]) for r in runs[v]},
            "digests": sorted({r["digest"] for r in runs[v]}),
        }
        if v != "ddp":
            summary[v]["launcher_cpu_share"] = statistics.fmean(r["launcher_cpu_share"] for r in runs[v])
    base = summary["ddp"]["interval"]["median"]
    for v in VARIANTS[1:]:
        med = summary[v]["interval"]["median"]
        mine, ddp = summary[v]["per_rep_median"], summary["ddp"]["per_rep_median"]
        paired = [mine[k] / ddp[k] for k in sorted(mine) if k in ddp]
        summary[v]["ratio"] = med / base
        summary[v]["overhead_pct"] = 100 * (med / base - 1)
        summary[v]["paired_ratio_median"] = statistics.median(paired)
        summary[v]["paired_ratios"] = paired
        summary[v]["inner_ratio"] = summary[v]["inner"]["median"] / summary["ddp"]["inner"]["median"]
    # same computation? final state digest of DDP and of checkpointless after the same steps
    same_state = summary["ddp"]["digests"] == summary["checkpointless"]["digests"]
    return {
        "quick": quick,
        "params": params,
        "model": MODEL,
        "steps_per_run": steps,
        "warmup_dropped": WARMUP,
        "reps": reps,
        "order": order_log,
        "wall_s": time.time() - t_start,
        "summary": summary,
        "same_final_state_ddp_vs_checkpointless": same_state,
        "runs": runs,
    }


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    rows = []
    for v in VARIANTS:
        iv, inner = s[v]["interval"], s[v]["inner"]
        rows.append(
            [
                v,
                iv["n"],
                iv["median"],
                iv["p95"],
                inner["median"],
                "1 (baseline)" if v == "ddp" else f"{s[v]['ratio']:.3f}",
                "–" if v == "ddp" else f"{s[v]['overhead_pct']:+.1f}%",
                "–" if v == "ddp" else f"{s[v]['paired_ratio_median']:.3f}",
            ]
        )
    table = common.md_table(
        [
            "variant",
            "steps (both ranks)",
            "median step s",
            "p95 step s",
            "median in-step s",
            "ratio to DDP",
            "overhead",
            "paired ratio (median over reps)",
        ],
        rows,
    )
    # keys are ints when run, strings once read back from the JSON (``--render``)
    per_rep = {v: {int(k): x for k, x in s[v]["per_rep_median"].items()} for v in VARIANTS}
    reps = common.md_table(
        ["variant", *[f"rep {i}" for i in range(res["reps"])]],
        [[v, *[per_rep[v].get(i) for i in range(res["reps"])]] for v in VARIANTS],
    )
    launcher = ", ".join(f"{v}: {100 * s[v]['launcher_cpu_share']:.1f}% of one core" for v in VARIANTS[1:])
    same = res["same_final_state_ddp_vs_checkpointless"]
    retried = sum(1 for v in VARIANTS[1:] for r in res["runs"][v] if r.get("failed_first_try"))
    return (
        f"Model: TinyGPT, {res['params'] / 1e6:.1f}M parameters ({json.dumps(res['model'])}), AdamW, "
        f"world size 2, {res['reps']} interleaved repetitions of {res['steps_per_run']} steps per variant "
        f"(first {res['warmup_dropped']} steps of each run dropped). Step = interval between consecutive "
        f"step ends on one rank; in-step = batch + forward + backward + reduction + optimizer.\n\n"
        f"{table}\n\nMedian step time per repetition (order alternates):\n\n{reps}\n\n"
        f"Launcher process CPU (control store + coordinator loop, in the benchmark process): {launcher}. "
        f"Final state (model + AdamW, ``digest_state``) of DDP and of checkpointless after the same "
        f"{res['steps_per_run']} steps: {'bitwise identical' if same else 'different'} "
        f"(so both compute the same thing). Checkpointless jobs run with hang_timeout_s={HANG_TIMEOUT_S:g} "
        f"(detection only); runs that failed and were retried: {retried}.\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ddp-worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.ddp_worker is not None:
        ddp_worker(a.ddp_worker, 2, a.port, a.steps, a.out)
        return 0
    res = run(a.quick, common.OUT)
    common.write_json(common.OUT / "steady_state.json", res)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
