"""A Session without a launcher: one process, the same loop, no fault tolerance."""

from __future__ import annotations

import os

import pytest
import torch

import checkpointless as cl

pytestmark = pytest.mark.timeout(60)


def test_local_loop_runs_and_reraises() -> None:
    assert "CHECKPOINTLESS_STORE" not in os.environ
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    session = cl.Session(model, opt, seed=3)
    seen = []
    for step in session.steps(4):
        with session.attempt():
            model(torch.ones(2, 3)).sum().backward()
            session.reduce_gradients()
            opt.step()
            opt.zero_grad()
        seen.append(step)
    assert seen == [0, 1, 2, 3] and session.rank == 0 and session.dp_size == 1
    assert len(session.finish()) == 64
    with pytest.raises(ZeroDivisionError):
        for _ in session.steps(5):
            with session.attempt():
                _ = 1 / 0


def test_steps_requires_attempt() -> None:
    session = cl.Session(torch.nn.Linear(1, 1))
    with pytest.raises(RuntimeError, match=r"session\.attempt"):
        for _ in session.steps(1):
            pass


def test_attempt_reseeds_per_step_and_rank() -> None:
    """Each attempt starts torch's, NumPy's and ``random``'s generators from ``step_seed(seed, step,
    rank)``, whatever was drawn before it: the draws are that seed's, and differ between steps and
    between ranks (a reseeding that ignored either would repeat them)."""
    import random

    import numpy as np

    from checkpointless.seeds import step_seed

    def draws(rank: int) -> list[tuple[float, float, float]]:
        session = cl.Session(torch.nn.Linear(1, 1), seed=7)
        session._member.rank = rank  # what a formation gives a process: its seeds follow it
        out = []
        for _ in session.steps(3):
            torch.rand(5), np.random.rand(), random.random()  # drawn between attempts: no effect on the next
            with session.attempt():
                out.append((torch.rand(1).item(), float(np.random.rand()), random.random()))
        return out

    def expected(step: int, rank: int) -> tuple[float, float, float]:
        s = step_seed(7, step, rank)
        g = torch.Generator().manual_seed(s)
        return (
            torch.rand(1, generator=g).item(),
            float(np.random.RandomState(s % 2**32).rand()),
            random.Random(s).random(),
        )

    got = {rank: draws(rank) for rank in (0, 1)}
    assert got == {rank: [expected(step, rank) for step in range(3)] for rank in (0, 1)}
    every = [d for rank in got for d in got[rank]]
    assert len(set(every)) == len(every) == 6  # no two (step, rank) draw alike


def test_log_converts_scalars_and_refuses_misuse() -> None:
    import numpy as np

    model = torch.nn.Linear(2, 1)
    session = cl.Session(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in session.steps(1):
        with session.attempt() as attempt:
            loss = model(torch.ones(1, 2)).sum()
            loss.backward()
            session.reduce_gradients()
            session.log(loss=loss, lr=np.float32(0.5), tokens=np.int64(2), name="x")
            with pytest.raises(cl.FatalError, match="expected a number"):
                session.log(bad=torch.ones(3))
        assert attempt.committed
    with pytest.raises(cl.FatalError, match="outside"):
        session.log(loss=1.0)
    session.emit("eval", heldout_loss=np.float32(1.5))  # NumPy scalars convert (no launcher: dropped)
