"""``--exact-resize``: the gradient summed over the shares in share order, so that the run is the
same bit for bit whatever the number of replicas: 4 replicas, 2 replicas holding 2 shares each, and
a job that shrinks through kills and grows back end with the same losses and the same
parameters, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_shares import SCRIPT, _losses
from tests.jobs import logs_of, run_job

pytestmark = pytest.mark.timeout(300)

STEPS = 12


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, SCRIPT, str(STEPS), str(out), *extra]


def _bitwise(a: Path, b: Path) -> None:
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == sorted(lb) and all(la[k] == lb[k] for k in la), {k: (la[k], lb.get(k)) for k in la}
    pa, pb = torch.load(a / "final.pt"), torch.load(b / "final.pt")
    assert all(torch.equal(pa[k], pb[k]) for k in pa), [k for k in pa if not torch.equal(pa[k], pb[k])]


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("four")
    result = run_job(workers=4, spares=0, steps=STEPS, exact_resize=True, command=_command(out))
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    return out


def test_two_replicas_holding_two_shares_each_are_four_bit_for_bit(tmp_path: Path, four: Path) -> None:
    result = run_job(
        workers=2, spares=0, shares=4, steps=STEPS, exact_resize=True, command=_command(tmp_path)
    )
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _bitwise(four, tmp_path)


def test_a_job_that_shrinks_and_grows_back_is_the_same_run_bit_for_bit(tmp_path: Path, four: Path) -> None:
    result = run_job(workers=4, spares=0, min_workers=2, steps=STEPS, exact_resize=True, resize_interval_s=0.5,
                     faults=["kill:rank=1@step=2", "kill:rank=2@step=4"],
                     command=_command(tmp_path / "e", "--pause", "0.4"))  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _bitwise(four, tmp_path / "e")
    sizes = [e["replicas"] for e in result.events if e["kind"] == "resized"]
    # the second kill shrinks the job again, or a process started for the first is ready and takes it
    assert sizes[0] == 3 and sizes[-1] == 4, sizes
    assert {3, 4} <= set(result.report["replicas_by_step"].values()), result.report["replicas_by_step"]


def test_a_step_without_the_share_loop_at_its_starting_size_is_the_same_bits(
    tmp_path: Path, four: Path
) -> None:
    result = run_job(
        workers=4, spares=0, steps=STEPS, exact_resize=True, command=_command(tmp_path, "--no-loop")
    )
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _bitwise(four, tmp_path)


def test_draws_before_the_share_loop_are_the_same_at_any_size(tmp_path: Path) -> None:
    """A random scale drawn before the loop comes from (seed, step) in an elastic job: the run that
    shrinks draws what the fault-free one did, bit for bit."""
    runs = {}
    for name, faults in (("full", []), ("shrunk", ["kill:rank=3@step=3"])):
        result = run_job(workers=4, spares=0, min_workers=2, steps=STEPS, exact_resize=True, faults=faults,
                         command=_command(tmp_path / name, "--draw-before"))  # fmt: skip
        assert result.ok, f"{result.error}\n{logs_of(result)}"
        runs[name] = result
    assert [e["replicas"] for e in runs["shrunk"].events if e["kind"] == "resized"] == [3]
    _bitwise(tmp_path / "full", tmp_path / "shrunk")
