"""An elastic job (``--min-workers``): ranks lost with no spare ready leave the job and the survivors,
numbered anew, compute their shares (``session.shares()``); the run stays the same run, its losses
those of the fault-free run at full size to rounding. Below the minimum the job stops in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_shares import SCRIPT, _losses
from tests.jobs import logs_of, run_job

pytestmark = pytest.mark.timeout(300)

STEPS = 10


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, SCRIPT, str(STEPS), str(out), *extra]


def _same_run(full: Path, elastic: Path) -> None:
    """Every (step, share) loss within 1e-4 relative and every parameter within 1e-5 of the largest."""
    a, b = _losses(full), _losses(elastic)
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    worst = max(abs(a[k] - b[k]) / abs(a[k]) for k in a)
    assert worst < 1e-4, worst
    pa, pb = torch.load(full / "final.pt"), torch.load(elastic / "final.pt")
    for name, t in pa.items():
        if t.is_floating_point():
            assert (t - pb[name]).abs().max() <= 1e-5 * t.abs().max(), name
        else:
            assert torch.equal(t, pb[name]), name


_FULL_REPORT: dict[str, dict] = {}


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-free run at its full size: 4 workers, one share each (its report in ``_FULL_REPORT``)."""
    out = tmp_path_factory.mktemp("full")
    result = run_job(workers=4, spares=0, steps=STEPS, command=_command(out))
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _FULL_REPORT["report"] = result.report
    return out


def test_a_job_with_no_spare_shrinks_from_four_to_three_to_two_and_stays_the_same_run(
    tmp_path: Path, full: Path
) -> None:
    result = run_job(workers=4, spares=0, min_workers=2, steps=STEPS, out=tmp_path / "run",
                     faults=["kill:rank=1@step=3", "kill:rank=2@step=6"], command=_command(tmp_path / "e"))  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _same_run(full, tmp_path / "e")
    resized = [(e["before"], e["replicas"], e["step"]) for e in result.events if e["kind"] == "resized"]
    assert resized == [(4, 3, 3), (3, 2, 6)], resized
    gens = [e for e in result.events if e["kind"] == "generation_started" and e["gen"] > 0]
    assert [len(g["members"]) for g in gens] == [3, 2] and not any(g["sources"] for g in gens)
    report = result.report
    assert report["steps_completed"] == STEPS and report["generations"] == 2, report
    assert all(f["lost_steps"] == 0 for f in report["faults"]), report["faults"]
    # the report: the replicas of every step, and each step's loss over its whole global batch
    # (a replica computing two shares weighs twice) equal to the full-size run's
    assert report["replicas_by_step"] == {str(s): 4 if s < 3 else 3 if s < 6 else 2 for s in range(STEPS)}
    ours, theirs = report["loss_by_step"], _FULL_REPORT["report"]["loss_by_step"]
    assert sorted(ours) == sorted(theirs) == sorted(str(s) for s in range(STEPS))
    assert all(abs(ours[k] - theirs[k]) <= 1e-4 * abs(theirs[k]) for k in ours), (ours, theirs)


def test_two_ranks_lost_at_once_and_a_hang_shrink_in_one_generation_each(tmp_path: Path, full: Path) -> None:
    result = run_job(workers=4, spares=0, min_workers=1, steps=STEPS, faults=["kill:rank=0,2@step=2",
                     "hang:rank=1@step=5", "exception:rank=0@step=7"], command=_command(tmp_path / "e"))  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _same_run(full, tmp_path / "e")
    resized = [(e["before"], e["replicas"]) for e in result.events if e["kind"] == "resized"]
    assert resized == [(4, 2), (2, 1)], resized


def test_a_spare_ready_takes_the_rank_and_the_job_keeps_its_size(tmp_path: Path) -> None:
    reference = run_job(workers=4, spares=0, steps=STEPS, command=_command(tmp_path / "ref"))
    assert reference.ok, f"{reference.error}\n{logs_of(reference)}"
    result = run_job(workers=4, spares=1, min_workers=2, steps=STEPS, faults=["kill:rank=1@step=3"],
                     command=_command(tmp_path / "e"))  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.digest == reference.digest  # a replacement: bitwise, as in a job of fixed size
    assert not [e for e in result.events if e["kind"] == "resized"]


def test_below_min_workers_the_job_stops_in_one_line(tmp_path: Path) -> None:
    result = run_job(workers=4, spares=0, min_workers=3, steps=STEPS,
                     faults=["kill:rank=1@step=2", "kill:rank=0@step=4"], command=_command(tmp_path / "e"))  # fmt: skip
    assert not result.ok
    assert result.error is not None and "fewer than --min-workers 3" in result.error, result.error
    assert "\n" not in result.error.strip(), result.error
    assert [(e["before"], e["replicas"]) for e in result.events if e["kind"] == "resized"] == [(4, 3)]


def test_an_elastic_job_whose_step_has_no_share_loop_is_refused_at_its_first_step(tmp_path: Path) -> None:
    result = run_job(
        workers=2, spares=0, min_workers=1, steps=STEPS, command=_command(tmp_path / "e", "--no-loop")
    )
    assert not result.ok
    assert (
        result.error is not None
        and "another number after a resize (--min-workers, --max-workers)" in result.error
    ), result.error
    committed = [e for e in result.events if e["kind"] == "step_committed"]
    assert not committed, committed[:2]


def test_eight_workers_shrink_to_five_through_kills_a_hang_and_an_exception(tmp_path: Path) -> None:
    """World size 8, eight shares: three ranks lost with no spare (one of them hung), an exception
    re-executed in place; the same run as the fault-free one at 8 to rounding."""
    steps = ["--global-batch", "32"]
    full = run_job(
        workers=8, spares=0, steps=STEPS, command=_command(tmp_path / "full", *steps), timeout_s=240
    )
    assert full.ok, f"{full.error}\n{logs_of(full)}"
    result = run_job(workers=8, spares=0, min_workers=4, steps=STEPS, timeout_s=240,
                     faults=["kill:rank=3@step=2", "hang:rank=6@step=4", "exception:rank=0@step=5",
                             "kill:rank=1@step=7"], command=_command(tmp_path / "e", *steps))  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _same_run(tmp_path / "full", tmp_path / "e")
    resized = [(e["before"], e["replicas"]) for e in result.events if e["kind"] == "resized"]
    assert resized == [(8, 7), (7, 6), (6, 5)], resized
