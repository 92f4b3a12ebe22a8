"""Smoke test of the comparison baselines (bench/baselines): torchrun + DCP resumes after a kill."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.baselines import analyse, read_logs, torchrun_dcp
from checkpointless.launch.demo import DemoModel

TINY = DemoModel(
    steps=12, seed=0, vocab_size=32, seq_len=16, d_model=32, n_layer=1, n_head=2, global_batch=4, eval_every=0
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_dcp_resumes_from_checkpoint_after_kill(tmp_path: Path) -> None:
    ref = torchrun_dcp.run(TINY, tmp_path / "ref", steps=12, every=4, timeout_s=80)
    assert ref.ok, ref.error
    res = torchrun_dcp.run(
        TINY, tmp_path / "kill", steps=12, every=4, kill_step=9, max_restarts=2, timeout_s=80
    )
    assert res.ok, res.error
    recs = read_logs(res.run_dir)
    # rank 1 killed itself once; the restarted group loaded the step-8 checkpoint
    assert [r["step"] for r in recs if r["ev"] == "fault"] == [9]
    assert sorted(r["step"] for r in recs if r["ev"] == "loaded") == [8, 8]
    a = analyse(recs, system="torchrun", total_steps=12)
    assert a.lineage["complete"] and a.lineage["skipped"] == 0 and a.lineage["repeated"] == 0
    assert a.faults[0]["lost_steps"] == 1  # step 8 was committed, then redone from the checkpoint
    assert a.faults[0]["next_commit_s"] is not None
    # and it ends exactly where the fault-free run ends
    ref_digests = analyse(read_logs(ref.run_dir), system="torchrun", total_steps=12).final_digests
    assert len(ref_digests) == 1 and a.final_digests == ref_digests


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchft_survivor_continues_and_replacement_heals(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    from bench.baselines import torchft_ddp

    if (why := torchft_ddp.available()) is not None:
        pytest.skip(why)
    res = torchft_ddp.run(TINY, tmp_path / "kill", steps=12, kill_step=6, timeout_s=120)
    assert res.ok, res.error
    recs = read_logs(res.run_dir)
    a = analyse(recs, system="torchft", total_steps=12)
    assert a.faults and a.faults[0]["next_commit_s"] is not None
    # the survivor kept committing without the dead group (in a run this short it may finish before the
    # restarted group rejoins, which then trains alone from scratch: no digest check here)
    alone = [
        r
        for r in recs
        if r["ev"] == "commit" and r["rank"] == 0 and r["step"] >= 6 and r["participants"] == 1
    ]
    assert alone
