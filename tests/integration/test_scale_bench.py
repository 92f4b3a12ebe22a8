"""Tests of ``bench/scale.py``: parameters from measured / missing inputs, and Young/Daly's closed form."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import scale
from checkpointless.analysis.simulate import ClusterParams, sweep, young_daly_interval

pytestmark = [pytest.mark.timeout(120)]

RECOVERY = {
    "recovery_config": {"hang_timeout_s": 2.0, "heartbeat_interval_s": 0.2},
    "summary": {
        "kill": {
            "detection_s": {"median": 0.03},
            "transfer_gbps": {"median": 0.5},
            "split_median": {"plan": 0.01, "join": 0.02},
        },
        "hang": {"detection_s": {"median": 2.5}},
    },
}
COMPARE = {
    "recovery": {"torchrun": {"all_ranks_s": {"median": 7.0}}},
    "torchrun_tuning": {"ckpt_s": 0.3},
}
FORMATION: dict[str, Any] = {"world_sizes": [2, 4], "fit": {"a_s": 0.004, "b_s_per_rank": 0.002, "r2": 0.9}}
RECIPE = {"recovery_bytes": 16e9, "workers": 256.0, "shards": 64.0, "approx_flops_per_step": 1.024e18}


def _rows(table: list[scale.Param]) -> dict[str, scale.Param]:
    return {p.field: p for p in table if p.field is not None}


def test_params_from_measurements(tmp_path: Path) -> None:
    (tmp_path / "rec.json").write_text(json.dumps(RECOVERY))
    (tmp_path / "cmp.json").write_text(json.dumps(COMPARE))
    (tmp_path / "ss.json").write_text(json.dumps({"summary": {"checkpointless": {"overhead_pct": 5.0}}}))
    p, table, m = scale.build_params(
        formation=FORMATION,
        recovery_json=tmp_path / "rec.json",
        compare_json=tmp_path / "cmp.json",
        steady_json=tmp_path / "ss.json",
        recipe=RECIPE,
    )
    rows = _rows(table)
    assert p.detect_base_s == 0.03 and "measured here" in rows["detect_base_s"].source
    assert p.detect_per_log2_rank_s == 0.2
    assert p.reform_base_s == pytest.approx(0.03)
    assert p.reform_per_rank_s == p.restart_per_rank_s == 0.002
    assert "measured here" in rows["reform_per_rank_s"].source
    assert p.restart_base_s == 7.0 and "measured here" in rows["restart_base_s"].source
    assert p.shard_state_gb == pytest.approx(16.0)
    assert p.checkpoint_cost_s == pytest.approx(0.3 + 16.0 / scale.STORAGE_WRITE_GB_S)
    assert p.step_time_s == pytest.approx(1.024e18 / (256 * scale.ACHIEVED_FLOP_S))
    assert p.failures_per_accel_hour == ClusterParams().failures_per_accel_hour
    assert m["loopback_transfer_gb_s"] == (0.5, "measured here (recovery_stall.json)")
    assert m["steady_overhead"][0] == pytest.approx(0.05)
    assert all(r.source and r.growth for r in table)
    assert not any(scale.NOT_MEASURED in r.source for r in table)
    # per-shard transfer does not grow with N; the measured formation slope does
    a, b = sweep([1000, 100_000], p)
    assert b["recovery_cost_s"] - a["recovery_cost_s"] == pytest.approx(
        0.002 * 99_000 + 0.2 * (math.log2(100_000) - math.log2(1000))
    )


def test_params_fall_back_to_documented_defaults(tmp_path: Path) -> None:
    p, table, m = scale.build_params(
        formation=None, recovery_json=tmp_path / "missing.json", compare_json=None, recipe=None
    )
    rows = _rows(table)
    for f, key in (("detect_base_s", "kill_detect_s"), ("restart_base_s", "torchrun_restart_s")):
        assert getattr(p, f) == scale.DEFAULTS[key]
        assert scale.NOT_MEASURED in rows[f].source
    assert p.reform_per_rank_s == scale.DEFAULTS["formation_slope_s"]
    assert scale.NOT_MEASURED in rows["reform_per_rank_s"].source
    assert scale.NOT_MEASURED in rows["shard_state_gb"].source
    assert all(src == scale.NOT_MEASURED for _, src in m.values())
    # a malformed file counts as missing
    (tmp_path / "bad.json").write_text("{not json")
    p2, _, _ = scale.build_params(formation=None, recovery_json=tmp_path / "bad.json", compare_json=None)
    assert p2.detect_base_s == scale.DEFAULTS["kill_detect_s"]


@pytest.mark.parametrize(("c", "m"), [(1.0, 1e6), (10.0, 3.6e6), (60.0, 1e7)])
def test_young_daly_matches_closed_form_for_small_c_over_m(c: float, m: float) -> None:
    # Daly's estimate -> Young's sqrt(2 C M) as C/M -> 0; the relative gap is about sqrt(C/2M)/3.
    tau = young_daly_interval(c, m)
    closed = math.sqrt(2 * c * m)
    assert tau == pytest.approx(closed, rel=2 * math.sqrt(c / (2 * m)))
    assert abs(tau / closed - 1) < 0.01


def test_fit_linear_recovers_a_line() -> None:
    fit = scale.fit_linear([2.0, 4.0, 8.0, 16.0], [0.01 + 0.003 * n for n in (2, 4, 8, 16)])
    assert fit["a_s"] == pytest.approx(0.01) and fit["b_s_per_rank"] == pytest.approx(0.003)
    assert fit["r2"] == pytest.approx(1.0)
