"""Build Hugging Face causal LMs from a :class:`~checkpointless.recipes.config.ModelConfig`.

Models are built from a config alone (no download, no pretrained weights), seeded so that
every process building the same recipe gets bitwise identical weights, and wrapped in
:class:`CausalLMWithLoss` so the training loop only ever sees ``loss = model(inputs,
targets)``. ``transformers`` is imported lazily so that importing this module (and the
recipe configs) stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from checkpointless.recipes.config import ModelConfig

__all__ = [
    "CausalLMWithLoss",
    "build_hf_model",
    "build_model",
    "count_parameters",
    "hf_config",
    "parameter_breakdown",
]

#: Loss-ignored target id (matches ``torch.nn.functional.cross_entropy``'s default).
IGNORE_INDEX = -100


def hf_config(cfg: ModelConfig) -> Any:
    """Translate a ``llama`` / ``gpt_oss`` ``cfg`` into its ``transformers`` config object.

    Attention (and, for MoE, the expert dispatch) use the ``eager`` implementations: plain
    PyTorch ops that run on CPU and are deterministic. Dropout is off unless ``extra``
    turns it on. ``cfg.extra`` is passed through last and so wins over these defaults.
    """
    import transformers

    if cfg.family == "tiny_gpt":
        raise ValueError("model.family: tiny_gpt is not a transformers model (see build_model)")
    kwargs: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": False,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_dropout": 0.0,
    }
    if cfg.head_dim is not None:
        kwargs["head_dim"] = cfg.head_dim
    config: Any
    if cfg.family == "llama":
        config = transformers.LlamaConfig(**{**kwargs, **cfg.extra})
    else:
        kwargs.update(
            num_local_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            sliding_window=cfg.sliding_window,
            layer_types=list(cfg.layer_types) if cfg.layer_types is not None else None,
        )
        config = transformers.GptOssConfig(**{**kwargs, **cfg.extra})
    config._attn_implementation = "eager"
    if cfg.family == "gpt_oss":
        config._experts_implementation = "eager"
    return config


def _model_class(cfg: ModelConfig) -> Any:
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "gpt_oss": transformers.GptOssForCausalLM,
    }[cfg.family]


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence ``transformers``' warnings (e.g. RoPE consistency notes) while building."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _tiny_gpt(cfg: ModelConfig) -> nn.Module:
    from checkpointless.models.tiny_gpt import GPTConfig, TinyGPT

    gpt = GPTConfig(
        vocab_size=cfg.vocab_size,
        seq_len=cfg.max_position_embeddings,
        d_model=cfg.hidden_size,
        n_layer=cfg.num_hidden_layers,
        n_head=cfg.num_attention_heads,
        dropout=float(cfg.extra.get("dropout", 0.0)),
    )
    return TinyGPT(gpt)


def build_hf_model(cfg: ModelConfig, seed: int, *, device: str | torch.device | None = None) -> nn.Module:
    """Build the bare model for ``cfg`` with weights drawn from ``seed``.

    That is the ``transformers`` model for ``llama`` / ``gpt_oss`` and the project's
    ``TinyGPT`` (which already returns the loss) for ``tiny_gpt``. The global RNG is
    forked, so building a model neither depends on nor disturbs the caller's random
    state: two processes calling this with equal arguments get bitwise identical fp32
    weights. ``device="meta"`` builds shapes only (no memory), for counting parameters of
    models far larger than the host.
    """
    target = torch.device(device) if device is not None else torch.device("cpu")
    with torch.random.fork_rng(devices=[]), target:
        torch.manual_seed(seed)
        if cfg.family == "tiny_gpt":
            model = _tiny_gpt(cfg)
        else:
            config = hf_config(cfg)
            with _quiet_transformers():
                model = _model_class(cfg)(config)
    model.train()
    return _as_module(model)


def _as_module(model: Any) -> nn.Module:
    """Return ``model`` typed as :class:`torch.nn.Module` (transformers is untyped)."""
    assert isinstance(model, nn.Module)
    return model


class CausalLMWithLoss(nn.Module):
    """Wrap a causal LM so that ``forward(inputs, targets)`` returns the scalar training loss.

    ``targets`` are aligned with ``inputs`` (already shifted by the data pipeline:
    ``targets[:, t]`` is the token after ``inputs[:, t]``); positions equal to ``-100``
    are ignored. The loss is the mean token cross-entropy over the vocabulary, computed in
    fp32. For MoE models whose config enables ``output_router_logits``, the router
    load-balancing loss is added with the config's ``router_aux_loss_coef``.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """Next-token logits of shape ``(batch, seq, vocab)``."""
        return _as_tensor(self.model(input_ids=inputs, use_cache=False).logits)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``targets`` under the model given ``inputs`` (both ``(B, T)``)."""
        if inputs.shape != targets.shape:
            raise ValueError(
                f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in shape"
            )
        out = self.model(input_ids=inputs, use_cache=False)
        logits = out.logits
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
        aux = getattr(out, "aux_loss", None)
        if aux is not None:
            coef = float(getattr(self.model.config, "router_aux_loss_coef", 0.0))
            loss = loss + coef * aux.float()
        return loss


def _as_tensor(value: Any) -> torch.Tensor:
    """Return ``value`` typed as a tensor."""
    assert isinstance(value, torch.Tensor)
    return value


def build_model(cfg: ModelConfig, seed: int, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build the recipe's model on CPU, seeded, so that ``loss = model(inputs, targets)``.

    ``llama`` / ``gpt_oss`` come wrapped in :class:`CausalLMWithLoss`; ``tiny_gpt`` is the
    project's ``TinyGPT``, which has that interface natively. Weights are initialised in
    fp32 from ``seed`` (bitwise identical across processes) and then cast to ``dtype``.

    Only the parameters are cast: buffers keep the dtype the model gave them (the rotary
    embeddings' ``inv_freq`` stays fp32, as ``transformers`` keeps it when it loads a
    model in bf16; rounding it to bf16 would shift the RoPE phases of far positions).
    """
    model = build_hf_model(cfg, seed)
    if dtype != torch.float32:
        with torch.no_grad():
            for p in model.parameters():  # each parameter once, tied ones included
                if p.is_floating_point():
                    p.data = p.data.to(dtype)
    return model if cfg.family == "tiny_gpt" else CausalLMWithLoss(model)


def parameter_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts by role, from a meta-device build (no memory is allocated).

    Keys: ``total``; ``embedding`` (input embedding and LM head; one matrix when tied);
    ``experts`` (MoE expert weights, all experts); ``active`` (parameters one token uses:
    total minus the experts it is not routed to); ``per_layer`` (the largest decoder
    layer, the unit FSDP gathers at once); ``tied`` (elements the model's ``state_dict``
    repeats because a parameter has more than one name, as tied embeddings do: counted
    once in ``total``, but ``state_dict`` and so a state transfer carry them twice).
    """
    model = build_hf_model(cfg, seed=0, device="meta")
    total = embedding = experts = 0
    tied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    layers: dict[str, int] = {}
    for name, p in model.named_parameters():  # de-duplicates tied weights
        n = p.numel()
        total += n
        parts = name.split(".")
        if "embed_tokens" in parts or parts[0] in ("lm_head", "tok", "pos", "head"):
            embedding += n
        if ".experts." in name:
            experts += n
        for marker in ("layers", "blocks"):
            if marker in parts:
                i = parts.index(marker)
                if i + 1 < len(parts) and parts[i + 1].isdigit():
                    key = ".".join(parts[: i + 2])
                    layers[key] = layers.get(key, 0) + n
                break
    tied -= total
    active = total
    if cfg.family == "gpt_oss" and cfg.num_local_experts and cfg.num_experts_per_tok:
        active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_local_experts
    return {
        "total": total,
        "embedding": embedding,
        "experts": experts,
        "active": active,
        "per_layer": max(layers.values(), default=0),
        "tied": tied,
    }


def count_parameters(cfg: ModelConfig) -> int:
    """Number of (unique) parameters of the model ``cfg`` describes, without allocating it."""
    return parameter_breakdown(cfg)["total"]
