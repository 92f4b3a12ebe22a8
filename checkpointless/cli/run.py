"""``checkpointless run RECIPE.yaml``: train what a YAML recipe says (Llama, GPT-OSS), fault
tolerant; ``--dry-run`` sizes it instead."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpointless.cli.job_flags import Parser, add_detection_args, job_config
from checkpointless.cli.job_run import exit_code, print_result, run_job
from checkpointless.errors import UsageError
from checkpointless.launch.cluster import LocalCluster
from checkpointless.observe.console import stderr_console


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="checkpointless run", description="Train what a YAML recipe says, fault tolerant.")
    p.add_argument("recipe", type=Path)
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    p.add_argument("--workers", type=int, default=None, help="override parallel.workers")
    p.add_argument("--spares", type=int, default=None, help="override parallel.spares")
    p.add_argument("--fault", action="append", default=None, metavar="SPEC")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    add_detection_args(p, defaults=False)  # the recipe's recovery section unless given
    p.add_argument("--dry-run", action="store_true", help="print sizes and memory, train nothing")
    p.add_argument("--quiet", action="store_true")
    return p


def run(argv: list[str], topology: LocalCluster | None = None) -> int:
    """``topology``: under ``cluster``, the hosts the job runs on."""
    from checkpointless.recipes.config import load_recipe
    from checkpointless.recipes.dryrun import dry_run, format_dry_run

    args = build_parser().parse_args(argv)
    if topology is not None:
        args.workers, args.spares = topology.workers, topology.spares
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        raise UsageError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    overrides = list(args.overrides)
    if args.workers is not None:
        overrides.append(f"parallel.workers={args.workers}")
    if args.spares is not None:
        overrides.append(f"parallel.spares={args.spares}")
    try:
        cfg = load_recipe(args.recipe, overrides, check_data=not args.dry_run)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if args.dry_run:
        print(format_dry_run(dry_run(cfg)))
        return 0
    args.workers, args.spares, args.seed = cfg.parallel.workers, cfg.parallel.spares, cfg.train.seed
    if args.hang_timeout is None:
        args.hang_timeout = cfg.recovery.hang_timeout_s
    if args.progress_timeout is None:
        args.progress_timeout = cfg.recovery.progress_timeout_s
    args.shards = cfg.parallel.shards
    args.backend, args.device = cfg.parallel.backend, cfg.parallel.device
    job = job_config(args, cfg.train.steps, [], cfg.recovery, topology=topology)
    command = [sys.executable, "-m", "checkpointless.recipes.train", str(args.recipe)]
    for o in overrides:
        command += ["--set", o]
    console = stderr_console()
    console.print(
        f"checkpointless run {cfg.name}: {job.workers} workers + {job.spares} spare(s), {cfg.train.steps} steps, "
        f"faults: {', '.join(map(str, job.faults)) or 'none'}",
        highlight=False,
    )
    result = run_job(
        job, command, args, console, steps=cfg.train.steps, out=args.out, metrics_port=args.metrics_port,
        topology=topology,
    )  # fmt: skip
    print_result(console, result, cfg.name)
    if result.report["heldout_loss"]:
        first, last = result.report["heldout_loss"][0][1], result.report["heldout_loss"][-1][1]
        console.print(f"held-out loss {first:.4f} -> {last:.4f}", highlight=False)
    if args.out is not None and result.ok and not result.write_error:
        from checkpointless.observe.plot import write_report

        try:
            write_report(args.out)
            console.print(f"report: {args.out / 'timeline.png'}, {args.out / 'summary.txt'}", highlight=False)
        except ImportError:
            console.print("report: install matplotlib (pip install checkpointless[report]) for timeline.png")
        except OSError as e:
            console.print(f"[red]error:[/red] could not write the report plot: {e}", highlight=False)
            return 1
    return exit_code(result)
