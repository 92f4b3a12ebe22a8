"""The training script of ``checkpointless run``: every worker and spare runs it.

``python -m checkpointless.recipes.train RECIPE.yaml [--set key=value]...``; the
launcher sets the environment that makes ``Session`` fault tolerant.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from checkpointless.protocol.env import ENV_JOB_ID, ENV_STORE
from checkpointless.protocol.vocab import Event
from checkpointless.recipes.precision import MasterWeightAdamW

if TYPE_CHECKING:
    from checkpointless.recipes.config import RecipeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def lr_lambda(step: int, warmup: int, total: int, schedule: str) -> float:
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class Training:
    """A recipe's model, the optimizer that updates it and that optimizer's LR schedule.

    ``float32``: ``torch.optim.AdamW`` on the fp32 model. ``bfloat16``: a bf16 model and
    :class:`~checkpointless.recipes.precision.MasterWeightAdamW` (fp32 master weights and
    moments; the masters are part of its ``state_dict``, so they are transferred); sharded,
    ``torch.optim.AdamW`` on fp32 shards that FSDP2 casts to bf16 for compute (``shard_model``).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    grad_clip: float | None

    def update(self) -> float:
        """The update of one step, once its grads are reduced: clip, step, advance the LR, zero grads.

        Clipping acts on the grads the optimizer uses: the fp32 model's grads, or with
        master weights their fp32 copies. Returns the learning rate this update used.
        """
        if self.grad_clip:
            if isinstance(self.optimizer, MasterWeightAdamW):
                self.optimizer.clip_grad_norm_(self.grad_clip)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=False)
        return lr


def shard_model(model: nn.Module, mesh: Any, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Apply FSDP2 on ``mesh``: each transformer layer is one unit (one all-gather in forward and
    in backward), the rest (embeddings, final norm, tied head) the root's.

    The layers are the modules whose class a ``transformers`` model lists in ``_no_split_modules``
    (``LlamaDecoderLayer``, ``GptOssDecoderLayer``) or the project's ``TinyGPT`` blocks.
    ``compute_dtype`` bfloat16: FSDP2's own mixed precision (``MixedPrecisionPolicy``): the sharded
    parameters, which the optimizer updates, stay float32 (they are the master weights), each unit
    all-gathers them as bfloat16 for its forward and backward, and gradients are reduced in float32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layer_types = {"_Block"}
    for m in model.modules():
        layer_types.update(getattr(m, "_no_split_modules", None) or ())
    for m in model.modules():
        if type(m).__name__ in layer_types and m is not model:
            fully_shard(m, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def heldout_loss(model: nn.Module, data: Any, batches: int, device: torch.device | None = None) -> float:
    """Mean loss of ``model`` over the first ``batches`` held-out batches (eval mode, no grad), on
    ``device`` (the model's: ``session.device``)."""
    model.eval()
    with torch.no_grad():
        losses = [
            model(x.to(device), y.to(device)).item()
            for x, y in (data.batch(i, 0, 1, split="val") for i in range(batches))
        ]
    model.train()
    return sum(losses) / len(losses)


def share_pass(
    model: nn.Module, data: Any, at: tuple[int, int], share: tuple[int, int], device: torch.device | None
) -> tuple[torch.Tensor, int]:
    """One share's forward and backward pass: step ``at[0]`` of ``at[1]``, share ``share[0]`` of
    ``share[1]`` (its next batches prefetched); the loss and the tokens it read."""
    (step, steps), (index, shares) = at, share
    data.prefetch(range(step + 1, min(steps, step + 3)), index, shares)
    inputs, targets = data.batch(step, index, shares)
    inputs, targets = inputs.to(device), targets.to(device)
    loss = model(inputs, targets)
    loss.backward()
    return loss, inputs.numel()


def build_training(cfg: RecipeConfig, mesh: Any = None, device: torch.device | None = None) -> Training:
    """Build the model, optimizer and LR schedule of recipe ``cfg`` (what every worker trains) on
    ``device`` (``checkpointless.local_device()``, which is ``session.device``; the CPU by default);
    with a device ``mesh``, the model is sharded on it first (``shard_model``)."""
    from checkpointless.recipes.models import build_model

    dtype = DTYPES[cfg.parallel.dtype]
    device = device or torch.device("cpu")
    if mesh is None:
        model = build_model(cfg.model, seed=cfg.train.seed, dtype=dtype).to(device)
    else:  # float32 shards (the master weights), FSDP2 computing in ``dtype`` (see shard_model)
        model = build_model(cfg.model, seed=cfg.train.seed, dtype=torch.float32).to(device)
        model = shard_model(model, mesh, dtype)
    oc = cfg.optim
    hyper: dict[str, Any] = {"lr": oc.lr, "betas": oc.betas, "eps": oc.eps, "weight_decay": oc.weight_decay}
    optimizer: torch.optim.Optimizer
    # the parameters that train: all, or with model.lora the adapter (no state, no master for the base)
    params = [p for p in model.parameters() if p.requires_grad]
    if params[0].dtype == torch.float32:  # the model's own weights are the masters
        optimizer = torch.optim.AdamW(params, **hyper)
    else:
        optimizer = MasterWeightAdamW(params, **hyper)
    steps = cfg.train.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, oc.warmup_steps, steps, oc.schedule)
    )
    return Training(model, optimizer, scheduler, oc.grad_clip)


def main(argv: list[str] | None = None) -> int:
    import checkpointless as cl
    from checkpointless.corpus import TokenDataset
    from checkpointless.corpus.cached_dataset import CachedDataset
    from checkpointless.corpus.shm_cache import ShmBatchCache
    from checkpointless.recipes.config import load_recipe
    from checkpointless.recipes.preflight import open_dataset

    p = argparse.ArgumentParser(prog="python -m checkpointless.recipes.train")
    p.add_argument("recipe")
    p.add_argument("--set", action="append", default=[], dest="overrides")
    args = p.parse_args(argv)
    cfg = load_recipe(
        args.recipe, args.overrides, check_data=False
    )  # the launcher checked; the dataset checks again
    torch.set_num_threads(1)
    if cfg.parallel.shards > 1:
        return train_sharded(cfg)
    device = cl.local_device()  # session.device: this process's GPU on a CUDA job, known before the session
    training = build_training(cfg, device=device)
    model, optimizer, scheduler = training.model, training.optimizer, training.scheduler
    steps = cfg.train.steps

    dc = cfg.data

    def dataset() -> TokenDataset:  # opened lazily: a replacement first serves batches from the node cache
        return open_dataset(cfg)

    cache = ShmBatchCache(os.environ.get(ENV_JOB_ID, f"local-{os.getpid()}"), cleanup_on_exit=False)
    data = CachedDataset(dataset, cache)

    session = cl.Session(model, optimizer, state={"scheduler": scheduler}, seed=cfg.train.seed)
    if session.rank == 0 and session.step == 0 and dc.eval_every:
        session.emit(Event.EVAL, heldout_loss=heldout_loss(model, data, dc.eval_batches, device))
    for step in session.steps(steps):
        with session.attempt() as attempt:
            tokens = 0
            for share in session.shares():  # one per replica, or more once an elastic job shrank
                loss, n = share_pass(model, data, (step, steps), (share, session.dp_size), device)
                session.log(loss=loss.item())
                tokens += n
            session.reduce_gradients()
            lr = training.update()  # clip, optimizer step, LR schedule, zero grads; the rate it used
            session.log(tokens=tokens, lr=lr)
        if not attempt.committed:
            continue  # failed and recovered: steps() yields the same step again
        if session.rank == 0 and cfg.train.log_every and (step + 1) % cfg.train.log_every == 0:
            print(
                f"step {step + 1}/{steps} loss {loss.item():.4f} lr {lr:.3e}", flush=True
            )  # into logs/w0.log
        if session.rank == 0 and dc.eval_every and ((step + 1) % dc.eval_every == 0 or step + 1 == steps):
            session.emit(Event.EVAL, heldout_loss=heldout_loss(model, data, dc.eval_batches, device))
    data.stop(timeout=5)
    session.finish()
    if session.rank == 0 and not os.environ.get(ENV_STORE):
        cache.cleanup()
    return 0


def train_sharded(cfg: RecipeConfig) -> int:
    """The loop of a sharded recipe (``parallel.shards > 1``, FSDP2 HSDP).

    The model is built again in every generation (``Session(build=...)``), so the loop reads
    ``session.model``. Evaluation gathers parameters, a collective of every rank: it runs
    inside the step's attempt, before the forward pass (so a failure in it is recovered like
    any other), and the value is the loss of the state after the step before; the event carries
    that step.
    """
    import checkpointless as cl
    from checkpointless.corpus import TokenDataset
    from checkpointless.corpus.cached_dataset import CachedDataset
    from checkpointless.corpus.shm_cache import ShmBatchCache
    from checkpointless.recipes.preflight import open_dataset

    steps, dc = cfg.train.steps, cfg.data
    device = cl.local_device()  # session.device

    def build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
        t = build_training(cfg, mesh, device)
        return t.model, t.optimizer, {"scheduler": t.scheduler}

    def dataset() -> TokenDataset:
        return open_dataset(cfg)

    cache = ShmBatchCache(os.environ.get(ENV_JOB_ID, f"local-{os.getpid()}"), cleanup_on_exit=False)
    data = CachedDataset(dataset, cache)

    session = cl.Session(build=build, seed=cfg.train.seed)
    for step in session.steps(steps):
        with session.attempt() as attempt:
            model, optimizer = session.model, session.optimizer
            assert model is not None and optimizer is not None
            scheduler = session.state["scheduler"]
            assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
            training = Training(model, optimizer, scheduler, cfg.optim.grad_clip)
            evaluated = (
                heldout_loss(model, data, dc.eval_batches, device)
                if dc.eval_every and step % dc.eval_every == 0
                else None
            )
            tokens = 0
            for share in session.shares():  # one per rank, or more once an elastic job shrank
                loss, n = share_pass(model, data, (step, steps), (share, session.dp_size), device)
                session.log(loss=loss.item())
                tokens += n
            session.reduce_gradients()
            lr = training.update()
            session.log(tokens=tokens, lr=lr)
        if not attempt.committed:
            continue
        if session.rank == 0 and evaluated is not None:
            session.emit(Event.EVAL, step=step - 1, heldout_loss=evaluated)
        if session.rank == 0 and cfg.train.log_every and (step + 1) % cfg.train.log_every == 0:
            print(f"step {step + 1}/{steps} loss {loss.item():.4f} lr {lr:.3e}", flush=True)
    data.stop(timeout=5)
    session.finish()
    if session.rank == 0 and not os.environ.get(ENV_STORE):
        cache.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
