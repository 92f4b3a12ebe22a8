"""Host utilisation (observe/usage.py): sampled from /proc, summarised per host for report.json,
served on the Prometheus endpoint labelled by host and rank."""

from __future__ import annotations

from checkpointless.observe.metrics import JobMetrics
from checkpointless.observe.usage import UsageRecorder, UsageSampler, summarize


def test_a_sample_has_this_hosts_cpu_share_and_memory() -> None:
    sampler = UsageSampler()
    x = 0
    for i in range(2_000_000):  # some CPU between two samples
        x += i
    s = sampler.sample()
    assert s["cpus"] >= 1 and 0.0 <= s["cpu_percent"] <= 100.0
    assert 0 < s["mem_used_bytes"] < s["mem_total_bytes"]
    assert "gpus" not in s or isinstance(s["gpus"], list)  # NVML only where a driver is


def test_rank_cpu_share_is_the_rate_of_its_cpu_time() -> None:
    r = UsageRecorder(every_s=2.0)
    assert r.due(10.0) and not r.due(11.0) and r.due(12.0)
    assert r.rank_cpu(10.0, "w0", 5.0) is None  # the first sample: no rate yet
    assert r.rank_cpu(12.0, "w0", 6.5) == 75.0
    assert r.rank_cpu(14.0, "w0", None) is None  # not readable (a lost host)


def test_report_summary_and_metrics_per_host() -> None:
    events = [
        {"kind": "host_usage", "host": "a", "cpu_percent": 50.0, "mem_used_bytes": 10, "ranks": {"0": 90.0},
         "gpus": [{"index": 0, "util_percent": 80.0, "mem_used_bytes": 7, "mem_total_bytes": 9}]},
        {"kind": "host_usage", "host": "a", "cpu_percent": 70.0, "mem_used_bytes": 30,
         "gpus": [{"index": 0, "util_percent": 0.0, "mem_used_bytes": 8, "mem_total_bytes": 9}]},
        {"kind": "host_usage", "host": "b", "cpu_percent": 10.0, "mem_used_bytes": 5},
        {"kind": "step_committed", "rank": 0},
    ]  # fmt: skip
    hosts = summarize(events)
    assert hosts["a"] == {
        "samples": 2, "cpu_percent_mean": 60.0, "cpu_percent_max": 70.0, "mem_used_bytes_max": 30,
        "gpus": [{"index": 0, "util_percent_mean": 40.0, "mem_used_bytes_max": 8}],
    }  # fmt: skip
    assert hosts["b"]["cpu_percent_mean"] == 10.0 and "gpus" not in hosts["b"]
    m = JobMetrics(0)
    for e in events[:3]:
        m.host_usage(e)
    from prometheus_client import generate_latest

    text = generate_latest(m.registry).decode()
    assert 'checkpointless_host_cpu_percent{host="b"} 10.0' in text
    assert 'checkpointless_rank_cpu_percent{host="a",rank="0"} 90.0' in text
    assert 'checkpointless_gpu_utilization_percent{gpu="0",host="a"} 0.0' in text
