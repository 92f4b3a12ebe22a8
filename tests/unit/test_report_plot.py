"""Tests for checkpointless.observe.plot and run_data: timeline.png + summary.txt from a synthetic run dir."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from checkpointless.cli import report
from checkpointless.observe import plot as report_plot
from checkpointless.observe import run_data

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run_dir(root: Path, *, with_fault: bool = True) -> Path:
    """Write a fake run: 2 ranks, 30 steps, a kill of rank 1 at step 15 (spare s0 takes over), evals."""
    run = root / "run1"
    run.mkdir()
    t0 = 1_700_000_000.0
    ev: list[dict[str, Any]] = []

    def add(t: float, kind: str, **kw: Any) -> None:
        base: dict[str, Any] = {"t": t0 + t, "kind": kind, "rank": None, "gen": 0, "step": None}
        base["proc"] = "coordinator"
        base.update(kw)
        ev.append(base)

    add(
        0.0,
        "job_started",
        workers=2,
        spares=1,
        steps=30,
        faults=["kill:rank=1@step=15"] if with_fault else [],
    )
    add(0.1, "generation_started", gen=0, members={"0": "w0", "1": "w1"}, resume_step=0)
    add(0.2, "spare_ready", proc="s0")
    t, gen, step = 0.3, 0, 0
    while step < 30:
        if with_fault and step == 15 and gen == 0:
            add(
                t,
                "fault_injected",
                fault="kill",
                ranks=[1],
                rank=1,
                step=15,
                proc="w1",
                index=0,
                target="step",
            )
            add(t + 0.5, "process_exited", target="w1", rank=1, role="worker", exitcode=-9)
            add(t + 0.5, "fault_detected", reason="process_exit", rank=1, target="w1", exitcode=-9)
            add(t + 0.55, "fault_detected", reason="collective_error", rank=0, proc="w0")
            add(t + 0.6, "spare_assigned", target="s0", rank=1, gen=1, replaces="w1")
            add(t + 0.7, "generation_started", gen=1, members={"0": "w0", "1": "s0"}, resume_step=14)
            add(t + 0.8, "transfer_begun", rank=1, src=0, gen=1, proc="s0")
            add(t + 1.6, "transfer_ended", rank=1, src=0, gen=1, bytes=123456, seconds=0.8, sha256_ok=True)
            add(t + 1.8, "recovery_done", gen=1, seconds=1.3)
            t, gen, step = t + 1.9, 1, 14
            continue
        for rank in (0, 1):
            proc = "s0" if (rank == 1 and gen == 1) else f"w{rank}"
            loss = 3.0 * (0.95**step) + 0.01 * rank
            add(
                t + 0.01 * rank,
                "step_committed",
                rank=rank,
                step=step,
                gen=gen,
                proc=proc,
                loss=loss,
                step_time_s=0.2,
                tokens=2048,
            )
        if step % 10 == 9:
            add(t + 0.05, "eval", step=step, gen=gen, heldout_loss=3.1 * (0.95**step))
        t += 0.2
        step += 1
    add(t, "some_future_kind", whatever=1)  # unknown kinds must be ignored
    add(t + 0.1, "job_finished", ok=True)

    lines = [json.dumps(e) for e in ev]
    lines.insert(5, "")  # blank line
    lines.append('{"t": 1, "kind": "step_comm')  # truncated last line from a crash
    (run / "events.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")

    faults = []
    if with_fault:
        faults.append(
            {
                "kind": "kill",
                "ranks": [1],
                "step": 15,
                "detection_s": 0.5,
                "stall_s": 1.8,
                "lost_steps": 1,
                "replaced_by": "s0",
            }
        )
    report = {
        "steps_completed": 30,
        "final_state_sha256": "ab12cd34ef56" + "0" * 52,
        "goodput": 0.8123,
        "wall_s": t + 0.1,
        "step_time_s": 0.2,
        "faults": faults,
    }
    (run / "report.json").write_text(json.dumps(report), encoding="utf-8")
    return run


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.timeout(60)
def test_write_report_png_and_summary(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path)
    summary = report_plot.write_report(run)

    png = run / "timeline.png"
    assert png.is_file()
    w, h = _png_size(png)
    assert 600 <= w <= 4000 and 400 <= h <= 4000
    assert png.stat().st_size > 10_000

    assert (run / "summary.txt").read_text(encoding="utf-8") == summary
    assert "steps completed: 30" in summary
    assert "goodput: 0.812" in summary
    assert "kill" in summary
    assert "detection 0.50 s" in summary
    assert "stall 1.80 s" in summary
    assert "lost 1 steps" in summary
    assert "replaced by s0" in summary
    assert "ab12cd34ef56" in summary
    # held-out loss first -> last
    assert "held-out loss: 1.9538 (step 9) -> 0.7004 (step 29)" in summary
    assert "3 evals" in summary
    assert "skipped 1 unparsable line" in summary
    assert summary.isascii()


@pytest.mark.timeout(60)
def test_series_are_derived_from_events(tmp_path: Path) -> None:
    run = run_data.load_run(make_run_dir(tmp_path))
    assert run.t0 == 1_700_000_000.0
    spans = run_data.fault_spans(run)
    assert len(spans) == 1
    sp = spans[0]
    assert sp.kind == "kill" and sp.ranks == [1] and sp.step == 15
    assert sp.detected is not None and sp.end is not None
    assert sp.detected - sp.start == pytest.approx(0.5)
    assert sp.end - sp.start == pytest.approx(1.8)
    commits = run_data.commits_by_rank(run)
    assert set(commits) == {0, 1}
    assert len(commits[0]) == 31  # 30 steps + 1 replayed
    train = run_data.train_loss(run)
    assert [s for s, _ in train] == list(range(30))
    assert train[0][1] == pytest.approx(3.005)


@pytest.mark.timeout(60)
def test_no_faults_and_minimal_report(tmp_path: Path) -> None:
    run = make_run_dir(tmp_path, with_fault=False)
    (run / "report.json").write_text("{}", encoding="utf-8")  # every field optional
    summary = report_plot.write_report(run)
    assert "faults: 0" in summary
    assert "steps completed: ?" in summary
    assert (run / "timeline.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(60)
def test_empty_events(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    (run / "events.jsonl").write_text("", encoding="utf-8")
    (run / "report.json").write_text('{"faults": []}', encoding="utf-8")
    summary = report_plot.write_report(run)
    assert "no evals" in summary
    assert (run / "timeline.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.timeout(60)
def test_main_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run_dir(tmp_path)
    assert report.run([str(run)]) == 0
    out = capsys.readouterr().out
    assert "kill" in out and "timeline.png" in out


@pytest.mark.timeout(60)
def test_main_missing_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.run([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope" in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("missing", ["events.jsonl", "report.json"])
def test_main_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], missing: str) -> None:
    run = make_run_dir(tmp_path)
    (run / missing).unlink()
    assert report.run([str(run)]) == 2
    err = capsys.readouterr().err
    assert missing in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (run / "timeline.png").exists()


@pytest.mark.timeout(60)
def test_main_bad_report_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run_dir(tmp_path)
    (run / "report.json").write_text("{not json", encoding="utf-8")
    assert report.run([str(run)]) == 2
    err = capsys.readouterr().err
    assert "report.json" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------- real faults, one list


def write_run(root: Path, events: list[dict[str, Any]], *, with_report: bool = True) -> Path:
    """A run directory as the launcher writes it: events.jsonl and build_report's report.json."""
    from checkpointless.observe.report import build_report

    run = root / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    report = build_report(events, total_steps=None, digest=None) if with_report else {}
    (run / "report.json").write_text(json.dumps(report), encoding="utf-8")
    return run


@pytest.mark.timeout(60)
def test_real_faults_are_shown_as_detected(tmp_path: Path) -> None:
    from tests.unit.test_report import _mixed_run

    run = write_run(tmp_path, _mixed_run())
    summary = report_plot.write_report(run)
    assert "faults: 5" in summary
    lines = [line for line in summary.splitlines() if line.startswith("  #")]
    assert "[injected kill:rank=0,2@step=3] ranks [0,2] (w0,w2)" in lines[0]
    assert "cause process_exit (SIGKILL)" in lines[0] and "replaced by s0,s1" in lines[0]
    assert "[injected hang:rank=1@step=5]" in lines[1] and "cause heartbeat_timeout," in lines[1]
    assert "crash [detected, not injected] ranks [2] (s1)" in lines[2]
    assert "cause process_exit (SIGSEGV)" in lines[2] and "detection -," in lines[2]
    assert "exception [detected, not injected]" in lines[3] and "replaced by in-place" in lines[3]
    assert "crash [detected, not injected] spare (s4)" in lines[4]
    assert "note: events.jsonl yields" not in summary
    assert (run / "timeline.png").read_bytes()[:8] == PNG_MAGIC

    spans = run_data.fault_spans(run_data.load_run(run))
    assert [(sp.kind, sp.injected, sp.replaced_by) for sp in spans] == [
        ("kill", True, "s0,s1"),
        ("hang", True, "s2"),
        ("crash", False, "s3"),
        ("exception", False, "in-place"),
        ("crash", False, None),
    ]
    assert spans[-1].spare and spans[-1].end is None
    assert all(sp.end is not None for sp in spans[:-1])


@pytest.mark.timeout(60)
def test_two_rank_fault_does_not_shift_the_next_faults_figures(tmp_path: Path) -> None:
    from tests.unit.test_report import two_rank_kill_then_one

    run = run_data.load_run(write_run(tmp_path, two_rank_kill_then_one()))
    spans = run_data.fault_spans(run)  # one span per fault, not one per fault_injected event
    assert [(sp.ranks, sp.replaced_by) for sp in spans] == [([0, 2], "s0,s1"), ([0], "s2")]
    summary = report_plot.format_summary(run)
    assert "replaced by s0,s1" in summary and "replaced by s2" in summary


@pytest.mark.timeout(60)
def test_summary_derives_faults_when_the_report_has_none(tmp_path: Path) -> None:
    from tests.unit.test_report import manual_kill

    run = run_data.load_run(write_run(tmp_path, manual_kill(-11)(), with_report=False))
    summary = report_plot.format_summary(run)
    assert "faults: 1" in summary
    assert "crash [detected, not injected] ranks [1] (w1)" in summary
    assert "SIGSEGV" in summary and "(from events)" in summary


@pytest.mark.timeout(60)
def test_summary_notes_a_report_that_disagrees_with_the_events(tmp_path: Path) -> None:
    from tests.unit.test_report import manual_kill

    run_dir = write_run(tmp_path, manual_kill(-9)())
    (run_dir / "report.json").write_text('{"faults": []}', encoding="utf-8")  # an old report: no real faults
    summary = report_plot.format_summary(run_data.load_run(run_dir))
    assert "note: events.jsonl yields 1 fault(s), report.json lists 0" in summary


def test_plotting_leaves_the_global_matplotlib_backend_alone(tmp_path: Path) -> None:
    import matplotlib

    from checkpointless.observe.plot import _plot
    from checkpointless.observe.run_data import RunData

    before = matplotlib.get_backend()
    matplotlib.use("svg")  # a caller's choice, which a library must not change
    try:
        _plot(RunData(events=[], report={}, run_dir=tmp_path), tmp_path / "t.png")
        assert matplotlib.get_backend() == "svg"
        assert (tmp_path / "t.png").stat().st_size > 0
    finally:
        matplotlib.use(before)


@pytest.mark.timeout(60)
def test_the_hosts_usage_is_a_panel_beside_the_steps(tmp_path: Path) -> None:
    """``host_usage`` events (a host's CPU, its ranks' shares, its accelerators) become a third
    panel on the same time axis as the steps; a run without them keeps two panels."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run_dir = make_run_dir(tmp_path / "a")
    events = run_dir / "events.jsonl"
    t0 = 1_700_000_000.0
    usage = [
        {"t": t0 + i, "kind": "host_usage", "proc": "launcher", "host": "host0", "cpus": 2,
         "cpu_percent": 50.0 + i, "ranks": {"0": 90.0, "1": 10.0 * i},
         "gpus": [{"index": 0, "util_percent": 0.0 if 15 <= i <= 17 else 95.0}]}
        for i in range(1, 20)
    ]  # fmt: skip
    with events.open("a") as f:
        f.writelines(json.dumps(e) + "\n" for e in usage)
    run = run_data.load_run(run_dir)
    series = run_data.usage_series(run)
    assert set(series) == {"host0 CPU", "rank 0 CPU", "rank 1 CPU", "host0 GPU0"}
    assert series["rank 0 CPU"][0] == (pytest.approx(1.0), pytest.approx(45.0))  # of the host's 2 cores
    assert [v for _, v in series["host0 GPU0"]].count(0.0) == 3
    report_plot.write_report(run_dir)
    _, with_usage = _png_size(run_dir / "timeline.png")
    plain = make_run_dir(tmp_path / "b")
    report_plot.write_report(plain)
    _, without = _png_size(plain / "timeline.png")
    assert with_usage > without
