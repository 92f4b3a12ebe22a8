"""``checkpointless launch [options] -- COMMAND``: run any script that uses
``checkpointless.Session``, fault tolerant, one process per worker and per spare.

torchrun's command line works too (``launch --nproc-per-node 8 train.py ARGS``): its flags are
taken where launch does the same thing, and the others refused in one line naming what to use."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from checkpointless.cli.job_flags import Parser, add_job_args, job_config, positive, topology_args
from checkpointless.cli.job_run import exit_code, print_result, run_job
from checkpointless.errors import UsageError
from checkpointless.launch.cluster import LocalCluster
from checkpointless.observe.console import stderr_console

WORKERS, SPARES = 2, 1
"""The defaults; under torchrun's ``--nproc-per-node`` the spares default to 0 (exactly N processes)."""

MULTI_HOST = "for several hosts use checkpointless coordinator and agent (checkpointless cluster to try them on one machine)"  # fmt: skip

# torchrun's flags that launch refuses, each with what to use instead
_REFUSED = {
    "max_restarts": "launch recovers a lost process without a restart: a hot spare takes its place (--spares)",
    "rdzv_id": "launch names its job itself; drop it (" + MULTI_HOST + ")",
    "rdzv_conf": "launch makes its own rendezvous; see --port, --hang-timeout",
    "role": "launch's processes are workers and spares (CHECKPOINTLESS_ROLE tells which)",
    "monitor_interval": "launch watches its processes by heartbeat: see --hang-timeout",
    "start_method": "launch starts its processes from a fork server; CHECKPOINTLESS_FORK_SERVER=0 starts each "
                    "as a fresh interpreter",
    "tee": "launch writes each process's output to its own log, never to the console: --out DIR keeps them in "
           "DIR/logs",
    "local_ranks_filter": "launch writes each process's output to its own log, never to the console: --out DIR "
                          "keeps them in DIR/logs",
}  # fmt: skip


def _flag(p: argparse._ActionsContainer, name: str, **kw: object) -> None:
    """torchrun's ``--a-b``, and its ``--a_b`` spelling (taken, not listed in ``--help``)."""
    p.add_argument(f"--{name.replace('_', '-')}", dest=name, **kw)  # type: ignore[arg-type]
    if "_" in name:
        p.add_argument(f"--{name}", dest=name, **{**kw, "help": argparse.SUPPRESS})  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="checkpointless launch",
        usage="checkpointless launch [options] -- COMMAND [ARGS...]\n"
        "       checkpointless launch [options] SCRIPT.py [ARGS...]   (torchrun's form; also -m MODULE)",
        description="Run any script that uses checkpointless.Session, fault tolerant: one process per "
        "worker and per spare, each running COMMAND.",
    )
    add_job_args(p, workers=WORKERS, spares=SPARES)
    p.set_defaults(workers=None, spares=None)  # filled in by run(): the defaults depend on torchrun's flags
    p.add_argument("--steps", type=int, default=None, help="the script's step count (checks --fault steps)")
    p.add_argument("--shards", type=int, default=1,
                   help="ranks that split one copy of the state (FSDP2/HSDP, Session(build=...)); 1: replicated")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--quiet", action="store_true")
    add_torchrun_args(p)
    p.add_argument("script", nargs="?", metavar="SCRIPT.py", help=argparse.SUPPRESS)
    p.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def add_torchrun_args(p: argparse.ArgumentParser) -> None:
    """torchrun's flags, each also in its ``--a_b`` spelling (see docs/guide/running.md)."""
    g = p.add_argument_group(
        "torchrun's flags",
        "taken where launch does the same; the others (--max-restarts, --rdzv-id, --rdzv-conf, --role, --tee, "
        "--local-ranks-filter, --monitor-interval, --start-method) are refused, naming what to use",
    )
    _flag(g, "nproc_per_node", metavar="N", help="--workers N, and --spares defaults to 0; gpu: one per visible "
          "CUDA device; cpu or auto: as torchrun counts them")  # fmt: skip
    _flag(g, "nnodes", metavar="1", help="1 or 1:1 (one host); " + MULTI_HOST)
    _flag(g, "node_rank", metavar="0", help="0 (one host)")
    g.add_argument("--standalone", action="store_true", help="what launch does: one host, its own rendezvous")
    _flag(g, "rdzv_backend", metavar="c10d", help="c10d or static: launch's own control store")
    _flag(g, "rdzv_endpoint", metavar="localhost:PORT", help="on this host: PORT is --port")
    _flag(g, "master_addr", metavar="localhost", help="this host (localhost, 127.0.0.1)")
    _flag(g, "master_port", metavar="PORT", help="--port PORT (the control store's)")
    _flag(g, "redirects", metavar="3", help="3: what launch does (each process's output to its log)")
    _flag(g, "log_dir", metavar="DIR", help="--out DIR (the logs go to DIR/logs)")
    g.add_argument(
        "-m", "--module", action="store_true", help="SCRIPT is a module: run python -m MODULE ARGS"
    )
    _flag(g, "no_python", action="store_true", help="run SCRIPT ARGS itself, not python SCRIPT ARGS")
    _flag(g, "run_path", action="store_true", help="what launch does with SCRIPT.py: python SCRIPT.py ARGS")
    for name in _REFUSED:
        _flag(g, name, help=argparse.SUPPRESS)


def _count(value: str) -> int:
    """``--nproc-per-node``'s value: a number, or torchrun's ``gpu``, ``cpu`` or ``auto``."""
    if value in ("gpu", "auto"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:
            return gpus
        if value == "gpu":
            raise UsageError("--nproc-per-node gpu: this machine has no visible CUDA device; give a number")
    if value in ("cpu", "auto"):
        return os.cpu_count() or 1
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"--nproc-per-node {value!r}: expected a number, gpu, cpu or auto") from None
    positive("nproc-per-node", n)
    return n


def _this_host(host: str) -> bool:
    """localhost, a loopback address or 0.0.0.0: torchrun's ways to name the one host."""
    return host.strip("[]") in ("localhost", "127.0.0.1", "::1", "0.0.0.0") or host.startswith("127.")


def _port(flag: str, value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) < 65536:
        raise UsageError(f"{flag} {value!r}: expected a port from 0 to 65535")
    return int(value)


def apply_torchrun(args: argparse.Namespace, topology: LocalCluster | None) -> None:
    """Turn torchrun's flags in ``args`` into launch's own (``--workers``, ``--spares``, ``--port``,
    ``--out``), or refuse them in one line; then fill in the size's defaults."""
    for name, instead in _REFUSED.items():
        if getattr(args, name) is not None:
            raise UsageError(f"--{name.replace('_', '-')}: not taken by checkpointless launch: {instead}")
    if topology is not None:
        for name in ("nproc_per_node", "nnodes", "node_rank"):
            if getattr(args, name) is not None:
                raise UsageError(f"checkpointless cluster launch: --{name.replace('_', '-')} follows from cluster's "
                                 "--nodes and --nproc-per-node (given before launch)")  # fmt: skip
    if args.nnodes is not None:
        sizes = args.nnodes.split(":")
        if not all(s.isdigit() for s in sizes) or len(sizes) > 2:
            raise UsageError(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX")
        if any(int(s) != 1 for s in sizes):
            raise UsageError(f"--nnodes {args.nnodes}: checkpointless launch runs on one host; {MULTI_HOST}; an "
                             "elastic job's sizes are --min-workers and --max-workers")  # fmt: skip
    if args.node_rank not in (None, "0"):
        raise UsageError(f"--node-rank {args.node_rank}: checkpointless launch runs on one host; {MULTI_HOST} "
                         "(agent --node-rank)")  # fmt: skip
    if args.rdzv_backend not in (None, "c10d", "static"):
        raise UsageError(f"--rdzv-backend {args.rdzv_backend}: launch makes its own rendezvous on this host (c10d "
                         f"or static are taken); {MULTI_HOST}")  # fmt: skip
    ports: dict[str, int] = {}
    if args.rdzv_endpoint is not None:
        host, colon, port = args.rdzv_endpoint.rpartition(":")
        host = host if colon else port
        if not _this_host(host):
            raise UsageError(f"--rdzv-endpoint {args.rdzv_endpoint}: launch runs on this host (localhost); "
                             f"{MULTI_HOST}")  # fmt: skip
        if colon:
            ports["--rdzv-endpoint"] = _port("--rdzv-endpoint", port)
    if args.master_addr is not None and not _this_host(args.master_addr):
        raise UsageError(
            f"--master-addr {args.master_addr}: launch runs on this host (localhost); {MULTI_HOST}"
        )
    if args.master_port is not None:
        ports["--master-port"] = _port("--master-port", args.master_port)
    if args.port:
        ports["--port"] = args.port
    if len(set(ports.values())) > 1:
        raise UsageError(f"{' and '.join(ports)} name different ports for launch's control store: give one")
    args.port = next(iter(ports.values()), args.port)
    if args.redirects not in (None, "3"):
        raise UsageError(f"--redirects {args.redirects}: launch writes every process's output to its own log "
                         "(--redirects 3); --out DIR keeps them in DIR/logs")  # fmt: skip
    if args.log_dir is not None:
        if args.out is not None:
            raise UsageError("--log-dir and --out both name the run's folder: give one")
        args.out = Path(args.log_dir)
    if args.nproc_per_node is not None:
        if args.workers is not None:
            raise UsageError("--nproc-per-node and --workers both give the number of workers: give one")
        args.workers = _count(args.nproc_per_node)
    if args.spares is None:
        args.spares = 0 if args.nproc_per_node is not None else SPARES
    if args.workers is None:
        args.workers = WORKERS


def command_of(args: argparse.Namespace, after: list[str] | None) -> list[str]:
    """The command each process runs: ``after`` (what follows ``--``, None without one), or
    torchrun's form, ``SCRIPT.py ARGS`` (also ``-m MODULE ARGS``, ``--no-python PROGRAM ARGS``)."""
    ways = (("-m", args.module), ("--no-python", args.no_python), ("--run-path", args.run_path))
    how = [flag for flag, given in ways if given]
    if len(how) > 1:
        raise UsageError(f"{' and '.join(how)}: give one")
    if args.script is None:
        if how:
            what = "MODULE" if how[0] == "-m" else "SCRIPT"
            raise UsageError(f"{how[0]} names how to run the script given without --, as torchrun takes it: "
                             f"checkpointless launch {how[0]} {what} ARGS")  # fmt: skip
        if after is None:
            raise UsageError("checkpointless launch: give the training command after --, e.g. -- python train.py "
                             "(or torchrun's form: launch train.py ARGS)")  # fmt: skip
        if not after:
            raise UsageError("checkpointless launch: the training command after -- is empty")
        command = after
    else:
        rest = [*args.script_args, *(["--", *after] if after is not None else [])]
        if how == ["-m"]:
            return [sys.executable, "-m", args.script, *rest]
        if how == ["--no-python"]:
            command = [args.script, *rest]
        elif not args.script.endswith(".py"):
            raise UsageError(f"checkpointless launch: give the training command after --, e.g. -- python train.py; "
                             f"without --, the first argument is a script.py (as torchrun takes it), got "
                             f"{args.script!r}")  # fmt: skip
        elif not os.path.isfile(args.script):
            raise UsageError(f"checkpointless launch: no such script: {args.script}")
        else:
            return [sys.executable, args.script, *rest]
    if command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    if shutil.which(command[0]) is None:
        raise UsageError(f"checkpointless launch: command not found or not executable: {command[0]}")
    return command


def run(argv: list[str], topology: LocalCluster | None = None) -> int:
    """``topology``: under ``cluster``, the hosts the job runs on."""
    split = argv.index("--") if "--" in argv else len(argv)
    own, after = argv[:split], (argv[split + 1 :] if split < len(argv) else None)
    # -h / --help: the options, with or without a command
    # under cluster, its sizes go first: torchrun's form takes everything after SCRIPT.py as its own
    args = build_parser().parse_args([*topology_args([], topology), *own])
    apply_torchrun(args, topology)
    command = command_of(args, after)
    job = job_config(args, args.steps, [], topology=topology)
    console = stderr_console()
    result = run_job(
        job, command, args, console, steps=args.steps, out=args.out, metrics_port=args.metrics_port,
        topology=topology,
    )  # fmt: skip
    print_result(console, result, "run")
    return exit_code(result)
