"""A preemption notice (``preempt:rank=R@step=S,notice=T``: SIGTERM, then SIGKILL T seconds later)
is used, not suffered: the rank hands its place to a ready spare (the job keeps its size, bit for
bit) or, in an elastic job, to the others, and no step is lost. A notice too short for the handoff
ends as an ordinary recovery, still with no lost step."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.integration.test_elastic import _same_run
from tests.integration.test_shares import SCRIPT, _losses
from tests.jobs import logs_of, run_job

pytestmark = pytest.mark.timeout(300)

STEPS = 16


def _command(out: Path) -> list[str]:
    return [sys.executable, SCRIPT, str(STEPS), str(out), "--pause", "0.2"]


_FULL: dict[int, Path] = {}


@pytest.fixture
def full(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """The fault-free run at a number of workers, made once per module when first asked for."""

    def at(workers: int) -> Path:
        if workers not in _FULL:
            out = tmp_path_factory.mktemp(f"full{workers}")
            result = run_job(workers=workers, spares=0, steps=STEPS,
                             command=[sys.executable, SCRIPT, str(STEPS), str(out)])  # fmt: skip
            assert result.ok, f"{result.error}\n{logs_of(result)}"
            _FULL[workers] = out
        return _FULL[workers]

    return at


def _left(result) -> list[str]:  # type: ignore[no-untyped-def]
    """The processes that left by themselves, their rank handed over."""
    return [n for n, path in result.logs.items() if "without this process: leaving" in path.read_text()]


@pytest.mark.parametrize("notice", ["30", "0.5"])
def test_a_worker_with_notice_hands_its_rank_to_the_spare_with_no_lost_step(
    notice: str, tmp_path: Path, full: Callable[[int], Path]
) -> None:
    result = run_job(workers=2, spares=1, steps=STEPS, faults=[f"preempt:rank=1@step=5,notice={notice}"],
                     out=tmp_path / "run", command=_command(tmp_path / "e"))  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert _losses(full(2)) == _losses(tmp_path / "e")  # bit for bit: the job kept its size
    ours, theirs = torch.load(tmp_path / "e" / "final.pt"), torch.load(full(2) / "final.pt")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    report = result.report
    assert report["steps_completed"] == STEPS and all(f["lost_steps"] == 0 for f in report["faults"])
    kinds = [e["kind"] for e in result.events]
    assert "notice_received" in kinds, logs_of(result)
    if notice == "30":  # handed over well within the notice: no fault, the process left by itself
        assert "handoff_done" in kinds and "recovery_done" not in kinds, kinds
        assert _left(result) == ["w1"], logs_of(result)
        assert [f["cause"] for f in report["faults"]] == [None]  # injected, never detected as a crash
    (assigned,) = [e for e in result.events if e["kind"] == "spare_assigned"]
    assert (assigned["rank"], assigned["target"], assigned["replaces"]) == (1, "s0", "w1")


def test_an_elastic_job_without_a_spare_goes_on_without_the_rank_that_has_notice(
    tmp_path: Path, full: Callable[[int], Path]
) -> None:
    result = run_job(workers=4, spares=0, min_workers=2, steps=STEPS, faults=["preempt:rank=0@step=5,notice=30"],
                     out=tmp_path / "run", command=_command(tmp_path / "e"))  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _same_run(full(4), tmp_path / "e")
    assert [(e["before"], e["replicas"], e["why"]) for e in result.events if e["kind"] == "resized"] == [
        (4, 3, "handoff")
    ]
    assert _left(result) == ["w0"] and result.report["steps_completed"] == STEPS
    assert all(f["lost_steps"] == 0 for f in result.report["faults"])
