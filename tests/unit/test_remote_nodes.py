"""The coordinator's side of the hosts' agents (launch/remote.py), on an in-memory store: who may
join, where spares go, when a silent host is lost."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from checkpointless.config import JobConfig
from checkpointless.control.auth import SignedStore, new_secret
from checkpointless.control.processes import ProcessTable
from checkpointless.launch.cluster_spec import host_timeout
from checkpointless.launch.remote import RemoteNodes
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Role


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _nodes(
    nodes: int = 2, nproc: int = 2, spare_nodes: int = 1, table: ProcessTable | None = None
) -> tuple[RemoteNodes, SignedStore, Clock, list]:
    store = SignedStore(dist.HashStore(), new_secret())
    job = JobConfig(workers=nodes * nproc, spares=spare_nodes * nproc)
    clock, lost = Clock(), []
    r = RemoteNodes(store, job, nodes=nodes, nproc_per_node=nproc, spare_nodes=spare_nodes, job_id="j",
                    emit=lambda kind, **f: lost.append({**f, "kind": kind}), clock=clock, table=table)  # fmt: skip
    return r, store, clock, lost


def _hello(
    store: SignedStore, host: str, pid: int, *, spare: bool = False, nproc: int = 2, node: int | None = None
) -> None:
    i = store.add(keys.AGENTS_COUNT, 1) - 1
    hello = {"host": host, "addr": f"10.0.0.{pid}", "nproc": nproc, "spare": spare, "pid": pid}
    if node is not None:
        hello["node_rank"] = node
    store.set(keys.agent_hello(i), json.dumps(hello))


def test_two_agents_asking_for_one_node_rank_the_second_is_refused_in_one_line() -> None:
    """Two hosts started with the same --node-rank (a copied command line): the first keeps it, the
    second is refused naming the first, and one asking for a rank the job does not have is refused;
    neither silently becomes another node."""
    r, store, _, _ = _nodes()
    _hello(store, "a", 1, node=0)
    _hello(store, "b", 2, node=0)
    _hello(store, "x", 3, node=2)
    _hello(store, "c", 4, node=1)
    _hello(store, "d", 5, spare=True)
    r.accept(timeout_s=1)
    assert sorted(r.hosts) == ["a", "c", "d"]
    error = json.loads(store.get(keys.node_accept("b", 2)) or "{}")["error"]
    assert error.startswith("node rank 0 is taken by the agent of a (pid 1") and "\n" not in error, error
    assert (
        "node rank 2 is not one of this job's 2 node(s)"
        in json.loads(store.get(keys.node_accept("x", 3)) or "{}")["error"]
    )
    assert [json.loads(store.get(keys.node_accept(h, p)) or "{}")["node"] for h, p in
            (("a", 1), ("c", 4), ("d", 5))] == [0, 1, 2]  # fmt: skip


def test_agents_join_and_the_wrong_ones_are_refused_in_one_line() -> None:
    r, store, _, _ = _nodes()
    _hello(store, "a", 1)
    _hello(store, "a", 2)  # a second agent claiming host a
    _hello(store, "b", 3, nproc=3)  # offers the wrong number of processes
    _hello(store, "b", 4)
    _hello(store, "c", 5, spare=True)
    r.accept(timeout_s=1)
    assert sorted(r.hosts) == ["a", "b", "c"]
    assert "already has an agent" in json.loads(store.get(keys.node_accept("a", 2)) or "{}")["error"]
    assert "offers 3" in json.loads(store.get(keys.node_accept("b", 3)) or "{}")["error"]
    assert [json.loads(store.get(keys.node_accept(h, p)) or "{}")["node"] for h, p in
            (("a", 1), ("b", 4), ("c", 5))] == [0, 1, 2]  # fmt: skip
    workers, spares = r.start()
    assert [w.name for w in workers] == ["w0", "w1", "w2", "w3"] and [w.host for w in workers] == [
        "a",
        "a",
        "b",
        "b",
    ]
    assert [s.host for s in spares] == ["c", "c"]
    orders = [json.loads(store.get(keys.node_order("c", i)) or "{}") for i in range(2)]
    assert [o["op"] for o in orders] == ["spawn", "spawn"] and {o["role"] for o in orders} == {"spare"}


def test_too_few_agents_is_a_clear_job_error() -> None:
    from checkpointless.errors import JobFailed

    r, store, _, _ = _nodes()
    _hello(store, "a", 1)
    with pytest.raises(JobFailed, match="only 1 of 3 host agent"):
        r.accept(timeout_s=0.2)


def test_a_silent_host_is_lost_and_its_processes_are_dead() -> None:
    r, store, clock, lost = _nodes()
    for h, p, spare in (("a", 1, False), ("b", 2, False), ("c", 3, True)):
        _hello(store, h, p, spare=spare)
    r.accept(timeout_s=1)
    workers, _ = r.start()

    def status(host: str, seq: int, procs: dict) -> None:
        store.set(keys.node_status(host), json.dumps({"seq": seq, "procs": procs}))

    alive = {"alive": True, "cpu": 1.0, "pid": 7}
    for seq in range(4):
        clock.t += host_timeout(r.job) / 2
        for h, names in (("a", ["w0", "w1"]), ("b", ["w2", "w3"]), ("c", ["s0", "s1"])):
            if h != "b" or seq == 0:  # host b falls silent after its first status
                status(h, seq, {n: alive for n in names})
        r.poll()
    assert [f["host"] for f in lost] == ["b"]
    assert [w.alive() for w in workers] == [True, True, False, False]
    # what the launcher says of a process lost with its host (after the job's end too): the host and its agent
    assert workers[2].log_tail().startswith("host b lost (its agent: pid 2 at 10.0.0.2): "), workers[
        2
    ].log_tail()
    assert workers[2].exitcode() is None
    # a replayed old status does not bring it back, nor hide a live host's news
    assert workers[0].cpu_seconds() == 1.0 and workers[2].cpu_seconds() is None


def test_spares_are_refilled_on_spare_hosts_only() -> None:
    table = ProcessTable()
    r, store, _, _ = _nodes(table=table)
    for h, p, spare in (("a", 1, False), ("b", 2, False), ("c", 3, True)):
        _hello(store, h, p, spare=spare)
    r.accept(timeout_s=1)
    workers, spares = r.start()
    for w in workers:  # the coordinator's table: who holds a rank
        table.add(w, Role.WORKER, 0.0)
    # a worker of host a died: host a keeps no spare; host c is full
    store.set(keys.node_status("a"), json.dumps({"seq": 1, "procs": {"w0": {"alive": False, "exit": -9}}}))
    r.poll()
    assert r.spawn_spare() is None
    # a spare of host c took the rank: host c now runs a rank, so it is no spare host either
    table.add(spares[0], Role.WORKER, 0.0)
    store.set(keys.node_status("c"), json.dumps({"seq": 1, "procs": {"s1": {"alive": False, "exit": 1}}}))
    r.poll()
    assert r.spawn_spare() is None
    table["s0"].role = Role.SPARE  # (had it stayed a spare) the freed slot on the spare host is refilled
    new = r.spawn_spare()
    assert new is not None and new.host == "c"


def test_a_host_that_does_not_answer_an_order_is_lost_within_the_answer_window() -> None:
    """A kill or a ping the agent does not answer (no newer status) within the answer window loses
    the host, long before its silence reaches the host timeout; a live agent's answer clears it,
    and a probe is sent once per window per host."""
    from checkpointless.launch.cluster_spec import answer_window

    r, store, clock, lost = _nodes()
    for h, p, spare in (("a", 1, False), ("b", 2, False), ("c", 3, True)):
        _hello(store, h, p, spare=spare)
    r.accept(timeout_s=1)
    workers, _ = r.start()
    window = answer_window(r.job)
    assert window < host_timeout(r.job) / 2
    seq = {"a": 0, "b": 0, "c": 0}

    def beat(*hosts: str) -> None:
        for h in hosts:
            seq[h] += 1
            store.set(keys.node_status(h), json.dumps({"seq": seq[h], "procs": {}}))

    beat("a", "b", "c")
    r.poll()

    def orders(host: str) -> list[str]:
        return [
            json.loads(store.get(keys.node_order(host, i)) or "{}").get("op")
            for i in range(r.hosts[host].orders)
        ]

    r.probe(["w0", "w1", "w2"])  # the coordinator waits for these ranks' reports
    r.probe(["w2"])  # again within the window: no second ping
    assert orders("a")[-1] == "ping" and orders("b").count("ping") == 1
    clock.t += window / 2
    beat("a")  # a answers; b does not
    r.poll()
    assert lost == [] and r.hosts["a"].asked is None and r.hosts["b"].asked is not None
    clock.t += window / 2 + 0.01
    r.poll()
    assert [f["host"] for f in lost] == ["b"] and "did not answer" in lost[0]["why"]
    assert [w.alive() for w in workers] == [True, True, False, False]
    assert orders("b")[-1] == "reset"  # read by its agent should it come back
    # a kill order to a live host is answered: nothing lost
    workers[0].kill()
    clock.t += window / 2
    beat("a", "c")
    r.poll()
    clock.t += window
    beat("a", "c")
    r.poll()
    assert [f["host"] for f in lost] == ["b"]


def test_a_lost_host_whose_agent_comes_back_and_resets_rejoins_as_a_spare_host() -> None:
    """Lost (silent), its agent is ordered to reset; a status answering that order (its processes
    dead) makes it a spare host again, reported once; a status without it (an agent still cut off,
    or a replay) does not."""
    from checkpointless.launch.cluster_spec import host_timeout

    r, store, clock, events = _nodes()
    for h, p, spare in (("a", 1, False), ("b", 2, False), ("c", 3, True)):
        _hello(store, h, p, spare=spare)
    r.accept(timeout_s=1)
    workers, _ = r.start()
    rejoined: list[str] = []
    seq = {"a": 0, "b": 0, "c": 0}

    def beat(host: str, **extra: object) -> None:
        seq[host] += 1
        store.set(keys.node_status(host), json.dumps({"seq": seq[host], "procs": {}, **extra}))

    def poll() -> None:
        rejoined.extend(h.name for h in r.poll())  # the hosts back: the caller fills them with spares

    for h in seq:
        beat(h)
    poll()
    clock.t += host_timeout(r.job) + 0.1
    beat("a")
    beat("c")
    poll()
    assert [e["kind"] for e in events] == ["host_lost"] and r.hosts["b"].lost
    reset = r.hosts["b"].reset
    assert reset is not None and json.loads(store.get(keys.node_order("b", reset)) or "{}") == {
        "op": "reset", "index": reset}  # fmt: skip
    beat("b")  # back, but has not carried out the reset yet
    poll()
    assert r.hosts["b"].lost and rejoined == []
    beat("b", reset=reset)
    poll()
    assert not r.hosts["b"].lost and r.hosts["b"].spare and rejoined == ["b"]
    assert [e["kind"] for e in events] == ["host_lost", "host_rejoined"] and events[1]["host"] == "b"
    beat("b", reset=reset)
    poll()
    assert rejoined == ["b"]  # once
    assert not workers[2].alive()  # its old processes stay dead to the job


def test_spares_per_node_keep_a_process_fault_on_its_host() -> None:
    """``--spares-per-node 1``: each worker host starts one spare of its own; a host that used its
    spare (it took a rank) gets the next one; spare hosts keep theirs."""
    store = SignedStore(dist.HashStore(), new_secret())
    job = JobConfig(workers=4, spares=2 + 2)
    table = ProcessTable()
    r = RemoteNodes(store, job, nodes=2, nproc_per_node=2, spare_nodes=1, job_id="j", emit=lambda kind, **f: None,
                    spares_per_node=1, table=table)  # fmt: skip
    for h, p, spare in (("a", 1, False), ("b", 2, False), ("c", 3, True)):
        _hello(store, h, p, spare=spare)
    r.accept(timeout_s=1)
    workers, spares = r.start()
    assert sorted((s.host, s.name) for s in spares) == [("a", "s2"), ("b", "s3"), ("c", "s0"), ("c", "s1")]
    for w in workers + [s for s in spares if s.name == "s2"]:  # a's own spare took a's lost rank
        table.add(w, Role.WORKER, 0.0)
    refill = r.spawn_spare()
    assert refill is not None and refill.host == "a"
    with pytest.raises(ValueError, match="spare\\(s\\) per node"):
        RemoteNodes(store, JobConfig(workers=4, spares=2), nodes=2, nproc_per_node=2, spare_nodes=1, job_id="j",
                    emit=lambda kind, **f: None, spares_per_node=1)  # fmt: skip


def test_a_drain_asked_from_outside_is_ordered_to_the_hosts_agent_at_the_next_poll() -> None:
    """``checkpointless drain``: the node is checked against the hosts as they stand (unknown, lost,
    draining: refused in one line), then the next ``poll`` orders its agent to drain and says so
    (``drain_asked``); the agent's status ``drained`` then takes the host out of the job, not lost."""
    from checkpointless.launch.drains import DrainRequests

    store = SignedStore(dist.HashStore(), new_secret())
    job = JobConfig(workers=4, spares=2)
    clock, seen = Clock(), []
    holder: list[RemoteNodes] = []
    drains = DrainRequests(lambda node: holder[0].drain_refusal(node))
    r = RemoteNodes(store, job, nodes=2, nproc_per_node=2, spare_nodes=1, job_id="j",
                    emit=lambda kind, **f: seen.append({**f, "kind": kind}), clock=clock, drains=drains)  # fmt: skip
    holder.append(r)
    assert drains.ask(1) == "no node 1 in this job (its nodes: none yet)"
    for h, p, spare in (("a", 1, False), ("b", 2, False), ("c", 3, True)):
        _hello(store, h, p, spare=spare)
    r.accept(timeout_s=1)
    r.start()
    assert drains.ask(5) == "no node 5 in this job (its nodes: 0, 1, 2)"
    assert drains.ask(1) is None
    r.poll()
    orders = [json.loads(store.get(keys.node_order("b", i)) or "{}") for i in range(r.hosts["b"].orders)]
    assert orders[-1] == {"op": "drain"}
    assert [(e["kind"], e["host"], e["node"]) for e in seen] == [("drain_asked", "b", 1)]
    alive = {"alive": True, "cpu": 1.0, "pid": 7}
    store.set(keys.node_status("b"), json.dumps({"seq": 1, "procs": {"w2": alive}, "draining": True}))
    r.poll()
    assert drains.ask(1) == "node 1 (b) is being drained already"
    gone = {"alive": False, "exit": 0, "pid": 7}
    store.set(
        keys.node_status("b"),
        json.dumps({"seq": 2, "procs": {"w2": gone}, "draining": True, "drained": True}),
    )
    r.poll()
    assert drains.ask(1) == "node 1 (b) has left the job: drained on a notice"
    assert [e["kind"] for e in seen] == ["drain_asked", "host_drained"]
