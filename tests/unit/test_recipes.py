"""Tests for checkpointless.recipes: YAML loading and validation, model builders, dry run."""

from __future__ import annotations

import itertools
import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from checkpointless.recipes.config import (
    OptimConfig,
    ParallelConfig,
    RecipeConfig,
    RecipeError,
    load_recipe,
    recipe_from_dict,
)
from checkpointless.recipes.model_config import ModelConfig

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ALL_RECIPES = sorted(RECIPES.glob("*.yaml"))
TINY = {"llama": RECIPES / "llama-tiny.yaml", "gpt_oss": RECIPES / "gpt-oss-tiny.yaml"}

torch.set_num_threads(1)


def _write(tmp_path: Path, raw: dict[str, Any], name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def _tiny_raw() -> dict[str, Any]:
    raw = yaml.safe_load(TINY["llama"].read_text(encoding="utf-8"))
    assert isinstance(raw, dict)
    return raw


# ----------------------------------------------------------------------------- loading


@pytest.mark.timeout(120)
def test_recipe_directory_has_the_four_recipes() -> None:
    names = {p.name for p in ALL_RECIPES}
    assert {"llama-tiny.yaml", "gpt-oss-tiny.yaml", "llama3-70b.yaml", "gpt-oss-120b.yaml"} <= names


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ALL_RECIPES, ids=lambda p: p.stem)
def test_every_recipe_loads(path: Path) -> None:
    cfg = load_recipe(path, check_data=False)
    assert isinstance(cfg, RecipeConfig)
    assert cfg.name == path.stem
    assert cfg.parallel.replicas * cfg.parallel.shards == cfg.parallel.workers
    assert cfg.data.global_batch % cfg.parallel.workers == 0
    if cfg.data.is_stdlib:  # loads with the data check on, too
        assert load_recipe(path) == cfg


@pytest.mark.timeout(120)
def test_tiny_recipe_values_and_round_trip(tmp_path: Path) -> None:
    cfg = load_recipe(TINY["llama"])
    assert cfg.model.family == "llama"
    assert cfg.optim.betas == (0.9, 0.95)
    assert isinstance(cfg.optim.lr, float)
    assert cfg.parallel.replicas == 2 and cfg.micro_batch == 8
    again = load_recipe(_write(tmp_path, cfg.to_dict()))
    assert again == cfg


@pytest.mark.timeout(120)
def test_unknown_key_names_dotted_key_and_file(tmp_path: Path) -> None:
    raw = _tiny_raw()
    raw["model"]["foo"] = 1
    path = _write(tmp_path, raw)
    with pytest.raises(ValueError, match=r"recipe\.yaml: unknown key 'model\.foo'"):
        load_recipe(path)
    raw = _tiny_raw()
    raw["trian"] = {"steps": 3}
    with pytest.raises(ValueError, match="unknown key 'trian'"):
        load_recipe(_write(tmp_path, raw))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("optim", "lr", "fast", "float"),
        ("model", "hidden_size", 12.5, "int"),
        ("train", "steps", True, "int"),
        ("model", "family", "mamba", "llama"),
        ("optim", "betas", [0.9], "tuple"),
        ("data", "seq_len", None, "int"),
        ("model", "layer_types", "full_attention", "list"),
    ],
)
def test_wrong_type_names_key_expected_and_given(
    tmp_path: Path, section: str, key: str, value: object, expected: str
) -> None:
    raw = _tiny_raw()
    raw[section][key] = value
    with pytest.raises(ValueError) as info:
        load_recipe(_write(tmp_path, raw))
    msg = str(info.value)
    assert "recipe.yaml" in msg and f"{section}.{key}" in msg and expected in msg
    assert type(value).__name__ in msg


@pytest.mark.timeout(120)
def test_section_must_be_mapping(tmp_path: Path) -> None:
    raw = _tiny_raw()
    raw["optim"] = 3
    with pytest.raises(ValueError, match=r"optim: expected mapping, got int"):
        load_recipe(_write(tmp_path, raw))


@pytest.mark.timeout(120)
def test_overrides_apply() -> None:
    cfg = load_recipe(
        TINY["llama"],
        [
            "optim.lr=1e-3",  # YAML 1.1 would read this as a string; recipes read it as a float
            "optim.betas=[0.8, 0.9]",
            "train.steps=7",
            "optim.warmup_steps=0",
            "parallel.workers=4",
            "model.extra.rms_norm_eps=1e-6",
            "name=renamed",
        ],
    )
    assert cfg.optim.lr == 1e-3
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.train.steps == 7
    assert cfg.parallel.workers == 4 and cfg.micro_batch == 4
    assert cfg.model.extra["rms_norm_eps"] == 1e-6
    assert cfg.name == "renamed"
    assert load_recipe(TINY["llama"], ["optim.grad_clip=null"]).optim.grad_clip is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("optim.lrr=1e-3", "optim.lrr"),
        ("optimizer.lr=1e-3", "optimizer"),
        ("optim.lr.x=1", "optim.lr"),
        ("optim.lr", "key=value"),
        ("train.steps=many", "train.steps"),
        ("optim.lr=-1", "optim.lr"),
        ("parallel.dtype=float16", "parallel.dtype"),
    ],
)
def test_bad_override_is_rejected(override: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        load_recipe(TINY["llama"], [override])


@pytest.mark.timeout(120)
def test_missing_data_dir_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-corpus"
    with pytest.raises(ValueError, match="no-such-corpus") as info:
        load_recipe(TINY["llama"], [f"data.source={missing}"])
    assert "data.source" in str(info.value)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with pytest.raises(ValueError, match=r"data\.source: corpus path contains no"):  # empty: refused too
        load_recipe(TINY["llama"], [f"data.source={corpus}"])
    for i in range(40):
        (corpus / f"doc{i}.txt").write_text(f"document {i}\n" * 30, encoding="utf-8")
    assert load_recipe(TINY["llama"], [f"data.source={corpus}"]).data.source.endswith("corpus")
    # Big recipes point at cluster paths; the dry run loads them without the check.
    with pytest.raises(ValueError, match="llama3-pretrain"):
        load_recipe(RECIPES / "llama3-70b.yaml")


@pytest.mark.timeout(120)
def test_impossible_layout_names_keys() -> None:
    with pytest.raises(ValueError, match=r"data\.global_batch.*parallel\.workers"):
        load_recipe(TINY["llama"], ["data.global_batch=15"])
    with pytest.raises(ValueError, match=r"parallel\.shards.*does not divide workers"):
        load_recipe(TINY["llama"], ["parallel.workers=4", "parallel.shards=3"])
    with pytest.raises(ValueError, match=r"data\.seq_len.*max_position_embeddings"):
        load_recipe(TINY["llama"], ["data.seq_len=1024"])
    with pytest.raises(ValueError, match=r"model\.vocab_size"):
        load_recipe(TINY["llama"], ["model.vocab_size=100"])
    with pytest.raises(ValueError, match=r"model\.num_local_experts"):
        load_recipe(TINY["llama"], ["model.num_local_experts=4"])
    with pytest.raises(ValueError, match=r"model\.layer_types"):
        load_recipe(TINY["gpt_oss"], ["model.num_hidden_layers=3"])


@pytest.mark.timeout(120)
def test_bad_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"nope\.yaml"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "broken.yaml"
    bad.write_text("model: [unclosed\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.yaml.*invalid YAML.*line 2, column 1") as info:
        load_recipe(bad)
    assert "\n" not in str(info.value)
    empty = tmp_path / "empty.yaml"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty\.yaml"):
        load_recipe(empty)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"list\.yaml"):
        load_recipe(listy)
    missing = _tiny_raw()
    del missing["model"]["hidden_size"]
    with pytest.raises(ValueError, match=r"model\.hidden_size: missing"):
        load_recipe(_write(tmp_path, missing))


@pytest.mark.timeout(120)
def test_dataclasses_validate_directly() -> None:
    with pytest.raises(RecipeError, match="lr"):
        OptimConfig(lr=0.0)
    with pytest.raises(RecipeError, match="shards"):
        ParallelConfig(workers=6, shards=4)
    with pytest.raises(RecipeError, match="num_experts_per_tok"):
        ModelConfig(
            family="gpt_oss",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_local_experts=2,
            num_experts_per_tok=3,
        )
    assert ParallelConfig(workers=8, shards=4).replicas == 2


# ----------------------------------------------------------------------------- models


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(TINY))
def test_tiny_model_builds_deterministically_and_trains(family: str) -> None:
    from checkpointless.recipes.models import CausalLMWithLoss, build_model, count_parameters

    cfg = load_recipe(TINY[family])
    rng_before = torch.random.get_rng_state()
    a = build_model(cfg.model, seed=cfg.train.seed)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "building must not consume the global RNG"
    b = build_model(cfg.model, seed=cfg.train.seed)
    c = build_model(cfg.model, seed=cfg.train.seed + 1)
    assert isinstance(a, CausalLMWithLoss)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)

    n = sum(p.numel() for p in a.parameters())
    assert n == count_parameters(cfg.model)
    assert n < 5_000_000

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.data.tokenizer_vocab_size, (2, 33), generator=gen)
    loss = a(tokens[:, :-1], tokens[:, 1:])
    assert loss.dim() == 0 and math.isfinite(loss.item())
    assert abs(loss.item() - math.log(cfg.model.vocab_size)) < 1.0  # near-uniform at init
    loss.backward()
    grads = [p.grad for p in a.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # Same weights, same batch -> bitwise identical loss (eager kernels on CPU).
    assert torch.equal(b(tokens[:, :-1], tokens[:, 1:]).detach(), loss.detach())


@pytest.mark.timeout(120)
def test_gpt_oss_tiny_uses_moe_and_both_attention_kinds() -> None:
    from checkpointless.recipes.models import build_model, parameter_breakdown

    cfg = load_recipe(TINY["gpt_oss"])
    model = build_model(cfg.model, seed=0)
    inner: Any = model.model
    hf = inner.config
    assert hf._attn_implementation == "eager"
    assert hf.num_local_experts == 4 and hf.num_experts_per_tok == 2
    assert set(hf.layer_types) == {"sliding_attention", "full_attention"}
    counts = parameter_breakdown(cfg.model)
    assert 0 < counts["active"] < counts["total"]
    assert counts["experts"] > 0

    # A few optimizer steps on one repeated batch must reduce the loss (MoE trains on CPU).
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 65), generator=gen)
    losses = []
    for _ in range(6):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


@pytest.mark.timeout(120)
def test_tiny_gpt_family_builds_the_projects_tiny_gpt() -> None:
    from checkpointless.models.tiny_gpt import TinyGPT
    from checkpointless.recipes.models import build_model, count_parameters

    overrides = [
        "model.family=tiny_gpt",
        "model.num_key_value_heads=null",
        "model.intermediate_size=512",
        "model.tie_word_embeddings=false",
        "model.extra={}",
    ]
    cfg = load_recipe(TINY["llama"], overrides)
    model = build_model(cfg.model, seed=0)
    assert isinstance(model, TinyGPT)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg.model)
    again = build_model(cfg.model, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    tokens = torch.randint(0, 256, (2, 17))
    assert math.isfinite(model(tokens[:, :-1], tokens[:, 1:]).item())
    with pytest.raises(ValueError, match=r"model\.intermediate_size"):
        load_recipe(TINY["llama"], [*overrides, "model.intermediate_size=300"])


# ----------------------------------------------------------------------------- dry run


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("recipe", "expected", "tolerance"),
    [("llama3-70b.yaml", 70.6e9, 0.03), ("gpt-oss-120b.yaml", 116.8e9, 0.05)],
)
def test_dry_run_big_recipes_without_allocating(recipe: str, expected: float, tolerance: float) -> None:
    from checkpointless.recipes.dryrun import dry_run, format_dry_run

    cfg = load_recipe(RECIPES / recipe, check_data=False)
    start = time.perf_counter()
    report = dry_run(cfg)
    elapsed = time.perf_counter() - start
    assert elapsed < 30, "meta-device build should be fast (and allocate nothing)"
    assert abs(report["params"] - expected) / expected < tolerance
    n, par = report["params"], cfg.parallel
    assert par.dtype == "bfloat16"
    shard = -(-n // par.shards)
    # sharded bf16 is FSDP2's mixed precision: fp32 shards (the masters), fp32 grads, 2 fp32 moments
    assert report["rank_params_bytes"] == 4 * shard
    assert report["rank_grads_bytes"] == 4 * shard
    assert report["rank_optimizer_bytes"] == 8 * shard and report["rank_master_bytes"] == 0
    assert report["recovery_bytes"] == 12 * shard
    assert report["gathered_layer_bytes"] == 2 * report["layer_params"]  # gathered in bf16
    assert report["recoverable"] and report["replicas"] == par.workers // par.shards
    # Recovery traffic is per shard: doubling the cluster (more replicas) does not change it.
    bigger = load_recipe(
        RECIPES / recipe,
        [f"parallel.workers={2 * par.workers}", f"data.global_batch={2 * cfg.data.global_batch}"],
        check_data=False,
    )
    assert dry_run(bigger)["recovery_bytes"] == report["recovery_bytes"]
    text = format_dry_run(report)
    assert "GiB" in text and cfg.name in text
    if recipe.startswith("gpt-oss"):
        assert report["active_params"] < 0.1 * n  # 4 of 128 experts per token


@pytest.mark.timeout(120)
def test_dry_run_tiny_matches_real_model_and_flags_single_replica() -> None:
    from checkpointless.cli import main
    from checkpointless.recipes.dryrun import dry_run
    from checkpointless.recipes.models import build_model

    cfg = load_recipe(TINY["llama"], ["parallel.shards=2"])
    report = dry_run(cfg)
    real = sum(p.numel() for p in build_model(cfg.model, seed=0).parameters())
    assert report["params"] == real
    assert report["rank_params_bytes"] == 4 * (-(-real // 2))
    assert report["rank_optimizer_bytes"] == 8 * (-(-real // 2))
    assert not report["recoverable"]
    assert main(["dryrun", str(TINY["llama"]), "--set", "optim.lr=1e-3"]) == 0
    assert main(["dryrun", str(TINY["llama"]), "--set", "optim.nope=1"]) == 2


@pytest.mark.timeout(120)
def test_exponent_floats_read_as_numbers(tmp_path: Path) -> None:
    text = TINY["llama"].read_text(encoding="utf-8").replace("lr: 3.0e-3", "lr: 3e-3")
    assert "lr: 3e-3" in text
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    assert load_recipe(path).optim.lr == 3e-3
    with pytest.raises(ValueError, match=r"optim\.lr: expected float, got str"):
        load_recipe(path, ["optim.lr='3e-3'"])


# ----------------------------------------------------------------------------- hostile input


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("optim.lr=.nan", "optim.lr"),
        ("optim.lr=.inf", "optim.lr"),
        ("optim.lr=-.inf", "optim.lr"),
        ("optim.eps=.nan", "optim.eps"),
        ("optim.weight_decay=.inf", "optim.weight_decay"),
        ("optim.weight_decay=.nan", "optim.weight_decay"),
        ("optim.grad_clip=.nan", "optim.grad_clip"),
        ("optim.grad_clip=.inf", "optim.grad_clip"),
        ("optim.betas=[.nan, 0.95]", "optim.betas[0]"),
        ("data.heldout_fraction=.nan", "data.heldout_fraction"),
        ("model.extra.rms_norm_eps=.nan", "model.extra.rms_norm_eps"),
        ("model.extra.rope_parameters.rope_theta=.inf", "model.extra.rope_parameters.rope_theta"),
    ],
)
def test_non_finite_floats_are_refused(override: str, key: str) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY["llama"], [override], check_data=False)
    msg = str(info.value)
    assert f"{key}: must be a finite number" in msg and "llama-tiny.yaml" in msg, msg


@pytest.mark.timeout(120)
def test_non_finite_floats_are_refused_in_python_too() -> None:
    for kwargs in ({"lr": math.nan}, {"lr": math.inf}, {"eps": math.nan}, {"weight_decay": math.nan}):
        with pytest.raises(RecipeError, match="finite"):
            OptimConfig(**kwargs)  # type: ignore[arg-type]
    assert OptimConfig(grad_clip=None).grad_clip is None


def _billion_laughs(levels: int) -> str:
    lines = ['lol0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def _alias_chain(levels: int, per: int) -> list[str]:
    """Anchors each nesting the previous one ``per`` levels deeper: ``levels * per`` deep once expanded."""
    return [f"a{i}: &a{i} {'[' * per}{f'*a{i - 1}' if i else '1'}{']' * per}" for i in range(levels + 1)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a: &a [*a]\n", "recursive alias *a at line 1"),
        ("name: x\nmodel: &m\n  self: *m\n", "recursive alias *m at line 3"),
        (_billion_laughs(7), "expands to more than 100000 values"),  # 9**7 = 4.8M strings
        ("name: " + "[" * 5000 + "]" * 5000 + "\n", "nesting deeper than 64 levels"),
        ("\n".join(_alias_chain(1000, 8)) + "\n", "nesting deeper than 64 levels at line 8"),
    ],
    ids=["recursive-list", "recursive-mapping", "billion-laughs", "deep-nesting", "deep-alias-chain"],
)
def test_hostile_yaml_is_refused_in_one_line(
    tmp_path: Path, text: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_text(text, encoding="utf-8")
    limit = sys.getrecursionlimit()
    start = time.perf_counter()
    with pytest.raises(RecipeError) as info:
        load_recipe(path, check_data=False)
    assert time.perf_counter() - start < 2
    assert sys.getrecursionlimit() == limit
    msg = str(info.value)
    assert needle in msg and "hostile.yaml: invalid YAML" in msg and "\n" not in msg, msg
    from checkpointless.cli import main

    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err and len(err.splitlines()) == 1, err


@pytest.mark.timeout(120)
def test_hostile_override_value_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # 1800 levels deep and ~55k values once expanded: this used to end in a RecursionError.
    override = "model.extra.chain={" + ", ".join(_alias_chain(60, 30)) + "}"
    start = time.perf_counter()
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY["llama"], [override], check_data=False)
    assert time.perf_counter() - start < 2
    msg = str(info.value)
    assert msg.startswith("model.extra.chain: override value '{a0: &a0 [[[[")
    assert "...' is not valid YAML: nesting deeper than 64 levels" in msg and "*a1 is expanded" in msg
    assert "\n" not in msg and len(msg) < 250, msg
    from checkpointless.cli import main

    assert main(["run", str(TINY["llama"]), "--dry-run", "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "nesting deeper than 64 levels" in err and len(err.splitlines()) == 1


@pytest.mark.timeout(120)
def test_ordinary_anchors_and_aliases_still_load(tmp_path: Path) -> None:
    text = TINY["llama"].read_text(encoding="utf-8")
    text = text.replace("max_position_embeddings: 256", "max_position_embeddings: &ctx 256")
    text = text.replace("seq_len: 128", "seq_len: *ctx")
    text = text.replace("extra:\n", "extra: &extra\n")
    assert "*ctx" in text and "&extra" in text
    path = tmp_path / "anchored.yaml"
    path.write_text(text, encoding="utf-8")
    cfg = load_recipe(path, check_data=False)
    assert cfg.model.max_position_embeddings == cfg.data.seq_len == 256
    assert cfg.model.extra == load_recipe(TINY["llama"], check_data=False).model.extra


@pytest.mark.timeout(120)
def test_recursive_or_huge_python_mappings_are_refused() -> None:
    raw: dict[str, Any] = yaml.safe_load(TINY["llama"].read_text(encoding="utf-8"))
    raw["model"]["extra"]["loop"] = raw["model"]["extra"]
    with pytest.raises(RecipeError, match="recursive structure"):
        recipe_from_dict(raw, check_data=False)
    leaf: list[Any] = ["lol"] * 10
    for _ in range(7):
        leaf = [leaf] * 10  # 10**8 values once expanded, a few hundred objects in memory
    raw = yaml.safe_load(TINY["llama"].read_text(encoding="utf-8"))
    raw["model"]["extra"]["laughs"] = leaf
    with pytest.raises(RecipeError, match="more than 100000 values"):
        recipe_from_dict(raw, check_data=False)


def test_cosine_schedule_decays_to_a_tenth_of_lr_as_documented() -> None:
    from checkpointless.recipes.train import lr_lambda

    source = Path(__import__("checkpointless.recipes.config").recipes.config.__file__).read_text()
    assert "decay from ``lr`` to ``0.1 * lr``" in source  # what the schema documents
    factors = [lr_lambda(s, warmup=10, total=110, schedule="cosine") for s in range(110)]
    assert factors[:10] == [(s + 1) / 10 for s in range(10)]  # linear warm-up
    assert factors[10] == 1.0 and all(a >= b for a, b in itertools.pairwise(factors[10:]))
    assert lr_lambda(110, warmup=10, total=110, schedule="cosine") == pytest.approx(0.1)  # the floor, not 0
    assert lr_lambda(500, warmup=10, total=110, schedule="cosine") == pytest.approx(0.1)
    assert lr_lambda(50, warmup=10, total=110, schedule="constant") == 1.0
