"""``--exact-resize``: the gradient summed over the shares in share order, so that the run is the
same bit for bit whatever the number of replicas: 4 replicas, 2 replicas holding 2 shares each, and
a job that shrinks through kills and grows back end with the same losses and the same
parameters, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpointless.launch.launcher import JobResult
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


SHARDED = str(Path(__file__).resolve().parents[2] / "examples" / "sharded_loop.py")


def _sharded(**kw: Any) -> JobResult:
    result = run_job(shards=2, steps=STEPS, exact_resize=True, timeout_s=240,
                     command=[sys.executable, SHARDED, "--steps", str(STEPS)], **kw)  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    return result


def test_a_sharded_job_is_the_same_run_bit_for_bit_at_any_number_of_replicas() -> None:
    """FSDP2 HSDP, 3 replicas x 2 shards: the fault-free run, 1 replica computing the 3 replicas'
    shares, and a job that loses a replica at step 4 (3 -> 2 replicas: one holds two replica shares)
    end with the same state and the same losses, bit for bit (the replicas' stage of the reduction
    is the exact sum over shares; each share's reduce-scatter over its replica's ranks is FSDP2's)."""
    full = _sharded(workers=6, spares=0)
    alone = _sharded(workers=2, spares=0, shares=6)
    shrunk = _sharded(workers=6, spares=0, min_workers=2, faults=["kill:rank=3@step=4"])
    assert [(e["before"], e["replicas"]) for e in shrunk.events if e["kind"] == "resized"] == [(3, 2)]
    assert full.digest == alone.digest == shrunk.digest
    assert full.report["loss_by_step"] == alone.report["loss_by_step"] == shrunk.report["loss_by_step"]
