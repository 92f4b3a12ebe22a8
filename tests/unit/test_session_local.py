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
    session = cl.Session(torch.nn.Linear(1, 1), seed=7)
    draws = []
    for _ in session.steps(2):
        with session.attempt():
            draws.append(torch.rand(1).item())
    again = cl.Session(torch.nn.Linear(1, 1), seed=7)
    for _ in again.steps(2):
        with again.attempt():
            assert torch.rand(1).item() == draws[again.step]


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
