"""The launcher's loop keeps Python's garbage collector off its long-lived objects
(``runtime.steady_gc``), and the event log keeps no object per event that the collector must scan."""

from __future__ import annotations

import gc

import pytest

from checkpointless.launch.runtime import FULL_GC_EVERY, steady_gc
from checkpointless.observe.event_log import EventLog

pytestmark = pytest.mark.timeout(30)


def test_the_loop_freezes_what_exists_and_spaces_full_collections_then_restores_both() -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    table = [{"name": f"w{i}", "hb": {"seq": i}} for i in range(1000)]  # a process table
    with steady_gc():
        assert gc.get_freeze_count() >= frozen + len(table)
        assert gc.get_threshold()[2] >= FULL_GC_EVERY
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen


def test_kept_and_held_events_leave_nothing_for_a_full_collection_to_scan() -> None:
    """Each event's clock and own time are kept beside it: a tuple holding the event (a dict) would
    stay tracked by the collector, 200,000 of them at 2,000 hosts."""
    log = EventLog(keep_commits=100)
    for i in range(400):
        ev = {
            "kind": "step_committed",
            "rank": i % 8,
            "gen": 0,
            "step": i // 8,
            "t": float(i),
            "proc": f"w{i % 8}",
        }
        log.record(ev, "h1", float(i))
    gc.collect()
    kept = log._retime_from + [t for _, times in log._held.values() for t in times]
    assert len(kept) > 100
    assert not any(gc.is_tracked(x) for x in kept)
    assert not any(gc.is_tracked(ev) for ev in log.events)
