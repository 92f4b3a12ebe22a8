"""The options every job command shares (``demo``, ``launch``, ``run``, ``coordinator``, and the
job under ``cluster``), their checks, and the :class:`JobConfig` they make.

Every check refuses a bad value with a :class:`UsageError` of one line, before anything starts
(the command line prints it and exits 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
from pathlib import Path
from typing import Any, NoReturn

from checkpointless.config import JobConfig, RecoveryConfig
from checkpointless.errors import UsageError
from checkpointless.fault_grammar import parse_faults, validate_schedule
from checkpointless.launch.cluster import LocalCluster


class Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes are a :class:`UsageError` (one line, exit 2), not
    argparse's usage and ``SystemExit``; ``--help`` still prints and exits 0."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def positive(name: str, value: int, minimum: int = 1) -> None:
    """An integer option ``--name`` of at least ``minimum``."""
    if value < minimum:
        raise UsageError(f"--{name} must be >= {minimum}, got {value}")


def seconds(name: str, value: float, *, zero: bool = False, negative: bool = False) -> None:
    """A duration option: a finite number, > 0 (``zero``: >= 0; ``negative``: any finite value).
    A NaN deadline is never passed, an infinite one never ends: both refused."""
    if not math.isfinite(value):
        raise UsageError(f"--{name} must be a finite number of seconds, got {value}")
    if not negative and (value < 0 or (value == 0 and not zero)):
        raise UsageError(f"--{name} must be {'>= 0' if zero else '> 0'} seconds, got {value:g}")


def address(name: str, value: str) -> None:
    """An IP address option (IPv4 or IPv6), refused in one line if it is not one."""
    try:
        ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        raise UsageError(f"--{name} {value!r} is not an IP address") from None


def host_port(name: str, value: str) -> None:
    """A ``HOST:PORT`` option with a port from 1 to 65535."""
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--{name} {value!r}: expected HOST:PORT (a port from 1 to 65535)")


def add_job_args(p: argparse.ArgumentParser, *, workers: int, spares: int) -> None:
    """The job's options: its size, faults, output, seed, control port, devices and detection."""
    p.add_argument("--workers", type=int, default=workers, help="data-parallel workers (ranks)")
    p.add_argument("--spares", type=int, default=spares, help="hot spare processes kept warm")
    p.add_argument("--fault", action="append", default=None, metavar="SPEC",
                   help="KIND:rank=R[,R]@step=S (kill|hang|exception|corrupt), kill|hang:rank=R@check=S (at a "
                        "consistency check), kill:spare@recovery|join, kill:source@recovery, kill:survivor@takeover, kill|partition:node=N@step=S, "
                        "partition:spare@recovery|join[,for=T], partition:source@recovery[,for=T], or none")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="write events.jsonl, report.json and logs here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="control store port (0: any free port)")
    add_device_args(p)
    add_detection_args(p)


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--backend`` and ``--device``."""
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="data plane: gloo (CPU, or CUDA tensors with --device cuda) or nccl (CUDA; "
                   "control messages then run on a gloo group beside it); default gloo")  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the ranks train: each process on cuda:<its slot on the host> "
                   "(workers 0..N-1, then spares), or cpu; default cuda with nccl, else cpu")  # fmt: skip


def check_device(job: JobConfig) -> None:
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


def add_detection_args(p: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """The detection and recovery options; ``defaults=False`` leaves them None, for ``run`` to take
    the recipe's values."""
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
    p.add_argument("--min-workers", type=int, default=None, metavar="M",
                   help="an elastic job: ranks lost with no spare ready leave the job, the survivors computing "
                   "their shares, while at least M workers live (default: no shrink)")  # fmt: skip
    p.add_argument("--max-workers", type=int, default=None, metavar="X",
                   help="an elastic job: capacity beyond the spares' reserve grows the job up to X workers, and "
                   "checkpointless scale may ask for up to X (at most --shares; default: --workers)")  # fmt: skip
    p.add_argument("--resize-interval", type=float, default=None, metavar="SECONDS",
                   help="the least time between two changes of size that no fault forced "
                   f"(default {d.resize_interval_s:g})")  # fmt: skip
    p.add_argument("--exact-resize", action="store_true", default=None,
                   help="sum each step's gradient over the shares in share order: bit for bit the same run "
                   "whatever the number of replicas (a job that shrinks or grows), at some steady-state cost")  # fmt: skip
    p.add_argument("--never-wait", action="store_true", default=None,
                   help="a lost worker's shares go to the survivors at once and a spare catches up in the "
                   "background, then takes them back (needs --min-workers below --workers)")  # fmt: skip
    p.add_argument("--control-port", type=int, default=None, metavar="PORT",
                   help="serve POST /scale (bearer token: control.json's) on this port on every interface "
                   "(default: a free port on loopback, named in <out>/control.json)")  # fmt: skip
    p.add_argument("--shares", type=int, default=None, metavar="S",
                   help="the data-parallel shares the global batch is cut into, for the whole job: a replica "
                   "holding several computes each (for share in session.shares()); default one per worker")  # fmt: skip
    p.add_argument("--exit-timeout", type=float, default=None, metavar="SECONDS",
                   help="once the job has finished, how long the ranks' processes may go on with their "
                   f"own work (saving, evaluating) before they are killed (default {d.exit_timeout_s:g})")  # fmt: skip


def check_durable(recovery: RecoveryConfig, key: str) -> None:
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


def check_out(out: Path | None) -> None:
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


def job_config(
    args: argparse.Namespace,
    steps: int | None,
    default_faults: list[str],
    recovery: RecoveryConfig | None = None,
    topology: LocalCluster | None = None,
) -> JobConfig:
    """The job the flags describe; ``recovery``: the recipe's settings, which the flags override;
    ``topology``: the hosts the faults' ``node=`` refer to. ``--out`` is created only once every
    other option is known to be right."""
    positive("workers", args.workers)
    positive("spares", args.spares, 0)
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    shards = getattr(args, "shards", 1)
    positive("shards", shards)
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
        if getattr(args, "min_workers", None) is not None:
            if not 1 <= args.min_workers <= args.workers:
                raise UsageError(
                    f"--min-workers must be between 1 and --workers {args.workers}, got {args.min_workers}"
                )
            changes["min_workers"] = args.min_workers
        if getattr(args, "max_workers", None) is not None:
            if args.max_workers < args.workers:
                raise UsageError(
                    f"--max-workers must be at least --workers {args.workers}, got {args.max_workers}"
                )
            changes["max_workers"] = args.max_workers
        interval = getattr(args, "resize_interval", None)
        if interval is not None:
            if not math.isfinite(interval) or interval <= 0:
                raise UsageError(f"--resize-interval must be a positive number of seconds, got {interval}")
            changes["resize_interval_s"] = interval
        if getattr(args, "exact_resize", None):
            changes["exact_resize"] = True
        if getattr(args, "never_wait", None):
            low = getattr(args, "min_workers", None)
            if low is None or low >= args.workers:
                raise UsageError(
                    f"--never-wait needs --min-workers below --workers {args.workers}: the survivors take a "
                    "lost worker's shares while a spare catches up"
                )
            changes["never_wait"] = True
        port = getattr(args, "control_port", None)
        if port is not None and not 0 <= port < 65536:
            raise UsageError(f"--control-port must be in 0..65535, got {port}")
        if getattr(args, "shares", None) is not None:
            if args.shares < 1:
                raise UsageError(f"--shares must be >= 1, got {args.shares}")
            changes["shares"] = args.shares
        if args.exit_timeout is not None:
            if not math.isfinite(args.exit_timeout) or args.exit_timeout <= 0:
                raise UsageError(
                    f"--exit-timeout must be a positive number of seconds, got {args.exit_timeout}"
                )
            changes["exit_timeout_s"] = args.exit_timeout
        recovery = dataclasses.replace(base, **changes)
        low, high = recovery.min_workers, recovery.max_workers
        if topology is not None:  # on several hosts a size is whole hosts' worth
            per = topology.nproc_per_node
            for flag, value in (("--min-workers", low), ("--max-workers", high)):
                if value and value % per:
                    raise UsageError(
                        f"{flag} {value} must be a multiple of --nproc-per-node {per}: on several hosts the "
                        "job changes size by whole hosts"
                    )
        check_durable(recovery, "recovery.durable_dir" if args.durable_dir is None else "--durable-dir")
        # without --steps, the steps are checked once the script's session.steps(total) says it
        validate_schedule(faults, workers=args.workers, spares=args.spares, steps=steps or 2**62,
                          durable=bool(recovery.durable_every), shards=shards,
                          consistency_every=recovery.consistency_every,
                          nodes=topology.nodes if topology else 0,
                          nproc_per_node=topology.nproc_per_node if topology else 0,
                          min_workers=recovery.min_workers, never_wait=recovery.never_wait)  # fmt: skip
        check_out(args.out)  # created only once everything else is known to be right
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
    check_device(job)
    return job


def topology_args(argv: list[str], topology: LocalCluster | None) -> list[str]:
    """Under ``cluster``: the workers and spares its hosts hold, appended to a job command's own."""
    if topology is None:
        return argv
    return [*argv, "--workers", str(topology.workers), "--spares", str(topology.spares)]
