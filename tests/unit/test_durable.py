"""The durable tier's snapshots: exact round trip, complete-only choice, corruption refused, pruning,
snapshots bound to their run, failed writes reported and cleaned up, room made on a full disk."""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkpointless import durable, durable_snapshots
from checkpointless.config import JobConfig
from checkpointless.control.plan import PlanError, initial_plan, make_plan
from checkpointless.errors import IntegrityError
from checkpointless.state import digest_state

pytestmark = pytest.mark.timeout(60)

RUN = durable_snapshots.RunId.of(JobConfig(workers=1, spares=0), seed=0, argv=["train.py"])


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    o = torch.optim.AdamW(m.parameters())
    m(torch.randn(6, 4)).sum().backward()
    o.step()
    return m, o


def _save(
    root: Path, step: int, state: dict[str, object], shard: int = 0, run: durable_snapshots.RunId = RUN
) -> durable.DurableWriter:
    w = durable.DurableWriter(root, every=1, run=run, shard=shard)
    assert w.save(step, state)
    w.wait()
    assert w.error is None and w.saved == [step], w.error
    return w


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@contextlib.contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """Writes past ``limit`` bytes fail with EFBIG (a real failure inside DCP, like a full disk)."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


def test_round_trip_is_exact(tmp_path: Path) -> None:
    m, o = _trained()
    _save(
        tmp_path, 9, {"model": m.state_dict(), "optimizer": o.state_dict(), "progress": {"committed_step": 9}}
    )
    assert durable_snapshots.latest_complete(tmp_path) == 9
    state = durable_snapshots.load(tmp_path, 9, 0, RUN)
    m2, o2 = _trained()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    m2.load_state_dict(state["model"])
    o2.load_state_dict(state["optimizer"])
    assert digest_state(m2, o2, 9) == digest_state(m, o, 9)
    assert state["progress"] == {"committed_step": 9}


def test_a_snapshot_without_its_manifest_is_never_chosen(tmp_path: Path) -> None:
    _save(tmp_path, 4, {"x": torch.ones(3)})
    _save(tmp_path, 9, {"x": torch.ones(3)})
    (RUN.dir(tmp_path) / "step-000000009" / "shard-0.json").unlink()  # a write cut short
    assert durable_snapshots.latest_complete(tmp_path) == 4
    with pytest.raises(IntegrityError, match="step 9"):
        durable_snapshots.load(tmp_path, 9, 0, RUN)


def test_every_shard_must_be_complete(tmp_path: Path) -> None:
    _save(tmp_path, 4, {"x": torch.ones(3)}, shard=0)
    _save(tmp_path, 4, {"x": torch.ones(3)}, shard=1)
    _save(tmp_path, 9, {"x": torch.ones(3)}, shard=0)
    assert durable_snapshots.latest_complete(tmp_path, shards=2) == 4
    assert durable_snapshots.latest_complete(tmp_path / "missing") is None


def test_a_corrupt_snapshot_is_refused_in_one_line(tmp_path: Path) -> None:
    _save(tmp_path, 3, {"x": torch.arange(1000.0)})
    (data,) = (RUN.dir(tmp_path) / "step-000000003" / "shard-0").glob("*.distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as corrupt:
        durable_snapshots.load(tmp_path, 3, 0, RUN)
    assert "\n" not in str(corrupt.value), corrupt.value
    # its files gone: the coordinator sees it without reading the data, and load says which
    data.unlink()
    damaged: list[tuple[int, str]] = []
    assert durable_snapshots.latest_complete(tmp_path, damaged=damaged) is None
    assert damaged == [(3, f"shard 0: {data.name} is missing")]
    with pytest.raises(IntegrityError, match="is missing") as gone:
        durable_snapshots.load(tmp_path, 3, 0, RUN)
    assert "\n" not in str(gone.value)


def test_the_writer_keeps_the_two_newest(tmp_path: Path) -> None:
    w = durable.DurableWriter(tmp_path, every=5, run=RUN)
    for step in (4, 9, 14, 19):
        assert w.due(step)
        w.save(step, {"x": torch.full((2,), float(step))})
        w.wait()
    assert not w.due(5)
    assert sorted(p.name for p in RUN.dir(tmp_path).iterdir()) == ["step-000000014", "step-000000019"]
    assert torch.equal(durable_snapshots.load(tmp_path, 14, 0, RUN)["x"], torch.full((2,), 14.0))


def test_pruning_keeps_the_newest_snapshot_complete_for_every_shard(tmp_path: Path) -> None:
    """Shard 1 skipped steps 9 and 14: shard 0's pruning keeps step 4, the one a rollback needs."""
    for shard in (0, 1):
        _save(tmp_path, 4, {"x": torch.ones(2)}, shard=shard)
    w = durable.DurableWriter(tmp_path, every=5, run=RUN, shard=0, shards=2)
    for step in (9, 14, 19):
        w.save(step, {"x": torch.ones(2)})
        w.wait()
    assert durable_snapshots.latest_complete(tmp_path, shards=2) == 4
    assert sorted(p.name for p in RUN.dir(tmp_path).iterdir()) == [
        "step-000000004", "step-000000014", "step-000000019",
    ]  # fmt: skip


def test_runs_sharing_a_directory_never_restore_nor_prune_each_other(tmp_path: Path) -> None:
    """Issue 19 (2): each run writes under its own key; the coordinator's choice is bounded by the
    job's shape and seed and by its committed step; a run never loads nor prunes another's files."""
    job = JobConfig(workers=1, spares=0)
    mine = durable_snapshots.RunId.of(job, seed=0, argv=["train.py", "--lr", "1e-3"])
    theirs = durable_snapshots.RunId.of(job, seed=0, argv=["train.py", "--lr", "3e-3"])
    other_seed = durable_snapshots.RunId.of(JobConfig(workers=1, spares=0, seed=1), seed=1, argv=["train.py"])
    assert len({mine.run, theirs.run, other_seed.run}) == 3 and mine.job == theirs.job != other_seed.job
    t = durable.DurableWriter(tmp_path, every=5, run=theirs)
    for step in (29, 39):
        t.save(step, {"x": torch.full((2,), -1.0)})
        t.wait()
    _save(tmp_path, 24, {"x": torch.ones(2)}, run=other_seed)
    m = durable.DurableWriter(tmp_path, every=5, run=mine)
    for step in (4, 9, 14):
        m.save(step, {"x": torch.full((2,), float(step))})
        m.wait()
    assert durable_snapshots.complete_steps(theirs.dir(tmp_path)) == [39, 29]  # not pruned by the other run
    assert m.candidates(1, at_most=100) == [14, 9]
    # the coordinator: the newest of this job's shape and seed, at most the step the job committed
    assert durable_snapshots.latest_complete(tmp_path, job=mine.job, at_most=20) == 14
    assert durable_snapshots.latest_complete(tmp_path, job=other_seed.job, at_most=100) == 24
    with pytest.raises(IntegrityError):
        durable_snapshots.load(tmp_path, 39, 0, mine)
    assert torch.equal(durable_snapshots.load(tmp_path, 14, 0, mine)["x"], torch.full((2,), 14.0))


def test_a_failed_rewrite_keeps_the_step_intact(tmp_path: Path) -> None:
    """Issue 19 (8): writing a step that already has a snapshot (a re-run after a rollback) never
    leaves a complete snapshot whose data is gone, even when the new write fails halfway."""
    _save(tmp_path, 9, {"x": torch.full((4,), 9.0)})
    w = durable.DurableWriter(tmp_path, every=1, run=RUN)
    with _file_size_limit(1 << 20):
        assert w.save(9, {"x": torch.zeros(1_000_000)})
        w.wait()
    assert w.error is not None and w.saved == []
    assert durable_snapshots.latest_complete(tmp_path) == 9
    assert torch.equal(durable_snapshots.load(tmp_path, 9, 0, RUN)["x"], torch.full((4,), 9.0))


def test_a_write_failing_inside_dcp_is_reported_and_leaves_no_files(tmp_path: Path) -> None:
    """Issue 19 (9): DCP raises ``CheckpointException`` (a BaseException): still a reported failure,
    in one line, and its partial files are removed."""
    heard: list[tuple[str, dict[str, object]]] = []
    w = durable.DurableWriter(tmp_path, every=1, run=RUN, on_event=lambda kind, f: heard.append((kind, f)))
    assert w.save(4, {"x": torch.ones(2)})
    w.wait()
    before = _files(tmp_path)
    with _file_size_limit(1 << 20):
        assert w.save(9, {"x": torch.zeros(1_000_000)})
        w.wait()
    assert [k for k, _ in heard] == ["durable_written", "durable_failed"], heard
    failed = heard[1][1]
    assert failed["step"] == 9 and str(failed["error"]).startswith("RuntimeError: "), failed  # DCP's cause
    assert "\n" not in str(failed["error"]) and "Traceback" not in str(failed["error"]), failed
    assert w.error == failed["error"] and w.saved == [4]
    assert _files(tmp_path) == before  # no partial snapshot of step 9
    assert durable_snapshots.latest_complete(tmp_path) == 4


def test_the_writer_reports_each_outcome(tmp_path: Path) -> None:
    """Written (with its time and size), skipped (the previous one still writing), failed (with the
    error): the job's report shows them, so a tier that silently falls behind cannot go unseen."""
    heard: list[tuple[str, dict[str, object]]] = []
    w = durable.DurableWriter(
        tmp_path / "ok", every=1, run=RUN, on_event=lambda kind, f: heard.append((kind, f))
    )
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
    w = durable.DurableWriter(blocked, every=1, run=RUN, on_event=lambda kind, f: heard.append((kind, f)))
    assert w.save(4, {"x": torch.ones(2)})
    w.wait()
    ((kind, fields),) = heard
    assert kind == "durable_failed" and fields["step"] == 4 and "a-file" in str(fields["error"]), heard
    assert w.error is not None


_FULL_DISK = """
import json, sys, torch
from checkpointless import durable, durable_snapshots
from checkpointless.config import JobConfig
heard = []
run = durable_snapshots.RunId.of(JobConfig(workers=1, spares=0), seed=0, argv=["train.py"])
w = durable.DurableWriter(sys.argv[1], every=1, run=run, on_event=lambda kind, f: heard.append([kind, f["step"]]))
for step in range(4):  # 2 MiB each on a 5 MiB disk: the third has no room unless the first goes
    w.save(step, {"x": torch.full((512 * 1024,), float(step))})
    w.wait()
w.save(4, {"x": torch.zeros(2 * 1024 * 1024)})  # 8 MiB: never fits
w.wait()
print(json.dumps({"heard": heard, "error": w.error, "complete": durable_snapshots.complete_steps(run.dir(sys.argv[1])),
                  "x": durable_snapshots.load(sys.argv[1], 3, 0, run)["x"][0].item()}))
"""


def test_a_full_disk_prunes_before_writing_and_reports_what_cannot_fit(tmp_path: Path) -> None:
    """Issue 19 (9): on a small disk (a 5 MiB tmpfs, mounted in a private namespace) the writer
    prunes older snapshots before a write that would not fit; one that cannot fit at all is a
    reported failure that leaves the newest snapshot intact."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f"mount -t tmpfs -o size=5m tmpfs {disk} && exec {sys.executable} -c {_quote(_FULL_DISK)} {disk}"
    try:
        proc = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
            capture_output=True, text=True, timeout=50,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the full-disk writer did not finish")
    if proc.returncode != 0 and "mount" in proc.stderr and "heard" not in proc.stdout:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["heard"] == [["durable_written", s] for s in range(4)] + [["durable_failed", 4]], out
    assert "no room" in out["error"] and "\n" not in out["error"], out
    assert out["complete"] == [3] and out["x"] == 3.0, out
    assert list(disk.iterdir()) == []  # the tmpfs went with its namespace


def _quote(text: str) -> str:
    return "'" + textwrap.dedent(text).replace("'", "'\\''") + "'"


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
