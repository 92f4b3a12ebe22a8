"""An elastic job grows back: a process started in a lost rank's place takes a new rank once it is
ready, and ``checkpointless scale`` shrinks and grows a running job within its bounds. Either way
the run stays the same run: the losses of the fault-free run at full size to rounding, no step
lost, the processes let go exit by themselves."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from checkpointless.control.coordinator import Coordinator
from tests.integration.test_elastic import _same_run
from tests.integration.test_shares import SCRIPT
from tests.jobs import logs_of, run_job

pytestmark = pytest.mark.timeout(300)

STEPS = 30
PAUSE = "0.25"  # a step's least length: a spare starts within a few steps


def _command(out: Path) -> list[str]:
    return [sys.executable, SCRIPT, str(STEPS), str(out), "--pause", PAUSE]


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-free run at its full size: 4 workers, one share each."""
    out = tmp_path_factory.mktemp("full")
    result = run_job(workers=4, spares=0, steps=STEPS, command=[sys.executable, SCRIPT, str(STEPS), str(out)])
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    return out


def _sizes(result: Any) -> list[tuple[int, int, str]]:
    return [(e["before"], e["replicas"], e["why"]) for e in result.events if e["kind"] == "resized"]


def _runs(by_step: dict[str, int]) -> list[int]:
    """The replica counts over the steps, each run of equal counts once."""
    out: list[int] = []
    for s in sorted(by_step, key=int):
        if not out or out[-1] != by_step[s]:
            out.append(by_step[s])
    return out


def test_scale_shrinks_then_grows_a_running_job(tmp_path: Path, full: Path) -> None:
    run = tmp_path / "run"
    asked: list[tuple[int, subprocess.Popen[str]]] = []

    def scale(coord: Coordinator) -> None:
        """Two requests through the command, at the steps the job reaches (one at a time)."""
        committed = max((int(hb.get("committed", -1)) for hb in coord.member_status().values()), default=-1)
        if asked and asked[-1][1].poll() is None:
            return
        size = coord.plan.world_size if coord.plan else 0
        if not asked and committed >= 4:
            want = 2
        elif len(asked) == 1 and size == 2 and committed >= 12:
            want = 4
        else:
            return
        cmd = [sys.executable, "-m", "checkpointless", "scale", str(run), "--workers", str(want)]
        asked.append((want, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))

    result = run_job(workers=4, spares=0, min_workers=2, max_workers=4, steps=STEPS, resize_interval_s=1.0,
                     out=run, command=_command(tmp_path / "e"), on_tick=scale)  # fmt: skip
    for _, p in asked:
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0 and err == "", (out, err)
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert [w for w, _ in asked] == [2, 4]
    _same_run(full, tmp_path / "e")
    assert _sizes(result) == [(4, 2, "request"), (2, 4, "request")], _sizes(result)
    report = result.report
    assert _runs(report["replicas_by_step"]) == [4, 2, 4], report["replicas_by_step"]
    assert report["faults"] == [] and report["recovery_s"] == [] and report["steps_completed"] == STEPS
    left = [n for n, path in result.logs.items() if "without this process: leaving" in path.read_text()]
    assert len(left) == 2, logs_of(result)  # the two let go left by themselves, not killed at the end
    assert all("Traceback" not in result.logs[n].read_text() for n in left), logs_of(result)
    assert not (run / "control.json").exists()  # the job is over: nobody can steer it
    done = subprocess.run([sys.executable, "-m", "checkpointless", "scale", str(run), "--workers", "3"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert json.loads((run / "report.json").read_text())["replicas_by_step"] == report["replicas_by_step"]


def test_a_newcomer_killed_as_it_receives_the_state_is_one_more_fault(tmp_path: Path, full: Path) -> None:
    """The process that grows the job dies during its transfer: the job shrinks again, and grows
    once the next process is ready."""
    result = run_job(workers=4, spares=0, min_workers=2, steps=STEPS, resize_interval_s=0.5, timeout_s=240,
                     faults=["kill:rank=3@step=2", "kill:spare@recovery"], out=tmp_path / "run",
                     command=[*_command(tmp_path / "e")[:-1], "0.4"])  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _same_run(full, tmp_path / "e")
    assert _sizes(result) == [(4, 3, "lost"), (3, 4, "capacity"), (4, 3, "lost"), (3, 4, "capacity")], _sizes(
        result
    )
    report = result.report
    assert _runs(report["replicas_by_step"]) == [4, 3, 4], report[
        "replicas_by_step"
    ]  # the grow cut short committed no step
    assert report["steps_completed"] == STEPS and all(f["lost_steps"] == 0 for f in report["faults"])
    assert sorted(f["spec"] for f in report["faults"]) == ["kill:rank=3@step=2", "kill:spare@recovery"]
    grows = [
        e for e in result.events if e["kind"] == "generation_started" and len(e["members"]) == 4 and e["gen"]
    ]
    assert grows and all(set(map(int, g["sources"])) == {3} for g in grows), grows  # the new rank receives


def test_a_syncbatchnorm_under_an_elastic_size_is_refused_in_one_line(tmp_path: Path) -> None:
    result = run_job(workers=2, spares=0, min_workers=1, steps=4,
                     command=[sys.executable, SCRIPT, "4", str(tmp_path / "e"), "--sync-bn"])  # fmt: skip
    assert not result.ok and result.error is not None
    assert "'1' is a SyncBatchNorm: its statistics depend on how many replicas" in result.error, result.error
    assert "\n" not in result.error


@pytest.mark.timeout(120)
def test_ctrl_c_during_a_resize_stops_the_job_reports_it_and_leaves_nothing(tmp_path: Path) -> None:
    from tests.integration.test_adversarial import _cli, _interrupt, _launcher_tree, _poll, _text

    out = tmp_path / "run"
    proc = _cli("launch", "--workers", "4", "--spares", "0", "--min-workers", "2", "--quiet", "--out", str(out),
                "--", sys.executable, SCRIPT, "400", str(tmp_path / "e"), "--pause", "0.1")  # fmt: skip
    with _launcher_tree(proc) as seen:
        _poll(lambda: '"step_committed"' in _text(out / "events.jsonl"), 60, "a committed step", proc, seen)
        asked = subprocess.run([sys.executable, "-m", "checkpointless", "scale", str(out), "--workers", "2"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert asked.returncode == 0, asked.stderr
        # the resize waits for --resize-interval (10 s) after the start; then Ctrl-C inside it
        _poll(lambda: '"resize_started"' in _text(out / "events.jsonl"), 60, "the resize", proc, seen)
        _interrupt(proc, seen, out)
        report = json.loads((out / "report.json").read_text())
        assert "SIGINT" in report["error"] and not (out / "control.json").exists()
    after = subprocess.run([sys.executable, "-m", "checkpointless", "scale", str(out), "--workers", "3"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert after.returncode == 2 and "no running job" in after.stderr, after.stderr


def test_an_elastic_size_on_several_hosts_that_is_not_whole_hosts_is_one_line() -> None:
    for flag, words in ((["--min-workers", "1"], "--min-workers 1 must be a multiple of --nproc-per-node 2"),
                        (["--max-workers", "5", "--shares", "6"], "--max-workers 5 must be a multiple")):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "checkpointless", "cluster", "--nodes", "2", "--nproc-per-node",
                               "2", "demo", "--steps", "4", *flag], capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2 and words in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
