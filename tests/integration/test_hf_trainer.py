"""A Hugging Face ``Trainer`` script made checkpointless by its import line
(``checkpointless.integrations.transformers.Trainer``): under the launcher a kill, an exception and
a hang end bitwise equal to the fault-free run (a map-style train set, and a stream), with the
Trainer's own accumulation, clipping, schedule, logging, evaluation and checkpoints; a resumed run
ends where the uninterrupted one does; alone (no launcher) it is the plain ``transformers.Trainer``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.jobs import logs_of, run_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "scripts" / "hf_trainer.py")
STEPS = 12


def _command(out: Path, *extra: str) -> list[str]:
    return [sys.executable, SCRIPT, str(out), str(STEPS), *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("hf-reference")
    job = run_job(workers=2, spares=0, steps=STEPS, command=_command(out), timeout_s=400)
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert job.digest is not None
    return job.digest, out


@pytest.mark.parametrize(
    "faults", [["kill:rank=1@step=7"], ["exception:rank=0@step=5"], ["kill:rank=0@step=3", "exception:rank=1@step=9"]],
    ids=["kill", "exception", "kill-then-exception"],
)  # fmt: skip
def test_a_trainer_script_recovers_bitwise(
    tmp_path: Path, reference: tuple[str, Path], faults: list[str]
) -> None:
    job = run_job(workers=2, spares=1, steps=STEPS, command=_command(tmp_path), faults=faults, timeout_s=400)
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert job.digest == reference[0]
    # the Trainer's own checkpoints, written once (rank 0), at save_steps
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-12",
        "checkpoint-6",
    ]


def test_a_checkpoint_whose_writer_died_is_written_whole_by_its_replacement(
    tmp_path: Path, reference: tuple[str, Path]
) -> None:
    """Rank 0 writes checkpoint-6 after the commit of step 6, outside any step: SIGKILLed after the
    model's weights and before the optimizer's, the directory is left without its optimizer and
    trainer_state.json. The replacement that takes rank 0 writes it whole, with the same model,
    optimizer and scheduler as the fault-free run's."""
    import torch
    from safetensors.torch import load_file

    job = run_job(workers=2, spares=1, steps=STEPS, command=_command(tmp_path, "--die-in-save", "6"),
                  timeout_s=400)  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert (tmp_path / ".died-in-save").exists()  # the writer did die in the middle
    assert job.digest == reference[0]
    ours, ref = tmp_path / "checkpoint-6", reference[1] / "checkpoint-6"
    assert json.loads((ours / "trainer_state.json").read_text())["global_step"] == 6
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    opt_a = torch.load(ours / "optimizer.pt", weights_only=True)["state"]
    opt_b = torch.load(ref / "optimizer.pt", weights_only=True)["state"]
    assert opt_a.keys() == opt_b.keys()
    assert all(torch.equal(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i])
    sched = [torch.load(d / "scheduler.pt", weights_only=True)["last_epoch"] for d in (ours, ref)]
    assert sched[0] == sched[1] == 6


def test_a_hung_rank_of_a_bf16_trainer_is_replaced_bitwise(tmp_path: Path) -> None:
    ref = run_job(
        workers=2, spares=0, steps=STEPS, command=_command(tmp_path / "ref", "--bf16"), timeout_s=400
    )
    assert ref.ok, f"{ref.error}\n{logs_of(ref)}"
    hung = run_job(workers=2, spares=1, steps=STEPS, command=_command(tmp_path / "hung", "--bf16"),
                   faults=["hang:rank=1@step=4"], hang_timeout_s=3.0, timeout_s=400)  # fmt: skip
    assert hung.ok, f"{hung.error}\n{logs_of(hung)}"
    assert hung.digest == ref.digest


def test_resuming_from_the_trainers_checkpoint_ends_where_the_whole_run_does(
    tmp_path: Path, reference: tuple[str, Path]
) -> None:
    """``resume_from_checkpoint`` at step 6, with a kill at step 8: the replacement (which loads the
    checkpoint too, before it waits) keeps the state it receives, and the job ends where the whole
    run does."""
    digest, out = reference
    job = run_job(workers=2, spares=1, steps=STEPS, timeout_s=400, faults=["kill:rank=1@step=8"],
                  command=_command(tmp_path, "--resume", str(out / "checkpoint-6")))  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert job.digest == digest
    committed = sorted({e["step"] for e in job.events if e["kind"] == "step_committed"})
    assert committed == list(range(6, STEPS))  # started at step 6
    assert [f["lost_steps"] for f in job.report["faults"]] == [0]


def test_an_exception_at_the_first_of_a_steps_micro_batches_recovers_bitwise(
    tmp_path: Path, reference: tuple[str, Path]
) -> None:
    """The model's forward raises at the first of step 4's two micro-batches on rank 1 (before the
    step's reduction): every rank runs the whole step again, and the job ends where the fault-free
    run does."""
    job = run_job(workers=2, spares=0, steps=STEPS, command=_command(tmp_path, "--raise-at", "4:0:1"),
                  timeout_s=400)  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert job.digest == reference[0]
    faults = job.report["faults"]
    assert len(faults) == 1 and faults[0]["lost_steps"] == 0, faults
    assert "at micro-batch 0 of step 4" in (faults[0].get("error") or ""), faults


@pytest.mark.parametrize(
    ("option", "faults"),
    [("--iterable", ["kill:rank=1@step=7", "exception:rank=0@step=9"]),
     ("--group-by-length", ["kill:rank=1@step=4", "exception:rank=0@step=8"]),
     ("--weighted", ["kill:rank=0@step=4", "exception:rank=1@step=8"])],
    ids=["stream", "group-by-length", "own-sampler"],
)  # fmt: skip
def test_a_trainer_reading_in_an_order_not_its_own_recovers_bitwise(
    tmp_path: Path, option: str, faults: list[str], request: pytest.FixtureRequest
) -> None:
    """``--iterable``: an ``IterableDataset`` train set (an endless stream shuffled by its own seed,
    no ``__len__``), the replacement and the re-executed steps positioned in the stream by the step.
    ``--group-by-length``: ``train_sampling_strategy="group_by_length"`` (samples of different
    lengths, padded by the script's collator), the epoch's order HF's length-grouped one drawn from
    the seed and the epoch. ``--weighted``: a ``Trainer`` subclass whose ``_get_train_sampler`` gives a
    ``WeightedRandomSampler`` (80 draws with replacement an epoch), each epoch's draws read from it with
    their randomness seeded by the epoch. Each way a kill and an exception end where the fault-free
    run does."""
    ref = run_job(workers=2, spares=0, steps=STEPS, command=_command(tmp_path / "ref", option), timeout_s=400)
    assert ref.ok, f"{ref.error}\n{logs_of(ref)}"
    if option == "--weighted":  # the sampler is read: the run is not the default order's
        assert ref.digest != request.getfixturevalue("reference")[0]
    job = run_job(workers=2, spares=1, steps=STEPS, command=_command(tmp_path / "faults", option),
                  faults=faults, timeout_s=400)  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert job.digest == ref.digest


def test_an_unsupported_setting_is_refused_in_one_line(tmp_path: Path) -> None:
    job = run_job(workers=2, spares=0, steps=STEPS, timeout_s=200,
                  command=_command(tmp_path, "--iterable", "--workers", "2"))  # fmt: skip
    assert not job.ok
    assert "does not support dataloader_num_workers=2 with an IterableDataset" in (job.error or ""), job.error
    assert "Traceback" not in (job.error or "")


def _eval_checks(job: Any) -> dict[str, list[dict[str, Any]]]:
    """Each process's ``EVALCHECK`` lines (``tests/scripts/evalcheck.py``), by log name."""
    found: dict[str, list[dict[str, Any]]] = {}
    for name, path in sorted(job.logs.items()):
        for line in path.read_text().splitlines():
            if line.startswith("EVALCHECK "):
                fields = dict(f.split("=", 1) for f in line.split(" metrics=")[0].split()[1:])
                found.setdefault(name, []).append(fields)
    return found


@pytest.mark.parametrize("fault", [None, "kill:5:1", "hang:10:0"], ids=["fault-free", "kill", "hang"])
def test_the_evaluation_is_shared_between_the_ranks_and_a_peer_lost_in_it_changes_nothing(
    tmp_path: Path, reference: tuple[str, Path], fault: str | None
) -> None:
    """``eval_strategy="steps"`` over 6 batches at 2 ranks: each rank computes 3 of them and the
    metrics equal those of the whole set evaluated by one process (HF's own loop, run beside it).
    A peer SIGKILLed or stopped after its first batch of an evaluation (after the step's commit,
    outside any step): the survivor computes the lost shard itself (6 batches, the same metrics),
    the next step recovers, and the job ends bitwise where the fault-free run does."""
    extra = ["--eval-check"] + ([f"--eval-fault={fault}"] if fault else [])
    job = run_job(workers=2, spares=1, steps=STEPS, command=_command(tmp_path, *extra), hang_timeout_s=3.0,
                  out=tmp_path / "run", timeout_s=400)  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert job.digest == reference[0]
    checks = _eval_checks(job)
    assert all(c["equal"] == "True" for lines in checks.values() for c in lines), checks
    if fault is None:
        assert {name: [(c["step"], c["batches"]) for c in lines] for name, lines in checks.items()} == {
            w: [("5", "3"), ("10", "3"), ("12", "3")] for w in ("w0", "w1")
        }
        return
    _, step, lost = fault.split(":")
    assert (tmp_path / ".eval-fault").exists()
    survivor = checks[f"w{1 - int(lost)}"]
    want = [(s, "6" if s == step else "3") for s in ("5", "10", "12")]
    assert [(c["step"], c["batches"]) for c in survivor] == want, survivor
    assert [f["lost_steps"] for f in job.report["faults"]] == [0]


def test_the_evaluation_is_shared_by_four_ranks(tmp_path: Path) -> None:
    """6 batches at 4 ranks: 1, 2, 1 and 2 of them (contiguous shares), the metrics the whole set's."""
    job = run_job(workers=4, spares=0, steps=STEPS, command=_command(tmp_path, "--eval-check"), timeout_s=400,
                  out=tmp_path / "run")  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    checks = _eval_checks(job)
    assert {name: {c["batches"] for c in lines} for name, lines in checks.items()} == {
        "w0": {"1"},
        "w1": {"2"},
        "w2": {"1"},
        "w3": {"2"},
    }
    assert all(c["equal"] == "True" for lines in checks.values() for c in lines) and len(checks["w0"]) == 3


SEQ2SEQ = str(ROOT / "tests" / "scripts" / "hf_seq2seq.py")


def test_a_seq2seq_trainer_generating_in_its_evaluations_recovers_bitwise(tmp_path: Path) -> None:
    """``hf_seq2seq.py`` (``Seq2SeqTrainer``, ``predict_with_generate``, ``compute_metrics`` over the
    generated tokens): the evaluations' 5 batches shared 2 and 3, their metrics the whole set's; an
    exception in step 5 and a SIGKILL in the evaluation after step 8 end bitwise where the
    fault-free run does, with the same predictions after training; alone, the plain
    ``Seq2SeqTrainer``."""

    def command(out: Path, *extra: str) -> list[str]:
        return [sys.executable, SEQ2SEQ, str(out), str(STEPS), "--eval-check", *extra]

    ref = run_job(workers=2, spares=0, steps=STEPS, command=command(tmp_path / "ref"), out=tmp_path / "ref-run",
                  timeout_s=400)  # fmt: skip
    assert ref.ok, f"{ref.error}\n{logs_of(ref)}"
    job = run_job(workers=2, spares=1, steps=STEPS, command=command(tmp_path / "f", "--eval-fault=kill:8:0"),
                  faults=["exception:rank=1@step=5"], out=tmp_path / "f-run", timeout_s=400)  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert job.digest == ref.digest
    assert (tmp_path / "f" / ".eval-fault").exists()
    for run in (ref, job):
        checks = _eval_checks(run)
        assert all(c["equal"] == "True" for lines in checks.values() for c in lines), checks
    shares = {name: {c["batches"] for c in lines} for name, lines in _eval_checks(ref).items()}
    assert shares == {"w0": {"2"}, "w1": {"3"}}, shares
    closing = [line for run in (ref, job) for _, path in sorted(run.logs.items())
               for line in path.read_text().splitlines() if line.startswith("trained ")]  # fmt: skip
    assert len(closing) == 4 and len(set(closing)) == 1, closing  # w0, w1; s0 (rank 0's), w1
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECKPOINTLESS_")}
    alone = subprocess.run([sys.executable, SEQ2SEQ, str(tmp_path / "alone"), "4"], capture_output=True,
                           text=True, timeout=240, env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert alone.returncode == 0 and "trained 4 steps" in alone.stdout, alone.stderr[-3000:]


@pytest.mark.timeout(300)
def test_the_trainer_script_runs_alone_as_a_plain_trainer(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in list(env):
        if name.startswith("CHECKPOINTLESS_"):
            del env[name]
    run = subprocess.run([sys.executable, SCRIPT, str(tmp_path), "4"], capture_output=True, text=True,
                         timeout=240, env=env)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trained 4 steps" in run.stdout
    # the callbacks the loop calls, in HF's order, are those the checkpointless loop calls
    (plain,) = [line for line in run.stdout.splitlines() if line.startswith("CALLBACKS ")]
    assert plain.split()[1:4] == ["on_step_begin", "on_substep_end", "on_pre_optimizer_step"], plain
    job = run_job(workers=2, spares=0, steps=4, command=[*_command(tmp_path / "launched")[:-1], "4"],
                  timeout_s=200, out=tmp_path / "job")  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert plain in job.logs["w0"].read_text().splitlines()
    stream = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "stream"), "2", "--iterable"],
                            capture_output=True, text=True, timeout=240, env=env)  # fmt: skip
    assert stream.returncode == 0, stream.stderr[-3000:]
    assert "trained 2 steps" in stream.stdout


CLASSIFIER = str(ROOT / "tests" / "scripts" / "hf_classifier.py")
EPOCHS, STEPS_PER_EPOCH = 3, 32  # 256 rows, 4 per device, 2 ranks


def _classifier_lines(job: object) -> list[str]:
    """Each process's closing line (the workers', in rank order of their names; a replaced rank's
    is its replacement's)."""
    lines = []
    for _, path in sorted(job.logs.items()):  # type: ignore[attr-defined]
        found = [line for line in path.read_text().splitlines() if line.startswith("trained ")]
        lines += found[-1:]
    return lines


@pytest.mark.parametrize(
    "faults", [["kill:rank=1@step=40"], ["exception:rank=0@step=63"]], ids=["kill", "exception"]
)
def test_an_epoch_trainer_with_best_model_and_early_stopping_recovers_bitwise(
    tmp_path: Path, faults: list[str]
) -> None:
    """A classifier trained by epochs over a ``datasets.Dataset`` (dropout on, a padding collator,
    evaluation and a checkpoint at every epoch's end, the best model loaded at the end, early
    stopping), each rank starting from weights of its own: a kill (the replacement enters mid-epoch
    with the Trainer's best metric and the callbacks' state) and an exception (the step executed
    again, its dropout drawn as before) end bitwise where the fault-free run does, and every rank
    evaluates (its share of the batches: the metrics are the whole set's), keeps and loads the same
    best checkpoint."""
    pytest.importorskip("datasets")
    steps = EPOCHS * STEPS_PER_EPOCH

    def command(out: Path) -> list[str]:
        return [sys.executable, CLASSIFIER, str(out), str(EPOCHS), "--eval-check"]

    ref = run_job(workers=2, spares=0, steps=steps, command=command(tmp_path / "ref"), out=tmp_path / "ref-run",
                  timeout_s=400)  # fmt: skip
    assert ref.ok, f"{ref.error}\n{logs_of(ref)}"
    job = run_job(workers=2, spares=1, steps=steps, command=command(tmp_path / "f"), out=tmp_path / "f-run",
                  faults=faults, timeout_s=400)  # fmt: skip
    assert job.ok, f"{job.error}\n{logs_of(job)}"
    assert job.digest == ref.digest
    want = [line.replace(str(tmp_path / "ref"), "OUT") for line in _classifier_lines(ref)]
    assert len(want) == 2 and want[0] == want[1], want  # the replicas agree
    got = [line.replace(str(tmp_path / "f"), "OUT") for line in _classifier_lines(job)]
    assert got == want, (got, want)  # a killed rank's own line never came: its replacement's did
    for run in (ref, job):  # the metrics the whole set's
        checks = _eval_checks(run)
        assert all(c["equal"] == "True" for lines in checks.values() for c in lines), checks
    checks = _eval_checks(ref)  # each epoch's 3 batches shared: 1 and 2
    shares = [c["batches"] for c in checks["w0"][:EPOCHS] + checks["w1"][:EPOCHS]]
    assert sorted(shares) == ["1"] * EPOCHS + ["2"] * EPOCHS, shares
    epochs = [p.name for p in (tmp_path / "ref").iterdir() if p.name.startswith("checkpoint-")]
    assert sorted(p.name for p in (tmp_path / "f").iterdir() if p.name.startswith("checkpoint-")) == sorted(
        epochs
    )
    assert f"checkpoint-{steps}" in epochs  # saved at the epochs' ends (save_total_limit keeps the best)


def _weights(checkpoint: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def test_the_ranks_share_the_loss_over_every_ranks_tokens_as_under_torchrun(tmp_path: Path) -> None:
    """Labels partly masked (-100), so the ranks' micro-batches hold different numbers of labels:
    with ``average_tokens_across_devices`` (the default), each step's loss is over every rank's
    tokens (``num_items_in_batch`` counted over the ranks, the loss scaled by them, as HF does under
    torchrun), so 2 ranks of 2 samples train what 1 rank of 4 does (to float rounding), and the
    logged loss is the ranks' mean. (Each rank's own token mean, averaged, trained another model.)"""
    one = run_job(workers=1, spares=0, steps=STEPS, command=_command(tmp_path / "one", "--padded", "--per-device", "4"),
                  timeout_s=400)  # fmt: skip
    assert one.ok, f"{one.error}\n{logs_of(one)}"
    two = run_job(
        workers=2, spares=0, steps=STEPS, command=_command(tmp_path / "two", "--padded"), timeout_s=400
    )
    assert two.ok, f"{two.error}\n{logs_of(two)}"
    a, b = _weights(tmp_path / "one" / "checkpoint-12"), _weights(tmp_path / "two" / "checkpoint-12")
    worst = max(float((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)) for k in a)
    assert worst < 1e-4, worst
    losses = [json.loads((tmp_path / d / "checkpoint-12" / "trainer_state.json").read_text())["log_history"]
              for d in ("one", "two")]  # fmt: skip
    logged = [[h["loss"] for h in history if "loss" in h] for history in losses]
    assert len(logged[0]) == STEPS // 2 and logged[0] == pytest.approx(logged[1], rel=1e-4)


MLM = str(ROOT / "tests" / "scripts" / "hf_mlm.py")


def test_a_masked_lm_script_with_random_masking_in_worker_processes_recovers_bitwise(tmp_path: Path) -> None:
    """``hf_mlm.py``: ``DataCollatorForLanguageModeling`` masks at random in 2 DataLoader worker
    processes over a ``datasets.Dataset`` (read a batch at a time, ``__getitems__``), with dynamic
    padding: a kill and then an exception end where the fault-free run does."""
    command = [sys.executable, MLM, str(tmp_path / "ref"), str(STEPS), "2"]
    reference = run_job(workers=2, spares=0, steps=STEPS, command=command, timeout_s=400)
    assert reference.ok, f"{reference.error}\n{logs_of(reference)}"
    command[2] = str(tmp_path / "faulted")
    faulted = run_job(workers=2, spares=1, steps=STEPS, command=command, timeout_s=400,
                      faults=["kill:rank=1@step=5", "exception:rank=0@step=8"])  # fmt: skip
    assert faulted.ok, f"{faulted.error}\n{logs_of(faulted)}"
    assert faulted.digest == reference.digest


def test_a_peft_lora_trainer_recovers_bitwise_moving_only_the_adapters(tmp_path: Path) -> None:
    """``get_peft_model(model, LoraConfig(...))`` handed to the ``Trainer``: a kill and then an
    exception end where the fault-free run does, and the replacement receives the adapters and
    their optimizer state only (the frozen base it already holds alike stays)."""
    reference = run_job(
        workers=2, spares=0, steps=STEPS, command=_command(tmp_path / "ref", "--lora"), timeout_s=400
    )
    assert reference.ok, f"{reference.error}\n{logs_of(reference)}"
    faulted = run_job(workers=2, spares=1, steps=STEPS, command=_command(tmp_path / "faulted", "--lora"),
                      faults=["kill:rank=1@step=5", "exception:rank=0@step=8"], timeout_s=400)  # fmt: skip
    assert faulted.ok, f"{faulted.error}\n{logs_of(faulted)}"
    assert faulted.digest == reference.digest
    (moved,) = [e for e in faulted.events if e["kind"] == "transfer_ended"]
    assert 0 < moved["bytes"] < moved["kept_bytes"], moved
