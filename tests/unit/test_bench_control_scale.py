"""``bench/control_scale.py``'s simulated agents speak the relay protocol (``launch/relay.py``), and
its page renders results of either protocol."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore

from bench import common, control_scale, scale_sim
from checkpointless.control.auth import SignedStore, job_namespace, new_secret, write_secret_file
from checkpointless.control.link import HeartbeatLink
from checkpointless.observe.fields import commits
from checkpointless.protocol import keys
from checkpointless.protocol.relay_wire import (
    FORWARDED,
    forwarded,
    pack_commits,
    read_relay_value,
    relay_value,
)
from checkpointless.protocol.vocab import Event, Phase, Role

pytestmark = pytest.mark.timeout(60)


class _Writes:
    """The store connection of a simulated host (the network boundary): what it was asked to set."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, purpose: str, name: str, value: bytes) -> None:
        self.values[name] = value


def _simulator(tmp_path: Path, protocol: str) -> tuple[scale_sim.Simulator, SignedStore]:
    secret = new_secret()
    write_secret_file(tmp_path / "secret", secret)
    a = argparse.Namespace(addr="127.0.0.1:1", secret_file=str(tmp_path / "secret"), hosts=1, first=0, count=2,
                           hang_timeout=2.0, step_s=1.0, join_timeout=10.0, protocol=protocol)  # fmt: skip
    return scale_sim.Simulator(a), SignedStore(None, secret, namespace=job_namespace(secret))


def test_a_relayed_host_writes_one_value_and_one_chunk_per_beat(tmp_path: Path) -> None:
    sim, store = _simulator(tmp_path, scale_sim.RELAY)
    ag = sim.agents[0]
    ag.conn = _Writes()  # type: ignore[assignment]
    for k in range(scale_sim.NPROC):
        sim._on_order(ag, {"op": "spawn", "name": f"w{k}", "role": Role.WORKER})
    sim._run_work(float("inf"))
    for p in ag.procs.values():
        p.rank, p.gen, p.phase = int(p.name[1:]), 0, Phase.IDLE
    sim.gen_running = 0
    for p in ag.procs.values():
        sim._commit(ag, p, 0)
    assert ag.conn.values == {}  # relayed: nothing reaches the coordinator's store before the beat
    sim._relay(ag)

    def read(key: str) -> str:
        text = store.open(key, ag.conn.values.pop(store.name(key)))  # type: ignore[union-attr]
        assert text is not None
        return text

    value = json.loads(read(keys.node_relay(ag.host)))
    lines = [json.loads(line) for line in read(keys.node_events(ag.host, 0)).splitlines()]
    assert ag.conn.values == {}  # one value and one chunk, nothing per rank
    assert value["seq"] == 1 and value["chunks"] == 1 and set(value["procs"]) == {f"w{k}" for k in range(8)}
    hb = value["procs"]["w3"]
    assert hb["rank"] == 3 and hb["gen"] == 0 and hb["committed"] == 0
    assert set(hb) <= set(FORWARDED)  # what a real relay forwards, no more
    # the host's 8 commits of the step: one event, as the real relay packs them
    assert [(e["kind"], e["proc"], e["step"]) for e in lines] == [
        (Event.STEPS_COMMITTED, f"agent {ag.host}", 0)
    ]
    assert [(c["proc"], c["rank"]) for c in commits(lines[0])] == [(f"w{k}", k) for k in range(8)]
    evs = [(c["proc"], {k: v for k, v in c.items() if k != "host"}) for c in commits(lines[0])]
    assert json.dumps(pack_commits(ag.host, evs)[0][1]) == json.dumps(lines[0])  # the same bytes
    sim._relay(ag)  # no new events: no chunk, a new heartbeat of each process
    value = json.loads(read(keys.node_relay(ag.host)))
    assert ag.conn.values == {} and value["chunks"] == 1 and value["procs"]["w3"]["seq"] == hb["seq"] + 1


def test_a_simulated_relay_value_is_the_bytes_the_relay_writes(tmp_path: Path) -> None:
    """The simulator writes its relay values from templates (``relay_wire.forwarded_template``): the
    bytes ``relay_wire.relay_value`` writes of the same heartbeats, each process in every state."""
    sim, store = _simulator(tmp_path, scale_sim.RELAY)
    ag = sim.agents[0]
    ag.conn = _Writes()  # type: ignore[assignment]
    for k in range(6):
        sim._on_order(ag, {"op": "spawn", "name": f"w{k}", "role": Role.WORKER})
    sim._run_work(float("inf"))
    report = json.dumps(
        {"gen": 0, "rank": 1, "committed": 2, "reason": "x", "has_state": True}, separators=(",", ":")
    )
    for k, p in enumerate(ag.procs.values()):  # bare, joined, stepping; each without a report, then with
        if k % 3:
            p.rank, p.gen, p.committed, p.phase = k, 0, 2, Phase.COMPUTE
        if k % 3 == 2:
            p.attempt, p.step_time = 3, 0.987654
        p.report = report if k >= 3 else ""
    sim._relay(ag)
    key = keys.node_relay(ag.host)
    text = store.open(key, ag.conn.values.pop(store.name(key)))  # type: ignore[attr-defined]
    assert text is not None
    value = read_relay_value(text)
    assert relay_value(value.seq, value.t or 0.0, value.chunks, value.procs) == text
    shapes = set()
    for hb in value.procs.values():
        assert list(hb) == list(forwarded(hb))  # in the relay's order
        shapes.add(tuple(hb))
    assert len(shapes) == 6


@pytest.fixture
def link() -> Iterator[tuple[HeartbeatLink, SignedStore]]:
    """A process's real heartbeat connection (``ControlClient``'s) to a real store, and the store."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    secret = new_secret()
    store = SignedStore(server, secret, namespace=job_namespace(secret))
    hb = HeartbeatLink(f"127.0.0.1:{server.port}", "w3", lambda raw: SignedStore(raw, secret, namespace=store.namespace),
                       timeout=timedelta(seconds=10), lease=10.0)  # fmt: skip
    yield hb, store
    del hb, server


def test_a_simulated_commit_is_the_line_a_rank_writes(link: tuple[HeartbeatLink, SignedStore]) -> None:
    """The simulator writes a rank's ``step_committed`` event from a template (``scale_sim``'s
    ``json_template`` of ``vocab.event``): the bytes a real heartbeat link writes of the event
    ``StepCommit.commit`` emits (the demo's one metric, ``loss``), alone and packed."""
    hb, store = link
    hb.update(rank=3, gen=1)
    hb.emit(Event.STEP_COMMITTED, rank=3, gen=1, step=7, step_time_s=0.987654, loss=2.123456)
    hb.flush()
    line = store.get(keys.events("w3", 0))
    assert line is not None
    t = json.loads(line)["t"]
    assert scale_sim.packed_commits("h0", 1, 7, [(t, "w3", 3, 0.987654, 2.123456)]) == line
    two = [(t, "w3", 3, 0.987654, 2.123456), (t + 0.5, "w4", 4, 0.5, 3.0)]
    evs = [(r[1], json.loads(scale_sim.packed_commits("h0", 1, 7, [r]))) for r in two]
    assert scale_sim.packed_commits("h0", 1, 7, two) == json.dumps(pack_commits("h0", evs)[0][1]) + "\n"


def test_a_simulated_per_rank_heartbeat_has_a_real_ones_fields(
    tmp_path: Path, link: tuple[HeartbeatLink, SignedStore]
) -> None:
    """Per-rank, the simulator writes a process's heartbeat from a template: before it joins, the
    fields a real heartbeat link writes; joined and stepping, those the coordinator reads (the
    relay's ``FORWARDED``: the relayed simulation's are built from them) and the link's own."""
    hb, store = link
    hb.flush()
    real = store.get(keys.heartbeat("w3"))
    assert real is not None
    own = set(json.loads(real))  # the link's own fields: seq, phase, its clock, its chunk count
    sim, _ = _simulator(tmp_path, scale_sim.PER_RANK)
    ag = sim.agents[0]
    ag.conn = _Writes()  # type: ignore[assignment]
    sim._on_order(ag, {"op": "spawn", "name": "w3", "role": Role.WORKER})
    sim._run_work(float("inf"))
    p = ag.procs["w3"]
    bare = json.loads(sim._hb_text(p))
    assert set(bare) == own and [type(bare[k]) for k in own] == [type(json.loads(real)[k]) for k in own]
    for attempt in (0, 3):  # joined, then stepping
        p.rank, p.gen, p.committed, p.phase, p.attempt, p.step_time = 3, 0, 2, Phase.COMPUTE, attempt, 0.5
        beat = json.loads(sim._hb_text(p))
        assert forwarded(beat) == json.loads(scale_sim.Simulator._forwarded_text(p))
        assert set(beat) - set(FORWARDED) <= own | {"start", "loss"}  # the rest: the link's, the session's


def test_the_relay_protocol_asks_far_fewer_calls_of_the_store() -> None:
    relay = scale_sim.protocol_rates(2000, 2.0, 1.0, scale_sim.RELAY)
    per_rank = scale_sim.protocol_rates(2000, 2.0, 1.0, scale_sim.PER_RANK)
    assert relay["ack"] * scale_sim.NPROC == pytest.approx(per_rank["ack"])  # a round trip per host, not rank
    assert relay["relay"] == pytest.approx((2000 + scale_sim.SPARE_NODES) * 10)
    assert per_rank["stop"] == 16_000  # each rank checks the job's stop every step
    assert relay["stop"] == 2_000  # relayed: the relay asks once a second for its host's ranks
    assert sum(relay.values()) < sum(per_rank.values()) / 5


def test_the_page_renders_either_protocol() -> None:
    res: dict[str, Any] = json.loads((common.RESULTS / "control_scale.json").read_text())
    res.pop("protocol", None)
    res["heartbeats"] = scale_sim.PER_RANK  # as results from before the relay say it
    page = control_scale.markdown(res)
    assert "protocol `per-rank`" in page and "offered: heartbeats / lease round trips / commits" in page
    res["protocol"] = scale_sim.RELAY
    page = control_scale.markdown(res)
    assert "protocol `relay`" in page and "offered: relay values / lease round trips / event chunks" in page
