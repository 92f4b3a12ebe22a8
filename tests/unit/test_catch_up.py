"""The catch-up's replay (``catch_up``): a copy of the state plus what the optimizer was given at
each step since, applied by another optimizer of the same kind, gives the same bits; a step called
with a closure cannot be followed; the light state leaves out exactly what a follower holds."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

from checkpointless.catch_up import fill_light, light_state
from checkpointless.step_log import StepLog, apply_step, copy_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def _train(model: nn.Module, opt: torch.optim.Optimizer, sched: object, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    if step % 3 == 2:
        model[3].bias.grad = None  # a parameter without a gradient at some steps
    opt.step()
    sched.step()  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_replaying_the_records_on_a_copy_gives_the_same_bits(kind: str) -> None:
    def make(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
        if kind == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(
                [{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": 3e-3}], lr=1e-3
            )
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    source = _model()
    opt, sched = make(source)
    for s in range(3):
        _train(source, opt, sched, s)
    # the follower: a model built alike, the copy loaded, then each step's records applied
    follower = _model()
    fopt, _ = make(follower)
    snapshot = copy_state({"model": source.state_dict(), "optimizer": opt.state_dict()})
    log = StepLog(opt)
    records = []
    for s in range(3, 9):
        _train(source, opt, sched, s)
        records.append(log.take()[0])  # kept: their buffers are never given back, so never reused
    log.close()
    follower.load_state_dict(snapshot["model"])
    fopt.load_state_dict(snapshot["optimizer"])
    for calls in records:
        assert len(calls) == 1
        apply_step(fopt, calls)
    for (name, a), b in zip(source.named_parameters(), follower.parameters(), strict=True):
        assert torch.equal(a, b), name
    state_a, state_b = opt.state_dict(), fopt.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    for k, v in state_a["state"].items():
        for name, t in v.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(state_b["state"][k][name])), (k, name)


def test_a_failed_step_s_records_are_dropped_and_a_closure_is_seen() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = StepLog(opt)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    log.drop()
    assert log.take() == ([], []) and not log.closure
    opt.step()
    assert len(log.take()[0]) == 1 and not log.closure
    opt.step(None)  # accelerate's optimizer wrapper passes its closure on by position: None
    assert len(log.take()[0]) == 1 and not log.closure
    opt.step(lambda: torch.tensor(0.0))
    assert log.closure
    log.close()
    opt.step()
    assert log.take() == ([], [])  # the hook is gone


def test_a_steps_gradients_are_copied_into_buffers_reused_only_once_given_back() -> None:
    """The records' gradients live in pooled buffers: equal to what the optimizer was given, apart
    from the next step's until the sender gives them back, then reused (no fresh pages); a dropped
    step's buffers come back at once."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = StepLog(opt)
    log.buffers.touch()
    (touched,) = log.buffers._free
    steps = []
    for s in range(3):
        model.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(s))).sum().backward()
        given = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        (call,), bufs = log.take()
        steps.append((call, bufs, given))
    (c0, b0, g0), (c1, b1, g1), (c2, b2, g2) = steps
    assert b0 == [touched] and b1[0] is not touched and b2[0] is not b1[0]  # none given back yet
    for call, given in ((c0, g0), (c1, g1), (c2, g2)):  # each step's own values, none overwritten
        assert all(
            torch.equal(a, b) for a, b in zip(call["grads"], given, strict=True)
        )  # every one has a gradient
    log.buffers.release(b1[0])
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    _, (b3,) = log.take()
    assert b3 is b1[0]  # reused
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    log.drop()  # a failed step: its buffers back at once
    assert len(log.buffers._free) == 1
    log.close()


def test_a_pooled_record_is_sent_and_replayed_to_the_same_bits() -> None:
    """A record's gradients are views into a pooled buffer: ``apply_step`` on them gives the bits
    of the source's own step."""
    source, follower = _model(), _model()
    opt = torch.optim.AdamW(source.parameters(), lr=1e-3)
    fopt = torch.optim.AdamW(follower.parameters(), lr=1e-3)
    log = StepLog(opt)
    for s in range(3):
        opt.zero_grad()
        source(torch.randn(4, 8, generator=torch.Generator().manual_seed(s))).pow(2).sum().backward()
        opt.step()
        calls, bufs = log.take()
        apply_step(fopt, calls)
        for b in bufs:
            log.buffers.release(b)
    log.close()
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), follower.parameters(), strict=True))


def test_the_light_state_leaves_out_parameters_and_optimizer_state_only() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    names = {n for n, _ in model.named_parameters()}
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "progress": {"committed": 7}}
    light = light_state(state, names)
    assert set(light["model"]) == set(model.state_dict()) - names  # the BatchNorm buffers stay
    assert (
        light["optimizer"]["state"] == {}
        and light["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]
    )
    assert light["progress"] == {"committed": 7}
    own = copy.deepcopy(state)
    whole = fill_light(light, own, names)
    assert (
        set(whole["model"]) == set(state["model"])
        and whole["optimizer"]["state"] is own["optimizer"]["state"]
    )


@pytest.mark.parametrize("flags", [[], ["--min-workers", "2"]])
def test_never_wait_without_a_smaller_size_is_one_line_and_exit_2(flags: list[str]) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "checkpointless", "demo", "--workers", "2", "--never-wait",
                           "--steps", "2", *flags], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.strip().splitlines() == [
        "error: --never-wait needs --min-workers below --workers 2: the survivors take a lost worker's shares "
        "while a spare catches up"
    ], done.stderr


def test_the_configuration_names_the_same_mistake() -> None:
    from checkpointless.config import JobConfig, RecoveryConfig

    with pytest.raises(ValueError, match="never_wait needs min_workers below workers"):
        JobConfig(workers=2, recovery=RecoveryConfig(never_wait=True))
    assert JobConfig(workers=2, recovery=RecoveryConfig(never_wait=True, min_workers=1)).recovery.never_wait


def test_the_report_lists_each_catch_up_and_how_it_ended() -> None:
    from checkpointless.observe.report import catch_ups

    def ev(t: float, kind: str, **f: object) -> dict[str, object]:
        return {"t": t, "kind": kind, **f}

    events = [
        ev(1.0, "catch_up_started", proc="coordinator", rank=2, gen=1, step=4, target="s0"),
        ev(1.2, "catch_up_sent", proc="w3", rank=2, gen=1, step=4, target="s0", bytes=100, seconds=0.1),
        ev(1.5, "catch_up_ended", proc="s0", gen=1, target="s0", ok=False, error="source gone"),
        ev(3.0, "catch_up_started", proc="coordinator", rank=0, gen=3, step=9, target="s0"),
        ev(3.1, "catch_up_sent", proc="w0", rank=0, gen=3, step=9, target="s0", bytes=100, seconds=0.05),
        ev(4.0, "catch_up_ended", proc="s0", rank=3, gen=4, step=11, src=0, ok=True),
        ev(5.0, "catch_up_started", proc="coordinator", rank=1, gen=5, step=20, target="s1"),
    ]
    got = catch_ups(events)
    assert [(c["target"], c["source_rank"], c["from_step"], c["ok"], c["error"]) for c in got] == [
        ("s0", 2, 4, False, "source gone"),
        ("s0", 0, 9, True, None),
        ("s1", 1, 20, None, None),
    ]
    assert got[0]["seconds"] == 0.5 and got[1]["seconds"] == 1.0 and got[1]["copy_s"] == 0.05
    assert got[2]["bytes"] is None and got[2]["seconds"] is None


def test_a_source_and_its_follower_over_a_real_pair_group_end_at_the_same_bits() -> None:
    """Source and follower on two threads over a real gloo pair: the copy, then each call of the
    optimizer's step sent as it is made; a failed attempt's calls dropped (the follower never
    applies them), a step with two calls applied as two, the end acknowledged: the follower holds
    the source's parameters and optimizer state bit for bit."""
    from datetime import timedelta

    from checkpointless.catch_up import CatchUpSource, follow
    from checkpointless.comm import Group
    from tests.unit.test_reducer import run_ranks

    secret = b"s" * 32
    timeout = timedelta(seconds=30)

    def grads(model: nn.Module, seed: int) -> None:
        model.zero_grad()
        g = torch.Generator().manual_seed(seed)
        nn.functional.mse_loss(
            model(torch.randn(8, 8, generator=g)), torch.randn(8, 2, generator=g)
        ).backward()

    def rank_fn(rank: int, store: Any) -> Any:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        pair = functools.partial(Group, store, 0, rank, 2, prefix="catch-up/", timeout=timeout)
        if rank == 1:
            group = pair()
            try:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict()}

                def load(st: dict[str, Any]) -> None:
                    model.load_state_dict(st["model"])
                    opt.load_state_dict(st["optimizer"])

                held = follow(group, secret, state, load, opt, lambda step: None)
            finally:
                group.abort()
            return held, copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        for s in range(2):
            grads(model, s)
            opt.step()
        sent: list[Any] = []
        source = CatchUpSource("s", {"model": model.state_dict(), "optimizer": opt.state_dict()}, 1, opt,
                               secret=secret, connect=pair, on_sent=sent.append)  # fmt: skip
        source.start()
        grads(model, 2)
        opt.step()
        source.committed(2)
        undo = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        grads(model, 99)
        opt.step()  # an attempt that fails after its optimizer step: undone, its call dropped
        model.load_state_dict(undo[0])
        opt.load_state_dict(undo[1])
        source.drop()
        grads(model, 3)
        opt.step()
        source.committed(3)
        grads(model, 4)
        opt.step()
        grads(model, 5)
        opt.step()  # two calls in one step
        source.committed(4)
        assert source.finish(4, 30.0), source.error
        assert len(sent) == 1
        return 4, copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

    (step_a, model_a, opt_a), (step_b, model_b, opt_b) = run_ranks(2, rank_fn)
    assert step_a == step_b == 4
    params = {n for n, _ in _model().named_parameters()}  # the buffers come with the join's light state
    assert all(torch.equal(model_a[k], model_b[k]) for k in params)
    for k, v in opt_a["state"].items():
        assert all(
            torch.equal(torch.as_tensor(t), torch.as_tensor(opt_b["state"][k][n])) for n, t in v.items()
        )


def test_a_join_check_hashes_beside_a_forward_pass_and_sees_a_change_outside_the_optimizer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``StateDigest`` equals the holder's own digest of its compared state; a forward pass that
    moves the running statistics while it hashes does not change it (what a forward pass moves is
    copied first), so the spare's first step cannot fail the check; a parameter changed outside
    the optimizer's step does (``JoinCheck``)."""
    import threading

    from checkpointless import following
    from checkpointless.following import JoinCheck, StateDigest
    from checkpointless.model_holder import ReplicatedModel
    from checkpointless.progress import Progress, StepState
    from checkpointless.state import combined_digest

    def holder() -> ReplicatedModel:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        return ReplicatedModel(model, opt, {}, Progress(StepState()), overlap=False, broadcast_buffers=True)

    source, spare = holder(), holder()
    theirs = combined_digest(source.entries())
    assert StateDigest(source).result() == theirs
    go = threading.Event()
    real = following.entry_digests

    def held(state: Any) -> Any:  # the hash begins only once the forward pass is over
        assert go.wait(10)
        return real(state)

    monkeypatch.setattr(following, "entry_digests", held)
    check = JoinCheck(spare, theirs)
    assert spare.model is not None
    spare.model(torch.randn(4, 8))  # the first step's forward pass moves the BatchNorm statistics
    go.set()
    assert check.same()
    monkeypatch.setattr(following, "entry_digests", real)
    changed = holder()
    assert changed.model is not None
    with torch.no_grad():
        changed.model[0].weight.mul_(0.999)  # outside the optimizer's step
    assert not JoinCheck(changed, theirs).same()
