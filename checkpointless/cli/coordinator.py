"""``checkpointless coordinator --nodes N --nproc-per-node P --secret-file F [job options]``: the
control plane of a job on several hosts (the control store, the coordinator and the event log);
one ``checkpointless agent`` per host starts the processes."""

from __future__ import annotations

import argparse
from pathlib import Path

from checkpointless.cli.job_flags import Parser, add_job_args, address, job_config, positive, seconds
from checkpointless.cli.job_run import exit_code, print_result, run_launcher
from checkpointless.control.auth import read_secret_file
from checkpointless.errors import UsageError
from checkpointless.launch.cluster import LocalCluster
from checkpointless.launch.cluster_spec import ClusterSpec


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="checkpointless coordinator",
        description="The control plane of a job on several hosts: the control store, the coordinator and "
        "the event log, here; one `checkpointless agent` per host starts the processes.",
    )
    add_job_args(p, workers=0, spares=0)
    p.add_argument("--nodes", type=int, required=True, help="worker hosts")
    p.add_argument("--nproc-per-node", type=int, required=True, help="processes per host")
    p.add_argument("--spare-nodes", type=int, default=0, help="spare hosts (default 0)")
    p.add_argument("--spares-per-node", type=int, default=0,
                   help="warm spare processes on each worker host (default 0)")  # fmt: skip
    p.add_argument("--bind", default="127.0.0.1",
                   help="the address the control store listens on, which the agents dial (default 127.0.0.1)")  # fmt: skip
    p.add_argument(
        "--secret-file", required=True, type=Path, help="the job's secret (chmod 600), as the agents'"
    )
    p.add_argument("--steps", type=int, default=None, help="the script's step count (checks --fault steps)")
    p.add_argument("--shards", type=int, default=1, help="ranks that split one copy of the state")
    p.add_argument("--join-timeout", type=float, default=300.0, help="seconds for every agent to join")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--quiet", action="store_true")
    return p


def run(argv: list[str]) -> int:
    from checkpointless.observe.console import stderr_console

    p = build_parser()
    for flag in ("--workers", "--spares"):
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise UsageError(f"checkpointless coordinator: {flag} follows from --nodes, --nproc-per-node and "
                             "--spare-nodes")  # fmt: skip
    args = p.parse_args(argv)
    positive("nodes", args.nodes, 1)
    positive("nproc-per-node", args.nproc_per_node, 1)
    positive("spare-nodes", args.spare_nodes, 0)
    positive("spares-per-node", args.spares_per_node, 0)
    seconds("join-timeout", args.join_timeout)
    address("bind", args.bind)
    topology = LocalCluster(args.nodes, args.nproc_per_node, args.spare_nodes, args.join_timeout,
                            args.spares_per_node)  # fmt: skip
    args.workers, args.spares = topology.workers, topology.spares
    job = job_config(args, args.steps, [], topology=topology)
    try:
        secret = read_secret_file(args.secret_file)
    except ValueError as e:
        raise UsageError(str(e)) from None
    console = stderr_console()

    def listening(addr: str) -> None:
        console.print(f"checkpointless coordinator: listening on {addr}; waiting for {args.nodes} node(s) and "
                      f"{args.spare_nodes} spare node(s)", highlight=False)  # fmt: skip

    spec = ClusterSpec(
        nodes=args.nodes, nproc_per_node=args.nproc_per_node, spare_nodes=args.spare_nodes,
        spares_per_node=args.spares_per_node, start_agents=listening, join_timeout_s=args.join_timeout,
    )  # fmt: skip
    result = run_launcher(job, [], args, console, steps=args.steps, metrics_port=args.metrics_port, host=args.bind,
                          port=args.port, out_dir=args.out, cluster=spec, secret=secret,
                          control_port=getattr(args, "control_port", None))  # fmt: skip
    print_result(console, result, "run")
    return exit_code(result)
