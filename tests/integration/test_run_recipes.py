"""`checkpointless run` on the tiny Hugging Face recipes, with a fault, real corpus, metrics scraped live."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from checkpointless.cli import main
from checkpointless.config import RecoveryConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--set", "train.steps=12", "--set", "data.eval_every=6", "--set", "data.eval_batches=1",
         "--set", "data.seq_len=32", "--set", "optim.warmup_steps=2"]  # fmt: skip


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkpointless", "run", *args, "--quiet"],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("recipe", "shards", "killed"),
    # llama-tiny replicated runs in float32 in test_metrics_scraped_during_a_run_with_a_fault and
    # in bfloat16 below, sharded in bfloat16 too; here gpt-oss-tiny replicated and sharded
    [("gpt-oss-tiny", 1, 1), ("gpt-oss-tiny", 2, 0)],
    ids=["gpt-oss-tiny", "gpt-oss-tiny-hsdp2x2"],
)
def test_recipe_with_kill_equals_fault_free(recipe: str, shards: int, killed: int, tmp_path: Path) -> None:
    """shards=2: 4 workers as 2 replicas x 2 shards (FSDP2 HSDP); the spare receives the killed rank's shard."""
    path = str(ROOT / "recipes" / f"{recipe}.yaml")
    layout = [] if shards == 1 else ["--workers", "4", "--set", f"parallel.shards={shards}"]
    spec = f"kill:rank={killed}@step=5"
    faulted = run_cli(path, *SMALL, *layout, "--fault", spec, "--out", str(tmp_path / "f"))
    assert faulted.returncode == 0, faulted.stderr
    clean = run_cli(path, *SMALL, *layout, "--spares", "0", "--out", str(tmp_path / "c"))
    assert clean.returncode == 0, clean.stderr
    rf = json.loads((tmp_path / "f" / "report.json").read_text())
    rc = json.loads((tmp_path / "c" / "report.json").read_text())
    assert rf["final_state_sha256"] == rc["final_state_sha256"]
    (fault,) = rf["faults"]
    assert fault["injected"] and fault["spec"] == spec  # it fired
    assert fault["lost_steps"] == 0 and fault["replaced_by"] == "s0"
    if shards > 1:
        events = [json.loads(line) for line in (tmp_path / "f" / "events.jsonl").read_text().splitlines()]
        transfers = [e for e in events if e["kind"] == "transfer_ended"]
        assert killed in {e["rank"] for e in transfers}
        assert all(e["src"] % shards == e["rank"] % shards for e in transfers)  # from a copy of its own shard
    losses = [loss for _, loss in rf["heldout_loss"]]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert (tmp_path / "f" / "timeline.png").stat().st_size > 10_000
    assert "step 10/12 loss" in (tmp_path / "c" / "logs" / "w0.log").read_text()  # train.log_every: 10


@pytest.mark.parametrize(
    ("recipe", "layout", "low", "killed"),
    [("llama-tiny", [], 1, 1), ("gpt-oss-tiny", ["--workers", "4", "--set", "parallel.shards=2"], 2, 0),
     ("gpt-oss-tiny", ["--workers", "4", "--set", "parallel.shards=2", "--set", "recovery.exact_resize=true"], 2, 0)],
    ids=["llama-tiny", "gpt-oss-tiny-hsdp2x2", "gpt-oss-tiny-hsdp2x2-exact"],
)  # fmt: skip
def test_a_recipe_without_spares_goes_on_smaller_with_the_fault_free_losses(
    recipe: str, layout: list[str], low: int, killed: int, tmp_path: Path
) -> None:
    """``recovery.min_workers``: the lost rank's replica leaves (sharded: with its other rank), the
    survivors compute its shares, and every step's loss is the fault-free run's to rounding (the
    same bits with ``recovery.exact_resize``)."""
    path = str(ROOT / "recipes" / f"{recipe}.yaml")
    spec = f"kill:rank={killed}@step=5"
    smaller = run_cli(path, *SMALL, *layout, "--spares", "0", "--set", f"recovery.min_workers={low}",
                      "--fault", spec, "--out", str(tmp_path / "f"))  # fmt: skip
    assert smaller.returncode == 0, smaller.stderr
    clean = run_cli(path, *SMALL, *layout, "--spares", "0", "--out", str(tmp_path / "c"))
    assert clean.returncode == 0, clean.stderr
    rf = json.loads((tmp_path / "f" / "report.json").read_text())
    rc = json.loads((tmp_path / "c" / "report.json").read_text())
    sizes = [rf["replicas_by_step"][s] for s in sorted(rf["replicas_by_step"], key=int)]
    assert sizes == [2] * 5 + [1] * 7, sizes
    (fault,) = rf["faults"]
    assert fault["spec"] == spec and fault["lost_steps"] == 0 and fault["replaced_by"] is None
    got, free = rf["loss_by_step"], rc["loss_by_step"]
    assert sorted(got, key=int) == sorted(free, key=int)
    assert max(abs(got[k] - free[k]) / abs(free[k]) for k in free) < 1e-4
    if "recovery.exact_resize=true" in layout:  # the sum over shares in share order: the same bits
        assert got == free


def test_metrics_scraped_during_a_run_with_a_fault(tmp_path: Path) -> None:
    path = str(ROOT / "recipes" / "llama-tiny.yaml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "checkpointless", "run", path, *SMALL, "--set", "train.steps=40",
         "--fault", "kill:rank=1@step=8", "--metrics-port", "0", "--out", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            m = re.search(r"(http://127\.0\.0\.1:\d+/metrics)", "".join(lines))
            url = m.group(1) if m else None
            time.sleep(0.1)
        assert url, "".join(lines)
        scraped: dict[str, float] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                text = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError:
                break
            for line in text.splitlines():
                if line.startswith("checkpointless_") and " " in line:
                    name, value = line.rsplit(" ", 1)
                    scraped[name] = float(value)
            if (
                scraped.get('checkpointless_faults_total{cause="process_exit",kind="crash"}', 0) >= 1
                and scraped.get("checkpointless_last_committed_step", 0) > 10
            ):
                break
            time.sleep(0.2)
        assert scraped.get('checkpointless_faults_total{cause="process_exit",kind="crash"}') == 1.0, scraped
        assert scraped["checkpointless_generation"] >= 1
        assert scraped["checkpointless_recovery_seconds_count"] >= 1
        assert 'checkpointless_step_time_seconds{rank="1"}' in scraped
        assert proc.wait(timeout=200) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_dry_run_of_full_size_recipes(capsys: pytest.CaptureFixture[str]) -> None:
    for name, params in (("llama3-70b", "70"), ("gpt-oss-120b", "11")):
        assert main(["run", str(ROOT / "recipes" / f"{name}.yaml"), "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert params in out and "GiB" in out


def test_recipe_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(ROOT / "recipes" / "llama-tiny.yaml")
    blocker = tmp_path / "a-file"  # a durable_dir below a file cannot be created
    blocker.write_text("")
    for extra, needle in (
        (["--set", "model.nope=1"], "model.nope"),
        (["--set", "data.global_batch=15"], "global_batch"),
        (["--set", "data.source=/no/such/dir"], "/no/such/dir"),
        (["--workers", "0"], "workers"),
        (["--set", "recovery.progress_timeout_s=.nan"], "progress_timeout_s"),
        (["--progress-timeout", "inf"], "--progress-timeout"),
        (["--hang-timeout", "0"], "--hang-timeout"),
        (["--set", "parallel.shards=3"], "parallel.shards"),
        (["--set", "recovery.consistency_every=-1"], "recovery.consistency_every"),
        (["--set", "recovery.durable_every=5"], "recovery.durable_dir"),
        (
            ["--set", "recovery.durable_every=5", "--set", f"recovery.durable_dir={blocker}/sub"],
            "recovery.durable_dir",
        ),
        (["--fault", "corrupt:rank=9@step=1"], "rank 9 is out of range"),
        (["--set", "recovery.nope=1"], "recovery.nope"),
    ):
        assert main(["run", path, *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_detection_settings_come_from_the_recipe_unless_a_flag_says_otherwise() -> None:
    from checkpointless.recipes.config import load_recipe

    path = ROOT / "recipes" / "llama-tiny.yaml"
    cfg = load_recipe(path, ["recovery.progress_timeout_s=7.5"], check_data=False)
    assert (
        cfg.recovery.progress_timeout_s == 7.5
        and cfg.recovery.hang_timeout_s == RecoveryConfig().hang_timeout_s
    )


@pytest.mark.parametrize(("layout", "killed"), [([], 1), (["--workers", "4", "--set", "parallel.shards=2"], 3)],
                         ids=["replicated", "hsdp2x2"])  # fmt: skip
def test_bf16_recipe_with_kill_equals_fault_free(layout: list[str], killed: int, tmp_path: Path) -> None:
    """bf16 with fp32 master weights (replicated: the optimizer's masters; sharded: FSDP2's float32
    shards, bf16 compute): the spare receives them, the run ends bit for bit as without the kill."""
    path = str(ROOT / "recipes" / "llama-tiny.yaml")
    short = [*SMALL, "--set", "train.steps=8", "--set", "data.eval_every=0",
             "--set", "parallel.dtype=bfloat16", *layout]  # fmt: skip
    faulted = run_cli(path, *short, "--fault", f"kill:rank={killed}@step=5", "--out", str(tmp_path / "f"))
    assert faulted.returncode == 0, faulted.stderr
    clean = run_cli(path, *short, "--spares", "0", "--out", str(tmp_path / "c"))
    assert clean.returncode == 0, clean.stderr
    rf = json.loads((tmp_path / "f" / "report.json").read_text())
    rc = json.loads((tmp_path / "c" / "report.json").read_text())
    assert rf["final_state_sha256"] == rc["final_state_sha256"]  # the digest covers the fp32 masters
    # the injected kill (a loaded machine may add a false hang at start-up: its spare is then s1)
    (fault,) = [f for f in rf["faults"] if f.get("injected")]
    assert fault["lost_steps"] == 0 and fault["replaced_by"] in ("s0", "s1")
