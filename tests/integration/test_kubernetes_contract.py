"""The pod contract of examples/kubernetes, run for real in network namespaces (no Kubernetes
control plane can run here): one namespace per pod, with its own address and hostname
``<job>-<index>`` and an /etc/hosts that resolves ``<job>-<index>.<service>`` as the headless
Service's DNS would; in each, ``entrypoint.sh`` with the environment job.yaml and config.yaml
give it (JOB_COMPLETION_INDEX as the Job controller sets it, the secret as a private file).

A worker pod is killed whole mid-run (every process in its namespace: a node lost); the spare
pod takes its ranks, pod 0 exits 0 with the final state of a fault-free run on one host, bit for
bit, while the other pods still linger (so the Job's success policy would hold); SIGTERM, as the
Job controller then sends, ends them with 0. Nothing is left behind: no process, namespace, or
/etc/netns file. Needs root; skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import yaml

from checkpointless.control.auth import new_secret
from checkpointless.launch.demo import DemoModel, worker_command
from checkpointless.launch.netns import Hosts
from checkpointless.observe.fields import unpacked

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"),
    reason="network namespaces need root, ip (iproute2) and unshare (util-linux)",
)

DIR = Path(__file__).resolve().parents[2] / "examples" / "kubernetes"
CLI = [sys.executable, "-m", "checkpointless"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS, SEED = 40, 11
KILL_AFTER_STEP = 4  # the worker pod dies once this step is committed
MARKER = "CHECKPOINTLESS_K8S_CONTRACT_TEST"  # in every pod's environment: finds what is left


def _manifests() -> tuple[str, str, dict[str, str]]:
    """(the Job's name, the Service's name, a pod's environment as job.yaml and config.yaml give it;
    a downward-API value as ``<fieldPath>``)."""
    docs = [d for p in sorted(DIR.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        (cm,) = [
            d
            for d in docs
            if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref["configMapRef"]["name"]
        ]
        env.update(cm["data"])
    for e in container.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else f"<{e['valueFrom']['fieldRef']['fieldPath']}>"
    return job["metadata"]["name"], svc["metadata"]["name"], env


def _digest(text: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.startswith("final state sha256:"))
    return line.split(":", 1)[1].strip()


def _our_processes(marker: str) -> list[int]:
    """Pids of the processes this test started (entrypoints, coordinator, agents, their processes:
    each inherits the marker in its environment)."""
    token = f"{MARKER}={marker}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                environ = (d / "environ").read_bytes()
            except OSError:
                continue
            if token in environ.split(b"\0"):
                pids.append(int(d.name))
    return pids


@pytest.fixture(scope="module")
def reference() -> str:
    """The same training on one host, fault-free: the digest the pods' job must end with."""
    _, _, env = _manifests()
    workers = int(env["CHECKPOINTLESS_NODES"]) * int(env["CHECKPOINTLESS_NPROC_PER_NODE"])
    ref = subprocess.run(
        [*CLI, "demo", "--workers", str(workers), "--spares", "0", "--steps", str(STEPS), "--seed", str(SEED),
         "--fault", "none", "--quiet"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    return _digest(ref.stderr)


class Pods:
    """One network namespace per pod of the Job, named as Kubernetes names them; ``start(i)`` runs
    entrypoint.sh as pod ``i``. Everything is removed on exit."""

    def __init__(self, tmp: Path) -> None:
        self.job, self.service, self.manifest_env = _manifests()
        self.nodes = int(self.manifest_env["CHECKPOINTLESS_NODES"])
        self.n = self.nodes + int(self.manifest_env["CHECKPOINTLESS_SPARE_NODES"])
        self.tmp = tmp
        self.net = Hosts(self.n)
        self.net.hostnames = [f"{self.job}-{i}" for i in range(self.n)]  # the Job controller's names
        self.etc = [Path("/etc/netns") / ns for ns in self.net.topology.namespaces]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, IO[bytes]] = {}
        self.secret = new_secret().hex() + "\n"

    def __enter__(self) -> Pods:
        self.net.__enter__()
        try:
            self._hosts_files()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _hosts_files(self) -> None:
        """What the kubelet and the cluster DNS give a pod of the headless Service: its own
        name, and every pod's ``<job>-<i>.<service>`` (the fully qualified name too)."""
        names = {
            i: [f"{h}.{self.service}", f"{h}.{self.service}.default.svc.cluster.local"]
            for i, h in enumerate(self.net.hostnames)
        }
        for i, etc in enumerate(self.etc):
            lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
            for j in range(self.n):
                own = [self.net.hostnames[j]] if j == i else []
                lines.append(" ".join([self.net.addr(j), *names[j], *own]))
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")

    def env(self, i: int) -> dict[str, str]:
        pod = self.tmp / f"pod{i}"
        pod.mkdir()
        secret = pod / "secret"
        secret.write_text(self.secret)
        # pod 0 and the workers: a root-owned 0600 file, read as it is; the spare: 0440, as with an
        # fsGroup, read through the entrypoint's private copy
        secret.chmod(0o440 if i >= self.nodes else 0o600)
        env = {k: v for k, v in self.manifest_env.items() if not v.startswith("<")}
        env |= {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "OMP_NUM_THREADS": "1",
            MARKER: str(self.tmp),
            "JOB_COMPLETION_INDEX": str(i),
            "CHECKPOINTLESS_SECRET_FILE": str(secret),
            "CHECKPOINTLESS_OUT": str(self.tmp / "out"),
            "CHECKPOINTLESS_LOG_DIR": str(pod / "logs"),
            "CHECKPOINTLESS_JOIN_TIMEOUT": "120",
            "CHECKPOINTLESS_COORDINATOR_ARGS": f"--steps {STEPS} --seed {SEED} --hang-timeout 2 --quiet",
        }
        if self.manifest_env.get("POD_IP") == "<status.podIP>" and i < self.nodes:
            env["POD_IP"] = self.net.addr(i)  # the spare pod goes without: its agent finds its address
        return env

    def start(self, i: int, command: list[str]) -> None:
        self.logs[i] = (self.tmp / f"pod{i}.log").open("wb")
        self.procs[i] = subprocess.Popen(
            self.net.argv(i, ["sh", str(DIR / "entrypoint.sh"), *command]),
            stdout=self.logs[i], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env(i),
            start_new_session=True,
        )  # fmt: skip

    def log(self, i: int) -> str:
        return (self.tmp / f"pod{i}.log").read_text(errors="replace")

    def kill(self, i: int) -> None:
        """The pod's node is lost: every process in its namespace, at once."""
        for pid in self.net.pids(i):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def __exit__(self, *exc: object) -> None:
        try:
            self.net.__exit__()  # kills every process left in the namespaces, removes them
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=30)
            for f in self.logs.values():
                f.close()
            for etc in self.etc:
                shutil.rmtree(etc, ignore_errors=True)


def _events(out: Path) -> Iterator[dict[str, Any]]:
    path = out / "events.jsonl"
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            yield json.loads(line)


def _secret_copies() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("checkpointless-secret.*")}


def _wait(what: str, done: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_pods_of_the_indexed_job_lose_a_worker_pod_and_end_bitwise_equal(
    tmp_path: Path, reference: str
) -> None:
    command = worker_command(DemoModel(steps=STEPS, seed=SEED, global_batch=16))
    copies_before = _secret_copies()
    with Pods(tmp_path) as pods:
        namespaces = set(pods.net.topology.namespaces)
        for i in range(pods.n):
            pods.start(i, command)
        out = tmp_path / "out"
        _wait(
            f"step {KILL_AFTER_STEP} to be committed",
            lambda: (
                any(
                    e["kind"] == "step_committed" and e["step"] >= KILL_AFTER_STEP
                    for e in unpacked(_events(out))
                )
                or pods.procs[0].poll() is not None
            ),
            300,
        )
        assert pods.procs[0].poll() is None, pods.log(0)[-3000:]
        pods.kill(1)  # worker pod 1's node is lost
        code0 = pods.procs[0].wait(timeout=300)
        # pod 0 (the coordinator) ended first: the spare pod still lingers, so a Job controller sees
        # index 0 succeed while a pod runs (the success policy holds, not "failed indexes")
        lingering = [i for i in range(2, pods.n) if pods.procs[i].poll() is None]
        for i in lingering:
            pods.procs[i].send_signal(signal.SIGTERM)  # what the controller then does
        n, lost = pods.n, pods.net.hostnames[1]
        codes = {i: pods.procs[i].wait(timeout=30) for i in range(1, n)}
        # every pod's processes ended by themselves (before the teardown kills what is left)
        _wait("every process of the pods to end", lambda: not _our_processes(str(tmp_path)), 30)
        logs = {i: pods.log(i) for i in range(pods.n)}
        addrs = {pods.net.hostnames[i]: pods.net.addr(i) for i in range(pods.n)}
        etc = list(pods.etc)
    assert code0 == 0, logs[0][-3000:]
    assert codes[1] == -signal.SIGKILL and all(codes[i] == 0 for i in range(2, n)), (codes, logs)
    assert lingering == list(range(2, n)), logs
    report = json.loads((out / "report.json").read_text())
    assert report["final_state_sha256"] == _digest(logs[0]) == reference != "None"
    events = list(_events(out))
    joined = {e["host"]: e["addr"] for e in events if e["kind"] == "host_joined"}
    assert joined == addrs  # each pod by its hostname, at its own address (the spare's found by route)
    assert [e["host"] for e in events if e["kind"] == "host_lost"] == [lost]
    assert {e["target"] for e in events if e["kind"] == "spare_assigned"}  # the spare pod took the ranks
    assert "spare host" in logs[n - 1] and "worker host 1" in logs[1]
    # nothing left: processes, namespaces, the fake DNS, the private copy of the secret
    assert _our_processes(str(tmp_path)) == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not namespaces & {line.split()[0] for line in listed.splitlines() if line.strip()}
    assert not any(p.exists() for p in etc)
    assert _secret_copies() == copies_before
