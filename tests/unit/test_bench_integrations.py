"""``bench/integrations.py``'s turns: which steps of a job count, by turn."""

from __future__ import annotations

import pytest

from bench import integrations

pytestmark = pytest.mark.timeout(60)


def test_a_step_counts_only_inside_its_own_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step counts in the turn it lies in, whole: one that spans a turn change (it waited, or its
    peer did) or that ran before the first turn, in another job's turn or after the last one, does not."""
    monkeypatch.setattr(integrations, "WARMUP", 1)
    flips = [(10.0, "plain"), (20.0, "checkpointless"), (30.0, "plain"), (40.0, "")]
    times = [8.0, 9.0, 11.0, 12.0, 13.5, 19.5, 31.0, 32.0, 39.0, 41.0]
    # after the warm-up (8.0 left out): 9-11 spans the first turn's start; 11-12, 12-13.5 and 13.5-19.5
    # lie in turn 0; 19.5-31 spans two changes (the job waited); 31-32, 32-39 in turn 2; 39-41 ends after the last
    assert integrations._turn_steps(times, flips, "plain") == {0: [1.0, 1.5, 6.0], 2: [1.0, 7.0]}
    assert integrations._turn_steps(times, flips, "checkpointless") == {}
    assert integrations._turn_steps([21.0, 22.0, 23.0, 29.0, 30.5], flips, "checkpointless") == {
        1: [1.0, 6.0]
    }
