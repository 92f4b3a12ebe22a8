"""Pretrained checkpoints and LoRA in recipes: the config checks, the loading, the frozen base, the
dry run of the full-size LoRA recipes. The checkpoints are tiny models these tests save themselves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import checkpointless as cl
from checkpointless.cli import main
from checkpointless.recipes.config import RecipeError, load_recipe, recipe_from_dict
from checkpointless.recipes.dryrun import dry_run, format_dry_run
from checkpointless.recipes.model_config import LoraConfig
from checkpointless.recipes.models import build_hf_model
from checkpointless.recipes.precision import MasterWeightAdamW
from checkpointless.recipes.train import build_training
from checkpointless.state import codec, frozen
from tests.unit.test_precision import batch, nbytes, train_step

pytestmark = pytest.mark.timeout(120)

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
LORA = {"llama": RECIPES / "llama-tiny-lora.yaml", "gpt_oss": RECIPES / "gpt-oss-tiny-lora.yaml"}

torch.set_num_threads(1)


def _raw(family: str = "llama") -> dict[str, Any]:
    raw = yaml.safe_load(LORA[family].read_text(encoding="utf-8"))
    assert isinstance(raw, dict)
    return raw


def save_checkpoint(family: str, path: Path, seed: int = 7) -> dict[str, torch.Tensor]:
    """A tiny "pretrained" model of the LoRA recipe's architecture (drawn from ``seed``, not the
    recipe's seed), as ``save_pretrained`` writes it; returns its weights."""
    arch = load_recipe(LORA[family], ["model.lora=null"], check_data=False).model
    model = build_hf_model(arch, seed)
    model.save_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.lora.rank=0", "model.lora.rank"),
        ("model.lora.alpha=-1", "model.lora.alpha"),
        ("model.lora.dropout=1.0", "model.lora.dropout"),
        ("model.lora.target_modules=[]", "model.lora.target_modules"),
        ("model.lora.target_modules=[all-linear, q_proj]", "model.lora.target_modules"),
        ("model.lora.target_modules=['']", "model.lora.target_modules[0]"),
        ("model.lora.target_parameters=[mlp.experts.down_proj]", "model.lora.dropout"),  # dropout 0.05
        ("model.lora.nope=1", "model.lora.nope"),
        ("model.lora=3", "model.lora"),
        ("model.pretrained=''", "model.pretrained"),
    ],
)
def test_lora_and_pretrained_values_are_checked_naming_the_key(override: str, key: str) -> None:
    with pytest.raises(RecipeError) as err:
        load_recipe(LORA["llama"], [override], check_data=False)
    assert f"{key}:" in str(err.value) or f"'{key}'" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_lora_defaults_and_overrides_reach_peft() -> None:
    cfg = load_recipe(LORA["llama"], ["model.lora.rank=4", "model.lora.alpha=8"], check_data=False)
    assert cfg.model.lora is not None and cfg.model.lora.peft_kwargs()["r"] == 4
    assert LoraConfig().target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert LoraConfig(target_modules=["all-linear"]).peft_kwargs()["target_modules"] == "all-linear"
    plain = load_recipe(LORA["llama"], ["model.lora=null"], check_data=False)
    assert plain.model.lora is None
    with pytest.raises(RecipeError, match=r"model\.pretrained: needs a transformers model family"):
        recipe_from_dict({"name": "t", "model": {**_tiny_gpt(), "pretrained": "/x"}}, check_data=False)


def _tiny_gpt() -> dict[str, Any]:
    return {"family": "tiny_gpt", "vocab_size": 257, "hidden_size": 32, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 128}  # fmt: skip


def test_a_pretrained_directory_that_does_not_fit_is_one_line_naming_the_key(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    save_checkpoint("llama", ckpt)
    assert load_recipe(LORA["llama"], [f"model.pretrained={ckpt}"]).model.pretrained == str(ckpt)
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((ckpt / "config.json").read_text())
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{")
    (bad_json / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    for pretrained, overrides, key, needle in (
        (tmp_path / "missing", [], "model.pretrained", "does not exist"),
        (empty, [], "model.pretrained", "no config.json"),
        (no_weights, [], "model.pretrained", "holds no weights"),
        (bad_json, [], "model.pretrained", "cannot read"),
        (ckpt, ["model.hidden_size=64"], "model.hidden_size", "has 128"),
        (ckpt, ["model.num_key_value_heads=4"], "model.num_key_value_heads", "has 2"),
        (ckpt, ["model.tie_word_embeddings=false"], "model.tie_word_embeddings", "has True"),
    ):
        with pytest.raises(RecipeError) as err:
            load_recipe(LORA["llama"], [f"model.pretrained={pretrained}", *overrides])
        text = str(err.value)
        assert f"{key}:" in text and needle in text and len(text.splitlines()) == 1, text
    with pytest.raises(RecipeError, match=r"model\.family: 'gpt_oss', but the checkpoint .* 'llama' model"):
        load_recipe(LORA["gpt_oss"], [f"model.pretrained={ckpt}"])
    # the command line: one line, exit code 2, nothing started
    assert main(["run", str(LORA["llama"]), "--set", f"model.pretrained={tmp_path / 'missing'}"]) == 2
    # a dry run does not read the directory (it may live on the training cluster only)
    assert main(["run", str(LORA["llama"]), "--dry-run", "--set", f"model.pretrained={tmp_path / 'x'}"]) == 0


def test_a_lora_target_that_matches_nothing_is_one_line_before_anything_starts() -> None:
    for family, override in (
        ("llama", "model.lora.target_modules=[nope]"),
        ("gpt_oss", "model.lora.target_modules=[nope]"),  # its experts still match: peft only warns
    ):
        with pytest.raises(RecipeError, match=r"model.lora: .*nope"):
            load_recipe(LORA[family], [override])


# ----------------------------------------------------------------------------- loading, freezing


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_the_base_is_the_checkpoint_frozen_and_only_the_adapter_trains(family: str, tmp_path: Path) -> None:
    saved = save_checkpoint(family, tmp_path / "ckpt")
    cfg = load_recipe(LORA[family], [f"model.pretrained={tmp_path / 'ckpt'}"])
    training = build_training(cfg)
    model = training.model
    assert model.training
    named = dict(model.named_parameters())
    frozen = {n: p for n, p in named.items() if not p.requires_grad}
    trainable = {n: p for n, p in named.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # every weight of the checkpoint, bit for bit, under peft's name for it (CausalLMWithLoss.model
    # is peft's PeftModel; a wrapped module's own weights are its base_layer's)
    state = model.state_dict()
    base = {
        k.removeprefix("model.base_model.model.").replace(".base_layer", ""): v
        for k, v in state.items()
        if "lora_" not in k
    }
    assert sorted(base) == sorted(saved)
    assert all(torch.equal(base[k], v) for k, v in saved.items())
    # the optimizer holds the adapter only: no moments (nor masters) for the base
    in_optimizer = {id(p) for g in training.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in trainable.values()}
    # built twice (two processes): bitwise identical, adapter included (seeded)
    again = build_training(cfg).model.state_dict()
    assert all(torch.equal(state[k], again[k]) for k in state)
    # a step moves the adapter and nothing else
    before = {n: p.detach().clone() for n, p in named.items()}
    x = torch.randint(0, 257, (2, 32))
    for _ in range(2):  # LoRA's B starts at zero, so A's gradient is zero in the first step
        model(x, x).backward()
        training.update()
    assert all(torch.equal(p, before[n]) for n, p in frozen.items())
    assert all(not torch.equal(p, before[n]) for n, p in trainable.items())
    # training leaves the parameters in the order a model just built lists them (peft's parametrized
    # experts re-register theirs at each forward): a replacement's layout is a survivor's
    assert [n for n, _ in model.named_parameters()] == list(named)


def test_a_checkpoint_lacking_a_weight_is_an_error_not_a_random_init(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    save_checkpoint("llama", ckpt)
    weights = load_file(ckpt / "model.safetensors")
    dropped = sorted(weights)[-1]
    del weights[dropped]
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    cfg = load_recipe(LORA["llama"], [f"model.pretrained={ckpt}"])  # config.json still fits
    with pytest.raises(ValueError, match="missing keys: " + dropped.replace(".", r"\.")):
        build_training(cfg)


def test_pretrained_without_lora_fine_tunes_the_whole_model(tmp_path: Path) -> None:
    saved = save_checkpoint("llama", tmp_path / "ckpt")
    cfg = load_recipe(LORA["llama"], [f"model.pretrained={tmp_path / 'ckpt'}", "model.lora=null"])
    training = build_training(cfg)
    state = training.model.state_dict()
    assert all(torch.equal(state["model." + k], v) for k, v in saved.items())
    assert all(p.requires_grad for p in training.model.parameters())


# ----------------------------------------------------------------------------- dry run


def test_dry_run_of_the_full_size_lora_recipes_sizes_base_adapter_and_recovery(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, full in (("llama3-70b-lora", "llama3-70b"), ("gpt-oss-120b-lora", "gpt-oss-120b")):
        lora = dry_run(load_recipe(RECIPES / f"{name}.yaml", check_data=False))
        base = dry_run(load_recipe(RECIPES / f"{full}.yaml", check_data=False))
        assert lora["lora"] and not base["lora"]
        assert lora["params"] > base["params"] and 0 < lora["trainable_params"] < 0.01 * lora["params"]
        assert lora["params"] - lora["trainable_params"] == base["params"]  # the base, frozen
        # the base has no grads and no optimizer state; the adapter has both
        per = lora["bytes_per_param"]
        shard = -(-lora["trainable_params"] // lora["shards"])
        assert lora["rank_grads_bytes"] == shard * per["grads"]
        assert lora["rank_optimizer_bytes"] == shard * per["optimizer"]
        # a recovery moves the adapter shard and its AdamW state; the base shard is kept
        assert lora["recovery_bytes"] == shard * (per["params"] + per["optimizer"])
        assert lora["recovery_kept_bytes"] >= lora["rank_params_bytes"] - shard * per["params"]
        assert lora["recovery_bytes"] < 0.02 * lora["recovery_kept_bytes"] and lora["recoverable"]
        assert base["recovery_kept_bytes"] == 0
        text = format_dry_run(lora)
        assert "LoRA adapter" in text and "not moved" in text
        assert main(["run", str(RECIPES / f"{name}.yaml"), "--dry-run"]) == 0
        assert "LoRA adapter" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(LORA))
def test_dry_run_bytes_are_what_a_lora_step_allocates_and_a_recovery_moves(family: str, dtype: str) -> None:
    """As test_precision's test for full training: the frozen base has no grads, no moments, no
    masters; a replacement that built the same base receives the adapter's share only."""
    cfg = load_recipe(LORA[family], [f"parallel.dtype={dtype}"], check_data=False)
    report = dry_run(cfg)
    training = build_training(cfg)
    model, opt = training.model, training.optimizer
    session = cl.Session(model, opt, state={"scheduler": training.scheduler}, seed=cfg.train.seed)
    params = list(model.parameters())
    adapter = [p for p in params if p.requires_grad]
    assert nbytes(params) == report["rank_params_bytes"]
    train_step(session, training, *batch(cfg))
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    masters = opt.masters if isinstance(opt, MasterWeightAdamW) else []
    assert [p.grad is not None for p in params] == [p.requires_grad for p in params]
    assert nbytes(p.grad for p in adapter) == report["rank_grads_bytes"] == session._model.reducer.bytes
    assert (
        nbytes(masters)
        == report["rank_master_bytes"]
        == (4 * sum(p.numel() for p in adapter) if masters else 0)
    )
    assert nbytes(moments) + nbytes(masters) == report["rank_optimizer_bytes"]

    # what a replacement that built the same base receives (state/frozen.py's rule)
    replacement = build_training(cfg).model
    registry = session._model.registry.state_dict()
    offered = frozen.offer({"model": replacement.state_dict()}, replacement)
    sent, kept = frozen.leave_out(registry, model, offered)
    _, model_tensors = codec.encode_state({"model": sent["state"]["model"]})
    _, optimizer_tensors = codec.encode_state({"optimizer": sent["state"]["optimizer"]})
    counters = [s["step"] for s in opt.state.values()]
    assert nbytes(model_tensors) + nbytes(optimizer_tensors) == report["recovery_bytes"] + nbytes(counters)
    assert kept == report["recovery_kept_bytes"] > 0


def test_the_tiny_lora_recipes_dry_run_counts_what_the_model_holds() -> None:
    for family, path in LORA.items():
        cfg = load_recipe(path, check_data=False)
        report = dry_run(cfg)
        model = build_hf_model(cfg.model, 0)
        assert report["params"] == sum(p.numel() for p in model.parameters())
        assert report["trainable_params"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert (
            report["embedding_params"]
            == dry_run(load_recipe(path, ["model.lora=null"], check_data=False))["embedding_params"]
        ), family


def test_pyproject_recipes_extra_has_peft_and_accelerate() -> None:
    text = (RECIPES.parent / "pyproject.toml").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("recipes = "))
    assert '"peft' in line and '"accelerate' in line  # make install installs the recipes extra
