"""The relay's wire format (``protocol/relay_wire.py``): the bytes a relay wrote before it had a
module of its own, read back as written, and the template writers' bytes equal to the encoders'."""

from __future__ import annotations

import json
from typing import Any

import pytest

from checkpointless.protocol.relay_wire import (
    FORWARDED,
    commit_count,
    forwarded,
    forwarded_template,
    pack_commits,
    packed_row_template,
    packed_text,
    read_relay_value,
    relay_value,
    relay_value_text,
    unpack_commits,
)
from checkpointless.protocol.vocab import Event, Phase

pytestmark = pytest.mark.timeout(30)

HEARTBEAT = {"seq": 7, "phase": Phase.COMPUTE, "rank": 3, "gen": 1, "committed": 41, "total": 100, "start": 0,
             "step": 42, "attempt": 2, "step_time_s": 0.25, "loss": 2.5, "t": 1765000000.125, "chunks": 9,
             "report": {"gen": 1, "rank": 3, "committed": 41, "reason": "collective_error"}, "leaving": 1,
             "applied": 40}  # fmt: skip


def test_the_relay_value_is_the_bytes_it_was() -> None:
    procs = {"w0": forwarded(HEARTBEAT), "s1": {"seq": 1, "phase": Phase.SPARE}}
    text = relay_value(12, 1765000000.5, 4, procs)
    # what launch/relay.py wrote before the format had a module of its own
    assert text == json.dumps(
        {"seq": 12, "t": 1765000000.5, "chunks": 4, "procs": procs}, separators=(",", ":")
    )
    assert text == (
        '{"seq":12,"t":1765000000.5,"chunks":4,"procs":{"w0":{"seq":7,"phase":"compute","rank":3,"gen":1,'
        '"committed":41,"step":42,"attempt":2,"step_time_s":0.25,"total":100,"report":{"gen":1,"rank":3,'
        '"committed":41,"reason":"collective_error"},"leaving":1,"applied":40},"s1":{"seq":1,"phase":"spare"}}}'
    )
    value = read_relay_value(text)
    assert (value.seq, value.t, value.chunks) == (12, 1765000000.5, 4)
    assert value.procs == json.loads(json.dumps(procs))


def test_a_relay_forwards_the_fields_the_coordinator_reads_in_one_order() -> None:
    hb = forwarded(HEARTBEAT)
    assert list(hb) == list(FORWARDED)  # t, chunks, start and loss stay on the host
    assert forwarded({"phase": Phase.IDLE, "t": 1.0, "seq": 2}) == {"seq": 2, "phase": Phase.IDLE}


def test_a_relay_value_without_a_clock_reads_with_none() -> None:
    value = read_relay_value('{"seq":3,"chunks":1}')
    assert (value.seq, value.t, value.chunks, value.procs) == (3, None, 1, {})


@pytest.mark.parametrize(
    "fields",
    [
        ("seq", "phase"),
        ("seq", "phase", "rank", "gen", "committed", "total"),
        FORWARDED[:-3],
        FORWARDED[:-2],
        FORWARDED[:-1],
        FORWARDED,
    ],
    ids=["bare", "joined", "stepping", "reported", "leaving", "following"],
)
def test_the_template_writer_writes_the_encoders_bytes(fields: tuple[str, ...]) -> None:
    hb = {k: v for k, v in forwarded(HEARTBEAT).items() if k in fields}
    args = tuple(json.dumps(v, separators=(",", ":")) if k == "report" else v for k, v in hb.items())
    beats = [("w3", forwarded_template(fields) % args), ("w4", forwarded_template(fields) % args)]
    assert relay_value_text(5, 1765000000.75, 2, beats) == relay_value(
        5, 1765000000.75, 2, {"w3": hb, "w4": hb}
    )


def _commit(t: float, proc: str, rank: int, **fields: Any) -> dict[str, Any]:
    return {"t": t, "kind": Event.STEP_COMMITTED, "proc": proc, "rank": rank, "gen": 2, "step": 17,
            "step_time_s": 0.5, **fields}  # fmt: skip


def test_packed_commits_from_templates_are_the_encoders_bytes() -> None:
    evs = [(f"w{k}", _commit(100.0 + k / 1000 + 1e-7, f"w{k}", k, loss=2.0 + k / 7)) for k in range(8)]
    [(names, ev)] = pack_commits("node-a", evs)
    assert names == tuple(f"w{k}" for k in range(8))
    row = packed_row_template('"proc": "%s", "rank": %d, "step_time_s": %r, "loss": %r')
    rows = [(e["t"], (e["proc"], e["rank"], e["step_time_s"], e["loss"])) for _, e in evs]
    assert packed_text("node-a", 2, 17, row, rows) == json.dumps(ev)
    back = unpack_commits(json.loads(json.dumps(ev)))
    assert [(c["proc"], c["rank"], c["gen"], c["step"], c["host"]) for c in back] == [
        (f"w{k}", k, 2, 17, "node-a") for k in range(8)
    ]
    assert [c["t"] for c in back] == pytest.approx([e["t"] for _, e in evs], abs=1e-6)


def test_unpacking_is_tolerant() -> None:
    assert unpack_commits(
        {"kind": Event.STEPS_COMMITTED, "t": "x", "ranks": [1, {"rank": 0, "dt": -0.1}]}
    ) == [{"t": None, "kind": Event.STEP_COMMITTED, "rank": 0, "gen": None, "step": None, "host": None}]
    assert unpack_commits({"kind": Event.STEPS_COMMITTED, "ranks": "no"}) == []
    assert unpack_commits({"kind": Event.FAULT_DETECTED}) == []


_EIGHT = [(f"w{k}", _commit(100.0 + k / 1000, f"w{k}", k)) for k in range(8)]


@pytest.mark.parametrize(
    ("ev", "n"),
    [
        (_commit(100.0, "w0", 0), 1),
        (pack_commits("node-a", _EIGHT)[0][1], 8),
        ({"kind": Event.STEPS_COMMITTED, "t": "x", "ranks": [1, {"rank": 0, "dt": -0.1}, "no"]}, 1),
        ({"kind": Event.STEPS_COMMITTED, "ranks": "no"}, 0),
        ({"kind": Event.STEPS_COMMITTED}, 0),
        ({"kind": Event.STEP_COMMITTED}, 1),
        ({"kind": Event.FAULT_DETECTED, "ranks": [{"rank": 0}]}, 0),
        ({}, 0),
    ],
    ids=["rank", "host of 8", "stray rows", "ranks not a list", "no ranks", "bare", "not a commit", "empty"],
)
def test_the_commit_count_is_what_unpacking_gives(ev: dict[str, Any], n: int) -> None:
    assert commit_count(ev) == len(unpack_commits(ev)) == n
    assert commit_count(json.loads(json.dumps(ev))) == n
