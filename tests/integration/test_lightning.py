"""A Lightning script made checkpointless by ``Trainer(strategy=CheckpointlessStrategy())``
(``tests/scripts/lightning_train.py``): under the launcher a kill, a hang and an exception are
recovered in-process and the job ends bitwise equal to the fault-free run: the final state digest
(model, optimizer, step) and the digest of everything registered (LR scheduler, the session's
progress, Lightning's own loop counters and callback state) agree; a replacement joins mid-epoch,
at an epoch's first step, at the last step and after it. With gradient accumulation
(``--accumulate 4``: steps of 4 and 2 micro-batches) a kill and an exception re-run the whole
optimizer step and end bitwise equal to the accumulating fault-free run. Alone (no launcher) the
script trains on one process, with and without accumulation; manual optimization is refused in
one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import logs_of, run_job
from tests.unit.test_state import assert_same

pytest.importorskip("lightning")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "scripts" / "lightning_train.py")
STEPS = 18  # 3 epochs of 96 samples in global batches of 8 x 2 ranks
ACCUMULATE = ("--accumulate", "4")
ACCUMULATED_STEPS = 6  # the same 6 batches per epoch, in 2 steps: 4 micro-batches, then 2


def _job(lightning_out: Path, *faults: str, spares: int = 1, extra: tuple[str, ...] = (), steps: int = STEPS,
         **kw: object):  # type: ignore[no-untyped-def]  # fmt: skip
    """Run the script with its Lightning output in ``lightning_out`` (emptied first: the paths in
    the callbacks' state are part of what the runs compare)."""
    shutil.rmtree(lightning_out, ignore_errors=True)
    command = [sys.executable, SCRIPT, str(lightning_out), *extra]
    return run_job(workers=2, spares=spares, steps=steps, command=command,
                   faults=list(faults), timeout_s=400, **kw)  # type: ignore[arg-type]  # fmt: skip


@pytest.fixture(scope="module")
def lightning_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One output directory for every run of this module, so that their registered states compare."""
    return tmp_path_factory.mktemp("lightning") / "out"


@pytest.fixture(scope="module")
def reference(lightning_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    job = _job(lightning_dir, spares=0, out=tmp_path_factory.mktemp("lightning-reference"))
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert job.digest is not None
    assert job.report["steps_completed"] == STEPS
    # rank 0's last line: 2 ranks, and the default process group is the session's (none of Lightning's)
    last = job.logs["w0"].read_text()
    assert f"trained {STEPS} steps" in last and "ranks 2, process group: the session's" in last, last[-2000:]
    return job.digest, job.report["final_registered_sha256"]


@pytest.fixture(scope="module")
def accumulated_reference(lightning_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    job = _job(lightning_dir, spares=0, extra=ACCUMULATE, steps=ACCUMULATED_STEPS,
               out=tmp_path_factory.mktemp("lightning-accumulated-reference"))  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert job.digest is not None
    assert job.report["steps_completed"] == ACCUMULATED_STEPS
    last = job.logs["w0"].read_text()
    assert f"trained {ACCUMULATED_STEPS} steps" in last and "ranks 2" in last, last[-2000:]
    return job.digest, job.report["final_registered_sha256"]


@pytest.mark.parametrize(
    "faults",
    [
        ["kill:rank=0@step=3", "exception:rank=1@step=9"],  # rank 0 (the logger's) replaced mid-epoch
        ["kill:rank=1@step=6"],  # the first step of epoch 1
        ["exception:rank=0@step=5"],
        ["kill:rank=1@step=17"],  # the last step
        [
            "preempt:rank=1@step=4,notice=30"
        ],  # a notice: Lightning's own SIGTERM handling must not stop the loop
    ],
    ids=["kill-then-exception", "kill-at-epoch-start", "exception", "kill-at-last-step", "preempt"],
)
def test_a_lightning_script_recovers_bitwise(
    lightning_dir: Path, reference: tuple[str, str], faults: list[str]
) -> None:
    job = _job(lightning_dir, *faults)
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert (job.digest, job.report["final_registered_sha256"]) == reference
    assert [f["lost_steps"] for f in job.report["faults"]] == [0] * len(faults)
    # rank 0 alone wrote Lightning's checkpoint and logs, in the one version directory
    versions = sorted(p.name for p in (lightning_dir / "lightning_logs").iterdir())
    assert versions == ["version_0"], versions
    assert [p.name for p in (lightning_dir / "lightning_logs" / "version_0" / "checkpoints").iterdir()] == [
        f"epoch=2-step={STEPS}.ckpt"
    ]


@pytest.mark.parametrize(
    "faults",
    [
        ["kill:rank=0@step=2"],  # rank 0 replaced at the first of epoch 1's 4 micro-batches
        ["exception:rank=1@step=3"],  # the 2 micro-batches that end epoch 1
    ],
    ids=["kill", "exception"],
)
def test_an_accumulating_script_recovers_bitwise(
    lightning_dir: Path, accumulated_reference: tuple[str, str], faults: list[str]
) -> None:
    """A step's micro-batches are one attempt: after the failure (at the step's reduction, once per
    optimizer step) the survivor runs the step's closures again from the first, the replacement
    enters the Trainer's loop at the step's first micro-batch, and the job ends where the
    fault-free run does."""
    job = _job(lightning_dir, *faults, extra=ACCUMULATE, steps=ACCUMULATED_STEPS)
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert (job.digest, job.report["final_registered_sha256"]) == accumulated_reference
    assert [f["lost_steps"] for f in job.report["faults"]] == [0] * len(faults)
    assert [p.name for p in (lightning_dir / "lightning_logs" / "version_0" / "checkpoints").iterdir()] == [
        f"epoch=2-step={ACCUMULATED_STEPS}.ckpt"
    ]


@pytest.mark.parametrize(
    "where", ["2:1:0", "4:2:1"], ids=["rank0-second-of-4-micro-batches", "rank1-third-of-4"]
)
def test_an_exception_inside_an_accumulated_step_recovers_bitwise(
    lightning_dir: Path, accumulated_reference: tuple[str, str], where: str
) -> None:
    """``training_step`` raises at a micro-batch that is not the step's last (before any reduction):
    the rank's attempt fails there, its peers' at the step's reduction, and every rank runs the
    step's closures again from the first; the job ends where the fault-free run does."""
    job = _job(lightning_dir, spares=0, extra=(*ACCUMULATE, "--raise-at", where), steps=ACCUMULATED_STEPS)
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert (job.digest, job.report["final_registered_sha256"]) == accumulated_reference
    faults = job.report["faults"]
    assert len(faults) == 1 and faults[0]["lost_steps"] == 0, faults
    step, micro, _ = where.split(":")
    assert f"at micro-batch {micro} of step {step}" in (faults[0].get("error") or ""), faults


def _kill_then_exception_ends_as_fault_free(lightning_dir: Path, tmp_path: Path, extra: tuple[str, ...],
                                            steps: int) -> None:  # fmt: skip
    """A kill of rank 0 at step 4 and an exception of rank 1 at step 8 end where the fault-free run
    does (both digests), neither losing a step."""
    ref = _job(lightning_dir, spares=0, extra=extra, steps=steps, out=tmp_path / "ref")
    assert ref.ok, f"{ref.error}\n{logs_of(ref)}"
    assert f"trained {steps} steps" in ref.logs["w0"].read_text()
    job = _job(lightning_dir, "kill:rank=0@step=4", "exception:rank=1@step=8", extra=extra, steps=steps,
               out=tmp_path / "faults")  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert (job.digest, job.report["final_registered_sha256"]) == (
        ref.digest,
        ref.report["final_registered_sha256"],
    )
    assert [f["lost_steps"] for f in job.report["faults"]] == [0, 0]


def test_a_script_with_a_weighted_sampler_of_its_own_recovers_bitwise(
    lightning_dir: Path, tmp_path: Path
) -> None:
    """The train ``DataLoader``'s sampler is the script's ``WeightedRandomSampler`` (80 draws an epoch,
    with replacement): each epoch's draws are read from it with their randomness seeded by the epoch
    (Lightning's epochs are the sampler's: 5 steps of 8 x 2 ranks)."""
    _kill_then_exception_ends_as_fault_free(lightning_dir, tmp_path, ("--weighted",), steps=15)


STREAM = ("--stream", "12")  # an endless stream, 12 steps in Lightning epochs of 6 batches


def test_a_script_on_a_stream_recovers_bitwise(lightning_dir: Path, tmp_path: Path) -> None:
    """An ``IterableDataset`` train set without ``__len__`` (``max_steps``): the stream goes on across
    Lightning's epochs."""
    _kill_then_exception_ends_as_fault_free(lightning_dir, tmp_path, STREAM, steps=12)


def test_a_hung_rank_is_replaced_bitwise(lightning_dir: Path, reference: tuple[str, str]) -> None:
    job = _job(lightning_dir, "hang:rank=1@step=11", hang_timeout_s=2.0)
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert (job.digest, job.report["final_registered_sha256"]) == reference


def _after_fit(job) -> list[str]:  # type: ignore[no-untyped-def]
    """The lines rank 0's code after ``fit`` printed, in every process of ``job``."""
    return [line for log in job.logs.values() for line in log.read_text().splitlines()
            if line.startswith(f"trained {STEPS} steps")]  # fmt: skip


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_killed_at_the_last_check_is_replaced_after_the_last_step(
    lightning_dir: Path, reference: tuple[str, str], rank: int, tmp_path: Path
) -> None:
    """The replicas' check after the last step (``--consistency-every 6``): the replacement receives
    the final state, finishes, and ``fit`` returns in it with the Trainer as the lost rank's left it:
    the script's code after ``fit`` runs there (rank 0's prints what the fault-free run's does)."""
    job = _job(lightning_dir, f"kill:rank={rank}@check={STEPS}", consistency_every=6, out=tmp_path)
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert (job.digest, job.report["final_registered_sha256"]) == reference
    lines = _after_fit(job)
    assert len(lines) == 1 and f"state {reference[0]}" in lines[0], lines


@pytest.mark.timeout(300)
def test_manual_optimization_is_refused_in_one_line(tmp_path: Path) -> None:
    job = _job(tmp_path / "out", spares=0, extra=("--manual",))
    assert not job.ok
    assert "CheckpointlessStrategy does not support manual optimization" in (job.error or ""), job.error


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("extra", "steps"),
    [((), 12), (ACCUMULATE, 3), (("--weighted",), 10)],
    ids=["per-batch", "accumulated", "weighted"],
)
def test_the_script_runs_alone_on_one_process(tmp_path: Path, extra: tuple[str, ...], steps: int) -> None:
    """12 batches of 8 samples: 12 steps, or 3 of 4 accumulated micro-batches; the weighted sampler's
    80 draws: 10 steps."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in list(env):
        if name.startswith("CHECKPOINTLESS_"):
            del env[name]
    run = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "--epochs", "1", *extra], capture_output=True,
                         text=True, timeout=240, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"trained {steps} steps" in run.stdout and "ranks 1, process group: of 1" in run.stdout, run.stdout


DATAMODULE = str(ROOT / "tests" / "scripts" / "lightning_datamodule.py")


def test_a_datamodule_script_with_checkpoints_early_stopping_and_bf16_recovers_bitwise(
    tmp_path: Path,
) -> None:
    """A script in the public examples' shape (``lightning_datamodule.py``: a DataModule whose train
    set jitters its samples in a DataLoader worker process, ModelCheckpoint top-2 and last,
    EarlyStopping, LearningRateMonitor, CSVLogger, bf16-mixed, validation twice an epoch, warm-up
    and cosine over ``estimated_stepping_batches``): a kill of rank 0 (the logger's) and then an
    exception end where the fault-free run does, state and everything registered (the callbacks'
    state among it), with the same checkpoints written. Before: ``estimated_stepping_batches`` in
    ``configure_optimizers`` made Lightning load the train data before the session existed, and it
    kept that DataLoader: every rank read the whole set (48 steps, not 24), and a replacement read
    from step 0 (the iterator was made before it received its step)."""
    out = tmp_path / "out"

    def run(*faults: str, spares: int):  # type: ignore[no-untyped-def]
        shutil.rmtree(out, ignore_errors=True)
        job = run_job(workers=2, spares=spares, steps=24, command=[sys.executable, DATAMODULE, str(out)],
                      faults=list(faults), timeout_s=400)  # fmt: skip
        assert job.ok, f"{job.error}\n{logs_of(job)}"
        ckpts = sorted(p.name for p in (out / "csv" / "version_0" / "checkpoints").iterdir())
        return job, ckpts

    reference, reference_ckpts = run(spares=0)
    assert reference.report["steps_completed"] == 24  # 128 samples, 8 per rank, 2 ranks, 3 epochs
    faulted, ckpts = run("kill:rank=0@step=5", "exception:rank=1@step=13", spares=1)
    assert faulted.digest == reference.digest
    assert faulted.report["final_registered_sha256"] == reference.report["final_registered_sha256"]
    assert ckpts == reference_ckpts and "last.ckpt" in ckpts and len(ckpts) == 3, ckpts


@pytest.mark.timeout(300)
def test_the_datamodule_script_runs_alone_on_one_process(tmp_path: Path) -> None:
    """128 samples in batches of 8 on one process: 16 steps an epoch (the train loader loaded early by
    ``estimated_stepping_batches``, before the session, is read as a function of the step too)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, DATAMODULE, str(tmp_path), "--epochs", "1"], capture_output=True,
                         text=True, timeout=240, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained 16 steps" in run.stdout, run.stdout


def test_resuming_from_a_lightning_checkpoint_ends_where_the_whole_run_does(
    lightning_dir: Path, tmp_path: Path
) -> None:
    """``fit(ckpt_path=...)`` from a checkpoint saved mid-epoch at step 5 (``every_n_train_steps``):
    the resumed job starts at step 5, and with a kill of rank 0 at that first step (the replacement
    enters Lightning's loop where its peers, resumed from the file, did), a kill of rank 1 later (its
    replacement keeps the state it received, not the file's step-5 one) and an exception, it ends
    where the uninterrupted run does: state, and everything registered (the callbacks' among it).
    Before: ``ckpt_path`` was refused."""
    every = ("--save-every", "5")
    whole = _job(lightning_dir, spares=0, extra=every, out=tmp_path / "whole")
    assert whole.ok, f"{whole.error}\n{logs_of(whole)}"
    ckpt = tmp_path / "step=5.ckpt"
    shutil.copy(lightning_dir / "every" / "step=5.ckpt", ckpt)
    faults = ("kill:rank=0@step=5", "kill:rank=1@step=9", "exception:rank=0@step=13")
    resumed = _job(lightning_dir, *faults, extra=(*every, "--resume", str(ckpt)), out=tmp_path / "resumed")
    assert resumed.ok, f"{resumed.error}\n{logs_of(resumed)}"
    assert resumed.digest == whole.digest
    assert resumed.report["final_registered_sha256"] == whole.report["final_registered_sha256"]
    committed = sorted({e["step"] for e in resumed.events if e["kind"] == "step_committed"})
    assert committed == list(range(5, STEPS))  # started at step 5
    assert [f["lost_steps"] for f in resumed.report["faults"]] == [0, 0, 0]


CKPTS = "lightning_logs/version_0/checkpoints"  # the default ModelCheckpoint's: top 1, at epochs' ends


@pytest.mark.parametrize(
    ("extra", "die", "written", "removed"),
    [(("--save-every", "2"), "4", "every/step=4.ckpt", None),
     ((), "12:epoch=", f"{CKPTS}/epoch=1-step=12.ckpt", f"{CKPTS}/epoch=0-step=6.ckpt"),
     ((), "18:epoch=", f"{CKPTS}/epoch=2-step=18.ckpt", f"{CKPTS}/epoch=1-step=12.ckpt"),
     (("--save-last-link",), "18:epoch=", f"{CKPTS}/epoch=2-step=18.ckpt", f"{CKPTS}/epoch=1-step=12.ckpt")],
    ids=["every-n-steps", "epoch-end-top-1", "after-the-last-step", "after-the-last-step-last-link"],
)  # fmt: skip
def test_a_checkpoint_whose_writer_died_is_written_whole_by_its_replacement(
    lightning_dir: Path, tmp_path: Path, extra: tuple[str, ...], die: str, written: str, removed: str | None
) -> None:
    """Rank 0 is SIGKILLed while it saves a checkpoint (before the file is written): the one
    ``every_n_train_steps=2`` saves at step 4, or the default ``ModelCheckpoint``'s (top 1) at the
    end of epoch 1, which outdates epoch 0's, or its last one, after the last step (the replacement
    joins after it, and only finishes). Its peers' callback state names the new file, as the
    fault-free run's does; the replacement writes it before its first step (and removes the
    outdated one), the run's checkpoints at its end are those of the fault-free run, each holding
    what that run's does, tensors bit for bit, counters and callbacks' state alike (every one of
    ``every``'s, step 4's among them; epoch 1's top-1 file is outdated by epoch 2's at the end, as
    in the fault-free run), and the job ends equal to it. Before: the file was missing (a later
    ``fit(ckpt_path=...)`` from the callback's own path failed) and the outdated one stayed. With
    ``save_last="link"``, ``last.ckpt`` links to the last file as in the fault-free run (before: it
    still linked to the removed epoch 1's)."""
    import torch

    d = written.rsplit("/", 1)[0]
    whole = _job(lightning_dir, spares=0, extra=extra, out=tmp_path / "whole")
    assert whole.ok, f"{whole.error}\n{logs_of(whole)}"
    kept = tmp_path / "whole-out"
    shutil.copytree(lightning_dir / d, kept, symlinks=True)
    died = _job(lightning_dir, extra=(*extra, "--die-in-save", die), out=tmp_path / "died")
    assert died.ok, f"{died.error}\n{logs_of(died)}"
    assert (lightning_dir / ".died-in-save").exists()  # the writer did die
    said = logs_of(died)
    assert f"wrote {lightning_dir / written}: rank 0 before it died" in said, said[-3000:]
    assert removed is None or f"removed {lightning_dir / removed}: rank 0 died before" in said, said[-3000:]
    assert len(died.report["faults"]) == 1 and died.report["faults"][0]["lost_steps"] == 0
    # rank 0's code after fit ran once, in its replacement, on the Trainer as the lost rank's fit
    # left it (steps, epoch, the metrics, the best checkpoint), as in the fault-free run
    assert _after_fit(died) == _after_fit(whole) and len(_after_fit(whole)) == 1, _after_fit(died)
    assert died.digest == whole.digest
    assert died.report["final_registered_sha256"] == whole.report["final_registered_sha256"]
    names = sorted(p.name for p in kept.iterdir())
    assert sorted(p.name for p in (lightning_dir / d).iterdir()) == names
    links = {n: os.readlink(kept / n) for n in names if (kept / n).is_symlink()}
    assert links == {
        n: os.readlink(lightning_dir / d / n) for n in names if (lightning_dir / d / n).is_symlink()
    }
    assert ("last.ckpt" in links) == ("--save-last-link" in extra), links
    for name in names:
        a = torch.load(kept / name, map_location="cpu", weights_only=False)
        b = torch.load(lightning_dir / d / name, map_location="cpu", weights_only=False)
        assert_same(a, b, f"{d}/{name}")
