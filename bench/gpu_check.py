"""The GPU check: checkpointless on CUDA, in one script that runs in under 10 minutes on one H200.

``python -m bench.gpu_check`` (``make gpu-check``) on a machine with CUDA. It writes
``bench/results/gpu_check.json`` (with the git commit) and prints a summary; without CUDA it
exits at once with one line (exit 2). Every part is recorded as ok, failed (with its error) or
skipped, and the script exits 1 if any part failed.

On one GPU, several ranks share it with CUDA tensors over gloo (the gloo data plane reduces and
broadcasts CUDA tensors and the transfer stages them through the host), and NCCL is checked on a
one-rank group (NCCL refuses two ranks of a group on one GPU). With a GPU for every worker and
spare (``devices.py``: each process on ``cuda:<its slot>``), the jobs run over NCCL proper.

- ``transfer``: ``send_state``/``recv_state`` between two threads, CUDA tensors into CUDA tensors
  (in place), over gloo (staged) and, with two GPUs, NCCL: bitwise equal, throughput; the CUDA RNG
  states in the session's progress state arrive and load.
- ``nccl_generations``: a one-rank NCCL group (and its gloo control group) formed, used (an
  all-reduce of a CUDA tensor, a barrier) and aborted, once per generation, timed.
- ``replicated``: the demo (TinyGPT with dropout on the GPU) with 3 workers and a spare: a kill and
  a hang, against the same job without faults: the final states must be equal bit for bit; the
  stall of each fault as the report measures it.
- ``nccl_job``: one worker over NCCL, a step that raises: the session aborts the NCCL group and
  forms the next generation's; bitwise equal to the run without the fault.
- ``hsdp``: a sharded recipe (FSDP2, 2 replicas x 2 shards, TinyGPT) with a kill: the replacement
  receives its shard from a replica; bitwise equal to the fault-free run.

``--cpu`` rehearses the same parts on the CPU (gloo, NCCL parts skipped), for working on the
script without a GPU; ``--quick`` makes the jobs shorter.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench import common

RECIPE = common.REPO / "recipes" / "llama-tiny.yaml"
TINY_GPT = ["model.family=tiny_gpt", "model.num_key_value_heads=null", "model.intermediate_size=512",
            "model.tie_word_embeddings=false", "model.extra={}", "data.eval_every=0",
            "optim.warmup_steps=2", "data.seq_len=64", "data.global_batch=16"]  # fmt: skip
DEMO = {"vocab_size": 64, "seq_len": 64, "d_model": 128, "n_layer": 2, "n_head": 4, "global_batch": 12,
        "eval_every": 0}  # fmt: skip


PARTS = ("transfer", "nccl_generations", "replicated", "nccl_job", "hsdp")


def _part(results: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """Run one part; record its result, or its error, and say so in one line."""
    t0 = time.monotonic()
    try:
        res = fn()
    except Exception as e:  # a part that breaks is a finding, not the end of the check
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    res["wall_s"] = round(time.monotonic() - t0, 2)
    results[name] = res
    state = "skipped" if res.get("skipped") else "ok" if res.get("ok") else "FAILED"
    detail = res.get("skipped") or res.get("error") or res.get("summary", "")
    print(f"  {name:<17} {state:<7} {res['wall_s']:>6.1f}s  {detail}", flush=True)


# -- in-process parts ----------------------------------------------------------------------------
def _pair(fn: Callable[[Any, int], Any], backend: str, devices: list[Any]) -> list[Any]:
    """``fn(group, rank)`` on ranks 0 and 1 of a fresh group, one thread each."""
    import torch
    from torch.distributed import TCPStore

    from checkpointless.comm import Group

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    out: list[Any] = [None, None]

    def target(rank: int) -> None:
        if devices[rank].type == "cuda":
            torch.cuda.set_device(devices[rank])
        store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=60))
        group = Group(store, 0, rank, 2, backend=backend, timeout=timedelta(seconds=60), device=devices[rank])
        try:
            out[rank] = fn(group, rank)
        except Exception as e:
            traceback.clear_frames(e.__traceback__)
            out[rank] = e
        finally:
            group.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a transfer thread did not finish in 240 s")
    for r in out:
        if isinstance(r, Exception):
            raise r
    return out


def transfer(device: str, quick: bool) -> dict[str, Any]:
    import torch

    from checkpointless.progress import Progress, StepState
    from checkpointless.state import recv_state, send_state

    mb = 16 if quick else 256
    key = b"g" * 32
    cuda = device == "cuda"
    dev = (
        [torch.device("cuda", i % torch.cuda.device_count()) for i in (0, 1)]
        if cuda
        else [torch.device("cpu")] * 2
    )

    at_step_7 = StepState()
    at_step_7.commit(7)

    def state(d: torch.device, seed: int) -> dict[str, Any]:
        g = torch.Generator(device=d).manual_seed(seed)
        return {
            "w": torch.randn(mb * 2**18, generator=g, device=d),  # mb MiB of float32
            "mask": torch.rand(1000, generator=g, device=d) > 0.5,
            "step": torch.tensor(float(seed)),  # a CPU tensor in a GPU state (Adam's step)
            "progress": Progress(at_step_7).state_dict(),
        }

    rows = []
    backends = ["gloo"] + (["nccl"] if cuda and torch.cuda.device_count() >= 2 else [])
    for backend in backends:
        if cuda:
            torch.cuda.manual_seed_all(1234)
        sent = state(dev[0], 1)
        mine = state(dev[1], 2)
        if cuda:
            torch.cuda.manual_seed_all(99)  # the receiver's generators, until the state loads

        def fn(group: Any, rank: int, sent: Any = sent, mine: Any = mine) -> Any:
            if rank == 0:
                return send_state(group, 1, sent, key=key)
            got, stats = recv_state(group, 0, key=key, into=mine)
            return got, stats

        stats0, (got, stats1) = _pair(fn, backend, dev)
        same = all(
            torch.equal(got[k].cpu(), sent[k].cpu()) and got[k].device == sent[k].device
            if k != "progress"
            else True
            for k in sent
        )
        in_place = got["w"].data_ptr() == mine["w"].data_ptr()
        rng_ok = None
        if cuda:
            sent_rng = sent["progress"]["rng"]["cuda"]
            got_rng = got["progress"]["rng"].get("cuda")
            Progress(StepState()).load_state_dict(got["progress"])
            rng_ok = got_rng is not None and all(
                torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), sent_rng, strict=True)
            )
        rows.append({
            "backend": backend, "bytes": stats1.bytes, "seconds": stats1.seconds,
            "gb_per_s": stats1.bytes / stats1.seconds / 1e9, "bitwise_equal": same, "in_place": in_place,
            "digest_agrees": stats0.sha256 == stats1.sha256, "cuda_rng_carried": rng_ok,
        })  # fmt: skip
    ok = all(r["bitwise_equal"] and r["in_place"] and r["digest_agrees"] and r["cuda_rng_carried"] is not False
             for r in rows)  # fmt: skip
    summary = ", ".join(f"{r['backend']} {r['gb_per_s']:.2f} GB/s" for r in rows)
    return {"ok": ok, "rows": rows, "summary": f"{mb} MiB: {summary}"}


def nccl_generations(device: str, generations: int = 5) -> dict[str, Any]:
    if device != "cuda":
        return {"skipped": "no CUDA (rehearsal)"}
    import torch
    from torch.distributed import TCPStore

    from checkpointless.comm import Group

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rows = []
    for gen in range(generations):
        t0 = time.perf_counter()
        group = Group(store, gen, 0, 1, prefix=f"gpu-check/{gen}/", backend="nccl", device=dev)
        formed = time.perf_counter()
        x = torch.full((1 << 20,), float(gen + 1), device=dev)
        group.allreduce_([x])
        group.barrier()  # on the gloo control group
        used = time.perf_counter()
        ok = bool((x == gen + 1).all().item()) and group.control is not group
        group.abort()
        rows.append({"gen": gen, "form_s": formed - t0, "use_s": used - formed,
                     "abort_s": time.perf_counter() - used, "ok": ok})  # fmt: skip
    summary = f"{generations} generations, form {max(r['form_s'] for r in rows):.3f}s max"
    return {"ok": all(r["ok"] for r in rows), "rows": rows, "summary": summary}


# -- jobs ----------------------------------------------------------------------------------------
def _job(command: list[str], *, workers: int, spares: int, shards: int = 1, steps: int, faults: list[str],
         backend: str, device: str, out: Path) -> Any:  # fmt: skip
    from checkpointless.config import JobConfig, RecoveryConfig
    from checkpointless.fault_grammar import parse_faults
    from checkpointless.launch.launcher import Launcher

    rc = RecoveryConfig(
        hang_timeout_s=3.0 if faults else 20.0, collective_timeout_s=60.0, consistency_every=10
    )
    job = JobConfig(workers=workers, spares=spares, shards=shards, backend=backend, device=device,
                    faults=parse_faults(faults), recovery=rc)  # fmt: skip
    return Launcher(job, command, total_steps=steps, out_dir=out, env=common.THREAD_ENV, timeout_s=300).run()


def _compare(
    name: str, run: Callable[[list[str], Path], Any], faults: list[str], out: Path
) -> dict[str, Any]:
    """The job with ``faults`` and without: both finish, their final states are equal bit for bit."""
    faulted = run(faults, out / name)
    clean = run([], out / f"{name}-reference")
    res: dict[str, Any] = {
        "ok": bool(faulted.ok and clean.ok and faulted.digest == clean.digest),
        "faulted_ok": faulted.ok, "reference_ok": clean.ok, "bitwise_equal": faulted.digest == clean.digest,
        "digest": faulted.digest, "error": faulted.error or clean.error,
        "faults": [{k: f.get(k) for k in ("spec", "kind", "cause", "ranks", "step", "detection_s", "stall_s", "lost_steps")}
                   for f in faulted.report["faults"]],
        "generations": faulted.report["generations"], "step_time_s": faulted.report["step_time_s"],
        "reference_step_time_s": clean.report["step_time_s"],
    }  # fmt: skip
    if not res["error"]:
        res.pop("error")
    stalls = [f["stall_s"] for f in res["faults"] if f.get("stall_s") is not None]
    res["summary"] = (f"bitwise {'equal' if res['bitwise_equal'] else 'DIFFERENT'}, stalls "
                      f"{', '.join(f'{s:.2f}s' for s in stalls) or 'none'}, step {res['step_time_s'] * 1000:.0f} ms")  # fmt: skip
    return res


def replicated(device: str, backend: str, quick: bool, out: Path) -> dict[str, Any]:
    from checkpointless.launch.demo import DemoModel, worker_command

    steps = 16 if quick else 40
    cmd = worker_command(DemoModel(steps=steps, **DEMO))  # type: ignore[arg-type]
    faults = [f"kill:rank=1@step={steps // 4}", f"hang:rank=2@step={steps // 2}"]
    res = _compare(
        "replicated",
        lambda f, o: _job(cmd, workers=3, spares=1, steps=steps, faults=f, backend=backend, device=device, out=o),
        faults, out,
    )  # fmt: skip
    res["backend"] = backend
    return res


def nccl_job(device: str, quick: bool, out: Path) -> dict[str, Any]:
    if device != "cuda":
        return {"skipped": "no CUDA (rehearsal)"}
    from checkpointless.launch.demo import DemoModel, worker_command

    steps = 8 if quick else 16
    cmd = worker_command(DemoModel(steps=steps, **{**DEMO, "global_batch": 4}))  # type: ignore[arg-type]
    return _compare(
        "nccl_job",
        lambda f, o: _job(cmd, workers=1, spares=0, steps=steps, faults=f, backend="nccl", device="cuda", out=o),
        [f"exception:rank=0@step={steps // 2}"], out,
    )  # fmt: skip


def hsdp(device: str, backend: str, quick: bool, out: Path) -> dict[str, Any]:
    steps = 8 if quick else 16
    sets = [*TINY_GPT, f"train.steps={steps}", "parallel.workers=4", "parallel.shards=2"]
    cmd = [common.PYTHON, "-m", "checkpointless.recipes.train", str(RECIPE)]
    for s in sets:
        cmd += ["--set", s]
    res = _compare(
        "hsdp",
        lambda f, o: _job(cmd, workers=4, spares=1, shards=2, steps=steps, faults=f, backend=backend,
                          device=device, out=o),
        [f"kill:rank=1@step={steps // 2}"], out,
    )  # fmt: skip
    res["backend"] = backend
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="rehearse on the CPU (no CUDA; NCCL parts skipped)")
    p.add_argument("--quick", action="store_true", help="shorter jobs")
    p.add_argument("--out", type=Path, default=None,
                   help="the JSON result (default bench/results/gpu_check.json; with --cpu bench/out/)")  # fmt: skip
    p.add_argument("--only", action="append", default=None, metavar="PART",
                   help="run only this part (repeatable): " + ", ".join(PARTS))  # fmt: skip
    args = p.parse_args(argv)
    if args.only and set(args.only) - set(PARTS):
        p.error(f"unknown part(s) {sorted(set(args.only) - set(PARTS))}; the parts: {', '.join(PARTS)}")
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device on this machine (torch {torch.__version__}, built with CUDA "
              f"{torch.version.cuda or 'none'}); run it where there is one, or --cpu to rehearse")  # fmt: skip
        return 2
    common.pin_threads()
    device = "cpu" if args.cpu else "cuda"
    gpus = 0 if args.cpu else torch.cuda.device_count()
    # NCCL proper where every worker and spare has its own GPU (workers + 1 spare per job)
    backend = {n: "nccl" if gpus >= n else "gloo" for n in (4, 5)}
    scratch = common.fresh_dir(common.OUT / "gpu_check")
    out_path = args.out or (
        common.OUT / "gpu_check_cpu.json" if args.cpu else common.RESULTS / "gpu_check.json"
    )
    name = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    print(f"gpu_check: {gpus} x {name}, torch {torch.__version__}, CUDA {torch.version.cuda}; "
          f"jobs over {backend[4]} (replicated) and {backend[5]} (HSDP)", flush=True)  # fmt: skip
    results: dict[str, Any] = {}
    t0 = time.monotonic()
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "transfer": lambda: transfer(device, args.quick),
        "nccl_generations": lambda: nccl_generations(device),
        "replicated": lambda: replicated(device, backend[4], args.quick, scratch),
        "nccl_job": lambda: nccl_job(device, args.quick, scratch),
        "hsdp": lambda: hsdp(device, backend[5], args.quick, scratch),
    }
    for part, fn in parts.items():
        if not args.only or part in args.only:
            _part(results, part, fn)
    ok = all(r.get("ok") or r.get("skipped") for r in results.values())
    doc = {
        **common.git_state(),
        "ok": ok,
        "rehearsal_on_cpu": args.cpu,
        "gpus": gpus,
        "gpu": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "quick": args.quick,
        "wall_s": round(time.monotonic() - t0, 1),
        "machine": common.machine_info(),
        "parts": results,
    }
    common.write_json(out_path, doc)
    print(f"gpu_check: {'ok' if ok else 'FAILED'} in {doc['wall_s']:.0f}s; {common.rel(out_path)} "
          f"(commit {str(doc['commit'])[:10]}{', dirty tree' if doc['dirty'] else ''})")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
