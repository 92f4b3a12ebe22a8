"""Replica consistency: per-entry state digests, the corrupt fault, buffer sync and its report."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from checkpointless.fault_grammar import FaultSpec, parse_fault, validate_schedule
from checkpointless.faults import FaultInjector
from checkpointless.module_state import BufferSync
from checkpointless.observe.report import build_report
from checkpointless.state import combined_digest, entry_digests, first_difference

pytestmark = pytest.mark.timeout(30)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    return model, opt


def test_entries_name_every_tensor_and_setting() -> None:
    model, opt = _trained()
    paths = [p for p, _ in entry_digests(_state(model, opt))]
    assert "model/1.running_mean" in paths and "model/1.num_batches_tracked" in paths
    assert "optimizer/state/0/exp_avg" in paths and "optimizer/param_groups/0/lr" in paths
    assert len(paths) == len(set(paths))


def test_a_flipped_bit_changes_the_digest_and_is_named() -> None:
    model, opt = _trained()
    a = entry_digests(_state(model, opt))
    with torch.no_grad():
        model[1].running_var.view(-1)[:1].view(torch.uint8)[:1].bitwise_xor_(1)
    b = entry_digests(_state(model, opt))
    assert combined_digest(a) != combined_digest(b)
    assert first_difference(a, b) == "model/1.running_var"
    assert first_difference(a, a) is None
    assert combined_digest(a) == combined_digest(entry_digests(_state(*_trained())))  # deterministic


def test_dtype_and_shape_are_part_of_an_entry() -> None:
    x = torch.zeros(4)
    assert entry_digests({"t": x})[0][1] != entry_digests({"t": x.view(2, 2)})[0][1]
    assert entry_digests({"t": x})[0][1] != entry_digests({"t": x.view(torch.int32)})[0][1]


def test_an_entry_only_one_side_has_is_a_difference() -> None:
    a = entry_digests({"x": torch.ones(2)})
    b = entry_digests({"x": torch.ones(2), "y": torch.ones(1)})
    assert first_difference(a, b) == "y"


def test_buffer_sync_alone_changes_nothing() -> None:
    model, _ = _trained()
    before = [b.clone() for b in model.buffers()]
    sync = BufferSync(model)
    assert sync and len(sync.buffers) == 3
    sync.sync(None)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers(), strict=True))
    assert not BufferSync(nn.Linear(2, 2))


def test_buffer_sync_sees_any_bit_a_forward_pass_moved_and_nothing_else() -> None:
    """``changed`` decides whether a sharded step broadcasts the buffers: a BatchNorm forward in
    training mode moves them, one in eval mode and a restore do not, and a sign flip of a zero
    (equal as a number, not as bits) is a change."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model.register_buffer("zero", torch.zeros(2))
    sync = BufferSync(model)
    assert not sync.changed()
    model.eval()
    model(torch.randn(5, 3))
    assert not sync.changed()
    model.train()
    model(torch.randn(5, 3))
    assert sync.changed()
    sync.restore()
    assert not sync.changed()
    model.get_buffer("zero")[1] = -0.0
    assert sync.changed()
    sync.commit()
    assert not sync.changed()


def test_corrupt_fault_parses_needs_no_spare_and_checks_its_rank() -> None:
    assert parse_fault("corrupt:rank=1@step=3") == FaultSpec("corrupt", (1,), 3)
    validate_schedule([parse_fault("corrupt:rank=1@step=3")], workers=2, spares=0, steps=10)
    with pytest.raises(ValueError, match="rank 2 is out of range for --workers 2"):
        validate_schedule([parse_fault("corrupt:rank=2@step=3")], workers=2, spares=0, steps=10)


def test_corrupt_fault_calls_the_corrupter_once() -> None:
    class Claims:
        def __init__(self) -> None:
            self.seen: set[str] = set()

        def claim(self, key: str) -> bool:
            new = key not in self.seen
            self.seen.add(key)
            return new

    hits: list[int] = []
    inj = FaultInjector([parse_fault("corrupt:rank=0@step=2")], Claims())
    for step in range(4):
        inj.at_step(0, step, corrupt=lambda: hits.append(1))
    inj.at_step(0, 2, corrupt=lambda: hits.append(1))  # a re-executed step is not hit again
    assert hits == [1]


def test_report_lists_a_corruption_with_its_detection_delay() -> None:
    def commit(t: float, rank: int, step: int) -> dict[str, object]:
        return {"t": t, "kind": "step_committed", "rank": rank, "step": step, "gen": 0, "step_time_s": 0.1}

    events: list[dict[str, object]] = [commit(1.0 + 0.1 * s, r, s) for s in range(10) for r in (0, 1, 2)]
    events += [
        {"t": 1.32, "kind": "fault_injected", "proc": "w1", "rank": 1, "gen": 0, "step": 3, "fault": "corrupt",
         "ranks": [1], "index": 0},
        {"t": 1.81, "kind": "state_diverged", "proc": "w0", "rank": 0, "gen": 0, "step": 7, "ranks": [1],
         "healthy": [0, 2], "entry": "model/0.weight"},
        {"t": 1.82, "kind": "state_resynced", "proc": "w1", "rank": 1, "gen": 0, "step": 7, "src": 0},
    ]  # fmt: skip
    events.sort(key=lambda e: float(e["t"]))  # type: ignore[arg-type]
    (f,) = build_report(events, total_steps=10, digest="ab")["faults"]
    assert f["kind"] == "corrupt" and f["cause"] == "state_diverged" and f["injected"]
    assert f["ranks"] == [1] and f["step"] == 3
    assert f["detected_step"] == 7 and f["detection_steps"] == 4
    assert f["detection_s"] == pytest.approx(0.49)
    assert f["error"] == "model/0.weight"
