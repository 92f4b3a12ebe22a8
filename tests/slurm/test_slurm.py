"""``examples/slurm/train.sbatch`` on a real Slurm cluster, with a real node death.

The cluster is made here, on this machine (root): three hosts as network namespaces with their own
address and hostname (``checkpointless.launch.netns.Hosts``: a bridge, a reaper that removes
everything if this process is killed), ``munged`` and ``slurmctld`` in this machine's namespace,
one ``slurmd`` per host, Debian's Slurm (22.05) with a configuration and a munge key of its own in
a temporary directory (``SLURM_CONF``; nothing under ``/etc`` is read or written). Slurm and munge
are installed from Debian if missing.

The job (2 worker nodes x 1 process + 1 spare node) trains the demo; once steps commit, every
process in one worker node's namespace is SIGKILLed (its slurmd, slurmstepd, agent and worker: a
node death, not an injected fault). The job must end with exit 0, the spare node must have taken
the lost node's rank, and the final state must equal the fault-free run bit for bit. A job whose
coordinator refuses its input ends at once with the coordinator's exit status.

``make test-slurm``; ``make test`` leaves it out (the ``slurm`` marker).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from checkpointless.observe.fields import unpacked

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="a Slurm cluster in network namespaces needs root"),
]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
CLI = [sys.executable, "-m", "checkpointless"]
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel", "nsenter")
PACKAGES = ("munge", "slurmctld", "slurmd", "slurm-client")  # Debian's; util-linux has nsenter
NODES, SPARE_NODES, NPROC = 2, 1, 1
STEPS, SEED = 40, 11
HANG = "2"  # every host shares this machine's cores (as `checkpointless cluster`'s default)
T = TypeVar("T")


def _run(argv: list[str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def _ensure_slurm() -> None:
    """Install Slurm and munge from Debian where a tool is missing (no daemon is started: a
    temporary policy-rc.d denies it, as Debian's container images do)."""
    if all(shutil.which(t) for t in TOOLS):
        return
    if shutil.which("apt-get") is None:
        pytest.skip(
            f"needs {', '.join(t for t in TOOLS if not shutil.which(t))} and no apt-get to install them"
        )
    policy = Path("/usr/sbin/policy-rc.d")
    made = not policy.exists()
    if made:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for argv in (
            ["apt-get", "update"],
            [
                "apt-get",
                "install",
                "-y",
                "-o",
                "DPkg::Lock::Timeout=300",
                "--no-install-recommends",
                *PACKAGES,
            ],
        ):
            r = _run(argv, timeout=600, env=env)
            assert r.returncode == 0, f"{' '.join(argv)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    finally:
        if made:
            policy.unlink(missing_ok=True)
    missing = [t for t in TOOLS if not shutil.which(t)]
    assert not missing, f"still missing after installing {PACKAGES}: {missing}"


_LIBC = ctypes.CDLL(None, use_errno=True)


def _die_with_test() -> None:
    """In a daemon between fork and exec: SIGKILL it if this test's process dies."""
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _wait(what: str, ready: Callable[[], T], timeout: float, diagnose: Callable[[], str] = lambda: "") -> T:
    """Poll ``ready()`` until it returns something true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"{what}: not within {timeout:.0f}s\n{diagnose()}")


class SlurmCluster:
    """munged, slurmctld and one slurmd per host (a network namespace), all of this test's own."""

    def __init__(self, hosts: Any, tmp: Path) -> None:
        self.hosts, self.tmp = hosts, tmp
        self.names: list[str] = list(hosts.hostnames)
        self.conf = tmp / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "OMP_NUM_THREADS": "1"}
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.jobs: list[str] = []

    def _daemon(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / log, "ab") as f:
            p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=self.env, preexec_fn=_die_with_test)  # fmt: skip
        self.daemons.append(p)
        return p

    def start(self) -> None:
        t = self.tmp
        t.chmod(0o711)  # munged: its socket's directory must be searchable by every user
        key = t / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        sock = t / "munge.socket"
        self._daemon(["munged", "-F", f"--key-file={key}", f"--socket={sock}", f"--pid-file={t}/munged.pid",
                      f"--log-file={t}/munged.log", f"--seed-file={t}/munged.seed"], "munged.out")  # fmt: skip
        _wait("munged's socket", sock.exists, 30, lambda: (t / "munged.log").read_text())
        ctl = self.hosts.bridge_addr
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={self.hosts.addr(i)} CPUs={os.cpu_count() or 1} State=UNKNOWN"
            for i, name in enumerate(self.names)
        )
        (t / "state").mkdir()
        (t / "spool").mkdir()
        self.conf.write_text(
            f"""ClusterName=cltest
SlurmctldHost={socket.gethostname().split(".")[0]}({ctl})
SlurmctldPort={_free_port(ctl)}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={t}/state
SlurmdSpoolDir={t}/spool/%n
SlurmctldPidFile={t}/slurmctld.pid
SlurmdPidFile={t}/slurmd-%n.pid
SlurmctldLogFile={t}/slurmctld.log
SlurmdLogFile={t}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/linear
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout=300
KillWait=5
MinJobAge=600
{nodes}
PartitionName=cltest Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )
        self._daemon(["slurmctld", "-D", "-c"], "slurmctld.out")
        for i, name in enumerate(self.names):
            # nsenter, not `ip netns exec` (which remounts /sys: slurmd then finds no cgroup mount)
            ns = self.hosts.topology.namespaces[i]
            self._daemon(["nsenter", f"--net=/var/run/netns/{ns}", "unshare", "--uts", "sh", "-c",
                          'hostname "$0" && exec slurmd -D -N "$0"', name], f"slurmd-{name}.out")  # fmt: skip
        _wait("every node idle", lambda: self.states() == {n: "idle" for n in self.names}, 60, self.diagnose)

    def states(self) -> dict[str, str]:
        """Every node's state (sinfo's short form: idle, alloc, down*...); fails if a daemon died."""
        dead = [p.args for p in self.daemons if p.poll() is not None]
        if dead:
            pytest.fail(f"a Slurm daemon exited: {dead}\n{self.diagnose()}")

        r = _run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, timeout=30)
        return (
            dict(line.split() for line in r.stdout.splitlines() if line.strip()) if r.returncode == 0 else {}
        )

    def sbatch(self, args: list[str], env: dict[str, str]) -> str:
        r = _run(["sbatch", "--parsable", *args], env={**self.env, **env}, timeout=60)
        assert r.returncode == 0, r.stderr
        job = r.stdout.strip().split(";")[0]
        self.jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        r = _run(["scontrol", "show", "job", "-o", job], env=self.env, timeout=30)
        return dict(re.findall(r"(\w+)=(\S*)", r.stdout)) if r.returncode == 0 else {}

    def kill_node(self, name: str) -> int:
        """A node's death: SIGKILL every process in its namespace (slurmd, slurmstepd, the job's
        processes); returns how many there were."""
        i = self.names.index(name)
        killed: set[int] = set()
        for _ in range(20):
            pids = set(self.hosts.pids(i)) - killed
            if not pids and killed:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed |= pids
            time.sleep(0.05)
        return len(killed)

    def diagnose(self) -> str:
        parts = []
        for log in sorted(self.tmp.glob("*.log")) + sorted(self.tmp.glob("*.out")):
            with contextlib.suppress(OSError):
                parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel the jobs, stop every daemon (the namespaces' processes go with them)."""
        for job in self.jobs:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                _run(["scancel", job], env=self.env, timeout=10)
        for i in range(len(self.names)):  # the slurmds and whatever the jobs left there
            for pid in self.hosts.pids(i):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for p in reversed(self.daemons):  # slurmctld, then munged
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    from checkpointless.launch.netns import Hosts

    _ensure_slurm()
    tmp = Path(tempfile.mkdtemp(prefix="checkpointless-slurm-"))
    try:
        with Hosts(NODES + SPARE_NODES) as hosts:
            cluster = SlurmCluster(hosts, tmp)
            try:
                cluster.start()
                yield cluster
            finally:
                cluster.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Job:
    """One run of ``train.sbatch`` on every node of the cluster (the demo: ``STEPS`` steps)."""

    def __init__(self, slurm: SlurmCluster, name: str, coordinator_args: str) -> None:
        self.slurm = slurm
        self.out = slurm.tmp / name
        self.output = slurm.tmp / f"{name}.out"
        env = {
            "CL_PYTHON": sys.executable, "CL_OUT": str(self.out), "CL_NPROC_PER_NODE": str(NPROC),
            "CL_SPARE_NODES": str(SPARE_NODES), "CL_DEMO_STEPS": str(STEPS), "CL_SEED": str(SEED),
            "CL_COORDINATOR_ARGS": coordinator_args, "CL_STOP_GRACE": "10",
        }  # fmt: skip
        self.id = slurm.sbatch([f"--nodes={NODES + SPARE_NODES}", f"--output={self.output}",
                                f"--chdir={slurm.tmp}", str(SCRIPT)], env)  # fmt: skip

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""

    def diagnose(self) -> str:
        return (
            f"job {self.slurm.job(self.id)}\n--- job output\n{self.text()[-6000:]}\n{self.slurm.diagnose()}"
        )

    def events(self) -> list[dict[str, Any]]:
        path = self.out / "events.jsonl"
        events = []
        for line in path.read_text().splitlines() if path.exists() else []:
            with contextlib.suppress(json.JSONDecodeError):  # the last line may be half written
                events.append(json.loads(line))
        return events

    def wait_end(self, timeout: float) -> dict[str, str]:
        """``scontrol show job``'s fields once the batch script has exited (COMPLETING included: a
        dead node holds the job there until slurmctld declares it down)."""

        def ended() -> dict[str, str]:
            info = self.slurm.job(self.id)
            return info if info.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING") else {}

        return _wait(f"the end of job {self.id}", ended, timeout, self.diagnose)


def _digest(text: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.startswith("final state sha256:"))
    return line.split(":", 1)[1].strip()


def test_the_job_exits_with_the_coordinators_status(slurm: SlurmCluster) -> None:
    """A coordinator that refuses its input (rank 7 of 2) ends the job at once with its exit
    status, 2, and its one line in the job's output; no agent was started, no secret is left."""
    job = Job(slurm, "refused", "--fault kill:rank=7@step=3 --quiet")
    info = job.wait_end(180)
    text = job.text()
    assert info["ExitCode"] == "2:0", job.diagnose()
    assert "train.sbatch: the coordinator did not start (exit 2)" in text, text
    assert "rank 7 is out of range" in text, text
    assert not (job.out / "logs").exists()  # each agent makes its host's folder there first
    assert not (Path(f"{job.out}.job") / "secret").exists()


def test_a_dead_slurm_node_is_replaced_by_a_spare_node_bitwise(slurm: SlurmCluster) -> None:
    job = Job(slurm, "out", f"--hang-timeout {HANG} --quiet")

    def training() -> list[dict[str, Any]]:
        events = job.events()
        done = [e for e in unpacked(events) if e["kind"] == "step_committed"]  # a host's come packed
        return events if any(e.get("step", 0) >= 2 for e in done) else []

    events = _wait("training under way (steps committed)", training, 300, job.diagnose)
    batch_host = slurm.job(job.id).get("BatchHost", "")
    joined = {e["host"]: e for e in events if e["kind"] == "host_joined"}
    assert sorted(joined) == sorted(slurm.names), joined
    # a worker node that is not the coordinator's (the batch host: the one node a job cannot lose)
    victim = next(h for h, e in sorted(joined.items()) if not e.get("spare") and h != batch_host)
    spare_host = next(h for h, e in joined.items() if e.get("spare"))
    killed_at = max(e["step"] for e in unpacked(events) if e["kind"] == "step_committed")
    assert killed_at < STEPS - 5, f"training went too fast to kill a node in the middle ({killed_at})"
    assert slurm.kill_node(victim) >= 3  # at least its slurmd, the step's slurmstepd, the agent

    info = job.wait_end(400)
    text = job.text()
    assert info["ExitCode"] == "0:0", job.diagnose()
    report = json.loads((job.out / "report.json").read_text())
    assert not report["error"], report["error"]
    assert report["final_state_sha256"] == _digest(text) != "None", text[-3000:]
    events = job.events()
    assert [e["host"] for e in events if e["kind"] == "host_lost"] == [victim], job.diagnose()
    assigned = [e for e in events if e["kind"] == "spare_assigned"]
    assert len(assigned) == NPROC, assigned
    assert (job.out / "logs" / spare_host / f"{assigned[0]['target']}.log").exists()  # on the spare node
    lost_ranks = [r for r in range(NODES * NPROC) if r // NPROC == joined[victim]["node"]]
    assert [f["ranks"] for f in report["faults"]] == [lost_ranks], report["faults"]
    assert not (Path(f"{job.out}.job") / "secret").exists()

    ref = _run(
        [*CLI, "demo", "--workers", str(NODES * NPROC), "--spares", "0", "--steps", str(STEPS), "--seed",
         str(SEED), "--global-batch", "16", "--fault", "none", "--quiet"],
        timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert report["final_state_sha256"] == _digest(ref.stderr), "the run through a node death differs"
