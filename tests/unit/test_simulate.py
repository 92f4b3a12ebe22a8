"""Tests for checkpointless.analysis.simulate: closed forms, Monte-Carlo cross-checks, sweep, plot, CLI."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointless.analysis import simulate as sim
from checkpointless.analysis.montecarlo import failure_times
from checkpointless.analysis.simulate import (
    LLAMA3_FAILURES_PER_GPU_HOUR,
    ClusterParams,
    goodput_checkpoint_restart,
    goodput_checkpointless,
    optimal_interval_exact,
    simulate_mc,
    spare_pool_stats,
    sweep,
    young_daly_interval,
    young_interval,
)
from checkpointless.cli import simulate as simulate_command

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _argmin(f: object, lo: float, hi: float, n: int = 20001) -> float:
    """Grid search then golden-section refinement of a unimodal function on [lo, hi]."""
    assert callable(f)
    xs = np.geomspace(lo, hi, n)
    ys = np.array([f(float(x)) for x in xs])
    i = int(np.argmin(ys))
    a, b = float(xs[max(i - 1, 0)]), float(xs[min(i + 1, n - 1)])
    g = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(100):
        c, d = b - g * (b - a), a + g * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return 0.5 * (a + b)


# ---------------------------------------------------------------------------- parameters


@pytest.mark.timeout(60)
def test_default_failure_rate_is_llama3() -> None:
    p = ClusterParams()
    assert p.failures_per_accel_hour == pytest.approx(419 / (54 * 24 * 16384))
    assert pytest.approx(1.9733e-5, rel=1e-3) == LLAMA3_FAILURES_PER_GPU_HOUR
    # 16,384 GPUs -> job MTBF = 54 days * 24 h / 419 interruptions
    assert p.mtbf_s / 3600 == pytest.approx(54 * 24 / 419)


@pytest.mark.timeout(60)
def test_costs_scale_as_documented() -> None:
    small = ClusterParams(n_accelerators=1024)
    big = ClusterParams(n_accelerators=1024 * 64)
    # restart cost grows with N, and more than checkpointless recovery does
    assert big.restart_cost_s > small.restart_cost_s
    assert big.recovery_cost_s > small.recovery_cost_s
    assert big.restart_cost_s - small.restart_cost_s > big.recovery_cost_s - small.recovery_cost_s
    # state transfer does not grow with N
    assert big.state_transfer_s == small.state_transfer_s == pytest.approx(4.0 / 25.0)
    # recovery includes one re-executed step
    no_step = replace(small, step_time_s=1e-9)
    assert small.recovery_cost_s - no_step.recovery_cost_s == pytest.approx(small.step_time_s)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_accelerators", 0),
        ("n_accelerators", 1.5),
        ("n_accelerators", True),
        ("failures_per_accel_hour", 0.0),
        ("failures_per_accel_hour", -1e-5),
        ("failures_per_accel_hour", math.nan),
        ("step_time_s", 0.0),
        ("checkpoint_cost_s", -1.0),
        ("restart_base_s", -1.0),
        ("restart_per_rank_s", math.inf),
        ("reform_per_log2_rank_s", -0.1),
        ("peer_bandwidth_gb_s", 0.0),
        ("spare_pool_size", -1),
        ("spare_pool_size", 2.0),
        ("spare_replace_s", -5.0),
        ("checkpointless_overhead", 1.0),
        ("checkpointless_overhead", -0.01),
        ("shard_state_gb", "big"),
    ],
)
def test_invalid_params_raise_naming_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ClusterParams(**{field: value})  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_params_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        ClusterParams(1000)  # type: ignore[misc]


@pytest.mark.timeout(60)
def test_invalid_function_args_raise() -> None:
    p = ClusterParams()
    with pytest.raises(ValueError, match="checkpoint_cost_s"):
        young_daly_interval(0.0, 100.0)
    with pytest.raises(ValueError, match="mtbf_s"):
        young_daly_interval(10.0, -1.0)
    with pytest.raises(ValueError, match="interval_s"):
        goodput_checkpoint_restart(p, interval_s=0.0)
    with pytest.raises(ValueError, match="system"):
        simulate_mc(p, "magic", 10.0, 0)
    with pytest.raises(ValueError, match="hours"):
        simulate_mc(p, "checkpointless", 0.0, 0)
    with pytest.raises(ValueError, match="hours"):
        simulate_mc(p, "checkpointless", 1e12, 0)
    with pytest.raises(ValueError, match="sizes"):
        sweep([], p)
    with pytest.raises(ValueError, match="n_accelerators"):
        sweep([0], p)


# ----------------------------------------------------------------- Young / Daly interval


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("c", "m"), [(60.0, 11_000.0), (10.0, 3600.0), (300.0, 2_000.0), (1.0, 1e6)])
def test_young_daly_closed_form(c: float, m: float) -> None:
    x = c / (2 * m)
    expected = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert young_daly_interval(c, m) == pytest.approx(expected, rel=1e-12)
    assert young_interval(c, m) == pytest.approx(math.sqrt(2 * c * m), rel=1e-12)
    # Daly reduces to Young when C << M
    if c / m < 1e-5:
        assert young_daly_interval(c, m) == pytest.approx(young_interval(c, m), rel=1e-3)


@pytest.mark.timeout(60)
def test_young_daly_large_checkpoint_cost_uses_mtbf() -> None:
    assert young_daly_interval(500.0, 200.0) == 200.0
    assert young_daly_interval(400.0, 200.0) == 200.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1000, 16384, 100_000])
def test_young_minimises_first_order_waste_numerically(n: int) -> None:
    p = ClusterParams(n_accelerators=n)
    tau_num = _argmin(lambda t: sim.checkpoint_restart_waste_first_order(p, t), 1.0, 10 * p.mtbf_s)
    assert tau_num == pytest.approx(young_interval(p.checkpoint_cost_s, p.mtbf_s), rel=1e-4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("c", "m"), [(60.0, 11_000.0), (60.0, 1800.0), (300.0, 2_000.0), (5.0, 1e5)])
def test_daly_interval_near_numerical_optimum_of_exact_waste(c: float, m: float) -> None:
    p = ClusterParams(
        checkpoint_cost_s=c,
        failures_per_accel_hour=3600.0 / (m * 16384),
        n_accelerators=16384,
    )
    assert p.mtbf_s == pytest.approx(m)
    tau_num = _argmin(lambda t: -goodput_checkpoint_restart(p, interval_s=t), 1.0, 10 * m)
    # the exact (bisection) optimum matches the numerical one
    assert optimal_interval_exact(c, m) == pytest.approx(tau_num, rel=1e-4)
    # Daly's higher-order estimate is within a couple of percent of it ...
    tau_daly = young_daly_interval(c, m)
    assert tau_daly == pytest.approx(tau_num, rel=0.02)
    # ... and loses (almost) no goodput, better than Young's first-order interval
    g_opt = goodput_checkpoint_restart(p, interval_s=tau_num)
    g_daly = goodput_checkpoint_restart(p, interval_s=tau_daly)
    g_young = goodput_checkpoint_restart(p, interval_s=young_interval(c, m))
    assert g_opt - g_daly < 1e-4
    assert g_daly >= g_young - 1e-12
    # None means the Daly interval
    assert goodput_checkpoint_restart(p) == pytest.approx(g_daly)


@pytest.mark.timeout(60)
def test_checkpoint_restart_first_order_agrees_for_rare_failures() -> None:
    p = ClusterParams(n_accelerators=1000)
    tau = young_daly_interval(p.checkpoint_cost_s, p.mtbf_s)
    waste = sim.checkpoint_restart_waste_first_order(p, tau)
    assert goodput_checkpoint_restart(p) == pytest.approx(1 - waste, abs=2e-3)


# ---------------------------------------------------------------------- spare pool model


@pytest.mark.timeout(60)
def test_spare_pool_stats_poisson_closed_form() -> None:
    p = ClusterParams(n_accelerators=100_000, spare_pool_size=3, spare_replace_s=3600.0)
    a = p.failure_rate_per_s * 3600.0
    pmf = [math.exp(-a) * a**k / math.factorial(k) for k in range(80)]
    st_ = spare_pool_stats(p)
    assert st_["offered_load"] == pytest.approx(a)
    assert st_["p_pool_empty"] == pytest.approx(1 - sum(pmf[:3]), rel=1e-9)
    assert st_["p_waiting"] == pytest.approx(1 - sum(pmf[:4]), rel=1e-9)
    backorders = sum((k - 3) * q for k, q in enumerate(pmf) if k > 3)
    assert st_["mean_wait_s"] == pytest.approx(backorders / p.failure_rate_per_s, rel=1e-9)


@pytest.mark.timeout(60)
def test_no_spares_means_every_failure_waits_full_replacement() -> None:
    p = ClusterParams(n_accelerators=1000, spare_pool_size=0, spare_replace_s=600.0)
    st_ = spare_pool_stats(p)
    assert st_["p_pool_empty"] == 1.0
    assert st_["mean_wait_s"] == pytest.approx(600.0)


@pytest.mark.timeout(60)
def test_mc_spare_waits_match_erlang_formula() -> None:
    """Per-failure FIFO waits in the MC average to E[(K - S)^+] / lam."""
    p = ClusterParams(n_accelerators=100_000, spare_pool_size=6, spare_replace_s=4 * 3600.0)
    rng = np.random.default_rng(3)
    t = failure_times(p, 20_000 * 3600.0, rng)
    s = p.spare_pool_size
    waits = np.maximum(0.0, t[:-s] + p.spare_replace_s - t[s:])
    assert waits.mean() == pytest.approx(spare_pool_stats(p)["mean_wait_s"], rel=0.05)
    assert (waits > 0).mean() == pytest.approx(spare_pool_stats(p)["p_pool_empty"], abs=0.02)


# ---------------------------------------------------------- Monte-Carlo vs closed forms


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1000, 16384, 100_000])
@pytest.mark.parametrize("system", ["checkpoint_restart", "checkpointless"])
def test_monte_carlo_matches_analytic(n: int, system: str) -> None:
    p = ClusterParams(n_accelerators=n)
    analytic = goodput_checkpoint_restart(p) if system == "checkpoint_restart" else goodput_checkpointless(p)
    mc = simulate_mc(p, system, hours=20_000.0, seed=7)
    assert mc == pytest.approx(analytic, abs=0.005)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("spares", "tol"), [(0, 0.01), (4, 0.02), (8, 0.01)])
def test_monte_carlo_matches_analytic_with_scarce_spares(spares: int, tol: float) -> None:
    p = ClusterParams(n_accelerators=100_000, spare_pool_size=spares, spare_replace_s=4 * 3600.0)
    assert spare_pool_stats(p)["p_pool_empty"] > 0.1  # the pool really runs dry
    mc = simulate_mc(p, "checkpointless", hours=20_000.0, seed=11)
    assert mc == pytest.approx(goodput_checkpointless(p), abs=tol)


@pytest.mark.timeout(60)
def test_monte_carlo_non_optimal_interval_and_hyphen_alias() -> None:
    p = ClusterParams(n_accelerators=32768, checkpoint_cost_s=120.0)
    mc = simulate_mc(p, "checkpoint-restart", hours=20_000.0, seed=5)
    assert mc == pytest.approx(goodput_checkpoint_restart(p), abs=0.005)


@pytest.mark.timeout(60)
def test_monte_carlo_is_seeded() -> None:
    p = ClusterParams(n_accelerators=100_000)
    for system in sim.SYSTEMS:
        a = simulate_mc(p, system, 500.0, 42)
        assert a == simulate_mc(p, system, 500.0, 42)
        assert 0.0 <= a <= 1.0
    assert simulate_mc(p, "checkpoint_restart", 500.0, 1) != simulate_mc(p, "checkpoint_restart", 500.0, 2)


@pytest.mark.timeout(60)
def test_monte_carlo_without_failures() -> None:
    p = ClusterParams(n_accelerators=1, failures_per_accel_hour=1e-12, checkpointless_overhead=0.05)
    assert simulate_mc(p, "checkpointless", 10.0, 0) == pytest.approx(0.95)
    # the Daly interval (~7.6 years) is far beyond 10 h: all compute, no checkpoint written yet
    assert sim.checkpoint_restart_interval(p) > 36_000
    assert simulate_mc(p, "checkpoint_restart", 10.0, 0) == 1.0


# ------------------------------------------------------------------------ sweep / shape


@pytest.mark.timeout(60)
def test_goodput_decreases_with_cluster_size() -> None:
    rows = sweep(list(sim.DEFAULT_SWEEP_SIZES), ClusterParams())
    assert [r["n_accelerators"] for r in rows] == list(sim.DEFAULT_SWEEP_SIZES)
    for key in ("goodput_checkpoint_restart", "goodput_checkpointless"):
        vals = [r[key] for r in rows]
        assert all(0.0 < v < 1.0 for v in vals)
        assert all(b < a for a, b in itertools.pairwise(vals)), (key, vals)


@pytest.mark.timeout(60)
def test_checkpointless_beats_checkpoint_restart_by_default() -> None:
    for r in sweep([1000, 10_000, 16_384, 100_000], ClusterParams()):
        assert r["goodput_checkpointless"] >= r["goodput_checkpoint_restart"], r
    p = ClusterParams()
    assert goodput_checkpointless(p) >= goodput_checkpoint_restart(p)
    assert goodput_checkpointless(p) <= 1 - p.checkpointless_overhead


@pytest.mark.timeout(60)
def test_sweep_with_monte_carlo_columns() -> None:
    rows = sweep([1000, 100_000], ClusterParams(), mc_hours=2000.0, seed=1)
    for r in rows:
        assert r["mc_checkpointless"] == pytest.approx(r["goodput_checkpointless"], abs=0.02)
        assert r["mc_checkpoint_restart"] == pytest.approx(r["goodput_checkpoint_restart"], abs=0.03)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(min_value=1, max_value=200_000),
    rate=st.floats(min_value=1e-7, max_value=1e-3),
    ckpt=st.floats(min_value=1.0, max_value=600.0),
    restart=st.floats(min_value=0.0, max_value=1800.0),
    spares=st.integers(min_value=0, max_value=64),
    replace_s=st.floats(min_value=0.0, max_value=86_400.0),
    overhead=st.floats(min_value=0.0, max_value=0.2),
    factor=st.floats(min_value=0.1, max_value=10.0),
)
@pytest.mark.timeout(60)
def test_property_goodput_bounds_and_optimality(
    n: int,
    rate: float,
    ckpt: float,
    restart: float,
    spares: int,
    replace_s: float,
    overhead: float,
    factor: float,
) -> None:
    p = ClusterParams(
        n_accelerators=n,
        failures_per_accel_hour=rate,
        checkpoint_cost_s=ckpt,
        restart_base_s=restart,
        spare_pool_size=spares,
        spare_replace_s=replace_s,
        checkpointless_overhead=overhead,
    )
    g_cr = goodput_checkpoint_restart(p)
    g_cl = goodput_checkpointless(p)
    assert 0.0 <= g_cr < 1.0
    assert 0.0 <= g_cl <= 1.0 - overhead
    # the exact optimum is at least as good as any other interval
    tau_opt = optimal_interval_exact(p.checkpoint_cost_s, p.mtbf_s)
    g_best = goodput_checkpoint_restart(p, interval_s=tau_opt)
    assert g_best >= goodput_checkpoint_restart(p, interval_s=tau_opt * factor) - 1e-12
    # more accelerators never help
    bigger = replace(p, n_accelerators=2 * n)
    assert goodput_checkpointless(bigger) <= g_cl + 1e-12
    assert goodput_checkpoint_restart(bigger, interval_s=tau_opt) <= g_best + 1e-12
    # more spares never hurt
    assert goodput_checkpointless(replace(p, spare_pool_size=spares + 1)) >= g_cl - 1e-12


# -------------------------------------------------------------------------- plot and CLI


@pytest.mark.timeout(60)
def test_plot_sweep_writes_png(tmp_path: Path) -> None:
    rows = sweep([1000, 10_000, 100_000], ClusterParams(), mc_hours=200.0)
    out = sim.plot_sweep(rows, tmp_path / "g.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(60)
def test_main_writes_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    rc = simulate_command.run(["--sizes", "1000,10000,100000", "--out", str(out), "--step-time-s", "5"])
    assert rc == 0
    data = json.loads((out / "simulate.json").read_text())
    assert [r["n_accelerators"] for r in data["rows"]] == [1000, 10_000, 100_000]
    assert data["params"]["step_time_s"] == 5.0
    assert (out / "goodput.png").read_bytes()[:8] == PNG_MAGIC
    captured = capsys.readouterr()
    assert "100000" in captured.out
    assert captured.err == ""


@pytest.mark.timeout(60)
def test_main_default_prints_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_command.run(["--mc-hours", "100", "--sizes", "2048"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[0].startswith("parameters: ") and "2048" in out[2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "argv",
    [
        ["--sizes", "1000,abc"],
        ["--sizes", "0,1000"],
        ["--sizes", ""],
        ["--failures-per-accel-hour", "-1"],
        ["--step-time-s", "fast"],
        ["--spare-pool-size", "1.5"],
        ["--checkpointless-overhead", "1.5"],
        ["--mc-hours", "-3"],
        ["--no-such-option"],
        ["positional"],
    ],
)
def test_main_bad_input_one_line_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_command.run(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("checkpointless simulate: error:")
    assert "Traceback" not in captured.err
    assert captured.out == ""


@pytest.mark.timeout(60)
def test_main_unwritable_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert simulate_command.run(["--sizes", "1000", "--out", str(blocker / "sub")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.timeout(60)
def test_main_help_returns_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_command.run(["--help"]) == 0
    out = capsys.readouterr().out
    for opt in ("--sizes", "--out", "--checkpoint-cost-s", "--spare-replace-s", "--reform-per-rank-s"):
        assert opt in out


def test_every_run_says_where_its_parameters_come_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert simulate_command.run(["--sizes", "1000"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("parameters: 17 defaults calibrated to published figures")
    assert "14 of them assumptions (checkpoint_cost_s, checkpoint_load_s, restart_base_s" in first
    measured = tmp_path / "measured.json"
    measured.write_text(
        json.dumps({"params": {"detect_base_s": 0.05, "restart_base_s": 30.0, "n_accelerators": 8}})
    )
    assert simulate_command.run(["--sizes", "1000", "--params", str(measured), "--restart-base-s", "45"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert f"1 from {measured}" in first and "1 from flags" in first and "15 defaults calibrated" in first
    with_file = simulate_command.run(
        ["--sizes", "1000", "--params", str(measured), "--out", str(tmp_path / "o")]
    )
    assert with_file == 0
    params = json.loads((tmp_path / "o" / "simulate.json").read_text())["params"]
    assert (
        params["detect_base_s"] == 0.05 and params["restart_base_s"] == 30.0
    )  # the file, where no flag says


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "not JSON"),
        ('{"warp_factor": 9}', "unknown parameter 'warp_factor'"),
        ('{"detect_base_s": "fast"}', "detect_base_s must be a number"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_bad_params_file_is_one_line_exit_2(
    content: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "p.json"
    bad.write_text(content)
    assert simulate_command.run(["--params", str(bad)]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_the_parameters_make_bench_measured_are_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scale = Path(__file__).resolve().parents[2] / "bench" / "results" / "scale.json"
    assert simulate_command.run(["--sizes", "16384", "--params", str(scale), "--out", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"parameters: 17 from {scale}")
    # every measured value is the one used, none of the calibrated defaults
    measured = json.loads(scale.read_text())["cluster_params"]
    used = json.loads((tmp_path / "simulate.json").read_text())
    for key, value in measured.items():
        if key != "n_accelerators":
            assert used["params"][key] == pytest.approx(value), key
    assert used["params"]["checkpoint_cost_s"] != ClusterParams().checkpoint_cost_s
    row = used["rows"][0]
    p = ClusterParams(**(measured | {"n_accelerators": 16_384}))
    assert row["goodput_checkpoint_restart"] == pytest.approx(goodput_checkpoint_restart(p))


# ----------------------------------------------------------- calibration to published figures


@pytest.mark.timeout(60)
def test_calibrated_defaults_reproduce_llama3_effective_training_time() -> None:
    """Llama 3 (Dubey et al. 2024, section 3.3.4): >90% effective training time with checkpoint-restart
    on 16,384 H100s at 419 unexpected interruptions in 54 days. The defaults must land in that range;
    the upper bound (0.95) keeps the assumed costs from being tuned into an optimistic corner."""
    p = ClusterParams()
    assert p.n_accelerators == 16_384
    g = goodput_checkpoint_restart(p)
    assert sim.LLAMA3_EFFECTIVE_TRAINING_TIME == 0.90
    assert sim.LLAMA3_EFFECTIVE_TRAINING_TIME < g < 0.95, g
    # the Monte-Carlo agrees that it is in the published range
    mc = simulate_mc(p, "checkpoint_restart", 20_000.0, seed=3)
    assert mc == pytest.approx(g, abs=0.01) and mc > 0.90
    # and the sweep row at 16,384 is the same figure
    (row,) = sweep([16_384], p)
    assert row["goodput_checkpoint_restart"] == pytest.approx(g)


def test_every_default_says_where_it_comes_from(capsys: pytest.CaptureFixture[str]) -> None:
    kinds = ("published", "derived from published figures", "assumption")
    for f in dataclasses.fields(ClusterParams):
        assert str(f.metadata.get("source", "")).startswith(kinds), f.name
    by_name = {f.name: str(f.metadata["source"]) for f in dataclasses.fields(ClusterParams)}
    # the costs no source gives at this scale are marked as assumptions
    for name in ("checkpoint_cost_s", "checkpoint_load_s", "restart_base_s", "restart_per_rank_s"):
        assert by_name[name].startswith("assumption"), name
    assert by_name["failures_per_accel_hour"].startswith("published")
    assert simulate_command.run(["--help"]) == 0
    out = capsys.readouterr().out
    assert "The Llama 3 Herd of Models" in out and "arXiv:2407.21783" in out and "3.3.4" in out
    assert "466 job interruptions" in out and "419 unexpected" in out and "78%" in out
    assert "bench/results/scale.json" in out and out.count("assumption:") >= 10
