"""bf16 recipes keep fp32 master weights: updates are not lost, the masters move with the state,
and the dry run's memory figures are the bytes a real training step allocates."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import checkpointless as cl
from checkpointless.recipes.config import RecipeConfig, load_recipe
from checkpointless.recipes.dryrun import dry_run
from checkpointless.recipes.models import build_model
from checkpointless.recipes.precision import MASTER_KEY, MasterWeightAdamW
from checkpointless.recipes.train import Training, build_training
from checkpointless.state import codec

pytestmark = pytest.mark.timeout(120)

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
TINY = {"llama": RECIPES / "llama-tiny.yaml", "gpt_oss": RECIPES / "gpt-oss-tiny.yaml"}

torch.set_num_threads(1)


def recipe(family: str, dtype: str, *overrides: str) -> RecipeConfig:
    return load_recipe(TINY[family], [f"parallel.dtype={dtype}", *overrides], check_data=False)


def batch(cfg: RecipeConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(session: cl.Session, training: Training, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """One step as ``checkpointless.recipes.train`` runs it (single process, no launcher)."""
    with session.attempt():
        training.model(inputs, targets).backward()
        session.reduce_gradients()
        training.update()


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def changed(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Fraction of elements that differ between two lists of same-shaped tensors."""
    return sum(int((x != y).sum()) for x, y in zip(a, b, strict=True)) / sum(x.numel() for x in a)


# ------------------------------------------------------------------------ setup


def test_float32_recipe_is_plain_adamw_and_bf16_gets_master_weights() -> None:
    fp32 = build_training(recipe("llama", "float32"))
    assert type(fp32.optimizer) is torch.optim.AdamW
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    bf16 = build_training(recipe("llama", "bfloat16"))
    opt = bf16.optimizer
    assert isinstance(opt, MasterWeightAdamW)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in opt.masters} == {torch.float32}
    assert opt.param_groups[0]["params"] == opt.masters  # the scheduler drives the masters' update
    assert bf16.scheduler.optimizer is opt
    # the masters start as the bf16 weights, exactly; buffers (RoPE frequencies) stay fp32
    assert all(torch.equal(m, p.float()) for p, m in zip(opt.model_params, opt.masters, strict=True))
    assert {b.dtype for b in bf16.model.buffers()} == {torch.float32}


# ------------------------------------------------------------------------ updates are not lost


def test_tiny_updates_accumulate_in_the_masters_where_plain_bf16_adamw_loses_them() -> None:
    # Adam's first steps move each weight by about lr. At 1.0 a bf16 weight only changes
    # once the update passes half a unit in the last place (2**-9 ~ 0.002), so lr = 5e-4
    # is lost by plain bf16 AdamW, every step, forever (the defect this module fixes).
    def setup(cls: type[torch.optim.AdamW]) -> tuple[nn.Parameter, torch.optim.AdamW]:
        p = nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
        return p, cls([p], lr=5e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    p, opt = setup(MasterWeightAdamW)
    assert isinstance(opt, MasterWeightAdamW)
    plain_p, plain = setup(torch.optim.AdamW)
    for step in range(10):
        for q, o in ((p, opt), (plain_p, plain)):
            q.grad = torch.ones_like(q)
            o.step()
            o.zero_grad()
        assert torch.equal(p, opt.masters[0].to(torch.bfloat16))  # the params are the masters rounded
        if step == 0:
            assert torch.equal(p, torch.ones_like(p))  # the bf16 weight did not move ...
            assert (opt.masters[0] < 1.0).all()  # ... its master did
    assert (opt.masters[0] < 1.0 - 9 * 5e-4).all()
    assert (p < 1.0).all()  # ten tiny updates moved the bf16 weights
    assert torch.equal(plain_p, torch.ones_like(plain_p))  # without masters: nothing, ever


def test_recipe_with_a_tiny_lr_keeps_learning_in_bf16() -> None:
    cfg = recipe("llama", "bfloat16", "optim.lr=1e-5", "optim.warmup_steps=0", "optim.schedule=constant")
    training = build_training(cfg)
    opt = training.optimizer
    assert isinstance(opt, MasterWeightAdamW)
    session = cl.Session(training.model, opt, state={"scheduler": training.scheduler}, seed=cfg.train.seed)
    params0 = [p.detach().clone() for p in training.model.parameters()]
    masters0 = [m.detach().clone() for m in opt.masters]
    # what train.py did before master weights: AdamW directly on the bf16 parameters
    old = build_model(cfg.model, seed=cfg.train.seed, dtype=torch.bfloat16)
    oc = cfg.optim
    old_opt = torch.optim.AdamW(
        old.parameters(), lr=oc.lr, betas=oc.betas, eps=oc.eps, weight_decay=oc.weight_decay
    )
    assert all(torch.equal(a, b) for a, b in zip(old.parameters(), params0, strict=True))
    inputs, targets = batch(cfg)
    for step in range(10):
        train_step(session, training, inputs, targets)
        old(inputs, targets).backward()
        torch.nn.utils.clip_grad_norm_(old.parameters(), 1.0)
        old_opt.step()
        old_opt.zero_grad()
        params = [p.detach() for p in training.model.parameters()]
        assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(params, opt.masters, strict=True))
        if step == 0:
            assert changed(opt.masters, masters0) > 0.99  # every master moved
            assert changed(params, params0) < 0.3  # most bf16 weights could not (measured: 16%)
    assert changed(list(training.model.parameters()), params0) > 0.6  # the updates added up (86%)
    assert changed(list(old.parameters()), params0) < 0.3  # plain bf16 AdamW stays where step 1 left it


def test_clipping_acts_on_the_fp32_grads_the_optimizer_uses() -> None:
    p = nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([p], lr=1e-3)
    p.grad = torch.full_like(p, 3.0)
    norm = opt.clip_grad_norm_(0.5)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(3.0 * 12**0.5)
    grad = opt.masters[0].grad
    assert grad is not None and grad.dtype == torch.float32
    assert torch.linalg.vector_norm(grad).item() == pytest.approx(0.5, rel=1e-6)
    assert torch.equal(p.grad, torch.full_like(p, 3.0))  # the bf16 grads are not touched
    opt.step()
    assert opt.masters[0].grad is None  # the fp32 copies live for one step only
    state = opt.state[opt.masters[0]]
    assert torch.equal(state["exp_avg"], 0.1 * grad)  # the update used the clipped fp32 grad


# ------------------------------------------------------------------------ transferred state


def test_state_round_trips_through_the_transfer_encoding_and_the_next_step_is_bitwise_identical() -> None:
    cfg = recipe("llama", "bfloat16", "optim.warmup_steps=1")
    src = build_training(cfg)
    src_session = cl.Session(
        src.model, src.optimizer, state={"scheduler": src.scheduler}, seed=cfg.train.seed
    )
    for step in range(2):
        train_step(src_session, src, *batch(cfg, seed=step))
    state = src_session._model.registry.state_dict()  # what a source sends to a replacement
    opt_state = state["optimizer"]["state"]
    assert all(opt_state[i][MASTER_KEY].dtype == torch.float32 for i in opt_state)
    # through the wire format (metadata + tensors); the receiver gets fresh copies
    meta, tensors = codec.encode_state(state)
    skeleton, _ = codec.decode_meta(meta)
    received = codec.unflatten(skeleton, [t.clone() for t in tensors])

    # the replacement built its own model from another seed: everything it has must come in the state
    dst = build_training(recipe("llama", "bfloat16", "optim.warmup_steps=1", "train.seed=1"))
    dst_session = cl.Session(
        dst.model, dst.optimizer, state={"scheduler": dst.scheduler}, seed=cfg.train.seed
    )
    assert dst_session.state_digest() != src_session.state_digest()
    dst_session._model.registry.load_state_dict(received)
    assert dst_session.step == src_session.step == 2
    assert dst_session.state_digest() == src_session.state_digest()
    assert dst.scheduler.get_last_lr() == src.scheduler.get_last_lr()

    for step in (2, 3):
        train_step(src_session, src, *batch(cfg, seed=step))
        train_step(dst_session, dst, *batch(cfg, seed=step))
        assert dst_session.state_digest() == src_session.state_digest()
    a, b = src.optimizer, dst.optimizer
    assert isinstance(a, MasterWeightAdamW) and isinstance(b, MasterWeightAdamW)
    for x, y in zip(a.masters, b.masters, strict=True):
        assert torch.equal(x, y)
    for x, y in zip(a.model_params, b.model_params, strict=True):
        assert torch.equal(x, y)

    # the digest covers the masters: one ulp in one master is a different state
    with torch.no_grad():
        b.masters[0].view(torch.int32)[0] += 1
    assert dst_session.state_digest() != src_session.state_digest()


def test_loading_refuses_a_state_without_master_weights() -> None:
    p = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    opt = MasterWeightAdamW([p])
    plain = torch.optim.AdamW([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="master"):
        opt.load_state_dict(plain.state_dict())
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][0][MASTER_KEY] = torch.zeros(3)
    with pytest.raises(ValueError, match="master weight"):
        opt.load_state_dict(bad)


# ------------------------------------------------------------------------ dry run == reality


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(TINY))
def test_dry_run_bytes_are_what_a_real_training_step_allocates(family: str, dtype: str) -> None:
    cfg = recipe(family, dtype)
    report = dry_run(cfg)
    training = build_training(cfg)
    model, opt = training.model, training.optimizer
    session = cl.Session(model, opt, state={"scheduler": training.scheduler}, seed=cfg.train.seed)
    params = list(model.parameters())  # unique: a tied embedding is one parameter
    assert sum(p.numel() for p in params) == report["params"]

    in_step: list[int] = []  # bytes of the fp32 grad copies while the optimizer steps
    if isinstance(opt, MasterWeightAdamW):
        opt.register_step_pre_hook(
            lambda *_: in_step.append(nbytes(m.grad for m in opt.masters if m.grad is not None))
        )
    train_step(session, training, *batch(cfg))

    state_tensors = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    counters = [s["step"] for s in opt.state.values()]
    assert len(state_tensors) == len(moments) + len(counters)  # nothing else in the optimizer state
    masters = opt.masters if isinstance(opt, MasterWeightAdamW) else []
    grads = [p.grad for p in params if p.grad is not None]
    assert len(grads) == len(params)
    measured = {
        "params": nbytes(params),
        "grads": nbytes(grads),
        "masters": nbytes(masters),
        "optimizer": nbytes(moments) + nbytes(masters),
    }
    assert measured["grads"] == session._model.reducer.bytes  # the grads are the reduction's buckets
    assert measured == {
        "params": report["rank_params_bytes"],
        "grads": report["rank_grads_bytes"],
        "masters": report["rank_master_bytes"],
        "optimizer": report["rank_optimizer_bytes"],
    }
    assert {t.dtype for t in state_tensors} == {torch.float32}  # fp32 moments in either dtype
    # left out of the dry run, on purpose: one fp32 scalar step counter per parameter tensor
    assert nbytes(counters) == 4 * len(params)
    if dtype == "bfloat16":
        assert in_step == [report["step_grads_bytes"]] == [4 * report["params"]]
        assert all(m.grad is None for m in masters)  # freed after the step
    else:
        assert report["step_grads_bytes"] == 0

    # what a replacement receives: model and optimizer state (a tied weight under both names)
    sent = session._model.registry.state_dict()
    _, model_tensors = codec.encode_state({"model": sent["model"]})
    _, optimizer_tensors = codec.encode_state({"optimizer": sent["optimizer"]})
    assert nbytes(model_tensors) + nbytes(optimizer_tensors) == report["recovery_bytes"] + nbytes(counters)


def test_sharded_bf16_keeps_float32_shards_and_computes_in_bf16() -> None:
    """Sharded recipes use FSDP2's mixed precision: the optimizer updates float32 shards (the
    masters, what is transferred), and every unit's forward runs on bf16 parameters."""
    from torch.distributed.tensor import DTensor

    from checkpointless.fsdp import Generation

    gen = Generation(torch.distributed.HashStore(), gen=0, prefix="bf16/", rank=0, world=1, shards=1)
    try:
        t = build_training(recipe("llama", "bfloat16"), mesh=gen.mesh)
        params = list(t.model.parameters())
        assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
        assert type(t.optimizer) is torch.optim.AdamW
        seen: set[torch.dtype] = set()
        linear = next(m for m in t.model.modules() if isinstance(m, nn.Linear))
        linear.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
        x = torch.randint(0, 64, (2, 16))
        t.model(x, x).backward()
        assert seen == {torch.bfloat16}
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in params)
    finally:
        gen.close()
