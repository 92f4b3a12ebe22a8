"""``checkpointless cluster [own options] [demo | launch | run] [their options]``: many hosts on
this machine.

It makes N + S hosts as network namespaces (``launch/netns.py``, root), runs the coordinator here
(on the hosts' bridge) and one agent in each host, runs the job across them
(:class:`~checkpointless.launch.cluster.LocalCluster`), and removes the hosts at the end, whatever
ends it (success, failure, Ctrl-C, SIGKILL of the command: the reaper).
"""

from __future__ import annotations

import argparse
import os

from checkpointless.cli import demo, launch
from checkpointless.cli import run as run_recipe
from checkpointless.cli.job_flags import Parser, positive, seconds
from checkpointless.errors import UsageError
from checkpointless.launch.cluster import LocalCluster

SUBCOMMANDS = ("demo", "launch", "run")
CLUSTER_HANG_TIMEOUT_S = 2.0
"""``cluster``'s default ``--hang-timeout`` (``demo`` and ``launch``): all its hosts share this
machine's cores, so beats come later than on real hosts (the host timeout is four times it)."""


def build_parser() -> argparse.ArgumentParser:
    """The command's own options; the job's follow its subcommand."""
    p = Parser(
        prog="checkpointless cluster",
        usage="checkpointless cluster [--nodes N] [--nproc-per-node P] [--spare-nodes S] "
        "[demo | launch | run] [their options]",
        description="Try many hosts on one machine: N + S hosts as network namespaces (root), one agent "
        "each, a job across them (demo by default), every host removed at the end.",
    )
    p.add_argument("--nodes", type=int, default=2, help="worker hosts (default 2)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="processes per host (default 2)")
    p.add_argument("--spare-nodes", type=int, default=1, help="spare hosts, kept warm (default 1)")
    p.add_argument("--join-timeout", type=float, default=120.0, help="seconds for every agent to join")
    p.add_argument("--spares-per-node", type=int, default=0, help="warm spare processes on each worker host: "
                   "a process fault is replaced on its own host (default 0: by a spare host's)")  # fmt: skip
    return p


def run(argv: list[str]) -> int:
    from checkpointless.launch.netns import MAX_HOSTS

    at = next((i for i, a in enumerate(argv) if a in SUBCOMMANDS), len(argv))
    own, sub, rest = argv[:at], (argv[at] if at < len(argv) else "demo"), argv[at + 1 :]
    args = build_parser().parse_args(own)
    positive("nodes", args.nodes, 1)
    positive("nproc-per-node", args.nproc_per_node, 1)
    positive("spare-nodes", args.spare_nodes, 0)
    positive("spares-per-node", args.spares_per_node, 0)
    seconds("join-timeout", args.join_timeout)
    if args.nodes + args.spare_nodes > MAX_HOSTS:
        raise UsageError(f"--nodes {args.nodes} + --spare-nodes {args.spare_nodes}: this machine makes at most "
                         f"{MAX_HOSTS} hosts")  # fmt: skip
    if os.geteuid() != 0:
        raise UsageError("checkpointless cluster makes network namespaces: run it as root")
    own_args = rest[: rest.index("--")] if "--" in rest else rest  # launch's; the script's follow `--`
    for flag in ("--workers", "--spares"):
        if any(a == flag or a.startswith(flag + "=") for a in own_args):
            raise UsageError(f"checkpointless cluster {sub}: {flag} follows from --nodes, --nproc-per-node and "
                             "--spare-nodes")  # fmt: skip
    if sub != "run" and not any(a == "--hang-timeout" or a.startswith("--hang-timeout=") for a in own_args):
        # every host shares this machine's cores: a lost beat is likelier than on a real cluster
        rest = ["--hang-timeout", str(CLUSTER_HANG_TIMEOUT_S), *rest]  # before launch's `-- COMMAND`
    topology = LocalCluster(args.nodes, args.nproc_per_node, args.spare_nodes, args.join_timeout,
                            args.spares_per_node)  # fmt: skip
    job = {"demo": demo.run, "launch": launch.run, "run": run_recipe.run}[sub]
    return job(rest, topology=topology)
