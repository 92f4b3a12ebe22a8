"""``checkpointless cluster`` (many hosts on this machine) and ``checkpointless agent`` (one host
of a job on several machines).

``cluster --nodes N --nproc-per-node P --spare-nodes S [demo | launch | run] [their options]``
makes N + S hosts as network namespaces (``netns.py``), runs the coordinator here (on the hosts'
bridge) and one agent in each host, runs the job across them, and removes the hosts at the end,
whatever ends it (success, failure, Ctrl-C, SIGKILL of the command: the reaper).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from checkpointless.control.auth import new_secret, read_secret_file, write_secret_file
from checkpointless.errors import LaunchError, UsageError
from checkpointless.launch.outputs import CONTROL_FILE
from checkpointless.launch.remote import ClusterSpec

SUBCOMMANDS = ("demo", "launch", "run")
CLUSTER_HANG_TIMEOUT_S = 2.0
"""``cluster``'s default ``--hang-timeout`` (``demo`` and ``launch``): all its hosts share this
machine's cores, so beats come later than on real hosts (the host timeout is four times it)."""


@dataclass
class LocalCluster:
    """The hosts ``checkpointless cluster`` makes for each job it runs."""

    nodes: int
    nproc_per_node: int
    spare_nodes: int
    join_timeout_s: float = 120.0
    spares_per_node: int = 0  # warm spare processes on each worker host

    @property
    def workers(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def spares(self) -> int:
        return self.spare_nodes * self.nproc_per_node + self.nodes * self.spares_per_node

    @contextlib.contextmanager
    def hosts(self, command: list[str], out: Path | None) -> Iterator[tuple[str, ClusterSpec, bytes]]:
        """(the coordinator's address, the job's hosts, the job's secret) for one job: the hosts
        are up, their agents start once the coordinator's store is (``ClusterSpec.start_agents``);
        on exit every agent is stopped and the hosts removed."""
        from checkpointless.launch.netns import Hosts

        secret = new_secret()
        total = self.nodes + self.spare_nodes
        tmp = Path(tempfile.mkdtemp(prefix="checkpointless-cluster-"))
        secret_file = tmp / "secret"
        write_secret_file(secret_file, secret)
        logs = (out / "logs") if out is not None else tmp / "logs"
        agents: list[subprocess.Popen[bytes]] = []
        files: list[IO[bytes]] = []

        def log_dir(host: str) -> Path:
            return logs / host

        # the secret's folder (the hosts' logs too, without --out) and the run's control file go
        # with the hosts, by the reaper if this command is SIGKILLed
        leftovers = [str(tmp)] + ([str(out / CONTROL_FILE)] if out is not None else [])
        try:
            with Hosts(total, leftovers) as net:

                def start_agents(store_addr: str) -> None:
                    for i in range(total):
                        name = net.hostnames[i]
                        log_dir(name).mkdir(parents=True, exist_ok=True)
                        argv = [
                            sys.executable, "-m", "checkpointless", "agent", "--coordinator", store_addr,
                            "--secret-file", str(secret_file), "--nproc-per-node", str(self.nproc_per_node),
                            "--addr", net.addr(i), "--log-dir", str(log_dir(name)),
                            "--join-timeout", str(self.join_timeout_s),
                            # a host back from a partition rejoins as a spare host (the command's own
                            # end removes every host, so no agent outlives it)
                            "--rejoin-window", "60",
                        ]  # fmt: skip
                        argv += ["--spare"] if i >= self.nodes else ["--node-rank", str(i)]
                        f = open(log_dir(name) / "agent.log", "wb")  # noqa: SIM115 (closed below)
                        files.append(f)
                        agents.append(subprocess.Popen(
                            net.argv(i, [*argv, "--", *command]), stdout=f, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, process_group=0,
                        ))  # fmt: skip

                spec = ClusterSpec(
                    nodes=self.nodes, nproc_per_node=self.nproc_per_node, spare_nodes=self.spare_nodes,
                    spares_per_node=self.spares_per_node,
                    start_agents=start_agents, join_timeout_s=self.join_timeout_s, log_dir_of=log_dir,
                )  # fmt: skip
                self.net = net
                try:
                    yield net.bridge_addr, spec, secret
                finally:
                    for a in agents:  # they stop by themselves once told; then by force
                        try:
                            a.wait(timeout=10)
                        except subprocess.TimeoutExpired:
                            a.kill()
                            a.wait(timeout=10)
        finally:
            for f in files:
                f.close()
            secret_file.unlink(missing_ok=True)
            if out is None:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    tmp.rmdir()


def cmd_cluster(argv: list[str]) -> int:
    """``checkpointless cluster [own options] [demo | launch | run] [their options]``."""
    from checkpointless.launch import cli
    from checkpointless.launch.netns import MAX_HOSTS

    at = next((i for i, a in enumerate(argv) if a in SUBCOMMANDS), len(argv))
    own, sub, rest = argv[:at], (argv[at] if at < len(argv) else "demo"), argv[at + 1 :]
    p = cli._Parser(
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
    args = p.parse_args(own)
    cli._positive("nodes", args.nodes, 1)
    cli._positive("nproc-per-node", args.nproc_per_node, 1)
    cli._positive("spare-nodes", args.spare_nodes, 0)
    cli._positive("spares-per-node", args.spares_per_node, 0)
    cli._seconds("join-timeout", args.join_timeout)
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
    run = {"demo": cli.cmd_demo, "launch": cli.cmd_launch, "run": cli.cmd_run}[sub]
    return run(rest, topology=topology)


def cmd_agent(argv: list[str]) -> int:
    """``checkpointless agent --coordinator HOST:PORT --secret-file F --nproc-per-node P [--spare] -- CMD``."""
    from checkpointless.launch import cli
    from checkpointless.launch.node import Agent, main_agent

    split = argv.index("--") if "--" in argv else len(argv)
    own, command = argv[:split], argv[split + 1 :]
    p = cli._Parser(
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
    args = p.parse_args(own)
    if not command:
        raise UsageError("checkpointless agent: give the training command after --, e.g. -- python train.py")
    cli._positive("nproc-per-node", args.nproc_per_node, 1)
    cli._host_port("coordinator", args.coordinator)
    cli._seconds("join-timeout", args.join_timeout)
    cli._seconds("clock-skew", args.clock_skew, negative=True)
    cli._seconds("rejoin-window", args.rejoin_window, zero=True)
    if args.node_rank is not None:
        if args.spare:
            raise UsageError("--node-rank and --spare: a spare host has no node rank (it takes a lost one's)")
        cli._positive("node-rank", args.node_rank, 0)
    if args.addr:
        cli._address("addr", args.addr)
    if args.host_name and (args.host_name != args.host_name.strip() or "/" in args.host_name):
        raise UsageError(f"--host-name {args.host_name!r}: no spaces or slashes in a host's name")
    try:
        secret = read_secret_file(args.secret_file)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    agent = Agent(
        args.coordinator, secret, command, nproc=args.nproc_per_node, spare=args.spare, host=args.host_name,
        addr=args.addr, log_dir=args.log_dir, node_rank=args.node_rank, join_timeout_s=args.join_timeout,
        clock_skew_s=args.clock_skew, rejoin_window_s=args.rejoin_window,
    )  # fmt: skip
    try:
        return main_agent(agent)
    except LaunchError as e:
        raise LaunchError(f"agent {agent.host}: {e}") from None


def cmd_coordinator(argv: list[str]) -> int:
    """``checkpointless coordinator --nodes N --nproc-per-node P --secret-file F [job options]``."""
    from checkpointless.launch import cli
    from checkpointless.launch.launcher import Launcher
    from checkpointless.observe.console import stderr_console

    p = cli._Parser(
        prog="checkpointless coordinator",
        description="The control plane of a job on several hosts: the control store, the coordinator and "
        "the event log, here; one `checkpointless agent` per host starts the processes.",
    )
    cli._add_job_args(p, workers=0, spares=0)
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
    for flag in ("--workers", "--spares"):
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise UsageError(f"checkpointless coordinator: {flag} follows from --nodes, --nproc-per-node and "
                             "--spare-nodes")  # fmt: skip
    args = p.parse_args(argv)
    cli._positive("nodes", args.nodes, 1)
    cli._positive("nproc-per-node", args.nproc_per_node, 1)
    cli._positive("spare-nodes", args.spare_nodes, 0)
    cli._positive("spares-per-node", args.spares_per_node, 0)
    cli._seconds("join-timeout", args.join_timeout)
    cli._address("bind", args.bind)
    topology = LocalCluster(args.nodes, args.nproc_per_node, args.spare_nodes, args.join_timeout,
                            args.spares_per_node)  # fmt: skip
    args.workers, args.spares = topology.workers, topology.spares
    job = cli._job(args, args.steps, [], topology=topology)
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
    launcher = Launcher(job, [], total_steps=args.steps, host=args.bind, port=args.port, out_dir=args.out,
                        cluster=spec, secret=secret)  # fmt: skip
    result = cli._run_launcher(launcher, args, console, steps=args.steps, metrics_port=args.metrics_port)
    cli._print_result(console, result, "run")
    return cli._exit_code(result)
