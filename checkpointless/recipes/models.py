"""Build Hugging Face causal LMs from a :class:`~checkpointless.recipes.model_config.ModelConfig`.

Models are built from a config, seeded so that every process building the same recipe gets
bitwise identical weights, or, with ``model.pretrained``, loaded from a local checkpoint
directory (``from_pretrained`` with ``local_files_only``: never a download); with
``model.lora`` the base is then frozen and a ``peft`` LoRA adapter, seeded too, is the only
thing that trains. Everything is wrapped in :class:`CausalLMWithLoss` so the training loop only
ever sees ``loss = model(inputs, targets)``. ``transformers`` and ``peft`` are imported lazily so
that importing this module (and the recipe configs) stays cheap.

The builders read a :class:`ModelConfig` by its fields only, so this module names it for the type
checker and does not import ``recipes.model_config`` at run time: ``preflight.check_lora`` builds
the recipe's model with :func:`build_hf_model`, and the import goes one way only.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from checkpointless.errors import RecipeError

if TYPE_CHECKING:
    from checkpointless.recipes.model_config import ModelConfig

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
    """Silence ``transformers``' warnings (e.g. RoPE consistency notes), its progress bars (loading
    weights) and the deprecation notes ``peft`` triggers in it while building."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _from_pretrained(cfg: ModelConfig) -> Any:
    """The ``transformers`` model of ``cfg`` with the weights of the checkpoint in ``cfg.pretrained``.

    The recipe's config (``hf_config``: eager attention, no cache, ``extra``) is the model's; the
    checkpoint supplies every weight, in fp32 (cast to the recipe's dtype by ``build_model``). A
    weight the checkpoint lacks, has in another shape, or has that the model does not use is an
    error, never a silent random initialisation (``preflight.check_pretrained`` names the usual
    causes before anything starts).
    """
    assert cfg.pretrained is not None
    model, info = _model_class(cfg).from_pretrained(
        cfg.pretrained, config=hf_config(cfg), local_files_only=True, dtype=torch.float32,
        output_loading_info=True,
    )  # fmt: skip
    for what in ("missing_keys", "mismatched_keys", "unexpected_keys"):
        bad = sorted(map(str, info.get(what) or ()))
        if bad:
            raise ValueError(
                f"model.pretrained: the checkpoint in {cfg.pretrained!r} does not fit the recipe's model "
                f"({what.replace('_', ' ')}: {', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})"
            )
    return model


def _with_lora(cfg: ModelConfig, model: nn.Module) -> nn.Module:
    """``model`` frozen, with ``cfg.lora``'s adapter (``peft.get_peft_model``): only the adapter trains.

    What ``peft`` refuses (a target that matches no module or parameter of the model) is a
    :class:`RecipeError` naming ``model.lora``, as is ``peft`` missing.
    """
    assert cfg.lora is not None
    try:
        import peft
    except ImportError:
        raise RecipeError(
            "model.lora", "needs the peft package: pip install 'checkpointless[recipes]'"
        ) from None
    with warnings.catch_warnings():
        # peft only warns when target_modules match nothing but target_parameters do: a typo
        warnings.filterwarnings("error", message=".*no module was matched", category=RuntimeWarning)
        try:
            return _as_module(peft.get_peft_model(model, peft.LoraConfig(**cfg.lora.peft_kwargs())))
        except (ValueError, RuntimeWarning) as exc:
            raise RecipeError("model.lora", " ".join(str(exc).split())) from None


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


def _settle_parameter_order(model: nn.Module) -> None:
    """Run one token through ``model`` so that its parameters are in the order training leaves them.

    ``peft`` adapts a targeted parameter (``target_parameters``) through ``torch.nn.utils.parametrize``,
    which registers the parameter anew, at the end of its module, at every forward pass: after the
    first one the order differs from a model just built (and then stays). A replacement that never
    ran a step and a survivor that ran many must list their parameters alike (the recovery's layout
    check, the replicas' digests): so every process takes that first pass here.
    """
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long))


def build_hf_model(cfg: ModelConfig, seed: int, *, device: str | torch.device | None = None) -> nn.Module:
    """Build the bare model for ``cfg`` with weights drawn from ``seed``.

    That is the ``transformers`` model for ``llama`` / ``gpt_oss`` and the project's
    ``TinyGPT`` (which already returns the loss) for ``tiny_gpt``; with ``cfg.pretrained`` the
    weights are the checkpoint's instead, and with ``cfg.lora`` the model is ``peft``'s
    ``PeftModel`` around it, whose base is frozen (``requires_grad=False``) and whose adapter
    is drawn from ``seed``. The global RNG is forked, so building a model neither depends on
    nor disturbs the caller's random state: two processes calling this with equal arguments get
    bitwise identical fp32 weights. ``device="meta"`` builds shapes only (no memory, and no
    checkpoint is read), for counting parameters of models far larger than the host.
    """
    target = torch.device(device) if device is not None else torch.device("cpu")
    with torch.random.fork_rng(devices=[]), target:
        torch.manual_seed(seed)
        if cfg.family == "tiny_gpt":
            model = _tiny_gpt(cfg)
        else:
            with _quiet_transformers():
                if cfg.pretrained is not None and target.type != "meta":
                    model = _from_pretrained(cfg)
                else:
                    model = _model_class(cfg)(hf_config(cfg))
                if cfg.lora is not None:
                    model = _with_lora(cfg, model)
                    if cfg.lora.target_parameters and target.type != "meta":
                        _settle_parameter_order(model)
    model.train()  # from_pretrained returns a model in eval mode
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

    Keys: ``total``; ``trainable`` (what the optimizer updates: ``total``, or with
    ``model.lora`` the adapter alone); ``embedding`` (input embedding and LM head; one matrix
    when tied); ``experts`` (MoE expert weights, all experts); ``active`` (parameters one token
    uses: total minus the experts it is not routed to); ``per_layer`` (the largest decoder
    layer, the unit FSDP gathers at once); ``tied`` (elements the model's ``state_dict``
    repeats because a parameter has more than one name, as tied embeddings do: counted
    once in ``total``, but ``state_dict`` and so a state transfer carry them twice);
    ``tied_trainable`` (of those, the trainable ones).
    """
    model = build_hf_model(cfg, seed=0, device="meta")
    total = embedding = experts = trainable = 0
    tied = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    tied_trainable = sum(
        p.numel() for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad
    )
    layers: dict[str, int] = {}
    for name, p in model.named_parameters():  # de-duplicates tied weights
        n = p.numel()
        total += n
        if p.requires_grad:
            trainable += n
        parts = name.split(".")
        if any(part.startswith("lora_") for part in parts):  # an adapter: none of the base's roles
            pass
        elif "embed_tokens" in parts or "lm_head" in parts or parts[0] in ("tok", "pos", "head"):
            embedding += n
        elif ".experts." in name:
            experts += n
        for marker in ("layers", "blocks"):
            if marker in parts:
                i = parts.index(marker)
                if i + 1 < len(parts) and parts[i + 1].isdigit():
                    key = ".".join(parts[: i + 2])
                    layers[key] = layers.get(key, 0) + n
                break
    tied -= total
    tied_trainable -= trainable
    active = total
    if cfg.family == "gpt_oss" and cfg.num_local_experts and cfg.num_experts_per_tok:
        active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_local_experts
    return {
        "total": total,
        "trainable": trainable,
        "embedding": embedding,
        "experts": experts,
        "active": active,
        "per_layer": max(layers.values(), default=0),
        "tied": tied,
        "tied_trainable": tied_trainable,
    }


def count_parameters(cfg: ModelConfig) -> int:
    """Number of (unique) parameters of the model ``cfg`` describes, without allocating it."""
    return parameter_breakdown(cfg)["total"]
