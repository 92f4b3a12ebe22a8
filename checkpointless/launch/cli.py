"""The ``checkpointless`` command line.

User mistakes end with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console

from checkpointless.config import JobConfig, RecoveryConfig
from checkpointless.control.coordinator import Coordinator
from checkpointless.errors import UsageError, UserInputError
from checkpointless.faults import parse_faults, validate_schedule
from checkpointless.launch.cluster import LocalCluster
from checkpointless.launch.launcher import JobResult, Launcher
from checkpointless.observe.console import stderr_console


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise UsageError(f"--{name} must be >= {minimum}, got {value}")


def _seconds(name: str, value: float, *, zero: bool = False, negative: bool = False) -> None:
    """A duration option: a finite number, > 0 (``zero``: >= 0; ``negative``: any finite value).
    A NaN deadline is never passed, an infinite one never ends: both refused."""
    if not math.isfinite(value):
        raise UsageError(f"--{name} must be a finite number of seconds, got {value}")
    if not negative and (value < 0 or (value == 0 and not zero)):
        raise UsageError(f"--{name} must be {'>= 0' if zero else '> 0'} seconds, got {value:g}")


def _address(name: str, value: str) -> None:
    """An IP address option (IPv4 or IPv6), refused in one line if it is not one."""
    try:
        ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        raise UsageError(f"--{name} {value!r} is not an IP address") from None


def _host_port(name: str, value: str) -> None:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--{name} {value!r}: expected HOST:PORT (a port from 1 to 65535)")


def _add_job_args(p: argparse.ArgumentParser, *, workers: int, spares: int) -> None:
    p.add_argument("--workers", type=int, default=workers, help="data-parallel workers (ranks)")
    p.add_argument("--spares", type=int, default=spares, help="hot spare processes kept warm")
    p.add_argument("--fault", action="append", default=None, metavar="SPEC",
                   help="KIND:rank=R[,R]@step=S (kill|hang|exception|corrupt), kill|hang:rank=R@check=S (at a "
                        "consistency check), kill:spare@recovery|join, kill:source@recovery, or none")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write events.jsonl, report.json and logs here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="control store port (0: any free port)")
    _add_device_args(p)
    _add_detection_args(p)


def _add_device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="data plane: gloo (CPU, or CUDA tensors with --device cuda) or nccl (CUDA; "
                   "control messages then run on a gloo group beside it); default gloo")  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the ranks train: each process on cuda:<its slot on the host> "
                   "(workers 0..N-1, then spares), or cpu; default cuda with nccl, else cpu")  # fmt: skip


def _check_device(job: JobConfig) -> None:
    """A CUDA job needs CUDA where its processes run (this host: the launcher starts them here)."""
    if job.device_type != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        flag = "--backend nccl" if job.backend == "nccl" and job.device is None else "--device cuda"
        raise UsageError(
            f"{flag}: this machine has no usable CUDA device (torch {torch.__version__}"
            f"{'' if torch.version.cuda else ', a build without CUDA'})"
        )


def _add_detection_args(p: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """``defaults=False`` leaves them None, for ``run`` to take the recipe's values."""
    d = RecoveryConfig()
    p.add_argument("--hang-timeout", type=float, default=d.hang_timeout_s if defaults else None,
                   help=f"seconds without heartbeat before a process is declared hung (default {d.hang_timeout_s})")  # fmt: skip
    p.add_argument("--progress-timeout", type=float, default=d.progress_timeout_s if defaults else None,
                   help="seconds a step may run, heartbeat alive, while peers wait for it, before it is "
                   f"declared stuck (default {d.progress_timeout_s})")  # fmt: skip
    p.add_argument("--consistency-every", type=int, default=None, metavar="STEPS",
                   help="replicas compare a digest of their state after the first step and every this many "
                   f"steps (0: first step only; default {d.consistency_every})")  # fmt: skip
    p.add_argument("--durable-every", type=int, default=None, metavar="STEPS",
                   help="last-resort durable tier: an asynchronous snapshot every this many steps, used only "
                   "when no live replica holds some shard (default off)")  # fmt: skip
    p.add_argument("--durable-dir", type=Path, default=None, help="where the durable tier writes")
    p.add_argument("--exit-timeout", type=float, default=None, metavar="SECONDS",
                   help="once the job has finished, how long the ranks' processes may go on with their "
                   f"own work (saving, evaluating) before they are killed (default {d.exit_timeout_s:g})")  # fmt: skip


def _check_durable(recovery: RecoveryConfig, key: str) -> None:
    """The durable tier's directory must be writable (or creatable): checked without writing anything."""
    if not recovery.durable_every or recovery.durable_dir is None:
        return
    path = Path(recovery.durable_dir)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise UsageError(f"{key} {path}: {probe} exists and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{key} {path}: not writable ({probe} does not let this user create files)")


def _check_out(out: Path | None) -> None:
    """``--out`` must be a directory we can create and write, checked before anything starts."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".checkpointless-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out {out}: not a writable directory ({e.strerror or e})") from None


def _job(
    args: argparse.Namespace,
    steps: int | None,
    default_faults: list[str],
    recovery: RecoveryConfig | None = None,
    topology: LocalCluster | None = None,
) -> JobConfig:
    """The job the flags describe; ``recovery``: the recipe's settings, which the flags override."""
    _positive("workers", args.workers)
    _positive("spares", args.spares, 0)
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    shards = getattr(args, "shards", 1)
    _positive("shards", shards)
    if args.workers % shards:
        raise UsageError(f"--shards {shards} must divide --workers {args.workers} (replicas x shards ranks)")
    try:
        faults = parse_faults(args.fault if args.fault is not None else default_faults)
        for flag, value in (
            ("--hang-timeout", args.hang_timeout),
            ("--progress-timeout", args.progress_timeout),
        ):
            if not math.isfinite(value) or value <= 0:
                raise UsageError(f"{flag} must be a positive number of seconds, got {value}")
        base = recovery or RecoveryConfig()
        changes: dict[str, Any] = {
            "hang_timeout_s": args.hang_timeout,
            "heartbeat_interval_s": min(base.heartbeat_interval_s, args.hang_timeout / 4),
            "progress_timeout_s": args.progress_timeout,
        }
        for name in ("consistency_every", "durable_every"):
            if getattr(args, name) is not None:
                if getattr(args, name) < 0:
                    raise UsageError(
                        f"--{name.replace('_', '-')} must be >= 0 steps, got {getattr(args, name)}"
                    )
                changes[name] = getattr(args, name)
        if args.durable_dir is not None:
            changes["durable_dir"] = str(args.durable_dir)
        if args.exit_timeout is not None:
            if not math.isfinite(args.exit_timeout) or args.exit_timeout <= 0:
                raise UsageError(
                    f"--exit-timeout must be a positive number of seconds, got {args.exit_timeout}"
                )
            changes["exit_timeout_s"] = args.exit_timeout
        recovery = dataclasses.replace(base, **changes)
        _check_durable(recovery, "recovery.durable_dir" if args.durable_dir is None else "--durable-dir")
        # without --steps, the steps are checked once the script's session.steps(total) says it
        validate_schedule(faults, workers=args.workers, spares=args.spares, steps=steps or 2**62,
                          durable=bool(recovery.durable_every), shards=shards,
                          consistency_every=recovery.consistency_every,
                          nodes=topology.nodes if topology else 0,
                          nproc_per_node=topology.nproc_per_node if topology else 0)  # fmt: skip
        _check_out(args.out)  # created only once everything else is known to be right
        job = JobConfig(
            workers=args.workers,
            spares=args.spares,
            shards=shards,
            backend=getattr(args, "backend", None) or "gloo",
            device=getattr(args, "device", None),
            seed=args.seed,
            faults=faults,
            recovery=recovery,
        )
    except ValueError as e:
        raise UsageError(str(e)) from e
    _check_device(job)
    return job


def _print_result(console: Console, result: JobResult, label: str) -> None:
    from checkpointless.observe.console import summary_table

    r = result.report
    console.print(
        f"[bold]{label}[/bold]: {'ok' if result.ok else 'FAILED'}  steps {r['steps_completed']}  "
        f"wall {r['wall_s']:.2f}s  step {r['step_time_s'] * 1000:.1f}ms  goodput {r['goodput']:.3f}  "
        f"generations {r['generations']}",
        highlight=False,
    )
    if r["faults"]:
        console.print(summary_table(r))
    durable = r.get("durable")
    if durable:
        newest = durable["newest_complete_step"]
        console.print(
            f"durable tier: {durable['written']} shard snapshot(s) written, newest complete step "
            f"{'none' if newest is None else newest}, {durable['skipped']} skipped (the previous one "
            f"still writing), {durable['failed']} failed",
            highlight=False,
        )
        if durable["last_error"]:
            console.print(
                f"[yellow]warning:[/yellow] durable snapshot failed: {durable['last_error']}", highlight=False
            )
    rejected = r.get("rejected_messages") or {}
    if result.error:
        # a job under attack fails for its attacker's reasons: say so before any peer is blamed
        outside = (
            f"control messages from outside the job were written to its store ({rejected['count']} "
            "rejected); the job's control and data ports must be reachable by its hosts only: "
            if rejected.get("count")
            else ""
        )
        console.print(f"[red]error:[/red] {outside}{result.error}", highlight=False)
    if rejected.get("count"):
        keys = rejected.get("keys") or []
        console.print(
            f"[yellow]warning:[/yellow] ignored {rejected['count']} control message(s) not sealed with "
            f"this job's secret (someone else writes to the job's store), on {', '.join(keys[:6])}"
            f"{', ...' if len(keys) > 6 else ''}",
            highlight=False,
        )
    unfired = r.get("unfired_faults")
    if unfired:
        # an injection run that injected nothing tested nothing: an error (exit 1) unless the job
        # failed anyway
        console.print(
            f"{'[red]error:[/red]' if result.ok else '[yellow]warning:[/yellow]'} "
            f"{len(unfired)} injected fault(s) never fired: {', '.join(unfired)} (the job committed "
            f"{r['steps_completed']} step(s); is --steps the script's step count?)",
            highlight=False,
        )
    console.print(f"final state sha256: {result.digest}", highlight=False)
    for name, what in (r.get("after_finish") or {}).items():
        where = f"; log: {result.logs[name]}" if name in result.logs else ""
        console.print(f"[red]error:[/red] {name} {what} (its work after training may be incomplete{where})",
                      highlight=False)  # fmt: skip
    if result.write_error:
        console.print(f"[red]error:[/red] {result.write_error}", highlight=False)


def _exit_code(result: JobResult) -> int:
    """128 + the signal that stopped the job; 1 if it failed, its files could not be written, a fault
    it was to inject never fired, or a rank's process failed after the job finished; else 0."""
    if result.interrupted is not None:
        return 128 + result.interrupted
    r = result.report
    failed = not result.ok or result.write_error or r.get("unfired_faults") or r.get("after_finish")
    return 1 if failed else 0


def _launch(
    job: JobConfig,
    command: list[str],
    args: argparse.Namespace,
    console: Console,
    *,
    steps: int | None,
    out: Path | None,
    metrics_port: int | None = None,
    topology: LocalCluster | None = None,
) -> JobResult:
    """Run one job with the live progress line (unless --quiet) and, if asked, a metrics endpoint;
    ``topology``: on the hosts ``checkpointless cluster`` makes."""
    if topology is not None:
        with topology.hosts(command, out) as (addr, spec, secret):
            launcher = Launcher(job, command, total_steps=steps, host=addr, port=args.port, out_dir=out,
                                cluster=spec, secret=secret)  # fmt: skip
            return _run_launcher(launcher, args, console, steps=steps, metrics_port=metrics_port)
    launcher = Launcher(job, command, total_steps=steps, port=args.port, out_dir=out)
    return _run_launcher(launcher, args, console, steps=steps, metrics_port=metrics_port)


def _run_launcher(
    launcher: Launcher,
    args: argparse.Namespace,
    console: Console,
    *,
    steps: int | None,
    metrics_port: int | None,
) -> JobResult:
    from checkpointless.observe.console import LiveProgress

    callbacks: list[Callable[[Coordinator], None]] = []
    if not args.quiet:
        progress = LiveProgress(steps, launcher.events, console)
        launcher.listen(progress.add)
        callbacks.append(progress)
    metrics = None
    if metrics_port is not None:
        if not 0 <= metrics_port < 65536:
            raise UsageError(f"--metrics-port must be in 0..65535, got {metrics_port}")
        from checkpointless.observe.live_metrics import MetricsFeed
        from checkpointless.observe.metrics import JobMetrics

        metrics = JobMetrics(metrics_port)
        try:
            metrics.start()
        except (OSError, ValueError) as e:
            raise UsageError(f"--metrics-port {metrics_port}: {e}") from e
        console.print(f"metrics: http://127.0.0.1:{metrics.port}/metrics", highlight=False)
        feed = MetricsFeed(metrics, launcher.events)
        launcher.listen(feed.add)
        callbacks.append(feed)
    launcher.on_tick = callbacks
    try:
        return launcher.run()
    finally:
        if metrics is not None:
            metrics.stop()


def _topology_args(argv: list[str], topology: LocalCluster | None) -> list[str]:
    """Under ``cluster``: the workers and spares its hosts hold."""
    if topology is None:
        return argv
    return [*argv, "--workers", str(topology.workers), "--spares", str(topology.spares)]


def cmd_demo(argv: list[str], topology: LocalCluster | None = None) -> int:
    from checkpointless.launch.demo import DemoModel, default_faults, worker_command

    p = _Parser(prog="checkpointless demo", description="Train a small GPT through real faults.")
    _add_job_args(p, workers=2, spares=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--verify", action="store_true", help="also run fault-free and compare final state hashes")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per step, split evenly over the workers (default: 16, rounded up "
                   "to a multiple of --workers)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no live progress")
    args = p.parse_args(_topology_args(argv, topology))
    _positive("steps", args.steps)
    _positive("layers", args.layers)
    _positive("d-model", args.d_model)
    job = _job(args, args.steps, default_faults(args.workers, args.steps), topology=topology)
    global_batch = (
        args.global_batch if args.global_batch is not None else -(-16 // args.workers) * args.workers
    )
    _positive("global-batch", global_batch)
    spec = DemoModel(
        steps=args.steps, seed=args.seed, d_model=args.d_model, n_layer=args.layers, global_batch=global_batch
    )  # its processes train on session.device (JobConfig.device_type)
    if spec.d_model % spec.n_head:
        raise UsageError(
            f"--d-model must be a multiple of the demo's {spec.n_head} attention heads, got {args.d_model}"
        )
    if spec.global_batch % args.workers:
        raise UsageError(f"--global-batch {spec.global_batch} must be a multiple of --workers {args.workers}")
    console = stderr_console()
    console.print(
        f"checkpointless demo: {args.workers} workers + {args.spares} spare(s), {args.steps} steps, "
        f"global batch {spec.global_batch}, {job.backend} on {job.device_type}, "
        f"faults: {', '.join(map(str, job.faults)) or 'none'}",
        highlight=False,
    )
    result = _launch(
        job, worker_command(spec), args, console, steps=args.steps, out=args.out, topology=topology
    )
    _print_result(console, result, "faulted run" if job.faults else "run")
    if _exit_code(result):
        return _exit_code(result)
    if args.verify:
        clean = JobConfig(**{**asdict(job), "faults": [], "recovery": job.recovery})
        ref_out = args.out / "reference" if args.out else None
        args.quiet = True
        ref = _launch(
            clean, worker_command(spec), args, console, steps=args.steps, out=ref_out, topology=topology
        )
        _print_result(console, ref, "fault-free reference")
        if ref.interrupted is not None:
            return _exit_code(ref)
        same = ref.ok and ref.digest == result.digest
        console.print(
            "[green]bitwise identical to the fault-free run[/green]"
            if same
            else "[red]final states DIFFER[/red]"
        )
        return 0 if same else 1
    return 0


def cmd_launch(argv: list[str], topology: LocalCluster | None = None) -> int:
    split = argv.index("--") if "--" in argv else len(argv)
    if split == len(argv) and not {"-h", "--help"} & set(argv):
        raise UsageError("checkpointless launch: give the training command after --, e.g. -- python train.py")
    own, command = argv[:split], argv[split + 1 :]
    p = _Parser(
        prog="checkpointless launch",
        usage="checkpointless launch [options] -- COMMAND [ARGS...]",
        description="Run any script that uses checkpointless.Session, fault tolerant: one process per "
        "worker and per spare, each running COMMAND.",
    )
    _add_job_args(p, workers=2, spares=1)
    p.add_argument("--steps", type=int, default=None, help="the script's step count (checks --fault steps)")
    p.add_argument("--shards", type=int, default=1,
                   help="ranks that split one copy of the state (FSDP2/HSDP, Session(build=...)); 1: replicated")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(_topology_args(own, topology))  # -h / --help: the options, with or without a command
    if not command:
        raise UsageError("checkpointless launch: the training command after -- is empty")
    job = _job(args, args.steps, [], topology=topology)
    if command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    if shutil.which(command[0]) is None:
        raise UsageError(f"checkpointless launch: command not found or not executable: {command[0]}")
    console = stderr_console()
    result = _launch(
        job, command, args, console, steps=args.steps, out=args.out, metrics_port=args.metrics_port,
        topology=topology,
    )  # fmt: skip
    _print_result(console, result, "run")
    return _exit_code(result)


def cmd_run(argv: list[str], topology: LocalCluster | None = None) -> int:
    from checkpointless.recipes.config import load_recipe
    from checkpointless.recipes.dryrun import dry_run, format_dry_run

    p = _Parser(prog="checkpointless run", description="Train what a YAML recipe says, fault tolerant.")
    p.add_argument("recipe", type=Path)
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    p.add_argument("--workers", type=int, default=None, help="override parallel.workers")
    p.add_argument("--spares", type=int, default=None, help="override parallel.spares")
    p.add_argument("--fault", action="append", default=None, metavar="SPEC")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    _add_detection_args(p, defaults=False)  # the recipe's recovery section unless given
    p.add_argument("--dry-run", action="store_true", help="print sizes and memory, train nothing")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
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
    job = _job(args, cfg.train.steps, [], cfg.recovery, topology=topology)
    command = [sys.executable, "-m", "checkpointless.recipes.train", str(args.recipe)]
    for o in overrides:
        command += ["--set", o]
    console = stderr_console()
    console.print(
        f"checkpointless run {cfg.name}: {job.workers} workers + {job.spares} spare(s), {cfg.train.steps} steps, "
        f"faults: {', '.join(map(str, job.faults)) or 'none'}",
        highlight=False,
    )
    result = _launch(
        job, command, args, console, steps=cfg.train.steps, out=args.out, metrics_port=args.metrics_port,
        topology=topology,
    )  # fmt: skip
    _print_result(console, result, cfg.name)
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
    return _exit_code(result)


_USAGE = """usage: checkpointless COMMAND [options]   (checkpointless COMMAND --help for its options)

commands:
  demo      train a small GPT through real faults, on this machine (optionally --verify bitwise)
  launch    run your own script that uses checkpointless.Session: checkpointless launch [options] -- python train.py
  run       train what a YAML recipe says (Llama, GPT-OSS), fault tolerant
  cluster   try many hosts on this machine (network namespaces, root): cluster --nodes N [demo|launch|run] ...
  coordinator  the control plane of a job on several machines: coordinator --nodes N --nproc-per-node P --secret-file F
  agent     one host of a job on several machines: agent --coordinator HOST:PORT --secret-file F -- CMD
  report    a finished run's timeline plot and summary, from its --out directory
  simulate  goodput of checkpoint-restart against checkpointless at cluster scale"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    commands = {"demo": cmd_demo, "launch": cmd_launch, "run": cmd_run}
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(_USAGE, file=sys.stdout if argv else sys.stderr)
            return 0 if argv else 2
        cmd, rest = argv[0], argv[1:]
        if cmd == "report":
            from checkpointless.observe.plot import main as report_main

            return report_main(rest)
        if cmd in ("cluster", "agent", "coordinator"):
            from checkpointless.launch.cluster import cmd_agent, cmd_cluster, cmd_coordinator

            return {"cluster": cmd_cluster, "agent": cmd_agent, "coordinator": cmd_coordinator}[cmd](rest)
        if cmd == "simulate":
            from checkpointless.analysis.simulate import main as simulate_main

            return simulate_main(rest)
        if cmd not in commands:
            raise UsageError(
                f"unknown command {cmd!r} (expected one of demo, launch, run, cluster, coordinator, agent, report, simulate)"
            )
        return commands[cmd](rest)
    except UserInputError as e:  # UsageError, LaunchError, RecipeError: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
