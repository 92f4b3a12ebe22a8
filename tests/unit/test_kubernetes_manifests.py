"""examples/kubernetes: every manifest valid against the published Kubernetes schemas (offline, with
``kubernetes-validate``), and the contract between the manifests and ``entrypoint.sh`` held: an
Indexed Job of N + S pods from the numbers the entrypoint reads, the headless Service that names
the pods, the secret as a private file only, the failure and success policies that keep the Job
alive when one pod (host) dies. The entrypoint itself runs here with a stand-in ``checkpointless``
that records its arguments (its real runs are tests/integration/test_kubernetes_contract.py)."""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.timeout(60)

DIR = Path(__file__).resolve().parents[2] / "examples" / "kubernetes"
ENTRYPOINT = DIR / "entrypoint.sh"
# 1.31: the oldest release where every field the Job uses is on by default (successPolicy and
# backoffLimitPerIndex beta, podFailurePolicy GA); 1.33: all of them GA
VERSIONS = ("1.31", "1.33")
FAIL_JOB_EXIT = 42  # entrypoint.sh: index 0's "the coordinator ended the job without success"


@functools.cache
def _docs() -> list[tuple[str, dict[str, Any]]]:
    """Every document of every manifest (parsed once: read only, a test that changes one copies it)."""
    return [
        (path.name, doc)
        for path in sorted(DIR.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in _docs() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''} in {DIR}, found {len(found)}"
    return found[0]


def _job() -> dict[str, Any]:
    return _one("Job")


def _pod() -> dict[str, Any]:
    spec: dict[str, Any] = _job()["spec"]["template"]["spec"]
    return spec


def _container() -> dict[str, Any]:
    containers = _pod()["containers"]
    assert len(containers) == 1
    c: dict[str, Any] = containers[0]
    return c


def _config() -> dict[str, str]:
    """The ConfigMap the container takes its environment from (the job's sizes)."""
    refs = [e["configMapRef"]["name"] for e in _container().get("envFrom", []) if "configMapRef" in e]
    assert len(refs) == 1, refs
    data: dict[str, str] = _one("ConfigMap", refs[0])["data"]
    return data


def _env() -> dict[str, str]:
    """Every variable a pod's container is given: the ConfigMap's, then the literal ones; a value
    from the downward API as ``<fieldPath>``."""
    env = dict(_config())
    for e in _container().get("env", []):
        env[e["name"]] = e["value"] if "value" in e else f"<{e['valueFrom']['fieldRef']['fieldPath']}>"
    return env


def _volume(name: str) -> dict[str, Any]:
    (v,) = [v for v in _pod()["volumes"] if v["name"] == name]
    return v


def _mount_of(volume: str) -> dict[str, Any]:
    (m,) = [m for m in _container()["volumeMounts"] if m["name"] == volume]
    return m


# -- the schemas ----------------------------------------------------------------------------
def test_the_example_has_the_resources_of_one_job() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for _, d in _docs())
    assert kinds == [
        ("ConfigMap", "ckpt-config"),
        ("ConfigMap", "ckpt-entrypoint"),
        ("Job", "ckpt"),
        ("Secret", "ckpt-secret"),
        ("Service", "ckpt"),
    ]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_against_the_published_schemas(version: str) -> None:
    for name, doc in _docs():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(
                f"{name}: {doc['kind']} invalid for Kubernetes {version}: {e.message} at {list(e.path)}"
            )


def test_the_validation_is_strict_enough_to_catch_a_misspelt_field_or_an_old_release() -> None:
    """A negative control: the schema check above would see a typo, and a release without the
    Job's fields."""
    job = copy.deepcopy(_job())
    job["spec"]["template"]["spec"]["subDomain"] = job["spec"]["template"]["spec"].pop("subdomain")
    with pytest.raises(kubernetes_validate.ValidationError, match="subDomain"):
        kubernetes_validate.validate(job, VERSIONS[0], strict=True)
    with pytest.raises(kubernetes_validate.ValidationError, match="successPolicy"):
        kubernetes_validate.validate(_job(), "1.29", strict=True)  # successPolicy came in 1.30


# -- the contract ---------------------------------------------------------------------------
def test_the_job_is_indexed_with_one_pod_per_host_from_the_numbers_the_entrypoint_reads() -> None:
    spec, env = _job()["spec"], _env()
    nodes, spares = int(env["CHECKPOINTLESS_NODES"]), int(env["CHECKPOINTLESS_SPARE_NODES"])
    assert nodes >= 1 and spares >= 1 and int(env["CHECKPOINTLESS_NPROC_PER_NODE"]) >= 1
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nodes + spares
    assert spec["maxFailedIndexes"] == spares  # each lost host uses up one spare host
    text = ENTRYPOINT.read_text()
    for name in ("CHECKPOINTLESS_NODES", "CHECKPOINTLESS_SPARE_NODES", "JOB_COMPLETION_INDEX"):
        assert f"\nneed {name} " in text  # the entrypoint reads (and requires) the same numbers


def test_one_failed_pod_fails_its_index_only_and_the_coordinators_failure_fails_the_job() -> None:
    spec, pod = _job()["spec"], _pod()
    assert pod["restartPolicy"] == "Never"  # a dead host stays dead (podFailurePolicy requires it)
    assert spec["backoffLimitPerIndex"] == 0  # a new agent could not join the running job
    assert spec.get("podReplacementPolicy", "Failed") == "Failed"
    assert "backoffLimit" not in spec  # with backoffLimitPerIndex it defaults to "unlimited"
    name = _container()["name"]
    rules = spec["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["FailJob", "FailIndex"]
    assert rules[0]["onExitCodes"] == {"containerName": name, "operator": "In", "values": [FAIL_JOB_EXIT]}
    assert rules[1]["onExitCodes"] == {"containerName": name, "operator": "NotIn", "values": [FAIL_JOB_EXIT]}
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}  # pod 0's coordinator
    # the entrypoint: 42 only from index 0 (the coordinator's verdict); another index never exits 42
    text = ENTRYPOINT.read_text()
    assert text.count(f"exit {FAIL_JOB_EXIT}") == 1
    assert f'[ "$code" -ne {FAIL_JOB_EXIT} ] || code=1' in text


def test_the_pods_are_named_through_the_headless_service_and_the_coordinator_is_pod_0() -> None:
    job, svc, pod, env = _job(), _one("Service"), _pod(), _env()
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True  # names resolve while the pods start
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert env["CHECKPOINTLESS_COORDINATOR_HOST"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    port = int(env["CHECKPOINTLESS_PORT"])
    assert [p["port"] for p in svc["spec"]["ports"]] == [port]
    assert [p["containerPort"] for p in _container()["ports"]] == [port]
    assert env["POD_IP"] == "<status.podIP>"  # the coordinator binds to it, the processes too


def test_the_secret_reaches_the_pods_as_a_private_file_and_never_as_env_or_args() -> None:
    secret, c, env = _one("Secret"), _container(), _env()
    vol = _volume("secret")["secret"]
    assert vol["secretName"] == secret["metadata"]["name"]
    assert vol["defaultMode"] in (0o400, 0o600)
    assert all(item.get("mode", vol["defaultMode"]) in (0o400, 0o600) for item in vol.get("items", []))
    mount = _mount_of("secret")
    assert mount["readOnly"] is True
    (item,) = vol["items"]
    assert item["key"] in secret.get("stringData", {}) | secret.get("data", {})
    assert env["CHECKPOINTLESS_SECRET_FILE"] == f"{mount['mountPath']}/{item['path']}"
    assert not any("secretRef" in e for e in c.get("envFrom", []))
    assert not any("secretKeyRef" in e.get("valueFrom", {}) for e in c.get("env", []))
    for value in (secret.get("stringData") or {}).values():
        words = [*c["command"], *c["args"], *env.values()]
        assert not any(value in w for w in words)
    assert "securityContext" not in _pod() or "fsGroup" not in _pod()["securityContext"]  # fsGroup: mode 0440


def test_the_entrypoint_configmap_is_entrypoint_sh_and_the_container_runs_it() -> None:
    data = _one("ConfigMap", _volume("entrypoint")["configMap"]["name"])["data"]
    assert data["entrypoint.sh"] == ENTRYPOINT.read_text(), (
        "entrypoint-configmap.yaml differs from entrypoint.sh: copy entrypoint.sh into it "
        "(indented four spaces under `entrypoint.sh: |`)"
    )
    assert _container()["command"] == ["/bin/sh", f"{_mount_of('entrypoint')['mountPath']}/entrypoint.sh"]
    assert _container()["args"]  # the training command


def test_every_variable_the_entrypoint_requires_is_set_and_every_one_set_is_read() -> None:
    text, env = ENTRYPOINT.read_text(), _env()
    required = set(re.findall(r"^need (\w+) ", text, re.MULTILINE))
    assert "JOB_COMPLETION_INDEX" in required
    missing = required - set(env) - {"JOB_COMPLETION_INDEX"}  # Kubernetes sets that one
    assert not missing, f"job.yaml/config.yaml do not set {sorted(missing)}"
    unread = [name for name in env if name not in text]
    assert not unread, f"set but never read by entrypoint.sh: {unread}"


# -- the entrypoint, with a stand-in for checkpointless -------------------------------------
FAKE = """#!/bin/sh
# records its arguments and the mode of the secret file it was given, then exits as told
log="$FAKE_LOG/$1.$$"
printf '%s\\n' "$@" >"$log"
prev=
for a in "$@"; do
    [ "$prev" = --secret-file ] && stat -L -c 'mode=%a' "$a" >>"$log" && cat "$a" >>"$log"
    prev=$a
done
[ "$1" = coordinator ] && exit "${FAKE_COORDINATOR_EXIT:-0}"
exit "${FAKE_AGENT_EXIT:-0}"
"""


def _entrypoint(
    tmp: Path, index: int, secret_mode: int = 0o600, **extra: str
) -> tuple[int, dict[str, list[str]]]:
    """Run entrypoint.sh as pod ``index`` with the manifests' environment; (its exit code, each
    stand-in call's arguments by command)."""
    bin_dir, log = tmp / "bin", tmp / f"log{index}"
    bin_dir.mkdir(exist_ok=True)
    log.mkdir()
    fake = bin_dir / "checkpointless"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    secret = tmp / f"secret{index}"
    secret.write_text("ab" * 32 + "\n")
    secret.chmod(secret_mode)
    env = {
        **{k: v for k, v in _env().items() if not v.startswith("<")},
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "JOB_COMPLETION_INDEX": str(index),
        "POD_IP": f"10.9.9.{10 + index}",
        "CHECKPOINTLESS_SECRET_FILE": str(secret),
        "CHECKPOINTLESS_OUT": str(tmp / "out"),
        "CHECKPOINTLESS_LINGER": "0",
        "FAKE_LOG": str(log),
        **extra,
    }
    run = subprocess.run(
        ["sh", str(ENTRYPOINT), "python", "train.py", "--lr", "3e-4"],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    calls = {p.name.split(".")[0]: p.read_text().splitlines() for p in log.iterdir()}
    return run.returncode, calls


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_entrypoint_is_posix_sh() -> None:
    for shell in ("sh", "dash", "bash"):
        if shutil.which(shell):
            subprocess.run([shell, "-n", str(ENTRYPOINT)], check=True, timeout=10)


def test_pod_0_runs_the_coordinator_and_a_worker_agent(tmp_path: Path) -> None:
    env = _env()
    code, calls = _entrypoint(tmp_path, 0)
    assert code == 0, calls
    coord, agent = calls["coordinator"], calls["agent"]
    assert _after(coord, "--nodes") == env["CHECKPOINTLESS_NODES"]
    assert _after(coord, "--spare-nodes") == env["CHECKPOINTLESS_SPARE_NODES"]
    assert _after(coord, "--nproc-per-node") == env["CHECKPOINTLESS_NPROC_PER_NODE"]
    assert _after(coord, "--bind") == "10.9.9.10" and _after(coord, "--port") == env["CHECKPOINTLESS_PORT"]
    assert _after(coord, "--out") == str(tmp_path / "out")
    assert coord[-len(env["CHECKPOINTLESS_COORDINATOR_ARGS"].split()) - 2 : -2] == (
        env["CHECKPOINTLESS_COORDINATOR_ARGS"].split()
    )  # the job's options, then the stand-in's record of the secret
    assert (
        _after(agent, "--coordinator")
        == f"{env['CHECKPOINTLESS_COORDINATOR_HOST']}:{env['CHECKPOINTLESS_PORT']}"
    )
    assert _after(agent, "--node-rank") == "0" and "--spare" not in agent
    assert _after(agent, "--addr") == "10.9.9.10"
    assert agent[agent.index("--") + 1 :][:4] == ["python", "train.py", "--lr", "3e-4"]
    assert _after(agent, "--secret-file") == str(tmp_path / "secret0")  # 0600, root's: as it is


def test_worker_and_spare_pods_run_an_agent_only(tmp_path: Path) -> None:
    nodes = int(_env()["CHECKPOINTLESS_NODES"])
    code, calls = _entrypoint(tmp_path, nodes - 1)
    assert code == 0 and set(calls) == {"agent"}
    assert _after(calls["agent"], "--node-rank") == str(nodes - 1)
    code, calls = _entrypoint(tmp_path, nodes)
    assert code == 0 and set(calls) == {"agent"}
    assert "--spare" in calls["agent"] and "--node-rank" not in calls["agent"]


@pytest.mark.skipif(os.geteuid() != 0, reason="a Secret volume's files are root's; so is this copy's check")
def test_a_secret_others_may_read_is_read_through_a_private_copy(tmp_path: Path) -> None:
    """With an fsGroup Kubernetes makes the secret group-readable (0440), which checkpointless
    refuses: the entrypoint gives it a private copy (0600) instead, removed at its exit."""
    code, calls = _entrypoint(tmp_path, 1, secret_mode=0o440)
    assert code == 0
    agent = calls["agent"]
    copy_path = Path(_after(agent, "--secret-file"))
    assert copy_path != tmp_path / "secret1" and "mode=600" in agent
    assert "ab" * 32 in agent  # the same secret
    assert not copy_path.exists() and not copy_path.parent.exists()


def test_pod_0_exits_42_when_the_coordinator_fails_and_other_pods_never_do(tmp_path: Path) -> None:
    code, _ = _entrypoint(tmp_path, 0, FAKE_COORDINATOR_EXIT="1")
    assert code == FAIL_JOB_EXIT  # the Job's podFailurePolicy: FailJob
    code, _ = _entrypoint(tmp_path, 1, FAKE_AGENT_EXIT="3")
    assert code == 3  # FailIndex: that host only
    code, _ = _entrypoint(tmp_path, 2, FAKE_AGENT_EXIT=str(FAIL_JOB_EXIT))
    assert code == 1


def test_an_index_beyond_the_job_or_a_missing_setting_is_refused_in_one_line(tmp_path: Path) -> None:
    env = _env()
    hosts = int(env["CHECKPOINTLESS_NODES"]) + int(env["CHECKPOINTLESS_SPARE_NODES"])
    code, calls = _entrypoint(tmp_path, hosts)
    assert code == 2 and calls == {}
    code, calls = _entrypoint(tmp_path, 1, CHECKPOINTLESS_PORT="")
    assert code == 2 and calls == {}


def test_the_secret_file_mode_is_what_the_product_accepts(tmp_path: Path) -> None:
    """The mode job.yaml gives the Secret's file passes checkpointless's own check."""
    from checkpointless.control.auth import read_secret_file

    f = tmp_path / "secret"
    f.write_text("cd" * 32 + "\n")
    f.chmod(_volume("secret")["secret"]["defaultMode"])
    assert read_secret_file(f) == bytes.fromhex("cd" * 32)
    assert stat.S_IMODE(f.stat().st_mode) & 0o077 == 0


def _children(pid: int) -> list[str]:
    """The command names of ``pid``'s children."""
    names = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    names.append((d / "comm").read_text().strip())
            except (OSError, IndexError, ValueError):
                continue
    return names


def test_a_pod_lingers_after_a_clean_end_and_sigterm_ends_it_with_0(tmp_path: Path) -> None:
    """After its agent ended cleanly a pod other than 0 waits (so that index 0's success is seen
    while it runs); the Job controller's SIGTERM then ends it at once, with its agent's 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "checkpointless").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "checkpointless").chmod(0o755)
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32 + "\n")
    secret.chmod(0o600)
    env = {
        **{k: v for k, v in _env().items() if not v.startswith("<")},
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "JOB_COMPLETION_INDEX": "1",
        "CHECKPOINTLESS_SECRET_FILE": str(secret),
        "CHECKPOINTLESS_LINGER": "60",
    }
    err = tmp_path / "err"
    with err.open("w") as f:
        pod = subprocess.Popen(["sh", str(ENTRYPOINT), "python", "train.py"], env=env, stderr=f)
    try:
        deadline = time.monotonic() + 20
        while "sleep" not in _children(pod.pid):
            assert time.monotonic() < deadline and pod.poll() is None, err.read_text()
            time.sleep(0.05)
        pod.send_signal(signal.SIGTERM)
        assert pod.wait(timeout=10) == 0, err.read_text()
    finally:
        if pod.poll() is None:
            pod.kill()
            pod.wait(timeout=10)
    assert "agent exited 0" in err.read_text() and "stopping" in err.read_text()
    assert "sleep" not in _children(os.getpid())
