"""A host's step commits packed into one event (``protocol/relay_wire.py``'s ``pack_commits``) and unpacked
by every reader (``observe.fields.commits``): the report, the fault list, the plot's series, the live
metrics and the event log say of a packed run what they say of the same run unpacked."""

# ruff: noqa: F811 (the fixtures of test_relay.py, imported, are the tests' parameters)
from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from checkpointless.control.auth import SignedStore
from checkpointless.launch import relay as relay_mod
from checkpointless.launch.relay import Relay
from checkpointless.observe.event_log import EventLog
from checkpointless.observe.fields import commits
from checkpointless.observe.live_metrics import MetricsFeed
from checkpointless.observe.metrics import JobMetrics
from checkpointless.observe.report import build_report
from checkpointless.observe.run_data import RunData, commits_by_rank, train_loss
from checkpointless.protocol import keys
from checkpointless.protocol.relay_wire import pack_commits
from checkpointless.protocol.vocab import Event
from tests.unit.test_relay import SECRET, _client, _relay_value, coordinator  # noqa: F401 (fixture)
from tests.unit.test_report import CASES, _mixed_run, host_lost

pytestmark = pytest.mark.timeout(60)

BEAT = 0.05  # the relay's heartbeat interval in these runs


def _commit(t: float, proc: str, rank: int, step: int, gen: int = 0, **fields: Any) -> dict[str, Any]:
    return {"t": t, "kind": Event.STEP_COMMITTED, "proc": proc, "rank": rank, "gen": gen, "step": step,
            "step_time_s": 0.1, **fields}  # fmt: skip


def test_a_steps_commits_are_packed_where_the_first_came_and_every_other_event_stays_as_it_was() -> None:
    fault = {"t": 5.004, "kind": Event.FAULT_DETECTED, "proc": "w1", "rank": 1, "reason": "exception"}
    evs = [
        ("w0", _commit(5.001, "w0", 0, 3, loss=2.5, tokens=64)),
        ("w1", fault),
        ("w1", _commit(5.003, "w1", 1, 3, loss=2.25, tokens=64)),
        ("w1", _commit(5.107, "w1", 1, 4)),  # alone at its step: as it came
        ("w0", _commit(5.002, "w0", 0, 3, gen=1)),  # another generation's step 3: alone
    ]
    out = pack_commits("h1", evs)
    assert [names for names, _ in out] == [("w0", "w1"), ("w1",), ("w1",), ("w0",)]
    packed = out[0][1]
    assert packed["kind"] == Event.STEPS_COMMITTED and packed["proc"] == "agent h1" and packed["host"] == "h1"
    assert (packed["gen"], packed["step"], packed["t"]) == (0, 3, 5.003)  # the latest row's time
    assert [row["dt"] for row in packed["ranks"]] == [-0.002, 0.0]
    assert out[1][1] is fault and out[2][1] is evs[3][1] and out[3][1] is evs[4][1]
    # unpacked: the events that came, each with its host
    back = commits(json.loads(json.dumps(packed)))
    originals = [evs[0][1], evs[2][1]]
    assert [{k: v for k, v in e.items() if k != "host"} for e in back] == [
        {**e, "t": pytest.approx(e["t"], abs=1e-9)} for e in originals
    ]
    assert {e["host"] for e in back} == {"h1"}
    assert commits(fault) == [] and commits(evs[3][1]) == [evs[3][1]]
    # a stranger's malformed rows give nothing, never an error
    assert commits({"kind": Event.STEPS_COMMITTED, "t": 1.0, "ranks": "x"}) == []
    assert (
        commits({"kind": Event.STEPS_COMMITTED, "t": 1.0, "ranks": [3, {"dt": "x", "rank": 0}]})[0]["t"]
        is None
    )


def _host_of(proc: Any) -> str | None:
    """Two workers a host (w0 and w1 on h0, ...), two spares a spare host (s0 and s1 on hs0, ...)."""
    if isinstance(proc, str) and proc[:1] in ("w", "s") and proc[1:].isdigit():
        return f"h{'s' if proc[0] == 's' else ''}{int(proc[1:]) // 2}"
    return None


def _packed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` as the coordinator receives them across hosts: each host's processes' events read
    by its relay once a beat (``pack_commits``), the launcher's and coordinator's as they are."""
    beats: dict[tuple[str, int], list[tuple[str, dict[str, Any]]]] = {}
    out = []
    for e in events:
        host = _host_of(e.get("proc"))
        if host is None:
            out.append(e)
        else:
            beats.setdefault((host, math.floor(e["t"] / BEAT)), []).append((e["proc"], dict(e)))
    for (host, _), evs in beats.items():
        out += [json.loads(json.dumps(ev)) for _, ev in pack_commits(host, evs)]
    out.sort(key=lambda e: e["t"])
    return out


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


RUNS: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = [
    ("mixed", _mixed_run),
    ("host lost", host_lost(True)),
    *[(name, build) for name, build, _ in CASES],
]


@pytest.mark.parametrize("build", [b for _, b in RUNS], ids=[n for n, _ in RUNS])
def test_a_packed_run_reads_as_the_same_run_unpacked(build: Callable[[], list[dict[str, Any]]]) -> None:
    events = build()
    packed = _packed(events)
    n_commits = sum(e["kind"] == Event.STEP_COMMITTED for e in events)
    together = Counter(  # the commits of one step that one host's relay reads in one beat
        (_host_of(e["proc"]), math.floor(e["t"] / BEAT), e["gen"], e["step"])
        for e in events
        if e["kind"] == Event.STEP_COMMITTED
    )
    packs = sum(e["kind"] == Event.STEPS_COMMITTED for e in packed)
    assert packs == sum(n > 1 for n in together.values())
    assert packs > 0 or build not in (_mixed_run,)
    assert sum(len(commits(e)) for e in packed) == n_commits
    want = build_report(events, total_steps=10, digest=None)
    got = build_report(packed, total_steps=10, digest=None)
    assert _close(got, want), (got, want)
    assert want["faults"] or want["steps_completed"]

    # the timeline's series
    runs = [
        RunData(run_dir=Path("."), events=evs, report={}, skipped_lines=0, t0=0.0) for evs in (events, packed)
    ]
    by_rank = [{r: sorted(c) for r, c in commits_by_rank(run).items()} for run in runs]
    assert _close(by_rank[0], by_rank[1])
    assert train_loss(runs[0]) == train_loss(runs[1])

    # the Prometheus feed
    samples = []
    for evs in (events, packed):
        metrics = JobMetrics(port=0)
        feed = MetricsFeed(metrics, evs)
        for e in evs:
            feed.add(e)
        feed.feed_events()
        samples.append(sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                              for fam in metrics.registry.collect() for s in fam.samples
                              if not s.name.endswith("_created")))  # fmt: skip
    assert _close(samples[0], samples[1])

    # the launcher's log, past its budget of commits kept in memory: the same figures, the same faults
    logs = []
    for evs in (events, packed):
        log = EventLog(keep_commits=4)
        for e in evs:
            log.record(e)
        log.finish()
        logs.append(log)
    assert _close(
        build_report(
            sorted(logs[1].events, key=lambda e: e["t"]), total_steps=10, digest=None, stats=logs[1].stats
        ),
        build_report(
            sorted(logs[0].events, key=lambda e: e["t"]), total_steps=10, digest=None, stats=logs[0].stats
        ),
    )


def test_a_relay_forwards_the_commits_its_ranks_made_in_one_beat_as_one_event(
    coordinator: tuple[Any, SignedStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, view = coordinator
    names = ["w0", "w1", "w2"]
    relay = Relay("h1", f"127.0.0.1:{server.port}", SECRET, names=lambda: names, interval=60.0, lease_s=1.0)
    clients = [
        _client(relay, server, n) for n in names
    ]  # the relay's thread is not started: it beats when told
    try:
        for rank, c in enumerate(clients):
            c.update(rank=rank, gen=0, committed=7)
            c.emit(Event.STEP_COMMITTED, sync=True, step=7, loss=1.0 + rank)
        relay.beat()  # the commits wait a beat for their step's others (``Relay._packed``)
        assert not view.raw.check([view.name(keys.node_events("h1", 0))])
        relay.beat()
        text = view.get(keys.node_events("h1", 0))
        assert text is not None
        (line,) = text.splitlines()  # one event for the host's three commits
        packed = json.loads(line)
        assert packed["kind"] == Event.STEPS_COMMITTED
        assert [(e["proc"], e["rank"], e["step"], e["loss"]) for e in commits(packed)] == [
            ("w0", 0, 7, 1.0), ("w1", 1, 7, 2.0), ("w2", 2, 7, 3.0)
        ]  # fmt: skip
        assert int(_relay_value(view)["chunks"]) == 1
        # each process learns that its events reached the coordinator (``ControlClient.drain``)
        assert all(c.drain(5.0) for c in clients)

        # past the relay's bound a packed event is its ranks' commits, dropped and counted as such
        monkeypatch.setattr(relay_mod, "HOLD_BYTES", 0)
        for c in clients:
            c.emit(Event.STEP_COMMITTED, sync=True, step=8)
        relay.beat()
        relay.beat()
        text = view.get(keys.node_events("h1", 1))
        assert text is not None
        (note,) = [json.loads(line) for line in text.splitlines()]
        assert note["kind"] == Event.EVENTS_DROPPED and note["dropped"] == 3
    finally:
        for c in clients:
            c.close()
        relay.close()


def test_a_commit_that_came_last_from_its_process_waits_one_beat_for_its_steps_others(
    coordinator: tuple[Any, SignedStore],
) -> None:
    """Each process ships its events at its own heartbeat, so one beat of the relay reads some of a
    step's commits and the next beat the rest: held back one beat, they go as one event. A commit
    followed by another event of its process goes at once (a process's events stay in order), and
    the last flush holds nothing back."""
    server, _ = coordinator
    relay = Relay("h1", f"127.0.0.1:{server.port}", SECRET, names=list, interval=60.0, lease_s=1.0)
    try:
        out = relay._packed(
            [("w0", _commit(1.00, "w0", 0, 5)), ("w1", _commit(1.01, "w1", 1, 5))], final=False
        )
        assert out == [] and relay._held_by["w0"] == relay._held_by["w1"] == 1  # not forwarded yet
        fault = {"t": 1.12, "kind": Event.FAULT_DETECTED, "proc": "w3", "rank": 3}
        out = relay._packed(
            [("w2", _commit(1.05, "w2", 2, 5)), ("w0", _commit(1.10, "w0", 0, 6)),
             ("w3", _commit(1.05, "w3", 3, 5)), ("w3", fault)],
            final=False,
        )  # fmt: skip
        assert relay._held_by["w1"] == 0 and relay._held_by["w0"] == 1  # its step 6 waits now
        kinds = [(names, json.loads(line)["kind"]) for names, line in out]
        assert kinds == [(("w0", "w1", "w2", "w3"), Event.STEPS_COMMITTED), (("w3",), Event.FAULT_DETECTED)]
        # fast steps: a process's earlier commits go at once, its last waits; the last flush: all
        out = relay._packed(
            [("w1", _commit(1.11, "w1", 1, 6)), ("w1", _commit(1.2, "w1", 1, 7)), ("w2", _commit(1.21, "w2", 2, 7))],
            final=False,
        )  # fmt: skip
        assert [names for names, _ in out] == [("w0", "w1")]  # step 6; step 7 waits
        out = relay._packed([], final=True)
        assert [names for names, _ in out] == [("w1", "w2")] and not relay._late
        assert not +relay._held_by  # nothing counted held
    finally:
        relay.close()
