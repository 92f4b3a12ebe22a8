"""The durable tier's snapshots: exact round trip, complete-only choice, corruption refused, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpointless import durable
from checkpointless.control.plan import PlanError, initial_plan, make_plan
from checkpointless.errors import IntegrityError
from checkpointless.state import digest_state

pytestmark = pytest.mark.timeout(60)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    o = torch.optim.AdamW(m.parameters())
    m(torch.randn(6, 4)).sum().backward()
    o.step()
    return m, o


def _save(root: Path, step: int, state: dict[str, object], shard: int = 0) -> durable.DurableWriter:
    w = durable.DurableWriter(root, every=1, shard=shard)
    assert w.save(step, state)
    w.wait()
    assert w.error is None and w.saved == [step]
    return w


def test_round_trip_is_exact(tmp_path: Path) -> None:
    m, o = _trained()
    _save(
        tmp_path, 9, {"model": m.state_dict(), "optimizer": o.state_dict(), "progress": {"committed_step": 9}}
    )
    assert durable.latest_complete(tmp_path) == 9
    state = durable.load(tmp_path, 9)
    m2, o2 = _trained()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    m2.load_state_dict(state["model"])  # type: ignore[arg-type]
    o2.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
    assert digest_state(m2, o2, 9) == digest_state(m, o, 9)
    assert state["progress"] == {"committed_step": 9}


def test_a_snapshot_without_its_manifest_is_never_chosen(tmp_path: Path) -> None:
    _save(tmp_path, 4, {"x": torch.ones(3)})
    _save(tmp_path, 9, {"x": torch.ones(3)})
    (tmp_path / "step-000000009" / "shard-0.json").unlink()  # a write cut short
    assert durable.latest_complete(tmp_path) == 4
    with pytest.raises(IntegrityError, match="step 9"):
        durable.load(tmp_path, 9)


def test_every_shard_must_be_complete(tmp_path: Path) -> None:
    _save(tmp_path, 4, {"x": torch.ones(3)}, shard=0)
    _save(tmp_path, 4, {"x": torch.ones(3)}, shard=1)
    _save(tmp_path, 9, {"x": torch.ones(3)}, shard=0)
    assert durable.latest_complete(tmp_path, shards=2) == 4
    assert durable.latest_complete(tmp_path / "missing") is None


def test_a_corrupt_snapshot_is_refused(tmp_path: Path) -> None:
    _save(tmp_path, 3, {"x": torch.arange(1000.0)})
    (data,) = (tmp_path / "step-000000003" / "shard-0").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match=r"\(corrupt\); not loaded"):
        durable.load(tmp_path, 3)
    data.unlink()
    with pytest.raises(IntegrityError, match="cannot be read"):
        durable.load(tmp_path, 3)


def test_the_writer_keeps_the_two_newest(tmp_path: Path) -> None:
    w = durable.DurableWriter(tmp_path, every=5)
    for step in (4, 9, 14, 19):
        assert w.due(step)
        w.save(step, {"x": torch.full((2,), float(step))})
        w.wait()
    assert not w.due(5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000014", "step-000000019"]
    assert torch.equal(durable.load(tmp_path, 14)["x"], torch.full((2,), 14.0))


def test_the_writer_reports_each_outcome(tmp_path: Path) -> None:
    """Written (with its time and size), skipped (the previous one still writing), failed (with the
    error): the job's report shows them, so a tier that silently falls behind cannot go unseen."""
    heard: list[tuple[str, dict[str, object]]] = []
    w = durable.DurableWriter(tmp_path / "ok", every=1, on_event=lambda kind, f: heard.append((kind, f)))
    big = {"x": torch.zeros(2_000_000)}
    assert w.save(0, big)
    assert not w.save(1, big)  # the first is still writing: skipped, not queued
    w.wait()
    kinds = [k for k, _ in heard]
    assert kinds == ["durable_skipped", "durable_written"], heard
    written = heard[1][1]
    assert written["step"] == 0 and written["bytes"] == 8_000_000 and float(written["seconds"]) > 0  # type: ignore[arg-type]
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    heard.clear()
    w = durable.DurableWriter(blocked, every=1, on_event=lambda kind, f: heard.append((kind, f)))
    assert w.save(4, {"x": torch.ones(2)})
    w.wait()
    ((kind, fields),) = heard
    assert kind == "durable_failed" and fields["step"] == 4 and "a-file" in str(fields["error"]), heard
    assert w.error is not None


def test_plan_rolls_back_only_when_a_shard_has_no_live_copy() -> None:
    prev = initial_plan(2, 1, ["w0", "w1"])
    with pytest.raises(PlanError, match="no durable copy exists"):
        make_plan(prev, {}, ["s0", "s1"])
    with pytest.raises(PlanError, match="holds no complete snapshot yet"):
        make_plan(prev, {}, ["s0", "s1"], durable_on=True, durable_step=None)
    plan = make_plan(prev, {}, ["s0", "s1"], durable_on=True, durable_step=9)
    assert plan.restore == 9 and plan.resume_step == 10 and not plan.sources
    assert plan.members == {0: "s0", 1: "s1"} and plan.replaced == {0: "w0", 1: "w1"}
    assert type(plan).from_json(plan.to_json()) == plan
    # a live copy: the snapshot is not used
    plan = make_plan(prev, {0: 12}, ["s0"], durable_on=True, durable_step=9)
    assert plan.restore is None and plan.resume_step == 13 and plan.sources == {1: 0}
