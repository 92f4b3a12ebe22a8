"""Many hosts on one machine (``checkpointless cluster``): network namespaces, one agent each.

A host is killed whole (its agent and every process, as a power loss) and a spare host takes its
ranks; the result equals the fault-free run on one host bit for bit. Nothing is left behind: no
namespace, no bridge, no process. Needs root (network namespaces); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from checkpointless.cli.commands import main
from checkpointless.observe.fields import unpacked
from tests.jobs import COMMITTED, pids_whose_command

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
ATTACKS = (
    "plan",
    "latest",
    "abort",
    "stop",
    "assign",
    "done",
    "hb",
    "fail",
    "failcount",
    "fatal",
    "events",
    "pg",
)

CLI = [sys.executable, "-m", "checkpointless"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip() and line.startswith("cl")}


def _bridges() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ": clbr" in line}


def _digest(stderr: str) -> str:
    line = next(ln for ln in stderr.splitlines() if ln.startswith("final state sha256:"))
    return line.split(":", 1)[1].strip()


STEPS = ["--steps", "16", "--quiet", "--hang-timeout", "2"]


@pytest.fixture(scope="module")
def reference() -> str:
    """The same training on one host, fault-free: the digest every cluster run must end with."""
    ref = subprocess.run(
        [*CLI, "demo", "--workers", "4", "--spares", "0", "--fault", "none", *STEPS],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    return _digest(ref.stderr)


LARGER = ("--d-model", "256", "--layers", "4")  # steps long enough for a handoff to come first


@pytest.fixture(scope="module")
def reference_larger() -> str:
    """The fault-free digest of the demo with the ``LARGER`` model on one host."""
    ref = subprocess.run([*CLI, "demo", "--workers", "4", "--spares", "0", "--fault", "none", *STEPS, *LARGER],
                         capture_output=True, text=True, timeout=300, env=ENV)  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    return _digest(ref.stderr)


def _cluster(
    out: Path, *faults: str, model: tuple[str, ...] = (), spare_nodes: int = 1, flags: tuple[str, ...] = ()
) -> list[dict]:
    """``cluster`` (two hosts of two, ``spare_nodes`` spare hosts) running the demo through
    ``faults``, with ``model``'s sizes and the demo's other ``flags``: its events, once it ended with
    status 0 leaving no namespace or bridge behind."""
    before = (_netns(), _bridges())
    run = subprocess.run(
        [*CLI, "cluster", "--nodes", "2", "--nproc-per-node", "2", "--spare-nodes", str(spare_nodes), "demo",
         *STEPS, *model, *flags, *(a for f in faults for a in ("--fault", f)), "--out", str(out)],
        capture_output=True, text=True, timeout=400, env=ENV,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (_netns(), _bridges()) == before  # nothing left behind
    report = json.loads((out / "report.json").read_text())
    assert report["final_state_sha256"] == _digest(run.stderr)
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_a_lost_host_is_replaced_by_a_spare_host_bitwise(tmp_path: Path, reference: str) -> None:
    out = tmp_path / "cluster"
    events = _cluster(out, "kill:node=1@step=6")
    assert json.loads((out / "report.json").read_text())["final_state_sha256"] == reference != "None"
    joined = {e["host"]: e for e in events if e["kind"] == "host_joined"}
    assert sorted(joined) == ["host0", "host1", "host2"] and joined["host2"]["spare"]
    assert len({e["addr"] for e in joined.values()}) == 3  # each host its own address
    lost = [e for e in events if e["kind"] == "host_lost"]
    assert [e["host"] for e in lost] == ["host1"]
    fired = [e for e in events if e["kind"] == "fault_injected"]
    assert len(fired) == 1 and fired[0]["rank"] in (2, 3) and fired[0]["ranks"] == [2, 3]
    # both of the lost host's ranks went to the spare host's processes, in one generation
    gens = [e for e in events if e["kind"] == "generation_started" and e["gen"] > 0]
    assert len(gens) == 1 and set(gens[0]["replaced"]) == {"2", "3"}
    assigned = {e["rank"]: e["target"] for e in events if e["kind"] == "spare_assigned"}
    assert sorted(assigned) == [2, 3] and set(assigned.values()) == {"s0", "s1"}
    assert (out / "logs" / "host2" / "s0.log").exists()  # the spare host's processes log on it
    # each of them took its state from a replica on a host that lives
    sources = {e["rank"]: e["src"] for e in events if e["kind"] == "transfer_begun"}
    assert sorted(sources) == [2, 3] and set(sources.values()) <= {0, 1}
    # one fault in the report, covering both ranks of the host
    report = json.loads((out / "report.json").read_text())
    assert [(f["kind"], f["injected"], f["ranks"]) for f in report["faults"]] == [("kill", True, [2, 3])]
    # each host's CPU and memory as its agent sampled them, and each rank's CPU share
    usage = [e for e in events if e["kind"] == "host_usage"]
    assert {"host0", "host2"} <= {e["host"] for e in usage} and any(e.get("ranks") for e in usage)
    assert report["hosts"]["host0"]["samples"] >= 1 and report["hosts"]["host0"]["mem_used_bytes_max"] > 0


@pytest.mark.timeout(600)
def test_a_partitioned_host_fences_itself_and_nothing_of_it_is_accepted(
    tmp_path: Path, reference: str
) -> None:
    """Host 1 cut off the network inside step 6 for 3 s, its processes alive: they stop by their
    lease (exit 3) before the coordinator gives their ranks to the spare host (the host may be lost
    and rejoin as a spare host, or not: it comes back near the answer window's end); none of them
    commits a step or writes anything accepted after the cut, also once the link is back; the
    final state equals the fault-free run."""
    out = tmp_path / "cluster"
    events = _cluster(out, "partition:node=1@step=6,for=3")
    assert json.loads((out / "report.json").read_text())["final_state_sha256"] == reference != "None"
    fired = [e for e in events if e["kind"] == "fault_injected"]
    assert len(fired) == 1 and fired[0]["fault"] == "partition" and fired[0]["ranks"] == [2, 3]
    t_cut = fired[0]["t"]
    exits = {
        e["target"]: e["exitcode"]
        for e in events
        if e["kind"] == "process_exited" and e["target"] in ("w2", "w3")
    }
    # each gave up its rank on its own lease: its exit code when its agent reported it before the
    # host was lost, else (the host lost first, its agent back later) its log says so
    assert set(exits) == {"w2", "w3"} and set(exits.values()) <= {3, None}, exits
    for name in ("w2", "w3"):
        assert "no answer from the control store" in (out / "logs" / "host1" / f"{name}.log").read_text()
    # (a host's commits come packed, one event per step: ``unpacked`` gives each rank's)
    # 0 stale commits, 0 accepted writes of the cut-off processes. What one of them saw of the cut
    # generation's collective (its neighbour's socket closing as that one gave up its rank) may
    # reach the log through its host's relay once the link is back: an observation, nothing more.
    after = [e for e in unpacked(events) if e.get("proc") in ("w2", "w3") and e["t"] > t_cut + 0.5]
    stale = [e for e in after if not (e["kind"] == "fault_detected" and e["gen"] == 0)]
    assert stale == [], stale
    assert not [
        e
        for e in unpacked(events)
        if e["kind"] == "step_committed" and e["proc"] in ("w2", "w3") and e["step"] >= 6
    ]
    replaced = [e for e in events if e["kind"] == "generation_started" and e["gen"] > 0]
    assert len(replaced) == 1 and set(replaced[0]["replaced"]) == {"2", "3"}
    logs = out / "logs" / "host1"
    assert "no answer from the control store" in (logs / "w2.log").read_text()


@pytest.mark.timeout(600)
def test_a_spare_host_cut_off_while_it_receives_its_state_holds_its_sources_no_longer_than_a_detection(
    tmp_path: Path,
) -> None:
    """Host 1 loses power at step 6; the spare host, cut off for 3 s once the first piece of ranks 2
    and 3's state has reached it, the rest on the wire (``partition:spare@recovery``; 38 MB a rank),
    no longer holds the survivors sending to it for gloo's whole timeout (58 s before a transfer's
    wait gave up on the generation's abort): the coordinator aborts the generation, the sources
    leave their transfers at once, and the host's next spares take the ranks. Final state equal to
    the fault-free run."""
    model = ("--d-model", "256", "--layers", "4")  # pieces still on the wire when the link goes down
    ref = subprocess.run([*CLI, "demo", "--workers", "4", "--spares", "0", "--fault", "none", *STEPS, *model],
                         capture_output=True, text=True, timeout=300, env=ENV)  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "cluster"
    events = _cluster(out, "kill:node=1@step=6", "partition:spare@recovery,for=3", model=model)
    assert (
        json.loads((out / "report.json").read_text())["final_state_sha256"] == _digest(ref.stderr) != "None"
    )
    (cut,) = [e for e in events if e["kind"] == "fault_injected" and e["fault"] == "partition"]
    assert cut["target"] == "recovery" and cut["proc"] in ("s0", "s1") and cut["gen"] == 1, cut
    # the sources gave up their transfers once the coordinator aborted generation 1
    detected = min(e["t"] for e in events if e["kind"] == "fault_detected" and e["gen"] == 1
                   and e["proc"] == "coordinator")  # fmt: skip
    left = [
        e for e in events if e["kind"] == "fault_detected" and e["gen"] == 1 and e["proc"] in ("w0", "w1")
    ]
    assert {e["proc"] for e in left} == {"w0", "w1"}, left
    assert max(e["t"] for e in left) - detected < 2.0, (detected, left)
    done = [e for e in events if e["kind"] == "recovery_done"]
    assert done and done[-1]["gen"] >= 2, done
    assert done[-1]["seconds"] < 5.0 and done[-1]["t"] - cut["t"] < 15.0, (cut, done)
    report = json.loads((out / "report.json").read_text())
    assert all(f["lost_steps"] == 0 for f in report["faults"]), report["faults"]


@pytest.mark.timeout(900)
def test_a_host_back_from_a_partition_rejoins_as_a_spare_host_and_takes_the_next_lost_host(
    tmp_path: Path,
) -> None:
    """Host 1 cut off for 7 s: its agent fences it (its processes stop) and the coordinator loses it
    (a spare host takes ranks 2 and 3); once the link is back its agent answers the reset order and
    the host rejoins as a spare host (``agent --rejoin-window``, which ``cluster`` sets). Host 0 then
    loses power: its ranks go to the rejoined host's new spares, and the final state equals the
    fault-free run."""
    steps = ["--steps", "300", "--quiet", "--hang-timeout", "2"]
    ref = subprocess.run(
        [*CLI, "demo", "--workers", "4", "--spares", "0", "--fault", "none", *steps],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "cluster"
    run = subprocess.run(
        [*CLI, "cluster", "--nodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", "demo", *steps,
         "--fault", "partition:node=1@step=10,for=7", "--fault", "kill:node=0@step=250", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert _digest(run.stderr) == _digest(ref.stderr) != "None"
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    kinds = [(e["kind"], e.get("host")) for e in events if e["kind"] in ("host_lost", "host_rejoined")]
    assert kinds == [("host_lost", "host1"), ("host_rejoined", "host1"), ("host_lost", "host0")], kinds
    last = [e for e in events if e["kind"] == "generation_started"][-1]
    for rank in ("0", "1"):  # host 0's ranks: on the rejoined host (its processes' logs are there)
        assert (out / "logs" / "host1" / f"{last['members'][rank]}.log").exists(), last
    assert "this host was lost to the job" in (out / "logs" / "host1" / "agent.log").read_text()


@pytest.mark.timeout(900)
def test_a_spare_per_node_keeps_a_process_fault_on_its_host(tmp_path: Path) -> None:
    """``--spares-per-node 1``, one rank per host: a killed process is replaced by its own host's
    spare (the host lives), a host killed whole by the spare host; each host that used its spare
    gets a new one; the final state equals the fault-free run."""
    out = tmp_path / "cluster"
    run = subprocess.run(
        [*CLI, "cluster", "--nodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1", "--spares-per-node",
         "1", "demo", "--steps", "20", "--quiet", "--fault", "kill:rank=1@step=9", "--fault", "kill:node=0@step=14",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    ref = subprocess.run(
        [*CLI, "demo", "--workers", "2", "--spares", "0", "--steps", "20", "--fault", "none", "--quiet",
         "--hang-timeout", "10"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert _digest(run.stderr) == _digest(ref.stderr) != "None"
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    logs = {
        p.parent.name: {q.stem for q in p.parent.glob("*.log")} for p in (out / "logs").glob("*/agent.log")
    }
    host_of = {proc: host for host, procs in logs.items() for proc in procs}
    assigned = [(e["rank"], e["target"]) for e in events if e["kind"] == "spare_assigned"]
    assert len(assigned) == 2, assigned
    # rank 1's own host's spare, if it was ready when the plan was made (spares start with the job
    # and take seconds to import torch: on a loaded machine the first fault can come first; the
    # spare host's, which was ready, then takes it)
    plan_t = next(e["t"] for e in events if e["kind"] == "generation_started" and e.get("gen") == 1)
    ready = {e["proc"]: e["t"] for e in events if e["kind"] == "spare_ready"}
    # (the readiness event is stamped by the spare, the coordinator learns it from a heartbeat: a
    # spare ready less than 0.5 s before the plan may or may not have been seen, either is right)
    own = [t for p, t in ready.items() if host_of.get(p) == "host1"]
    if any(t < plan_t - 0.5 for t in own):
        assert host_of[assigned[0][1]] == "host1", (assigned, ready, plan_t)
        assert host_of[assigned[1][1]] == "host2"  # host 0 lost whole: the spare host
    elif any(t < plan_t for t in own):
        assert host_of[assigned[0][1]] in ("host1", "host2"), (assigned, ready, plan_t)
        assert host_of[assigned[1][1]] in ("host1", "host2")
    else:  # the spare host's spare went to rank 1; host 0's rank then goes to any live host's spare
        assert host_of[assigned[0][1]] == "host2", (assigned, ready, plan_t)
        assert host_of[assigned[1][1]] in ("host1", "host2")
    assert [e["host"] for e in events if e["kind"] == "host_lost"] == ["host0"]


@pytest.mark.timeout(900)
def test_a_lost_host_of_a_sharded_job_is_replaced_bitwise(tmp_path: Path) -> None:
    """HSDP across hosts, the natural layout: shards within a host, replicas across hosts. Host 1
    (one copy of every shard) is killed whole; the spare host's ranks receive each its shard from
    host 0's copy; the final state equals the fault-free run on one host. Also: ``cluster launch``
    puts its own options before the script's ``--`` (the script gets only its own)."""
    example = str(Path(__file__).resolve().parents[2] / "examples" / "sharded_loop.py")
    job = ["--shards", "2", "--steps", "14", "--quiet"]
    ref = subprocess.run(
        [*CLI, "launch", "--workers", "4", "--spares", "0", *job, "--fault", "none", "--hang-timeout", "10",
         "--", "python", example,
         "--steps", "14"],
        capture_output=True, text=True, timeout=400, env=ENV,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "cluster"
    before = (_netns(), _bridges())
    run = subprocess.run(
        [*CLI, "cluster", "--nodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", "launch", *job,
         "--fault", "kill:node=1@step=7", "--out", str(out), "--", "python", example, "--steps", "14"],
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (_netns(), _bridges()) == before
    assert _digest(run.stderr) == _digest(ref.stderr) != "None"
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    replaced = [e for e in events if e["kind"] == "generation_started" and e["gen"] > 0]
    assert len(replaced) == 1 and set(replaced[0]["replaced"]) == {"2", "3"}, replaced
    hosts = {e["host"]: e["node"] for e in events if e["kind"] == "host_joined"}
    # one stream per lost rank, each from host 0's rank holding the same shard (the other copy)
    received = {e["rank"]: e["src"] for e in events if e["kind"] == "transfer_begun"}
    assert received == {2: 0, 3: 1}, received
    assert len(hosts) == 3


@pytest.mark.timeout(900)
def test_a_lost_host_of_an_elastic_sharded_job_takes_its_replica_out_and_the_run_stays_the_same(
    tmp_path: Path,
) -> None:
    """HSDP across hosts with ``--min-workers 2`` and no spare host: host 1 (one replica, both
    shards) is killed; host 0's replica computes both replicas' shares; every step's loss is the
    fault-free run's on one host to rounding."""
    example = str(Path(__file__).resolve().parents[2] / "examples" / "sharded_loop.py")
    job = ["--shards", "2", "--steps", "14", "--quiet"]
    ref = subprocess.run(
        [*CLI, "launch", "--workers", "4", "--spares", "0", *job, "--out", str(tmp_path / "ref"), "--", "python",
         example, "--steps", "14"],
        capture_output=True, text=True, timeout=400, env=ENV,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "cluster"
    before = (_netns(), _bridges())
    run = subprocess.run(
        [*CLI, "cluster", "--nodes", "2", "--nproc-per-node", "2", "--spare-nodes", "0", "launch", *job,
         "--min-workers", "2", "--fault", "kill:node=1@step=7", "--out", str(out), "--", "python", example,
         "--steps", "14"],
        capture_output=True, text=True, timeout=600, env=ENV,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (_netns(), _bridges()) == before
    report = json.loads((out / "report.json").read_text())
    free = json.loads((tmp_path / "ref" / "report.json").read_text())["loss_by_step"]
    sizes = [report["replicas_by_step"][s] for s in sorted(report["replicas_by_step"], key=int)]
    assert sizes == [2] * 7 + [1] * 7, sizes
    assert [(f["spec"], f["lost_steps"]) for f in report["faults"]] == [("kill:node=1@step=7", 0)]
    got = report["loss_by_step"]
    assert sorted(got, key=int) == sorted(free, key=int)
    assert max(abs(got[k] - free[k]) / abs(free[k]) for k in free) < 1e-4


@pytest.mark.timeout(900)
# the stranger through a recovery, and beside a job that loses nothing (both e2e: tests/e2e.txt)
@pytest.mark.parametrize("fault", ["kill:node=1@step=30", "none"])
def test_a_stranger_on_a_hosts_network_cannot_steer_the_job(tmp_path: Path, fault: str) -> None:
    """A process in the spare host's namespace without the job's secret (a process of another job,
    or an intruder on the cluster's network) reaches the coordinator's store on the hosts' network
    and forges every key of the protocol, the agents' as well (hellos, statuses, orders), sealed
    with its own secret or not at all; it also lists the store's keys and writes the abort of every
    generation and the job's stop under the job's own namespace. All along a job that loses host 1,
    or loses nothing: the job ends as it would have, bitwise, only host 1 is lost (or none), the
    stranger cannot join a process group, and what it wrote is counted as rejected. The store
    listens on the hosts' bridge only."""
    import socket
    import time

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "cluster"
    before = _netns()
    err = (tmp_path / "cluster.err").open("w")
    job = subprocess.Popen(
        [*CLI, "cluster", "--nodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", "demo", "--steps", "80",
         "--quiet", "--hang-timeout", "2", "--port", str(port), "--fault", fault, "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=err, env=ENV,
    )  # fmt: skip
    stranger = None
    try:
        events = out / "events.jsonl"
        deadline = time.monotonic() + 300
        # started as soon as a host has joined: its own start (importing torch) overlaps the job's
        while '"host_joined"' not in (events.read_text() if events.exists() else ""):
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "cluster.err").read_text()
            time.sleep(0.05)
        joined = [json.loads(line) for line in events.read_text().splitlines() if '"host_joined"' in line]
        bridge = joined[0]["addr"].rsplit(".", 1)[0] + ".1"
        spare_ns = next(n for n in _netns() - before if n.endswith("h2"))
        # not on loopback: the store binds to the bridge only
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex(("127.0.0.1", port)) != 0
        status = tmp_path / "stranger.json"
        stranger = subprocess.Popen(
            ["ip", "netns", "exec", spare_ns, sys.executable, str(scripts / "adv_stranger.py"), bridge, str(port),
             str(status), "120", ",".join([*ATTACKS, "agent", "list"])],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "stranger.err").open("w"), env=ENV,
        )  # fmt: skip
        job.wait(timeout=600)
    finally:
        for p in (job, stranger):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        err.close()
    text = (tmp_path / "cluster.err").read_text()
    assert job.returncode == 0, text[-3000:]
    ref = subprocess.run(
        [*CLI, "demo", "--workers", "4", "--spares", "0", "--fault", "none", "--steps", "80", "--quiet",
         "--hang-timeout", "10"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert _digest(text) == _digest(ref.stderr) != "None"
    attack = json.loads(status.read_text())
    events_ = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    # it attacked while the job trained, until training was over (the cluster's end kills it)
    last_commit = max(e["t"] for e in unpacked(events_) if e["kind"] == "step_committed")
    assert attack["rounds"] >= 5 and attack["last_t"] > last_commit, (attack, last_commit)
    assert not any(r["joined"] for r in attack["pg"]), attack["pg"]
    report = json.loads((out / "report.json").read_text())
    assert report["rejected_messages"]["count"] > 0, report["rejected_messages"]
    # and named on the console as messages from outside the job
    said = " ".join(text.split())
    assert (
        f"ignored {report['rejected_messages']['count']} control message(s) not sealed with this job's "
        "secret (someone else writes to the job's store)"
    ) in said, text[-3000:]
    assert [e["host"] for e in events_ if e["kind"] == "host_lost"] == (["host1"] if fault != "none" else [])
    if fault == "none":
        assert report["generations"] == 0, report["generations"]
        assert {"gen/0/abort", "job/stop"} & set(report["rejected_messages"]["keys"]), report[
            "rejected_messages"
        ]
    assert _netns() == before


def _hosts_of(pid: int) -> tuple[set[str], set[str]]:
    """The namespaces and bridge of the ``cluster`` command ``pid`` (named after it, ``netns.py``):
    another job's may come and go meanwhile."""
    tag = f"{pid % 100000:05d}"
    return {n for n in _netns() if n.startswith(f"cl{tag}h")}, {b for b in _bridges() if b == f"clbr{tag}"}


def _reaper_of(pid: int) -> list[int]:
    """The reaper of the ``cluster`` command ``pid`` (its argument names the command's bridge), while
    it runs: once it has exited, everything it removes is gone."""
    bridge = f'"clbr{pid % 100000:05d}"'
    return pids_whose_command(lambda cmd: "checkpointless.launch.netns" in cmd and bridge in cmd)


def _demo_pids(seed: int) -> list[int]:
    """Pids of this test's processes (their command lines carry its seed), agents included."""
    token = f'"seed": {seed},'
    return pids_whose_command(lambda cmd: token in cmd)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("signum", "keep"), [("SIGKILL", True), ("SIGINT", True), ("SIGKILL", False)],
    ids=["SIGKILL", "SIGINT", "SIGKILL-without-out"],
)  # fmt: skip
def test_killing_the_cluster_command_leaves_nothing_behind(tmp_path: Path, signum: str, keep: bool) -> None:
    """SIGKILL (or Ctrl-C) of ``checkpointless cluster`` mid-training: every agent and process on
    every host ends (the agents fence on their lease once the coordinator is gone), every network
    namespace and the bridge are removed (the reaper), and no shared-memory file is left; the
    events up to then are on disk. The job's secret file, its folder and the run folder's control
    file (there, 0600, while the job ran) are removed too. Without ``--out`` (killed as soon as its
    workers are started), the hosts' logs and the launcher's own log folder in the temp directory
    are removed as well."""
    import signal
    import stat
    import time

    seed = 4242 + (signum == "SIGINT") + 2 * (not keep)
    shm_before = set(os.listdir("/dev/shm"))
    out = tmp_path / "cluster"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    job = subprocess.Popen(
        [*CLI, "cluster", "--nodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1", "demo", "--steps",
         "100000", "--seed", str(seed), "--quiet", *(["--out", str(out)] if keep else [])],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "err").open("w"), env={**ENV, "TMPDIR": str(tmp)},
    )  # fmt: skip
    try:
        events = out / "events.jsonl"
        deadline = time.monotonic() + 300

        def started() -> bool:
            if keep:
                return bool(COMMITTED.search(events.read_text() if events.exists() else ""))
            return len(list(tmp.glob("checkpointless-cluster-*/logs/host*/w*.log"))) == 2  # both workers

        while not started():
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()[-3000:]
            time.sleep(0.2)
        assert len(_demo_pids(seed)) >= 3  # an agent per host, the workers, the spare
        assert _hosts_of(job.pid)[0], "the hosts are not named after the command's pid"
        (secret_dir,) = [d for d in tmp.iterdir() if d.name.startswith("checkpointless-cluster-")]
        assert (secret_dir / "secret").exists()
        if keep:
            control = json.loads((out / "control.json").read_text())
            assert stat.S_IMODE((out / "control.json").stat().st_mode) == 0o600
            host, port = control["addr"].rsplit(":", 1)
            assert control["pid"] == job.pid and port.isdigit(), control
            assert host.startswith("10."), control  # the bridge
            assert control["token"] != (secret_dir / "secret").read_text().strip()
        else:  # the launcher's own log folder, named after its process
            assert len(list(tmp.glob(f"checkpointless-logs-{job.pid}-*"))) == 1, sorted(tmp.iterdir())
        job.send_signal(getattr(signal, signum))
        job.wait(timeout=120)
        deadline = time.monotonic() + 60  # the agents' lease (4 s here) and a margin
        while (
            _demo_pids(seed) or any(_hosts_of(job.pid)) or _reaper_of(job.pid)
        ) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=30)
    assert _demo_pids(seed) == []
    assert _hosts_of(job.pid) == (set(), set()) and _reaper_of(job.pid) == []
    assert not secret_dir.exists() and not (out / "control.json").exists(), sorted(tmp.rglob("*"))
    assert [d.name for d in tmp.iterdir() if d.name.startswith("checkpointless-")] == []
    assert {f for f in set(os.listdir("/dev/shm")) - shm_before if "checkpointless" in f} == set()
    assert not keep or COMMITTED.search((out / "events.jsonl").read_text())


@pytest.mark.timeout(60)
def test_cluster_refuses_bad_input_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from checkpointless.cli import main

    cases = {
        ("--nodes", "0"): "--nodes must be >= 1",
        ("--nodes", "40", "--spare-nodes", "30"): "at most 64 hosts",
        ("demo", "--fault", "kill:node=2@step=1"): "node 2 does not exist",
        ("demo", "--workers", "3"): "--workers follows from --nodes",
        ("--join-timeout", "nan"): "--join-timeout must be a finite number of seconds",
        ("--join-timeout", "0"): "--join-timeout must be > 0 seconds",
        ("--join-timeout", "-1"): "--join-timeout must be > 0 seconds",
    }
    before = (_netns(), _bridges())
    for args, words in cases.items():
        assert main(["cluster", *args]) == 2, args
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, (args, err)
    assert (_netns(), _bridges()) == before


@pytest.mark.timeout(60)
def test_agent_refuses_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from checkpointless.cli import main
    from checkpointless.control.auth import new_secret, write_secret_file

    secret = tmp_path / "secret"
    write_secret_file(secret, new_secret())
    open_file = tmp_path / "open"
    open_file.write_text(new_secret().hex())
    open_file.chmod(0o644)
    cases = {
        ("--coordinator", "127.0.0.1:1", "--secret-file", str(secret), "--join-timeout", "1"):
            "cannot reach the coordinator at 127.0.0.1:1",
        ("--coordinator", "127.0.0.1:1", "--secret-file", str(open_file)): "readable by others",
        ("--coordinator", "nowhere", "--secret-file", str(secret)): "expected HOST:PORT",
        ("--coordinator", "127.0.0.1:1", "--secret-file", str(secret)): "give the training command after --",
        ("--coordinator", "127.0.0.1:99999", "--secret-file", str(secret)): "a port from 1 to 65535",
    }  # fmt: skip
    coord = ("--coordinator", "127.0.0.1:1", "--secret-file", str(secret))
    for extra, words in {
        ("--join-timeout", "nan"): "--join-timeout must be a finite number of seconds",
        ("--join-timeout", "0"): "--join-timeout must be > 0 seconds",
        ("--join-timeout", "-1"): "--join-timeout must be > 0 seconds",
        ("--clock-skew", "nan"): "--clock-skew must be a finite number of seconds",
        ("--rejoin-window", "-1"): "--rejoin-window must be >= 0 seconds",
        ("--node-rank", "-3"): "--node-rank must be >= 0",
        ("--node-rank", "0", "--spare"): "a spare host has no node rank",
        ("--addr", "999.1.1.1"): "--addr '999.1.1.1' is not an IP address",
    }.items():
        cases[(*coord, *extra)] = words
    for args, words in cases.items():
        cmd = [] if "give the" in words else ["--", "true"]
        assert main(["agent", "--nproc-per-node", "1", *args, *cmd]) == 2, args
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, (args, err)


@pytest.mark.timeout(60)
def test_coordinator_refuses_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from checkpointless.cli import main
    from checkpointless.control.auth import new_secret, write_secret_file

    secret = tmp_path / "secret"
    write_secret_file(secret, new_secret())
    base = ["coordinator", "--nodes", "1", "--nproc-per-node", "1", "--secret-file", str(secret)]
    for extra, words in {
        ("--join-timeout", "nan"): "--join-timeout must be a finite number of seconds",
        ("--join-timeout", "-1"): "--join-timeout must be > 0 seconds",
        ("--join-timeout", "0"): "--join-timeout must be > 0 seconds, got 0",
        ("--bind", "999.1.1.1"): "--bind '999.1.1.1' is not an IP address",
        ("--nodes", "0"): "--nodes must be >= 1",
    }.items():
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, (extra, err)


@pytest.mark.timeout(60)
def test_an_agent_dialling_a_port_that_is_no_store_gives_up_at_its_join_timeout(tmp_path: Path) -> None:
    """A port that accepts connections and never answers (another service, a stalled process): c10d's
    handshake has no deadline, the agent's join timeout bounds it, and it says so in one line."""
    import socket
    import time

    from checkpointless.control.auth import new_secret, write_secret_file

    secret = tmp_path / "secret"
    write_secret_file(secret, new_secret())
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        t0 = time.monotonic()
        r = subprocess.run(
            [*CLI, "agent", "--coordinator", f"127.0.0.1:{silent.getsockname()[1]}", "--secret-file",
             str(secret), "--nproc-per-node", "1", "--join-timeout", "3", "--", "true"],
            capture_output=True, text=True, timeout=50, env=ENV,
        )  # fmt: skip
        took = time.monotonic() - t0
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert (
        r.returncode == 2
        and len(errors) == 1
        and "did not answer as a checkpointless coordinator" in errors[0]
    ), r.stderr
    assert took < 3 + 20, took  # the join timeout and the interpreter's start (torch's import)


@pytest.mark.timeout(120)
def test_an_agent_with_another_secret_is_told_so(tmp_path: Path) -> None:
    """A coordinator's hello is sealed with the job's secret: an agent with another one stops at once."""
    from checkpointless.control.auth import SignedStore, new_secret, write_secret_file
    from checkpointless.launch.launcher import open_store
    from checkpointless.protocol import keys

    store = open_store("127.0.0.1", 0)
    SignedStore(store, new_secret()).set(keys.CLUSTER_HELLO, "checkpointless")
    secret = tmp_path / "secret"
    write_secret_file(secret, new_secret())
    r = subprocess.run(
        [*CLI, "agent", "--coordinator", f"127.0.0.1:{store.port}", "--secret-file", str(secret),
         "--nproc-per-node", "1", "--join-timeout", "20", "--", "true"],
        capture_output=True, text=True, timeout=60, env=ENV,
    )  # fmt: skip
    assert r.returncode == 2 and "has another secret" in r.stderr, r.stderr


@pytest.mark.timeout(600)
def test_a_host_with_notice_is_drained_into_the_spare_host_with_no_lost_step(
    tmp_path: Path, reference_larger: str
) -> None:
    """``preempt:node=1@step=6,notice=60``: host 1's agent gets SIGTERM (what Kubernetes sends a
    pod, Slurm a step's tasks). It drains its host: both of its ranks hand their places to the spare
    host's processes in one handoff, they exit 0, and the agent leaves the job once none is left
    (no host lost, no fault detected). Final state equal to the fault-free run."""
    out = tmp_path / "cluster"
    events = _cluster(out, "preempt:node=1@step=6,notice=60", model=LARGER)
    report = json.loads((out / "report.json").read_text())
    assert report["final_state_sha256"] == reference_larger != "None"
    kinds = [e["kind"] for e in events]
    assert "host_drained" in kinds and "host_lost" not in kinds and "recovery_done" not in kinds, kinds
    handoffs = [e for e in events if e["kind"] == "handoff_started"]
    assert sorted(e["rank"] for e in handoffs) == [2, 3] and len({e["gen"] for e in handoffs}) == 1, handoffs
    assigned = {e["rank"]: e["target"] for e in events if e["kind"] == "spare_assigned"}
    assert sorted(assigned) == [2, 3] and set(assigned.values()) == {"s0", "s1"}
    assert report["steps_completed"] == 16 and all(f["lost_steps"] == 0 for f in report["faults"])
    assert [f["cause"] for f in report["faults"]] == [None], report["faults"]  # injected, nothing crashed


def _committed_step(events: Path) -> int:
    """The highest step any rank committed so far, from the streamed ``events.jsonl``."""
    parsed = []
    for line in (events.read_text() if events.exists() else "").splitlines():
        if COMMITTED.search(line):
            try:
                parsed.append(json.loads(line))
            except ValueError:  # a line being written
                pass
    return max((e["step"] for e in unpacked(parsed) if e.get("kind") == "step_committed"), default=-1)


class _RunningCluster:
    """``cluster ... demo`` with the ``LARGER`` model, fault-free, running in the background: what
    a test drives from outside while it trains."""

    def __init__(self, tmp_path: Path) -> None:
        self.out, self._err_path = tmp_path / "cluster", tmp_path / "cluster.err"
        self._err = self._err_path.open("w")
        self.job = subprocess.Popen(
            [*CLI, "cluster", "--nodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", "demo", *STEPS,
             *LARGER, "--fault", "none", "--out", str(self.out)],
            stdout=subprocess.DEVNULL, stderr=self._err, env=ENV,
        )  # fmt: skip
        self._deadline = time.monotonic() + 300

    def __enter__(self) -> _RunningCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.job.poll() is None:
            self.job.kill()
            self.job.wait(timeout=30)
        self._err.close()

    def wait_until(self, done: Callable[[], bool]) -> None:
        while not done():
            assert self.job.poll() is None and time.monotonic() < self._deadline, self._err_path.read_text()
            time.sleep(0.1)

    def drain(self, node: int) -> tuple[int, str, str]:
        """``checkpointless drain`` in this process (the command's start, a few seconds, would come
        after this short job's end; the command itself: ``tests/unit/test_drain.py``): its exit
        status, stdout and stderr."""
        said, error = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(error), contextlib.redirect_stdout(said):
            code = main(["drain", str(self.out), "--node", str(node)])
        return code, said.getvalue(), error.getvalue()

    def ended(self) -> list[dict]:
        """The job's events, once it ended with status 0."""
        assert self.job.wait(timeout=400) == 0, self._err_path.read_text()[-3000:]
        return [json.loads(line) for line in (self.out / "events.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["command", "notice-file"])
def test_a_drain_asked_from_outside_hands_the_host_over_with_no_lost_step(
    tmp_path: Path, reference_larger: str, how: str
) -> None:
    """``checkpointless drain RUN_DIR --node 1`` on a running job, or a notice handler creating host
    1's notice file (``agent --notice-file``; ``cluster`` gives each host one in its log folder):
    host 1 drains as on its agent's SIGTERM, both of its ranks handed to the spare host in one
    handoff, no host lost, no fault, no lost step; the final state equals the fault-free run. A
    second drain of the same host, and one of a node the job does not have, are refused in one line."""
    with _RunningCluster(tmp_path) as run:
        run.wait_until(lambda: _committed_step(run.out / "events.jsonl") >= 4)
        if how == "command":
            code, said, error = run.drain(1)
            assert code == 0 and "to drain node 1" in said, error
            refused = ((1, "is being drained already"), (7, "no node 7 in this job"))
        else:
            (run.out / "logs" / "host1" / "notice").touch()
            refused = ((7, "no node 7 in this job"),)
        for node, words in refused:
            code, _, error = run.drain(node)
            assert code == 2 and words in error and len(error.strip().splitlines()) == 1, error
        events = run.ended()
    report = json.loads((run.out / "report.json").read_text())
    assert report["final_state_sha256"] == reference_larger != "None"
    kinds = [e["kind"] for e in events]
    assert "host_drained" in kinds and "host_lost" not in kinds and "recovery_done" not in kinds, kinds
    assert ("drain_asked" in kinds) == (how == "command"), kinds
    handoffs = [e for e in events if e["kind"] == "handoff_started"]
    assert sorted(e["rank"] for e in handoffs) == [2, 3] and len({e["gen"] for e in handoffs}) == 1, handoffs
    assert report["steps_completed"] == 16 and all(f["lost_steps"] == 0 for f in report["faults"])


@pytest.mark.timeout(600)
def test_draining_the_spare_host_then_a_worker_host_with_no_spare_left_keeps_the_run(
    tmp_path: Path, reference_larger: str
) -> None:
    """The spare host drained (its spares end, it leaves the job), then host 1 asked to drain with
    no spare anywhere: its ranks have nowhere to go, so they train on (a notice with no successor
    is no fault) and the job ends as the fault-free run, with host 1 still in it."""
    with _RunningCluster(tmp_path) as run:
        run.wait_until(lambda: _committed_step(run.out / "events.jsonl") >= 2)
        assert run.drain(2)[0] == 0
        run.wait_until(lambda: '"host_drained"' in (run.out / "events.jsonl").read_text())
        assert run.drain(1)[0] == 0
        events = run.ended()
    report = json.loads((run.out / "report.json").read_text())
    assert report["final_state_sha256"] == reference_larger != "None"
    (end,) = [e["t"] for e in events if e["kind"] == "job_finished"]
    # host 1 kept its ranks until the end (then its processes were gone: drained, after the end)
    assert [e["host"] for e in events if e["kind"] == "host_drained" and e["t"] < end] == ["host2"]
    assert [e["node"] for e in events if e["kind"] == "drain_asked"] == [2, 1]
    kinds = [e["kind"] for e in events]
    assert "host_lost" not in kinds and "recovery_done" not in kinds and "handoff_started" not in kinds, kinds
    spares = {
        e["target"]: e["exitcode"] for e in events if e["kind"] == "process_exited" and e["role"] == "spare"
    }
    assert set(spares) == {"s0", "s1"} and set(spares.values()) <= {0, -15}, spares  # told to leave
    assert report["steps_completed"] == 16 and report["faults"] == []


def _demo_digest(*flags: str) -> str:
    """The fault-free digest of the demo on one host, four workers, with ``flags``."""
    ref = subprocess.run([*CLI, "demo", "--workers", "4", "--spares", "0", "--fault", "none", *STEPS, *flags],
                         capture_output=True, text=True, timeout=300, env=ENV)  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    return _digest(ref.stderr)


@pytest.mark.timeout(600)
def test_a_lost_host_with_no_spare_host_shrinks_the_job_by_a_host_and_it_stays_the_same_run(
    tmp_path: Path,
) -> None:
    """``--min-workers 2`` on two hosts of two and no spare host: host 1 loses power at step 6, the
    survivors on host 0 take its shares at once (4 -> 2 replicas, two shares each) and train on;
    with ``--exact-resize`` the final state equals the fault-free run at four, bit for bit."""
    flags = ("--exact-resize",)
    out = tmp_path / "cluster"
    events = _cluster(out, "kill:node=1@step=6", spare_nodes=0, flags=(*flags, "--min-workers", "2"))
    report = json.loads((out / "report.json").read_text())
    assert report["final_state_sha256"] == _demo_digest(*flags) != "None"
    resized = [(e["before"], e["replicas"], e["why"]) for e in events if e["kind"] == "resized"]
    assert resized == [(4, 2, "lost")], resized
    assert report["replicas_by_step"]["15"] == 2 and report["steps_completed"] == 16
    assert [f["lost_steps"] for f in report["faults"]] == [0], report["faults"]


@pytest.mark.timeout(600)
def test_never_wait_on_hosts_the_spare_host_catches_up_in_the_background_then_joins(tmp_path: Path) -> None:
    """``--never-wait`` on two hosts of two with a spare host: host 1 loses power at step 6; the
    survivors take its shares at once (no transfer to wait for) while the spare host's processes
    catch up from them across hosts (their progress reaches the coordinator through their host's
    relay), then join: back to four replicas, the state equal to the fault-free run bit for bit."""
    flags = ("--exact-resize",)
    out = tmp_path / "cluster"
    events = _cluster(
        out, "kill:node=1@step=6", model=LARGER, flags=(*flags, "--min-workers", "2", "--never-wait")
    )
    report = json.loads((out / "report.json").read_text())
    assert report["final_state_sha256"] == _demo_digest(*flags, *LARGER) != "None"
    resized = [(e["before"], e["replicas"], e["why"]) for e in events if e["kind"] == "resized"]
    assert resized == [(4, 2, "lost"), (2, 4, "catch_up")], resized
    ended = [e for e in events if e["kind"] == "catch_up_ended" and e.get("ok")]
    assert sorted(e["proc"] for e in ended) == ["s0", "s1"], ended
    assert all(f["lost_steps"] == 0 for f in report["faults"]), report["faults"]
