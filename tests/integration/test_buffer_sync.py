"""Buffers across replicas (``checkpointless.module_state.BufferSync``): rank 0's are broadcast at the steps
where some rank's moved since the last commit, the ranks agreeing through a flag the gradient
reduction carries, and at no other step (a constant table costs no collective); a buffer moved on
one rank only still ends equal everywhere, with a kill in the job too."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.jobs import logs_of, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "buffer_moves.py")
STEPS = 9


def _lines(job) -> dict[str, tuple[int, float]]:  # type: ignore[no-untyped-def]
    out = {}
    for name, path in job.logs.items():
        m = re.search(r"BUFFERS broadcasts=(\d+) seen=([-\d.]+)", path.read_text())
        if m:
            out[name] = (int(m.group(1)), float(m.group(2)))
    return out


@pytest.mark.parametrize(
    ("workers", "faults"),
    [(2, ["kill:rank=1@step=5"]), (4, ["exception:rank=2@step=3", "kill:rank=1@step=5"])],
    ids=["2-kill", "4-exception-then-kill"],
)
def test_buffers_are_broadcast_where_a_rank_moved_them_and_nowhere_else(
    tmp_path: Path, workers: int, faults: list[str]
) -> None:
    command = [sys.executable, SCRIPT, str(STEPS)]
    ref = run_job(workers=workers, spares=0, steps=STEPS, command=command, out=tmp_path / "ref")
    assert ref.ok, f"{ref.error}\n{logs_of(ref)}"
    # rank 1 bumped its counter at steps 3 and 6: two broadcasts, each rank 0's counter (0) winning
    assert _lines(ref) == {f"w{r}": (2, 0.0) for r in range(workers)}, logs_of(ref)
    faulted = run_job(workers=workers, spares=1, steps=STEPS, command=command, faults=faults,
                      out=tmp_path / "faulted")  # fmt: skip
    assert faulted.ok, f"{faulted.error}\n{logs_of(faulted)}"
    assert faulted.digest == ref.digest
    seen = {name: v for name, (_, v) in _lines(faulted).items()}
    assert set(seen.values()) == {0.0} and len(seen) == workers, logs_of(faulted)
