"""Many hosts on this machine, for one job: :class:`LocalCluster` makes N + S hosts as network
namespaces (``netns.py``), starts one ``checkpointless agent`` in each once the coordinator's store
is up, and removes the hosts at the end, whatever ends it (success, failure, Ctrl-C, SIGKILL of the
command: the reaper). The ``checkpointless cluster`` command (``checkpointless/cli/cluster.py``)
runs a job on them.
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

from checkpointless.control.auth import new_secret, write_secret_file
from checkpointless.launch.cluster_spec import ClusterSpec
from checkpointless.launch.outputs import CONTROL_FILE, temp_logs_glob


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

        # the secret's folder (the hosts' logs too, without --out), the run's control file and the
        # launcher's own log folder (without --out; empty here: the agents keep the processes' logs)
        # go with the hosts, by the reaper if this command is SIGKILLed
        leftovers = [str(tmp)] + ([str(out / CONTROL_FILE)] if out is not None else [])
        try:
            with Hosts(total, leftovers, [temp_logs_glob(os.getpid())] if out is None else []) as net:

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
                            # a preemption notice for the host: creating this file drains it
                            "--notice-file", str(log_dir(name) / "notice"),
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
