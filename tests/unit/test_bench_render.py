"""``bench/run_all.py --render``: the page from committed results alone, with repository-relative paths;
``bench/scale.py``'s two formation fits."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import common, scale

XS = [2.0, 4.0, 8.0, 16.0]


def test_fit_linear_recovers_known_parameters() -> None:
    fit = scale.fit_linear(XS, [0.02 + 0.004 * x for x in XS])
    assert fit["a_s"] == pytest.approx(0.02)
    assert fit["b_s_per_rank"] == pytest.approx(0.004)
    assert fit["r2"] == pytest.approx(1.0)
    assert fit["rmse_s"] == pytest.approx(0.0, abs=1e-12)
    assert all(r == pytest.approx(0.0, abs=1e-12) for r in fit["residuals_s"])


def test_fit_power_recovers_known_parameters() -> None:
    fit = scale.fit_power(XS, [0.003 * x**1.7 for x in XS])
    assert fit["c_s"] == pytest.approx(0.003)
    assert fit["k"] == pytest.approx(1.7)
    assert fit["r2_log"] == pytest.approx(1.0)
    assert fit["rmse_s"] == pytest.approx(0.0, abs=1e-12)
    assert scale.formation_power(100_000, fit) == pytest.approx(0.003 * 100_000**1.7)


def test_fit_power_rejects_non_positive() -> None:
    with pytest.raises(ValueError):
        scale.fit_power([0.0, 2.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        scale.fit_linear([1.0], [1.0])


def _formation(times: dict[int, float]) -> dict[str, Any]:
    rows = [
        {"world": w, "times_s": [t * 0.9, t, t * 1.2], "median_s": t, "wake_lag_median_s": 0.001}
        for w, t in times.items()
    ]
    xs, ys = [float(w) for w in times], list(times.values())
    return {
        "world_sizes": list(times),
        "reps": 3,
        "cores": 2,
        "rows": rows,
        "fit": scale.fit_linear(xs, ys),
        "fit_power": scale.fit_power(xs, ys),
        "loadavg": [1.0, 1.0, 1.0],
    }


def _results_dir(tmp_path: Path) -> Path:
    d = tmp_path / "results"
    d.mkdir()
    machine = {
        "date": "2026-01-01T00:00:00+00:00",
        "hostname": "h",
        "platform": "Linux",
        "python": "3.12",
        "torch": "2.x",
        "nproc": "2",
        "lscpu": ["CPU(s): 2"],
        "free": "Mem: 8Gi",
        "loadavg": [0.5, 0.5, 0.5],
        "run": {"argv": ["--only", "scale"], "quick": True, "wall_s": 60.0, "loadavg_end": [1.0, 1.0, 1.0]},
    }
    common.write_json(d / "machine.json", machine)
    res = scale.analyse(
        _formation({2: 0.010, 4: 0.016, 8: 0.030, 16: 0.110}),
        recipe=None,
        recovery_json=None,
        compare_json=None,
        steady_json=None,
        mc_hours=None,
    )
    # an older run wrote the plot's absolute path: the page must not show it
    res["plot"] = str(common.OUT / "scale" / "goodput.png")
    res["_command"] = "OMP_NUM_THREADS=1 python bench/run_all.py --only scale"
    res["_date"] = machine["date"]
    common.write_json(d / "scale.json", res)
    return d


def test_render_from_results_has_no_absolute_paths(tmp_path: Path) -> None:
    from bench import run_all

    results = _results_dir(tmp_path)
    doc = tmp_path / "benchmarks.md"
    assert run_all.main(["--render", "--results", str(results), "--doc", str(doc)]) == 0
    text = doc.read_text()
    for bad in ("/work", "/tmp", "/home", str(common.REPO), str(tmp_path)):
        assert bad not in text, bad
    assert "`bench/out/scale/goodput.png`" in text
    assert "upper bound" not in text
    # both fit forms and the side-by-side sweep, with the beyond-measurement labels
    assert "power law c·N^k" in text and "linear a + b·N" in text
    assert "goodput CL, power" in text and "extrapolation + assumption" in text
    assert "https://github.com/NVIDIA/nccl/issues/1156" in text
    # benchmarks without a result are marked, not crashing the page
    assert "not run" in text


def test_render_without_results_fails_cleanly(tmp_path: Path) -> None:
    from bench import run_all

    assert run_all.main(["--render", "--results", str(tmp_path), "--doc", str(tmp_path / "x.md")]) == 2
    assert not (tmp_path / "x.md").exists()


def test_power_sweep_uses_power_formation(tmp_path: Path) -> None:
    res = json.loads((_results_dir(tmp_path) / "scale.json").read_text())
    pfit = res["formation"]["fit_power"]
    for r in res["rows_power"]:
        assert r["formation_s"] == pytest.approx(scale.formation_power(r["n_accelerators"], pfit))
    lin = {r["n_accelerators"]: r for r in res["rows"]}
    big = res["rows_power"][-1]
    # superlinear growth measured (k > 1): the power law predicts more formation, hence less goodput, at 100k
    assert pfit["k"] > 1 and not math.isclose(
        big["formation_s"], lin[big["n_accelerators"]]["formation_linear_s"]
    )
    assert big["goodput_checkpointless"] < lin[big["n_accelerators"]]["goodput_checkpointless"]


def test_slim_drops_raw_series() -> None:
    from bench import run_all

    res = {
        "jobs": [{"analysis": {"curve": [[0.0, 1]] * 1000, "faults": []}}],
        "runs": {"ddp": [{"intervals": [0.1] * 1000, "inner": [0.1] * 10, "digest": "x"}]},
    }
    assert "curve" not in run_all.slim("compare", res)["jobs"][0]["analysis"]
    ss = run_all.slim("steady_state", res)["runs"]["ddp"][0]
    assert ss["n_intervals"] == 1000 and "intervals" not in ss and ss["digest"] == "x"
    assert "curve" in res["jobs"][0]["analysis"]  # the caller's data is untouched


def test_git_state_records_commit_and_dirty(tmp_path: Path) -> None:
    state = common.git_state()
    commit = str(state["commit"])
    assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit)
    assert isinstance(state["dirty"], bool)
    assert common.git_state(tmp_path) == {"commit": None, "dirty": None}  # not a repository


def test_the_benchmarks_own_outputs_do_not_make_the_tree_dirty(tmp_path: Path) -> None:
    """A run of several sections writes results as it goes: the next section's code is still clean."""
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                       check=True, capture_output=True, timeout=30)  # fmt: skip

    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for name in ("code.py", "bench/results/a.json", "docs/benchmarks.md"):
        (tmp_path / name).write_text("0")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "x")
    assert common.git_state(tmp_path)["dirty"] is False
    (tmp_path / "bench" / "results" / "a.json").write_text("1")
    (tmp_path / "bench" / "results" / "b.json").write_text("1")
    (tmp_path / "docs" / "benchmarks.md").write_text("1")
    assert common.git_state(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("1")
    assert common.git_state(tmp_path)["dirty"] is True


def test_every_result_run_all_writes_carries_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    from bench import run_all

    fake = types.ModuleType("fake")
    fake.__doc__ = "A stand-in benchmark."
    fake.run = lambda quick, out: {"quick": quick, "value": 1.0}  # type: ignore[attr-defined]
    fake.markdown = lambda res: f"value {res['value']}"  # type: ignore[attr-defined]
    monkeypatch.setattr(run_all, "BENCHES", [("fake", "Fake", fake)])
    monkeypatch.setattr(common, "OUT", tmp_path / "out")
    monkeypatch.setattr(common, "git_state", lambda repo=common.REPO: {"commit": "f" * 40, "dirty": False})
    results, doc = tmp_path / "results", tmp_path / "b.md"
    assert run_all.main(["--quick", "--results", str(results), "--doc", str(doc)]) == 0
    for path in (results / "fake.json", tmp_path / "out" / "fake.json", results / "machine.json"):
        saved = json.loads(path.read_text())
        assert saved["_commit"] == "f" * 40 and saved["_dirty"] is False, path
    assert "commit: `ffffffffffff`, clean tree.*" in doc.read_text()


def test_render_gives_each_section_its_commit(tmp_path: Path) -> None:
    from bench import run_all

    results = _results_dir(tmp_path)
    doc = tmp_path / "benchmarks.md"
    assert run_all.main(["--render", "--results", str(results), "--doc", str(doc)]) == 0
    assert "on 2026-01-01T00:00:00+00:00; commit: unrecorded.*" in doc.read_text()  # an older result
    res = json.loads((results / "scale.json").read_text())
    res["_commit"], res["_dirty"] = "0123456789abcdef" * 2 + "01234567", True
    common.write_json(results / "scale.json", res)
    assert run_all.main(["--render", "--results", str(results), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "commit: `0123456789ab`, dirty tree (uncommitted or untracked files).*" in text
    assert "- **Code:** commit: unrecorded" in text  # machine.json of the older run has none
    # the simulate defaults and their sources are on the page, with the calibrated figure
    assert "## `checkpointless simulate`: defaults and their sources" in text
    assert "The Llama 3 Herd of Models" in text and "| `--checkpoint-cost-s` | 20 |" in text
    assert "--params bench/results/scale.json" in text


def test_committed_compare_reading_is_accurate() -> None:
    """The settings line of the goodput runs shows what they ran with (torchrun's tuned N, not the
    recovery jobs' N=50), and fault-free runs of different lengths are not said to end alike."""
    from bench import compare

    res = json.loads((common.RESULTS / "compare.json").read_text())
    md = compare.markdown(res)
    torchrun = [j for j in res["jobs"] if j["name"].startswith("goodput-") and j["system"] == "torchrun"]
    assert torchrun, "compare.json has no torchrun goodput run: the settings line read here renders nothing"
    for j in torchrun:
        n = j["extra"]["every"]
        assert f'{j["label"]}: `{{"every": {n}' in md and j["label"] == f"torchrun N={n}"
    steps = {j["system"]: j["steps"] for j in res["jobs"] if j["name"].endswith("-ref")}
    assert {"torchft", "checkpointless"} <= set(steps), f"compare.json's fault-free reference runs: {steps}"
    if steps["torchft"] != steps["checkpointless"]:
        assert "checkpointless, plain_ddp, torchft" not in md
        assert f"({steps['checkpointless']} steps each) end in the same state" in md


def test_every_committed_result_renders_its_section() -> None:
    """Each benchmark of the page has its committed result, and its section (and the targets'
    summary) renders a table with rows from it: a result whose shape changed fails here rather
    than leaving a section empty."""
    from bench import run_all

    results = run_all.load_results(common.RESULTS)
    for key, _, mod in run_all.BENCHES:
        assert key in results, f"bench/results/{key}.json is missing: its section would say 'not run'"
        rows = [line for line in mod.markdown(results[key]).splitlines() if line.startswith("|")]
        assert len(rows) >= 3, f"bench/{key}.py's section renders no table row from its committed result"
    summary = [line for line in run_all.targets(results).splitlines() if line.startswith("|")]
    assert len(summary) >= 3, "the targets' summary renders no row from the committed results"


def test_paired_interval_and_its_verdict() -> None:
    """A target is met only when the whole 95% interval of the paired ratio lies within it."""
    assert common.paired_interval([1.02]) is None
    g, lo, hi = common.paired_interval([1.0713571522210632, 1.0531654441203506, 1.0228137162375355,
                                        1.0244749314581185])  # fmt: skip
    assert lo < g < hi and 1.04 < g < 1.045 and abs(lo - 1.006) < 0.002 and abs(hi - 1.081) < 0.002
    assert common.interval_verdict(lo, hi, 1.01).startswith("not established")
    assert common.interval_verdict(0.995, 1.008, 1.01) == "met"
    assert common.interval_verdict(1.02, 1.05, 1.01) == "**not met**"
    g, lo, hi = common.paired_interval([1.0, 1.0, 1.0])
    assert g == lo == hi == 1.0
