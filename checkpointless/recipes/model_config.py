"""The recipe's ``model`` section: the architecture (:class:`ModelConfig`) and its LoRA adapter
(:class:`LoraConfig`), validated as :mod:`checkpointless.recipes.config` validates every section."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from checkpointless.errors import RecipeError
from checkpointless.recipes.field_checks import (
    require_finite,
    require_finite_tree,
    require_one_of,
    require_positive,
)

__all__ = ["ATTENTION_PROJECTIONS", "Family", "LayerType", "LoraConfig", "ModelConfig"]

Family = Literal["llama", "gpt_oss", "tiny_gpt"]
LayerType = Literal["sliding_attention", "full_attention"]


#: ``LoraConfig.target_modules``' default: the attention projections, which both families name alike.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(kw_only=True)
class LoraConfig:
    """A LoRA adapter (``peft``'s ``LoraConfig``): the base model is frozen, only the adapter trains.

    A recovery then moves the adapter and its optimizer state only: a replacement builds the same
    base (from ``model.pretrained``, or from the seed) and proves it identical by digest
    (``checkpointless.state.frozen``).
    """

    rank: int = 8
    """Rank ``r`` of the low-rank update ``B @ A`` of each targeted weight."""

    alpha: float = 16.0
    """Scale of the update: the adapter's output is multiplied by ``alpha / rank``."""

    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1)."""

    target_modules: list[str] = field(default_factory=lambda: list(ATTENTION_PROJECTIONS))
    """Names (or name suffixes) of the ``nn.Linear`` modules that get an adapter, or the single
    entry ``all-linear`` (every linear layer but the LM head)."""

    target_parameters: list[str] = field(default_factory=list)
    """Parameters (not modules) that get an adapter, by name suffix: GPT-OSS's experts are one
    tensor per layer (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``)."""

    def __post_init__(self) -> None:
        require_positive("rank", self.rank)
        require_positive("alpha", self.alpha)
        require_finite("dropout", self.dropout)
        if not 0.0 <= self.dropout < 1.0:
            raise RecipeError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules and not self.target_parameters:
            raise RecipeError("target_modules", "is empty and so is target_parameters: nothing to adapt")
        for key, names in (
            ("target_modules", self.target_modules),
            ("target_parameters", self.target_parameters),
        ):
            for i, name in enumerate(names):
                if not name:
                    raise RecipeError(f"{key}[{i}]", "must be a non-empty name")
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:
            raise RecipeError("target_modules", "'all-linear' must be the only entry")
        if self.target_parameters and self.dropout:
            raise RecipeError("dropout", "must be 0 with target_parameters (peft applies no dropout there)")

    def peft_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``peft.LoraConfig``."""
        targets: list[str] | str = (
            "all-linear" if self.target_modules == ["all-linear"] else list(self.target_modules)
        )
        return {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": targets or None,
            "target_parameters": list(self.target_parameters) or None,
        }


@dataclass(kw_only=True)
class ModelConfig:
    """Architecture of the causal language model (mapped onto a ``transformers`` config)."""

    family: Family
    """Model family: ``llama`` (LlamaForCausalLM), ``gpt_oss`` (GptOssForCausalLM, MoE) or
    ``tiny_gpt`` (the project's plain-torch ``checkpointless.models.tiny_gpt.TinyGPT``)."""

    vocab_size: int
    """Number of token ids the embedding and LM head cover (>= the tokenizer's vocabulary)."""

    hidden_size: int
    """Width of the residual stream."""

    intermediate_size: int
    """Width of the MLP (per expert for ``gpt_oss``)."""

    num_hidden_layers: int
    """Number of decoder layers."""

    num_attention_heads: int
    """Number of query heads."""

    num_key_value_heads: int | None = None
    """Number of key/value heads (grouped-query attention); ``None`` means one per query head."""

    head_dim: int | None = None
    """Per-head width; ``None`` means ``hidden_size // num_attention_heads``."""

    max_position_embeddings: int = 2048
    """Longest sequence the positional encoding supports."""

    tie_word_embeddings: bool = False
    """Share the input embedding matrix with the LM head."""

    num_local_experts: int | None = None
    """``gpt_oss`` only: number of experts per MoE layer."""

    num_experts_per_tok: int | None = None
    """``gpt_oss`` only: experts each token is routed to (top-k)."""

    sliding_window: int | None = None
    """``gpt_oss`` only: window of the sliding-attention layers, in tokens."""

    layer_types: list[LayerType] | None = None
    """``gpt_oss`` only: per-layer attention kind; ``None`` alternates sliding / full."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments passed verbatim to the ``transformers`` config class."""

    pretrained: str | None = None
    """A local directory holding a Hugging Face checkpoint of this architecture (what
    ``save_pretrained`` writes: ``config.json`` and the weights): the model starts from its
    weights (``from_pretrained``, local files only, never a download) instead of a seeded
    initialisation. Every worker and spare reads it; ``checkpointless run`` checks it first."""

    lora: LoraConfig | None = None
    """Fine-tune a LoRA adapter on the frozen model instead of the whole model (``peft``)."""

    def __post_init__(self) -> None:
        require_one_of("family", self.family, typing.get_args(Family))
        if self.family == "tiny_gpt":
            for name in ("pretrained", "lora"):
                if getattr(self, name) is not None:
                    raise RecipeError(name, "needs a transformers model family ('llama' or 'gpt_oss')")
        if self.pretrained is not None and not self.pretrained.strip():
            raise RecipeError("pretrained", "must be a directory path (or left out)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            require_positive(name, getattr(self, name))
        require_positive("num_attention_heads", self.num_attention_heads)
        require_positive("max_position_embeddings", self.max_position_embeddings)
        require_positive("num_key_value_heads", self.num_key_value_heads, allow_none=True)
        require_positive("head_dim", self.head_dim, allow_none=True)
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise RecipeError(
                "hidden_size",
                f"{self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
                " (set head_dim explicitly if that is intended)",
            )
        kv = self.kv_heads
        if self.num_attention_heads % kv:
            raise RecipeError(
                "num_key_value_heads",
                f"num_attention_heads={self.num_attention_heads} is not divisible by {kv}",
            )
        moe_fields = ("num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types")
        if self.family == "gpt_oss":
            require_positive("num_local_experts", self.num_local_experts)
            require_positive("num_experts_per_tok", self.num_experts_per_tok)
            assert self.num_local_experts is not None and self.num_experts_per_tok is not None
            if self.num_experts_per_tok > self.num_local_experts:
                raise RecipeError(
                    "num_experts_per_tok",
                    f"{self.num_experts_per_tok} exceeds num_local_experts={self.num_local_experts}",
                )
            require_positive("sliding_window", self.sliding_window, allow_none=True)
            if self.layer_types is not None:
                if len(self.layer_types) != self.num_hidden_layers:
                    raise RecipeError(
                        "layer_types",
                        f"has {len(self.layer_types)} entries, expected num_hidden_layers={self.num_hidden_layers}",
                    )
                for i, kind in enumerate(self.layer_types):
                    require_one_of(f"layer_types[{i}]", kind, typing.get_args(LayerType))
                if "sliding_attention" in self.layer_types and self.sliding_window is None:
                    raise RecipeError("sliding_window", "is required when layer_types has sliding_attention")
        else:
            for name in moe_fields:
                if getattr(self, name) is not None:
                    raise RecipeError(name, f"is only supported for family 'gpt_oss', not {self.family!r}")
        if self.family == "tiny_gpt":
            self._check_tiny_gpt()
        if not isinstance(self.extra, Mapping):
            raise RecipeError("extra", f"must be a mapping, got {type(self.extra).__name__}")
        require_finite_tree("extra", self.extra)
        own = {f.name for f in dataclasses.fields(self)}
        for key in self.extra:
            if key in own:
                raise RecipeError(f"extra.{key}", f"duplicates model.{key}; set it there instead")

    def _check_tiny_gpt(self) -> None:
        """``tiny_gpt`` is the project's own ``TinyGPT``: check what it cannot express."""
        if self.kv_heads != self.num_attention_heads:
            raise RecipeError("num_key_value_heads", "tiny_gpt has no grouped-query attention")
        if self.head_dim is not None:
            raise RecipeError("head_dim", "tiny_gpt derives it as hidden_size // num_attention_heads")
        if self.intermediate_size != 4 * self.hidden_size:
            raise RecipeError(
                "intermediate_size", f"tiny_gpt's MLP is 4 x hidden_size = {4 * self.hidden_size}"
            )
        if self.tie_word_embeddings:
            raise RecipeError("tie_word_embeddings", "tiny_gpt does not tie its embeddings")
        for key in self.extra:
            if key != "dropout":
                raise RecipeError(f"extra.{key}", "tiny_gpt only accepts extra.dropout")

    @property
    def kv_heads(self) -> int:
        """Effective number of key/value heads."""
        return self.num_key_value_heads or self.num_attention_heads
