"""The session's collectives keep to their planes in a real job on the pretend accelerator (the
doubles of ``tests/devicefake.py``; the transfer alone: ``tests/unit/test_device_planes.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from checkpointless.config import JobConfig, RecoveryConfig
from checkpointless.fault_grammar import parse_faults
from checkpointless.launch.launcher import Launcher
from checkpointless.protocol.vocab import Event

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pretend_device.py"


@pytest.mark.timeout(240)
def test_session_collectives_and_a_replacements_transfer_keep_to_their_planes(tmp_path: Path) -> None:
    """A real job (3 workers, 1 spare, a kill at step 3, a flipped bit on rank 2 at step 4, replicas
    compared every 2 steps, so rank 2 is re-synced from the majority) trains on the pretend device:
    every data-plane tensor is a device tensor, every control tensor a CPU one, and each plane
    carried what it should: gradients, buffers and the state's device tensors on the data plane;
    barriers, the layout check, digests, headers and CPU state on the control plane."""
    planes = tmp_path / "planes"
    planes.mkdir()
    steps = 8
    job = JobConfig(
        workers=3, spares=1, faults=parse_faults(["kill:rank=1@step=3", "corrupt:rank=2@step=4"]),
        recovery=RecoveryConfig(hang_timeout_s=4.0, consistency_every=2, collective_timeout_s=30.0),
    )  # fmt: skip
    result = Launcher(
        job, [sys.executable, str(SCRIPT), str(steps)], total_steps=steps, env={"PLANES_OUT": str(planes)},
        timeout_s=200,
    ).run()  # fmt: skip
    assert result.ok, (result.error, {n: p.read_text()[-3000:] for n, p in result.logs.items()})
    assert [p.name for p in planes.glob("*.violations")] == []
    reports = {p.stem: json.loads(p.read_text()) for p in planes.glob("*.json")}
    assert set(reports) >= {"w0", "s0"}, sorted(reports)  # w1 was killed; the spare replaced it
    total: dict[str, int] = {}
    for r in reports.values():
        assert r["violations"] == []
        for k, v in r["calls"].items():
            total[k] = total.get(k, 0) + v
    for kind in ("data.allreduce", "data.broadcast", "data.send", "data.recv",
                 "control.allgather", "control.allreduce", "control.send", "control.recv"):  # fmt: skip
        assert total.get(kind, 0) > 0, (kind, total)
    assert "data.allgather" not in total, total
    assert reports["s0"]["calls"].get("data.recv", 0) > 0  # the replacement received device tensors
    assert reports["w2"]["calls"].get("data.recv", 0) > 0  # so did the corrupted replica, re-synced
    assert [e["rank"] for e in result.events if e["kind"] == Event.STATE_RESYNCED] == [2]
