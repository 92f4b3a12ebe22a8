"""A script written for torchrun's default process group (issue 21): ``dist.get_rank()``,
``DistributedSampler(dataset)`` with no arguments and its own ``all_reduce`` (inside the step, and
between steps in ``session.between_steps()``) work under the launcher, a generation after another;
a peer that fails during the evaluation between steps (killed, stopped, or raising) is recovered
and the result equals the fault-free run bit for bit; the script runs alone too."""

from __future__ import annotations

import functools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import logs_of, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "default_group.py")
STEPS = 10


def _evals(result, rank: int) -> dict[int, tuple[bool, float]]:  # type: ignore[no-untyped-def]
    """What each evaluation of the process that ended as ``rank`` printed."""
    procs = {e["target"] for e in result.events if e["kind"] == "spare_assigned" and e.get("rank") == rank}
    names = procs or {f"w{rank}"}
    out: dict[int, tuple[bool, float]] = {}
    for name in sorted(names):
        for m in re.finditer(r"^eval (\d+) ([01]) (\S+)$", result.logs[name].read_text(), re.M):
            out[int(m[1])] = (m[2] == "1", float(m[3]))
    return out


def _command(shards: int, *args: str) -> list[str]:
    return [sys.executable, SCRIPT, str(STEPS), *args, *(["--sharded"] if shards > 1 else [])]


@functools.cache
def _reference(workers: int, shards: int, tmp: str) -> tuple[str, dict[int, tuple[bool, float]]]:
    result = run_job(
        workers=workers, shards=shards, spares=0, steps=STEPS, command=_command(shards),
        out=Path(tmp) / f"ref{workers}x{shards}",
    )  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.digest
    return result.digest, _evals(result, 0)


@pytest.mark.parametrize(
    ("workers", "shards", "fault"),
    [(2, 1, "kill"), (2, 1, "hang"), (2, 1, "raise"), (4, 1, "kill"), (4, 2, "kill")],
)
def test_a_peer_failing_between_steps_is_recovered_bitwise(
    workers: int, shards: int, fault: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The fault strikes rank 1 in the evaluation after step 3, before its all-reduce (sharded: the
    other ranks may be in the forward pass's all-gather)."""
    digest, evals = _reference(workers, shards, str(tmp_path_factory.getbasetemp()))
    assert all(done for done, _ in evals.values()) and sorted(evals) == [1, 3, 5, 7, 9]
    result = run_job(
        workers=workers, shards=shards, spares=1, steps=STEPS, command=_command(shards, fault),
        out=tmp_path_factory.mktemp(f"{fault}{workers}x{shards}"), hang_timeout_s=3.0, expect_fired=False,
    )  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.digest == digest
    between = [e for e in result.events if e["kind"] == "fault_detected" and e.get("between_steps")]
    assert between and {e["rank"] for e in between} <= set(range(workers)) - {1}, between
    assert all(e["step"] == 4 for e in between), between
    # the survivors' evaluation after step 3 ended early; every other one equals the reference's
    survivor = _evals(result, 0)
    assert survivor[3][0] is False and math.isnan(survivor[3][1])
    assert {s: v for s, v in survivor.items() if s != 3} == {s: v for s, v in evals.items() if s != 3}
    assert [e["rank"] for e in result.events if e["kind"] == "spare_assigned"] == [1]


@pytest.mark.parametrize("sharded", [False, True])
def test_the_script_runs_alone_on_a_default_group_of_one(sharded: bool) -> None:
    done = subprocess.run(
        [sys.executable, SCRIPT, "4", *(["--sharded"] if sharded else [])],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.findall(r"^eval (\d+) 1 ", done.stdout, re.M) == ["1", "3"]
