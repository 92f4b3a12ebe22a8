"""Tests for checkpointless.observe.metrics.JobMetrics: a private-registry Prometheus endpoint."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from checkpointless.observe.metrics import JobMetrics

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(m: JobMetrics) -> Samples:
    """Fetch /metrics over HTTP and return {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(m.url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode("utf-8")
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class FakeClock:
    """Manually advanced monotonic clock."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def metrics() -> Iterator[JobMetrics]:
    m = JobMetrics(port=0)
    m.start()
    try:
        yield m
    finally:
        m.stop()


@pytest.mark.timeout(60)
def test_scrape_values(metrics: JobMetrics) -> None:
    assert metrics.port > 0
    metrics.step_committed(rank=0, step=1, step_time_s=0.25, tokens=1000)
    metrics.step_committed(rank=1, step=1, step_time_s=0.30, tokens=1000)
    metrics.step_committed(rank=0, step=2, step_time_s=0.20, tokens=1000)
    metrics.fault("crash", "process_exit")
    metrics.fault("crash", "process_exit")
    metrics.fault("hang", "heartbeat_timeout")
    metrics.recovery(0.07)
    metrics.recovery(2.5)
    metrics.generation(3, replicas=4)
    metrics.goodput(0.875)

    s = scrape(metrics)
    assert s[("checkpointless_last_committed_step", ())] == 2
    assert s[("checkpointless_step_commits_total", ())] == 3
    assert s[("checkpointless_goodput", ())] == 0.875
    assert s[("checkpointless_generation", ())] == 3
    assert s[("checkpointless_replicas", ())] == 4
    assert s[("checkpointless_faults_total", (("cause", "process_exit"), ("kind", "crash")))] == 2
    assert s[("checkpointless_faults_total", (("cause", "heartbeat_timeout"), ("kind", "hang")))] == 1
    assert s[("checkpointless_step_time_seconds", (("rank", "0"),))] == pytest.approx(0.20)
    assert s[("checkpointless_step_time_seconds", (("rank", "1"),))] == pytest.approx(0.30)
    assert s[("checkpointless_recovery_seconds_count", ())] == 2
    assert s[("checkpointless_recovery_seconds_sum", ())] == pytest.approx(2.57)
    assert s[("checkpointless_recovery_seconds_bucket", (("le", "0.05"),))] == 0
    assert s[("checkpointless_recovery_seconds_bucket", (("le", "0.1"),))] == 1
    assert s[("checkpointless_recovery_seconds_bucket", (("le", "30.0"),))] == 2
    assert s[("checkpointless_recovery_seconds_bucket", (("le", "+Inf"),))] == 2
    assert s[("checkpointless_tokens_per_second", ())] > 0

    # Lower step after a rollback does not lower the high-water mark.
    metrics.step_committed(rank=0, step=1, step_time_s=0.2, tokens=1000)
    assert scrape(metrics)[("checkpointless_last_committed_step", ())] == 2


@pytest.mark.timeout(60)
def test_private_registry_no_clash() -> None:
    a, b = JobMetrics(port=0), JobMetrics(port=0)  # same metric names, no "Duplicated timeseries"
    a.start()
    b.start()
    try:
        a.fault("kill")
        assert a.port != b.port
        assert scrape(a)[("checkpointless_faults_total", (("cause", "unknown"), ("kind", "kill")))] == 1
        assert ("checkpointless_faults_total", (("cause", "unknown"), ("kind", "kill"))) not in scrape(b)
        assert REGISTRY.get_sample_value("checkpointless_goodput") is None
    finally:
        a.stop()
        b.stop()


@pytest.mark.timeout(60)
def test_tokens_per_second_window() -> None:
    clock = FakeClock()
    m = JobMetrics(port=0, window_s=10.0, clock=clock)
    m.start()
    try:
        assert scrape(m)[("checkpointless_tokens_per_second", ())] == 0
        # 2 ranks x 1000 tokens per 0.5 s step -> 4000 tokens/s
        for step in range(10):
            clock.t += 0.5
            for rank in (0, 1):
                m.step_committed(rank=rank, step=step, step_time_s=0.5, tokens=1000)
        assert scrape(m)[("checkpointless_tokens_per_second", ())] == pytest.approx(4000.0)
        # Steady state over a full window: still 4000 tokens/s.
        for step in range(10, 60):
            clock.t += 0.5
            for rank in (0, 1):
                m.step_committed(rank=rank, step=step, step_time_s=0.5, tokens=1000)
        assert scrape(m)[("checkpointless_tokens_per_second", ())] == pytest.approx(4000.0, rel=0.06)
        # Stall: no commits for longer than the window -> rate decays to 0.
        clock.t += 11.0
        assert scrape(m)[("checkpointless_tokens_per_second", ())] == 0
    finally:
        m.stop()


@pytest.mark.timeout(60)
def test_port_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        busy = sock.getsockname()[1]
        m = JobMetrics(port=busy)
        with pytest.raises(OSError, match=str(busy)) as info:
            m.start()
        assert "in use" in str(info.value)
        assert not m.running
        m.stop()  # harmless when never started


@pytest.mark.timeout(60)
def test_bad_port() -> None:
    with pytest.raises(ValueError, match="70000"):
        JobMetrics(port=70000)


@pytest.mark.timeout(60)
def test_stop_frees_port() -> None:
    m = JobMetrics(port=0)
    m.start()
    port = m.port
    scrape(m)
    with pytest.raises(RuntimeError):
        m.start()
    m.stop()
    m.stop()  # idempotent
    assert not m.running
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    # The same port can be bound again, by a fresh JobMetrics.
    with JobMetrics(port=port) as again:
        assert again.port == port
        again.generation(7)
        assert scrape(again)[("checkpointless_generation", ())] == 7
