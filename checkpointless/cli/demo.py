"""``checkpointless demo``: train a small GPT through real faults, on this machine (or on the hosts
``cluster`` makes), optionally ``--verify``-ing it bitwise against a fault-free run."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from checkpointless.cli.job_flags import Parser, add_job_args, job_config, positive, topology_args
from checkpointless.cli.job_run import exit_code, print_result, run_job
from checkpointless.config import JobConfig
from checkpointless.errors import UsageError
from checkpointless.launch.cluster import LocalCluster
from checkpointless.observe.console import stderr_console


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="checkpointless demo", description="Train a small GPT through real faults.")
    add_job_args(p, workers=2, spares=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--verify", action="store_true", help="also run fault-free and compare final state hashes")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step, split evenly over the workers (default: 16, rounded up "
                   "to a multiple of --workers)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no live progress")
    return p


def run(argv: list[str], topology: LocalCluster | None = None) -> int:
    """``topology``: under ``cluster``, the hosts the job runs on."""
    from checkpointless.launch.demo import DemoModel, default_faults, worker_command

    args = build_parser().parse_args(topology_args(argv, topology))
    positive("steps", args.steps)
    positive("layers", args.layers)
    positive("d-model", args.d_model)
    job = job_config(args, args.steps, default_faults(args.workers, args.steps), topology=topology)
    shares = job.share_count  # the global batch is cut into shares (by default one per worker)
    global_batch = args.global_batch if args.global_batch is not None else -(-16 // shares) * shares
    positive("global-batch", global_batch)
    spec = DemoModel(
        steps=args.steps, seed=args.seed, d_model=args.d_model, n_layer=args.layers, global_batch=global_batch
    )  # its processes train on session.device (JobConfig.device_type)
    if spec.d_model % spec.n_head:
        raise UsageError(
            f"--d-model must be a multiple of the demo's {spec.n_head} attention heads, got {args.d_model}"
        )
    if spec.global_batch % shares:
        what = f"--shares {shares}" if shares != args.workers else f"--workers {args.workers}"
        raise UsageError(f"--global-batch {spec.global_batch} must be a multiple of {what}")
    console = stderr_console()
    console.print(
        f"checkpointless demo: {args.workers} workers + {args.spares} spare(s), {args.steps} steps, "
        f"global batch {spec.global_batch}, {job.backend} on {job.device_type}, "
        f"faults: {', '.join(map(str, job.faults)) or 'none'}",
        highlight=False,
    )
    result = run_job(
        job, worker_command(spec), args, console, steps=args.steps, out=args.out, topology=topology
    )
    print_result(console, result, "faulted run" if job.faults else "run")
    if exit_code(result):
        return exit_code(result)
    if args.verify:
        clean = JobConfig(**{**asdict(job), "faults": [], "recovery": job.recovery})
        ref_out = args.out / "reference" if args.out else None
        args.quiet = True
        ref = run_job(
            clean, worker_command(spec), args, console, steps=args.steps, out=ref_out, topology=topology
        )
        print_result(console, ref, "fault-free reference")
        if ref.interrupted is not None:
            return exit_code(ref)
        same = ref.ok and ref.digest == result.digest
        console.print(
            "[green]bitwise identical to the fault-free run[/green]"
            if same
            else "[red]final states DIFFER[/red]"
        )
        return 0 if same else 1
    return 0
