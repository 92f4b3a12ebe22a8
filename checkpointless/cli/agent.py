"""``checkpointless agent --coordinator HOST:PORT --secret-file F --nproc-per-node P [--spare] -- CMD``:
one host of a job on several hosts (:class:`checkpointless.launch.host_agent.HostAgent`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpointless.cli.job_flags import Parser, address, host_port, positive, seconds
from checkpointless.control.auth import read_secret_file
from checkpointless.errors import LaunchError, UsageError


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="checkpointless agent",
        usage="checkpointless agent --coordinator HOST:PORT --secret-file FILE --nproc-per-node P [options] "
        "-- COMMAND [ARGS...]",
        description="One host of a job on several hosts: joins the coordinator, starts this host's "
        "processes (each running COMMAND) on its orders, reports them, stops them.",
    )
    p.add_argument(
        "--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's control store"
    )
    p.add_argument("--secret-file", required=True, type=Path,
                   help="the job's secret: 64 hex digits in a file only this user can read (chmod 600)")  # fmt: skip
    p.add_argument("--nproc-per-node", type=int, required=True, help="processes this host runs")
    p.add_argument(
        "--spare", action="store_true", help="a spare host: its processes wait to take a lost host's ranks"
    )
    p.add_argument("--node-rank", type=int, default=None, help="this host's place among the worker hosts")
    p.add_argument("--host-name", default="", help="this host's name in the job (default: its hostname)")
    p.add_argument("--addr", default="", help="this host's address its processes bind to (default: the "
                   "address it reaches the coordinator from)")  # fmt: skip
    p.add_argument("--log-dir", type=Path, default=None, help="where the processes' logs go")
    p.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        help="seconds to reach and join the coordinator (every host must have joined; default 300)",
    )
    p.add_argument("--clock-skew", type=float, default=0.0, metavar="S",
                   help="add S seconds to this host's processes' wall clock in their events and heartbeats "
                   "(plays a host whose clock is off; the coordinator's clock offsets undo it)")  # fmt: skip
    p.add_argument("--rejoin-window", type=float, default=0.0, metavar="S",
                   help="once cut off from the coordinator for its lease, this host stops its processes and "
                   "waits up to S seconds for the coordinator to answer again, then rejoins the job as a "
                   "spare host (default 0: it exits at once, code 3)")  # fmt: skip
    p.add_argument("--notice-file", type=Path, default=None, metavar="PATH",
                   help="drain this host once PATH exists (a preemption notice: have the cloud's notice "
                   "handler create it); the same as this agent's SIGTERM")  # fmt: skip
    return p


def run(argv: list[str]) -> int:
    from checkpointless.launch.host_agent import HostAgent, main_agent

    split = argv.index("--") if "--" in argv else len(argv)
    own, command = argv[:split], argv[split + 1 :]
    args = build_parser().parse_args(own)
    if not command:
        raise UsageError("checkpointless agent: give the training command after --, e.g. -- python train.py")
    positive("nproc-per-node", args.nproc_per_node, 1)
    host_port("coordinator", args.coordinator)
    seconds("join-timeout", args.join_timeout)
    seconds("clock-skew", args.clock_skew, negative=True)
    seconds("rejoin-window", args.rejoin_window, zero=True)
    if args.node_rank is not None:
        if args.spare:
            raise UsageError("--node-rank and --spare: a spare host has no node rank (it takes a lost one's)")
        positive("node-rank", args.node_rank, 0)
    if args.addr:
        address("addr", args.addr)
    if args.host_name and (args.host_name != args.host_name.strip() or "/" in args.host_name):
        raise UsageError(f"--host-name {args.host_name!r}: no spaces or slashes in a host's name")
    try:
        secret = read_secret_file(args.secret_file)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    agent = HostAgent(
        args.coordinator, secret, command, nproc=args.nproc_per_node, spare=args.spare, host=args.host_name,
        addr=args.addr, log_dir=args.log_dir, node_rank=args.node_rank, join_timeout_s=args.join_timeout,
        clock_skew_s=args.clock_skew, rejoin_window_s=args.rejoin_window, notice_file=args.notice_file,
    )  # fmt: skip
    try:
        return main_agent(agent)
    except LaunchError as e:
        raise LaunchError(f"agent {agent.host}: {e}") from None
