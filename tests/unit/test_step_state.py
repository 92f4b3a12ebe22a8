"""The loop's position (``progress.StepState``): where a fresh loop begins, what a recovery changes,
and what moves with the state (``Progress``)."""

from __future__ import annotations

import pytest
import torch

from checkpointless.progress import Progress, StepState

pytestmark = pytest.mark.timeout(30)


def test_the_first_steps_call_sets_the_start_and_later_calls_do_not() -> None:
    s = StepState()
    assert s.start_at(5) and (s.committed, s.next, s.first_commit) == (4, 5, 5)
    assert not s.start_at(0)  # a script that calls steps() once per epoch
    assert (s.committed, s.next, s.first_commit) == (4, 5, 5)


def test_a_replacement_that_received_a_later_position_keeps_it() -> None:
    s = StepState()
    s.load(11, 12)  # the source's position came with the state
    assert s.start_at(3)
    assert (s.committed, s.next, s.first_commit) == (11, 12, 3)


def test_a_recovered_step_is_reported_re_executed_once() -> None:
    s = StepState()
    s.resume(7, recovered=True)
    assert s.next == 7 and s.begin_attempt() and s.attempts == 1
    assert not s.begin_attempt() and s.attempts == 2  # its second try is not a re-execution
    s.resume(0, recovered=False)  # generation 0
    assert not s.begin_attempt()


def test_a_commit_resets_the_steps_own_failures() -> None:
    s = StepState()
    assert [s.failed_locally() for _ in range(3)] == [1, 2, 3]
    s.commit(0)
    assert (s.committed, s.next, s.local_failures) == (0, 1, 0)
    assert s.failed_locally() == 1


def test_progress_moves_the_position_and_the_rng_but_never_loads_a_lineage() -> None:
    src = StepState()
    src.commit(41)
    src.descend(7)
    torch.manual_seed(3)
    state = Progress(src).state_dict()
    expected = torch.rand(3)
    dst = StepState()
    dst.descend(9)
    torch.manual_seed(99)
    Progress(dst).load_state_dict(state)
    assert (dst.committed, dst.next) == (41, 42) and state["lineage"] == 7
    assert dst.lineage == 9  # the member takes a source's lineage from the transfer, not from here
    assert torch.equal(torch.rand(3), expected)


def test_a_build_that_returns_no_sharded_model_is_refused_in_words() -> None:
    from checkpointless.errors import Unrecoverable
    from checkpointless.sharded_model import ShardedModel

    mesh = object()  # the build never gets to use it
    for built, words in [("nope", r"must return \(model, optimizer\)"),
                         ((torch.nn.Linear(1, 1), None), "without fully_shard")]:  # fmt: skip
        holder = ShardedModel(lambda mesh, built=built: built, Progress(StepState()), broadcast_buffers=True)
        with pytest.raises(Unrecoverable, match=words):
            holder.enter(mesh)
        assert holder.model is None


def test_a_failed_attempt_is_undone_to_the_last_commit() -> None:
    from checkpointless.model_holder import ReplicatedModel

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    holder = ReplicatedModel(model, None, {}, Progress(StepState()), overlap=False, broadcast_buffers=True)
    holder.commit()
    before = model[1].running_mean.clone()
    model(torch.randn(4, 2))  # a forward pass of the failed attempt moves the statistics
    model[0].weight.requires_grad_(False)  # and the loop froze a layer inside it
    assert not torch.equal(model[1].running_mean, before)
    holder.undo_attempt()
    assert torch.equal(model[1].running_mean, before) and model[0].weight.requires_grad
