"""The launcher's event log (observe/event_log.py): every event to the file and the listeners, a
bounded share in memory, and a report from that share equal to the report from every event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checkpointless.observe.event_log import HELD, EventLog
from checkpointless.observe.report import build_report
from checkpointless.observe.usage import summarize
from checkpointless.protocol.relay_wire import pack_commits
from tests.unit.test_report import Run

pytestmark = pytest.mark.timeout(60)


def _long_run() -> list[dict[str, Any]]:
    """Four ranks, long stretches of steps between a kill, a hang and an exception."""
    run = Run(workers=4, spares=3, faults=("kill:rank=1@step=40", "hang:rank=2@step=90")).train(40)
    run.inject(0, "kill", [1]).wait(0.05).exit("w1", -9).peers_fail([1], "process_exit")
    run.recover([1]).train(50)
    run.inject(1, "hang", [2]).wait(2.0).hang_detected("w2").peers_fail([2], "process_exit")
    run.recover([2]).train(30)
    run.raised(3).peers_fail([3]).recover([]).train(40)
    for i in range(50):  # a host's usage samples
        run.ev("host_usage", proc="launcher", host="h0", cpu_percent=float(i), mem_used_bytes=1000 + i)
    return run.finish()


def _as_json(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [json.loads(json.dumps(e)) for e in events]


def _fed(events: list[dict[str, Any]], log: EventLog) -> list[dict[str, Any]]:
    heard: list[dict[str, Any]] = []
    log.listeners.append(heard.append)
    for ev in events:
        log.record(ev)
    log.finish()
    return heard


def test_a_log_within_its_budget_keeps_every_event_in_order(tmp_path: Path) -> None:
    events = _long_run()
    log = EventLog()
    log.open(tmp_path / "events.jsonl")
    heard = _fed(events, log)
    log.close()
    assert log.events == events == heard and log.in_memory() and log.thinned == 0
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == _as_json(events)


def test_beyond_its_budget_the_log_keeps_what_the_report_needs_and_the_file_keeps_everything(
    tmp_path: Path,
) -> None:
    events = _long_run()
    commits = sum(e["kind"] == "step_committed" for e in events)
    log = EventLog(keep_commits=20, keep_usage=5)
    log.open(tmp_path / "events.jsonl")
    heard = _fed(events, log)
    log.close()
    assert heard == events  # the listeners hear every event
    assert [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()] == _as_json(events)
    kept = [e for e in log.events if e["kind"] == "step_committed"]
    # the budget, each rank's first commit of each generation, its last HELD before each fault
    # or recovery event, and at the end
    assert 20 < len(kept) < commits / 5
    assert log.thinned == len(events) - len(log.events) > 0 and not log.in_memory()
    assert sum(e["kind"] == "host_usage" for e in log.events) == 5
    # the report from what was kept, with the figures of every commit, is the report of every event
    full = build_report(events, total_steps=160, digest=None)
    thin = build_report(
        sorted(log.events, key=lambda e: e["t"]), total_steps=160, digest=None, stats=log.stats
    )
    for key in ("steps_completed", "generations", "recovery_s", "faults"):
        assert thin[key] == full[key], key
    for key in ("goodput", "wall_s", "step_time_s"):
        assert thin[key] == pytest.approx(full[key], abs=1e-4), key
    assert [f["lost_steps"] for f in thin["faults"]] == [f["lost_steps"] for f in full["faults"]]
    assert log.usage.result() == summarize(events)
    # a rank's held commits are bounded
    assert all(len(h) <= HELD for h in log._held.values())


def test_a_log_that_cannot_write_its_file_keeps_everything_in_memory() -> None:
    events = _long_run()
    log = EventLog(keep_commits=20, keep_usage=5)
    log.open(Path("/dev/full"))  # every write fails, as on a full disk (when the buffer is flushed)
    for ev in events[:5]:
        log.record(ev)
    log.flush()
    assert log.stream_error is not None and "/dev/full" in log.stream_error
    for ev in events[5:]:
        log.record(ev)
    log.finish()
    assert log.events == events and log.in_memory()


def test_a_hosts_packed_commits_count_as_its_ranks_commits() -> None:
    def commit(rank: int, step: int) -> dict[str, Any]:
        return {"t": 10.0 + step + rank / 100, "kind": "step_committed", "proc": f"w{rank}", "rank": rank,
                "gen": 0, "step": step, "step_time_s": 1.0}  # fmt: skip

    log = EventLog(keep_commits=10, keep_usage=5)
    for step in range(6):  # 4 ranks, packed per step: 6 events, 24 commits
        [(_, packed)] = pack_commits("node-a", [(f"w{r}", commit(r, step)) for r in range(4)])
        log.record(packed)
    log.record({"t": 20.0, "kind": "steps_committed", "proc": "agent node-a", "gen": 0, "ranks": "no"})
    assert log.commits == 24 and log.recorded == 7  # the last event (its ranks not a list) holds none
    # the budget counts commits, not events: the first 3 packed events fill it (12 >= 10); of the
    # rest the relay's first is already kept, so they are held
    assert sum(e["kind"] == "steps_committed" for e in log.events) == 3
