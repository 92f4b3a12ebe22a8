"""One derivation of the step figures: report.json, the live console and /metrics agree on every prefix."""

from __future__ import annotations

import itertools
import random
import statistics
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from checkpointless.observe.console import LiveProgress
from checkpointless.observe.live_metrics import MetricsFeed
from checkpointless.observe.metrics import JobMetrics
from checkpointless.observe.progress import StepStats
from checkpointless.observe.report import build_report

pytestmark = pytest.mark.timeout(60)

Event = dict[str, Any]


def _reference(events: list[Event]) -> tuple[int, float, float, float]:
    """The figures by their definitions, recomputed from scratch (steps, step time, wall, goodput)."""
    commits = [e for e in events if e["kind"] == "step_committed"]
    if not commits:
        return 0, 0.0, 0.0, 0.0
    by_rank: dict[int, list[tuple[float, int, int]]] = {}
    for e in commits:
        by_rank.setdefault(e["rank"], []).append((e["t"], e["step"], e["gen"]))
    gaps = []
    for cs in by_rank.values():
        cs.sort()
        gaps += [b[0] - a[0] for a, b in itertools.pairwise(cs) if a[2] == b[2] and b[1] == a[1] + 1]
    step_time = statistics.median(gaps) if gaps else 0.0
    # each rank's highest step, and the newest generation it committed that step in; the count is
    # over the ranks whose highest step is in the newest such generation (not ranks a shrink left)
    last = {r: max((c[1], c[2]) for c in cs) for r, cs in by_rank.items()}
    top = max(gen for _, gen in last.values())
    steps = min(step for step, gen in last.values() if gen == top) + 1
    wall = max(e["t"] for e in commits) - min(e["t"] - e["step_time_s"] for e in commits)
    return steps, step_time, wall, (min(1.0, steps * step_time / wall) if wall > 0 else 0.0)


_commit = st.fixed_dictionaries(
    {
        "kind": st.just("step_committed"),
        "t": st.floats(0, 100, allow_nan=False).map(lambda x: round(x, 3)),
        "rank": st.integers(0, 3),
        "step": st.integers(0, 12),
        "gen": st.integers(0, 2),
        "step_time_s": st.floats(0, 1).map(lambda x: round(x, 3)),
        "tokens": st.integers(0, 100),
    }
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_commit, max_size=40), st.randoms())
def test_fed_in_any_order_the_figures_match_their_definitions(
    events: list[Event], rnd: random.Random
) -> None:
    shuffled = list(events)
    rnd.shuffle(shuffled)
    stats = StepStats.of(shuffled)
    steps, step_time, wall, goodput = _reference(events)
    assert stats.steps_completed == steps
    assert stats.step_time_s == pytest.approx(step_time)
    assert stats.wall_s == pytest.approx(wall)
    assert stats.goodput == pytest.approx(goodput)
    assert 0.0 <= stats.goodput <= 1.0
    assert stats.tokens == sum(e["tokens"] for e in events)


def test_a_window_keeps_few_interval_counters_and_the_median_to_four_digits() -> None:
    """A live view (``window=``) fed a long job whose step times never repeat exactly: its counters
    stay bounded by the spread of the intervals, and its median is the exact one to 0.05%."""
    rnd = random.Random(7)
    ranks, steps = 50, 400
    events = [
        {"kind": "step_committed", "t": s * 1.0 + r * 1e-3 + rnd.uniform(0.0, 0.5), "rank": r, "step": s, "gen": 0,
         "step_time_s": 1.0}
        for r in range(ranks) for s in range(steps)
    ]  # fmt: skip
    live, whole = StepStats(window=4), StepStats.of(events)
    for ev in events:
        live.add(ev)
    assert len(live._gaps) <= 5_001 + 501  # intervals 0.5 to 1.5 s at 4 digits: 0.5000-0.9999, 1.000-1.500
    assert len(whole._gaps) > 3 * len(live._gaps)  # without a window every distinct interval is counted
    assert live.step_time_s == pytest.approx(whole.step_time_s, rel=5e-4)
    assert live.steps_completed == whole.steps_completed == steps


def test_malformed_commits_and_other_events_are_ignored() -> None:
    stats = StepStats()
    assert not stats.add({"kind": "step_committed", "t": "soon", "rank": 0, "step": 0})
    assert not stats.add({"kind": "step_committed", "t": 1.0, "rank": True, "step": 0})
    assert not stats.add({"kind": "fault_detected", "t": 1.0, "rank": 0, "step": 0})
    assert stats.steps_completed == 0 and stats.goodput == 0.0


def _run(ranks: int = 2, steps: int = 12) -> list[Event]:
    """Commits of a run with a stall in the middle (a recovery), arriving rank by rank."""
    events: list[Event] = []
    for s in range(steps):
        t = 10.0 + 0.1 * s + (1.5 if s >= 6 else 0.0)
        for r in range(ranks):
            events.append({"kind": "step_committed", "t": t + 0.001 * r, "rank": r, "step": s,
                           "gen": int(s >= 6), "step_time_s": 0.1, "tokens": 64, "loss": 2.0 - 0.1 * s})  # fmt: skip
    events.insert(13, {"kind": "recovery_done", "t": 10.7, "seconds": 1.2, "proc": "coordinator"})
    return events


def _gauge(metrics: JobMetrics, name: str) -> float:
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    raise KeyError(name)


def test_console_metrics_and_report_agree_on_every_prefix() -> None:
    events = _run()
    live: list[Event] = []
    metrics = JobMetrics(port=0)
    feed = MetricsFeed(metrics, live)
    console = Console(record=True, width=200)
    progress = LiveProgress(12, live, console, every_s=0.0)
    coord = SimpleNamespace(plan=SimpleNamespace(gen=0, world_size=2, shards=1), ready_spares=lambda: [])
    for i, ev in enumerate(events):
        live.append(ev)
        feed.add(ev)
        progress.add(ev)
        feed(coord)  # type: ignore[arg-type]
        line = progress.line(coord, now=float(i))  # type: ignore[arg-type]
        report = build_report(sorted(live, key=lambda e: e["t"]), total_steps=12, digest=None)
        assert f"step {report['steps_completed']}/12" in line
        if report["steps_completed"]:
            shown = float(line.split("goodput ")[1].split()[0])
            assert shown == pytest.approx(report["goodput"], abs=0.005 + 1e-9)  # shown with 2 decimals
            assert _gauge(metrics, "checkpointless_goodput") == pytest.approx(report["goodput"], abs=1e-4)
    assert report["steps_completed"] == 12 and 0.3 < report["goodput"] < 1.0  # the stall costs goodput
    assert _gauge(metrics, "checkpointless_last_committed_step") == 11
    assert _gauge(metrics, "checkpointless_step_commits_total") == 24
    assert _gauge(metrics, "checkpointless_recovery_seconds_count") == 1
    assert "loss 0.9000" in line  # the lowest rank's latest commit
