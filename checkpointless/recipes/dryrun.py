"""Dry-run a recipe: parameter count, per-rank memory for the training state, recovery traffic.

Nothing is allocated: the model is built on PyTorch's ``meta`` device, so a 120B-parameter
recipe is sized in about a second on a laptop.

Memory model (per rank, model state only; activations, temporary buffers and the
communication buckets are not included):

* ``float32``: params 4 B, grads 4 B, AdamW moments 2 x 4 B per parameter.
* ``bfloat16``: params 2 B, grads 2 B, AdamW moments 2 x 4 B plus fp32 master weights 4 B
  (``checkpointless.recipes.precision.MasterWeightAdamW``). During the optimizer step it
  also holds an fp32 copy of the grads, 4 B per parameter, freed when the step ends
  (reported as the transient ``fp32 grads in step``).
* ``bfloat16`` sharded (``shards > 1``): FSDP2's mixed precision. The shards are fp32 and are
  the master weights (params 4 B, grads reduced in fp32 4 B, AdamW moments 2 x 4 B); each
  unit is all-gathered in bf16 for compute (the transient ``gathered layer``, 2 B per
  parameter of a layer).

These are the bytes of the tensors a recipe really allocates (``tests/unit/test_precision.py``
counts them after a real step). AdamW also keeps one fp32 scalar step counter per parameter
tensor, a few KB, which is left out.

With FSDP shard degree ``shards`` every rank holds ``1 / shards`` of all of that;
``replicas = workers / shards`` ranks hold each shard. During forward/backward FSDP also
gathers one full decoder layer at a time (reported as the transient ``gathered layer``).

With ``model.lora`` the base is frozen: its parameters are held (in the dtype above) but have no
grads and no optimizer state (``build_training`` gives the optimizer the adapter alone); the
adapter's parameters have all three.

Recovery: a spare that replaces a failed rank receives that rank's shard of the params and
optimizer state (master weights and moments) from the rank holding the same shard in a
healthy replica. Frozen parameters the spare built alike (a LoRA base, from the same
checkpoint or seed) are compared by digest and not moved (``checkpointless.state.frozen``):
with ``model.lora`` only the adapter and its optimizer state travel (``recovery_kept_bytes``
is the base the spare keeps). Gradients are not moved: recovery happens at a step boundary, where they
are recomputed. A tied parameter (input embedding = LM head) is moved once per name, as
the model's ``state_dict`` lists it (``recovery_bytes`` counts that too). The bytes moved
therefore depend only on the model and ``shards``, not on the number of workers. With a
single replica there is no donor and the state is lost.

The command ``checkpointless dryrun RECIPE.yaml [--set key=value ...]`` prints it.
"""

from __future__ import annotations

from typing import Any

from checkpointless.recipes.config import RecipeConfig

__all__ = [
    "compute_bytes_per_param",
    "dry_run",
    "format_dry_run",
    "master_bytes_per_param",
    "state_bytes_per_param",
]

GIB = 1024**3


def state_bytes_per_param(dtype: str, shards: int = 1) -> dict[str, int]:
    """Bytes per parameter of each part of the training state under ``dtype``.

    Keys: ``params``, ``grads``, ``optimizer`` (AdamW moments, plus fp32 master weights
    when a replicated model runs in bf16; sharded, the fp32 shards are the masters).
    """
    if dtype == "float32" or (dtype == "bfloat16" and shards > 1):
        return {"params": 4, "grads": 4, "optimizer": 8}
    if dtype == "bfloat16":
        return {"params": 2, "grads": 2, "optimizer": 8 + 4}
    raise ValueError(f"parallel.dtype: unsupported dtype {dtype!r}")


def master_bytes_per_param(dtype: str, shards: int = 1) -> int:
    """Bytes per parameter of the separate fp32 master weights (part of ``optimizer``): 4 for a
    replicated bf16 model, else 0. The fp32 grad copy that exists only during the optimizer step
    has the same size.
    """
    state_bytes_per_param(dtype)  # validates the dtype
    return 4 if dtype == "bfloat16" and shards == 1 else 0


def compute_bytes_per_param(dtype: str) -> int:
    """Bytes per parameter of the weights the forward and backward passes use (a gathered layer)."""
    return 2 if dtype == "bfloat16" else 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def dry_run(cfg: RecipeConfig) -> dict[str, Any]:
    """Size the recipe without allocating it.

    Returns a flat dict: parameter counts (``params``, ``active_params``,
    ``embedding_params``, ``expert_params``, ``layer_params``), the layout (``workers``,
    ``spares``, ``shards``, ``replicas``, ``world_size``, ``micro_batch``,
    ``tokens_per_step``), per-rank bytes (``rank_params_bytes``, ``rank_grads_bytes``,
    ``rank_optimizer_bytes``, of which ``rank_master_bytes`` are fp32 master weights,
    ``trainable_params`` (the adapter with ``model.lora``, else ``params``), ``lora`` (whether),
    ``rank_total_bytes``; transient: ``gathered_layer_bytes``, ``step_grads_bytes`` the fp32
    grad copy during a master-weight optimizer step), totals
    (``replica_state_bytes``: one full copy of params+grads+optimizer state;
    ``cluster_state_bytes``: all replicas), recovery (``recovery_bytes``: what one failed
    rank's replacement receives, params and optimizer state, a tied parameter under each
    of its names; ``recovery_kept_bytes``: frozen parameters the replacement holds alike and so
    keeps; ``recovery_donors``: healthy ranks holding that shard; ``recoverable``) and
    ``approx_flops_per_step`` (6 x active params x tokens).
    """
    from checkpointless.recipes.models import parameter_breakdown

    counts = parameter_breakdown(cfg.model)
    par = cfg.parallel
    per_param = state_bytes_per_param(par.dtype, par.shards)
    n, trained = counts["total"], counts["trainable"]
    shard_params = _ceil_div(n, par.shards)  # FSDP pads the flat parameter to a multiple of shards
    shard_trained = _ceil_div(trained, par.shards)  # frozen parameters have no grads, no optimizer state
    rank = {
        "params": shard_params * per_param["params"],
        "grads": shard_trained * per_param["grads"],
        "optimizer": shard_trained * per_param["optimizer"],
    }
    master = shard_trained * master_bytes_per_param(par.dtype, par.shards)
    # a tied parameter is sent again under its 2nd name; a frozen one (and its 2nd name) is kept
    tied = _ceil_div(counts["tied_trainable"], par.shards) * per_param["params"]
    kept = (
        shard_params - shard_trained + _ceil_div(counts["tied"] - counts["tied_trainable"], par.shards)
    ) * (per_param["params"])
    rank_total = sum(rank.values())
    return {
        "name": cfg.name,
        "family": cfg.model.family,
        "dtype": par.dtype,
        "params": n,
        "trainable_params": trained,
        "lora": cfg.model.lora is not None,
        "active_params": counts["active"],
        "embedding_params": counts["embedding"],
        "expert_params": counts["experts"],
        "layer_params": counts["per_layer"],
        "workers": par.workers,
        "spares": par.spares,
        "shards": par.shards,
        "replicas": par.replicas,
        "world_size": par.world_size,
        "micro_batch": cfg.micro_batch,
        "tokens_per_step": cfg.tokens_per_step,
        "bytes_per_param": per_param,
        "rank_params_bytes": rank["params"],
        "rank_grads_bytes": rank["grads"],
        "rank_optimizer_bytes": rank["optimizer"],
        "rank_master_bytes": master,
        "rank_total_bytes": rank_total,
        "gathered_layer_bytes": counts["per_layer"] * compute_bytes_per_param(par.dtype)
        if par.shards > 1
        else 0,
        "step_grads_bytes": master,  # fp32 grad copies, same size as the masters
        "replica_state_bytes": rank_total * par.shards,
        "cluster_state_bytes": rank_total * par.workers,
        "recovery_bytes": shard_trained * per_param["params"] + tied + rank["optimizer"],
        "recovery_kept_bytes": kept,
        "recovery_donors": par.replicas - 1,
        "recoverable": par.replicas > 1,
        "approx_flops_per_step": 6 * counts["active"] * cfg.tokens_per_step,
    }


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _gib(b: int) -> str:
    return f"{b / GIB:,.2f} GiB" if b >= GIB or b == 0 else f"{b / 1024**2:,.2f} MiB"


def _flops(f: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if f >= scale:
            return f"{f / scale:,.1f} {unit}"
    return f"{f / 1e6:,.1f} MFLOP"


def format_dry_run(report: dict[str, Any]) -> str:
    """Render a :func:`dry_run` report as a human-readable table."""
    bpp = report["bytes_per_param"]
    trained = "adapter param" if report["lora"] else "param"
    rows: list[tuple[str, str]] = [
        ("recipe", f"{report['name']} ({report['family']}, {report['dtype']})"),
        ("parameters", f"{_count(report['params'])} ({report['params']:,})"),
    ]
    if report["expert_params"]:
        rows.append(("  active per token", _count(report["active_params"])))
        rows.append(("  in experts", _count(report["expert_params"])))
    rows.append(("  embeddings + head", _count(report["embedding_params"])))
    if report["lora"]:
        share = report["trainable_params"] / report["params"]
        rows.append(
            (
                "  LoRA adapter",
                f"{_count(report['trainable_params'])} trainable ({share:.2%}); the base is frozen",
            )
        )
    rows += [
        (
            "layout",
            f"{report['workers']} workers = {report['replicas']} replicas x {report['shards']} shards"
            f", + {report['spares']} spares",
        ),
        ("batch", f"{report['micro_batch']} seq/worker, {report['tokens_per_step']:,} tokens/step"),
        ("compute", f"~{_flops(report['approx_flops_per_step'])}/step (6 x active x tokens)"),
        ("per rank: params", f"{_gib(report['rank_params_bytes'])}  ({bpp['params']} B/param / shards)"),
        ("per rank: grads", f"{_gib(report['rank_grads_bytes'])}  ({bpp['grads']} B/{trained} / shards)"),
        (
            "per rank: AdamW state",
            f"{_gib(report['rank_optimizer_bytes'])}  ({bpp['optimizer']} B/{trained} / shards"
            + (", incl. fp32 master)" if report["rank_master_bytes"] else ")"),
        ),
        ("per rank: total", _gib(report["rank_total_bytes"])),
    ]
    if report["gathered_layer_bytes"]:
        rows.append(
            ("  + gathered layer", f"{_gib(report['gathered_layer_bytes'])} transient (FSDP all-gather)")
        )
    if report["step_grads_bytes"]:
        rows.append(
            ("  + fp32 grads in step", f"{_gib(report['step_grads_bytes'])} transient (optimizer step only)")
        )
    rows += [
        ("one replica", _gib(report["replica_state_bytes"])),
        ("whole cluster", _gib(report["cluster_state_bytes"])),
        (
            "recovery moves",
            f"{_gib(report['recovery_bytes'])} per failed rank ("
            + (
                "adapter + its AdamW shard; the frozen base, "
                + _gib(report["recovery_kept_bytes"])
                + ", is checked by digest, not moved"
                if report["lora"]
                else "params + AdamW shard"
            )
            + ")"
            + (
                f", from any of {report['recovery_donors']} donor(s)"
                if report["recoverable"]
                else "; NO healthy replica (replicas = 1): state would be lost"
            ),
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
