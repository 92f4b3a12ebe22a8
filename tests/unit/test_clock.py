"""Clock offsets from heartbeats (control/clock.py): a skewed host's events land on the
coordinator's time base; a clock that steps is followed; an outlier is not."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointless.control.clock import SHOWN_S, ClockOffsets


def _beats(
    offsets: ClockOffsets, proc: str, skew: float, n: int, rng: random.Random, t0: float = 1000.0
) -> float:
    """``n`` heartbeats, each written after the previous read began and read by the next one."""
    read_began = t0
    for _ in range(n):
        written = read_began + rng.uniform(0, 0.1)
        read = written + rng.uniform(0, 0.05)
        offsets.observe(proc, written + skew, read_began, read + 0.001)
        read_began = read
    return read_began


@pytest.mark.parametrize("skew", [30.0, -7.5, 0.2])
def test_the_offset_converges_to_the_skew(skew: float) -> None:
    offsets = ClockOffsets()
    _beats(offsets, "w1", skew, 200, random.Random(1))
    assert abs(offsets.offset("w1") - skew) < 0.01
    assert offsets.uncertainty("w1") is not None and offsets.uncertainty("w1") < 0.02  # type: ignore[operator]
    assert offsets.to_coordinator("w1", 2000.0 + skew) == pytest.approx(2000.0, abs=0.01)
    assert set(offsets.shown()) == {"w1"}


def test_a_process_on_the_coordinators_clock_is_not_moved() -> None:
    offsets = ClockOffsets()
    _beats(offsets, "w0", 0.0, 200, random.Random(2))
    assert offsets.offset("w0") == 0.0 and offsets.shown() == {}
    assert offsets.offset("never-heard") == 0.0


def test_one_late_heartbeat_does_not_move_the_estimate() -> None:
    offsets = ClockOffsets()
    rng = random.Random(3)
    t = _beats(offsets, "w1", 5.0, 100, rng)
    # stamped, then descheduled for 0.4 s before it reached the store: its upper bound is wrong
    offsets.observe("w1", t + 5.0, t + 0.35, t + 0.45)
    assert abs(offsets.offset("w1") - 5.0) < 0.02


def test_a_clock_that_steps_is_followed() -> None:
    offsets = ClockOffsets()
    rng = random.Random(4)
    t = _beats(offsets, "w1", 5.0, 100, rng)
    _beats(offsets, "w1", 9.0, 100, rng, t0=t)
    assert abs(offsets.offset("w1") - 9.0) < 0.02


@settings(max_examples=60, deadline=None)
@given(skew=st.floats(-3600, 3600), seed=st.integers(0, 10_000))
def test_the_true_offset_stays_inside_the_interval(skew: float, seed: int) -> None:
    offsets = ClockOffsets()
    _beats(offsets, "w", skew, 50, random.Random(seed))
    half = offsets.uncertainty("w")
    assert half is not None
    estimate = offsets.offset("w") if abs(skew) >= 2 * SHOWN_S else skew
    assert abs(estimate - skew) <= half + 1e-6
