"""`checkpointless run` of the LoRA recipes from a pretrained checkpoint the test saves itself: a kill
and an exception end bit for bit as the fault-free run, and the replacement receives the adapter and
its optimizer state only (it loads the base from the same checkpoint and proves it identical)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from checkpointless.recipes.config import load_recipe
from checkpointless.recipes.models import build_hf_model
from tests.unit.test_recipe_lora import LORA, save_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
# --hang-timeout: up to 5 processes import transformers and peft and build their models at once on
# a 2-core machine others share; the kills here are process exits, not hangs
SMALL = ["--set", "train.steps=12", "--set", "data.eval_every=6", "--set", "data.eval_batches=1",
         "--set", "data.seq_len=32", "--set", "optim.warmup_steps=2", "--hang-timeout", "2"]  # fmt: skip
FAULTS = ["kill:rank=1@step=5", "exception:rank=0@step=8"]
HSDP = ["--workers", "4", "--set", "parallel.shards=2"]  # 2 replicas x 2 shards (FSDP2)
OVERHEAD = 64 * 1024  # RNG states, step counters, buffers: what travels besides parameters and moments


def run_cli(*args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkpointless", "run", *args, "--quiet"],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def faulted_and_clean(
    recipe: Path, args: list[str], out: Path, specs: list[str] = FAULTS
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run ``recipe`` with ``specs`` (a kill, then an exception) and without a fault; both must end
    with the same state digest. Returns the faulted run's report and events."""
    faults = [a for spec in specs for a in ("--fault", spec)]
    faulted = run_cli(str(recipe), *SMALL, *args, *faults, "--out", str(out / "f"))
    assert faulted.returncode == 0, faulted.stderr[-3000:]
    clean = run_cli(str(recipe), *SMALL, *args, "--spares", "0", "--out", str(out / "c"))
    assert clean.returncode == 0, clean.stderr[-3000:]
    rf = json.loads((out / "f" / "report.json").read_text())
    rc = json.loads((out / "c" / "report.json").read_text())
    assert rf["final_state_sha256"] == rc["final_state_sha256"] is not None
    kill, exception = sorted(rf["faults"], key=lambda f: f["spec"] != specs[0])
    assert kill["spec"] == specs[0] and kill["injected"] and kill["replaced_by"] == "s0"
    assert exception["spec"] == specs[1] and exception["injected"]
    assert kill["lost_steps"] == exception["lost_steps"] == 0
    events = [json.loads(line) for line in (out / "f" / "events.jsonl").read_text().splitlines()]
    return rf, events


def parameter_bytes(recipe: Path, overrides: list[str]) -> tuple[int, int]:
    """Bytes of the frozen and of the trainable parameters as the model's ``state_dict`` lists them
    (a tied weight under each of its names), in float32."""
    model = build_hf_model(load_recipe(recipe, overrides).model, seed=0)
    params = list(model.named_parameters(remove_duplicate=False))
    frozen = sum(4 * p.numel() for _, p in params if not p.requires_grad)
    return frozen, sum(4 * p.numel() for _, p in params if p.requires_grad)


@pytest.mark.parametrize("family", ["llama"])  # gpt-oss's adapters: the sharded test below
def test_lora_from_a_checkpoint_recovers_bitwise_moving_only_the_adapter(family: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    save_checkpoint(family, ckpt)
    pretrained = [f"model.pretrained={ckpt}"]
    rf, events = faulted_and_clean(LORA[family], ["--set", pretrained[0]], tmp_path)
    (moved,) = [e for e in events if e["kind"] == "transfer_ended" and e["proc"] == "s0"]
    frozen, adapter = parameter_bytes(LORA[family], pretrained)
    assert moved["kept_bytes"] == frozen > 0  # the whole base: checked by digest, not sent
    # the adapter, its two AdamW moments, and the few KB of RNG states and counters
    assert 3 * adapter <= moved["bytes"] < 3 * adapter + OVERHEAD
    losses = [loss for _, loss in rf["heldout_loss"]]
    assert len(losses) >= 2 and losses[-1] < losses[0]


def test_sharded_lora_from_a_checkpoint_recovers_bitwise_moving_only_the_adapter_shard(
    tmp_path: Path,
) -> None:
    """HSDP 2 x 2: every generation builds the model from the checkpoint; the spare receives its
    shard of the adapter and keeps its shard of the base (FSDP2's local tensors, found by storage)."""
    ckpt = tmp_path / "ckpt"
    save_checkpoint("gpt_oss", ckpt)
    pretrained = [f"model.pretrained={ckpt}"]
    faults = ["kill:rank=3@step=5", "exception:rank=0@step=8"]
    _, events = faulted_and_clean(LORA["gpt_oss"], ["--set", pretrained[0], *HSDP], tmp_path, faults)
    (moved,) = [e for e in events if e["kind"] == "transfer_ended" and e["proc"] == "s0"]
    assert moved["rank"] == 3 and moved["src"] == 1  # the same shard's other replica
    frozen, adapter = parameter_bytes(LORA["gpt_oss"], pretrained)
    assert frozen // 3 < moved["kept_bytes"] < frozen  # about half the base: this rank's shard
    assert moved["bytes"] < min(3 * adapter + OVERHEAD, moved["kept_bytes"])  # its adapter shard


def test_a_full_fine_tune_from_a_checkpoint_moves_every_parameter(tmp_path: Path) -> None:
    """The same checkpoint without LoRA: nothing is frozen, the replacement receives everything."""
    ckpt = tmp_path / "ckpt"
    save_checkpoint("llama", ckpt)
    overrides = [f"model.pretrained={ckpt}", "model.lora=null"]
    _, events = faulted_and_clean(LORA["llama"], [a for o in overrides for a in ("--set", o)], tmp_path)
    (moved,) = [e for e in events if e["kind"] == "transfer_ended" and e["proc"] == "s0"]
    frozen, params = parameter_bytes(LORA["llama"], overrides)
    assert frozen == 0 and moved["kept_bytes"] == 0
    # every parameter (the tied one twice) and the moments of each (once: one tensor)
    tied = 4 * 257 * 128
    assert 3 * params - 2 * tied <= moved["bytes"] < 3 * params - 2 * tied + OVERHEAD
