"""Typed training recipes: the schema of a recipe YAML file, as validated dataclasses.

A recipe is a YAML file with the sections ``model``, ``data``, ``optim``, ``parallel``,
``train`` and ``recovery`` plus a top-level ``name``. :func:`load_recipe` turns it
into a :class:`RecipeConfig`, checking every key and type on the way and naming the dotted
key (``optim.lr``) and the file in every error, so a typo never silently falls back to a
default. ``--set``-style overrides (``"optim.lr=1e-3"``) are applied to the raw YAML
before validation, so they go through exactly the same checks.

This module is the schema; reading YAML safely (alias, size and depth limits: see
:data:`MAX_YAML_NODES`, :data:`MAX_YAML_DEPTH`) is :mod:`checkpointless.recipes.safe_yaml`, the
strict type checks and the overrides the schema-free :mod:`checkpointless.recipes.loader`.

Every dataclass validates its own values in ``__post_init__`` and raises
:class:`RecipeError` (a :class:`ValueError`) naming the offending field, so configs built
directly in Python are checked too. Float fields must be finite (``.nan``/``.inf`` are
refused).

With ``check_data`` (the default, and what ``checkpointless run`` uses before launching
anything), :func:`load_recipe` also opens the corpus exactly as every worker will, so a
missing or empty ``data.source``, an invalid JSONL line, a corpus too short for one
``seq_len + 1`` window per split or a damaged token cache is reported up front, as one
:class:`RecipeError` naming ``data.source``; likewise a ``model.pretrained`` directory that is
missing, holds no Hugging Face checkpoint, or holds one of another architecture than the recipe
says (:func:`check_pretrained`), naming the ``model.`` key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from checkpointless.config import RecoveryConfig
from checkpointless.corpus import BYTE_VOCAB_SIZE  # 256 byte values + end-of-document
from checkpointless.errors import RecipeError
from checkpointless.recipes import loader, safe_yaml
from checkpointless.recipes.safe_yaml import MAX_YAML_DEPTH, MAX_YAML_NODES

if TYPE_CHECKING:
    from checkpointless.corpus import TokenDataset

__all__ = [
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RecipeConfig",
    "RecipeError",
    "TrainConfig",
    "apply_overrides",
    "check_lora",
    "check_pretrained",
    "check_recipe_data",
    "load_recipe",
    "open_dataset",
    "recipe_from_dict",
]

Family = Literal["llama", "gpt_oss", "tiny_gpt"]
Tokenizer = Literal["byte", "bpe"]
Schedule = Literal["constant", "cosine"]
DType = Literal["float32", "bfloat16"]
Backend = Literal["gloo", "nccl"]
Device = Literal["cpu", "cuda"]
LayerType = Literal["sliding_attention", "full_attention"]


def _choice(key: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise RecipeError(key, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _positive(key: str, value: float | None, *, allow_none: bool = False, allow_zero: bool = False) -> None:
    if value is None:
        if not allow_none:
            raise RecipeError(key, "is required")
        return
    _finite(key, value)
    if value < 0 or (value == 0 and not allow_zero):
        raise RecipeError(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _finite(key: str, value: object) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(key, f"must be a finite number, got {value!r}")


def _finite_tree(key: str, value: object) -> None:
    """``_finite`` on every float in a (nested) mapping or list, naming the dotted key."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _finite_tree(f"{key}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _finite_tree(f"{key}[{i}]", v)
    else:
        _finite(key, value)


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
        _positive("rank", self.rank)
        _positive("alpha", self.alpha)
        _finite("dropout", self.dropout)
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
        _choice("family", self.family, typing.get_args(Family))
        if self.family == "tiny_gpt":
            for name in ("pretrained", "lora"):
                if getattr(self, name) is not None:
                    raise RecipeError(name, "needs a transformers model family ('llama' or 'gpt_oss')")
        if self.pretrained is not None and not self.pretrained.strip():
            raise RecipeError("pretrained", "must be a directory path (or left out)")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            _positive(name, getattr(self, name))
        _positive("num_attention_heads", self.num_attention_heads)
        _positive("max_position_embeddings", self.max_position_embeddings)
        _positive("num_key_value_heads", self.num_key_value_heads, allow_none=True)
        _positive("head_dim", self.head_dim, allow_none=True)
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
            _positive("num_local_experts", self.num_local_experts)
            _positive("num_experts_per_tok", self.num_experts_per_tok)
            assert self.num_local_experts is not None and self.num_experts_per_tok is not None
            if self.num_experts_per_tok > self.num_local_experts:
                raise RecipeError(
                    "num_experts_per_tok",
                    f"{self.num_experts_per_tok} exceeds num_local_experts={self.num_local_experts}",
                )
            _positive("sliding_window", self.sliding_window, allow_none=True)
            if self.layer_types is not None:
                if len(self.layer_types) != self.num_hidden_layers:
                    raise RecipeError(
                        "layer_types",
                        f"has {len(self.layer_types)} entries, expected num_hidden_layers={self.num_hidden_layers}",
                    )
                for i, kind in enumerate(self.layer_types):
                    _choice(f"layer_types[{i}]", kind, typing.get_args(LayerType))
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
        _finite_tree("extra", self.extra)
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


@dataclass(kw_only=True)
class DataConfig:
    """Where training text comes from and how it is cut into batches."""

    source: str = "stdlib"
    """``stdlib`` (the Python standard library's own source files, always present) or a
    directory of text files (``.txt``, ``.md``, ``.py``; ``.jsonl`` with a ``"text"`` field)."""

    tokenizer: Tokenizer = "byte"
    """``byte`` (one token per UTF-8 byte, vocabulary 256) or ``bpe`` (trained on the data)."""

    vocab_size: int | None = None
    """Vocabulary size of the ``bpe`` tokenizer (required for ``bpe``, unused for ``byte``)."""

    seq_len: int = 128
    """Tokens per training sequence."""

    global_batch: int = 16
    """Sequences per optimizer step summed over all workers."""

    heldout_fraction: float = 0.05
    """Fraction of the corpus held out for evaluation, in [0, 1)."""

    eval_every: int = 0
    """Evaluate every this many steps; 0 disables evaluation."""

    eval_batches: int = 4
    """Batches averaged per evaluation."""

    def __post_init__(self) -> None:
        if not self.source:
            raise RecipeError("source", "must be 'stdlib' or a directory path")
        _choice("tokenizer", self.tokenizer, typing.get_args(Tokenizer))
        if self.tokenizer == "bpe":
            _positive("vocab_size", self.vocab_size)
            assert self.vocab_size is not None
            if self.vocab_size <= BYTE_VOCAB_SIZE:
                raise RecipeError("vocab_size", f"a bpe vocabulary needs > {BYTE_VOCAB_SIZE} ids")
        elif self.vocab_size not in (None, BYTE_VOCAB_SIZE):
            raise RecipeError(
                "vocab_size", f"the byte tokenizer has {BYTE_VOCAB_SIZE} ids, got {self.vocab_size}"
            )
        _positive("seq_len", self.seq_len)
        _positive("global_batch", self.global_batch)
        _finite("heldout_fraction", self.heldout_fraction)
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise RecipeError("heldout_fraction", f"must be in [0, 1), got {self.heldout_fraction!r}")
        _positive("eval_every", self.eval_every, allow_zero=True)
        _positive("eval_batches", self.eval_batches)
        if self.eval_every and self.heldout_fraction == 0.0:
            raise RecipeError("heldout_fraction", "is 0 but eval_every > 0 needs held-out data")

    @property
    def tokenizer_vocab_size(self) -> int:
        """Number of ids the tokenizer can emit."""
        return BYTE_VOCAB_SIZE if self.tokenizer == "byte" else int(self.vocab_size or 0)

    @property
    def is_stdlib(self) -> bool:
        """Whether the corpus is the bundled standard-library source."""
        return self.source == "stdlib"


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    name: Literal["adamw"] = "adamw"
    """Optimizer; only ``adamw`` is supported."""

    lr: float = 3e-4
    """Peak learning rate."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment decay rates, each in [0, 1)."""

    weight_decay: float = 0.1
    """Decoupled weight decay."""

    eps: float = 1e-8
    """AdamW denominator epsilon."""

    warmup_steps: int = 0
    """Linear warm-up steps from 0 to ``lr``."""

    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; ``None`` disables clipping."""

    schedule: Schedule = "cosine"
    """After warm-up: ``constant``, or ``cosine`` decay from ``lr`` to ``0.1 * lr`` at the last step."""

    def __post_init__(self) -> None:
        _choice("name", self.name, ("adamw",))
        _positive("lr", self.lr)
        if len(self.betas) != 2:
            raise RecipeError("betas", f"must have two entries, got {len(self.betas)}")
        for i, beta in enumerate(self.betas):
            _finite(f"betas[{i}]", beta)
            if not 0.0 <= beta < 1.0:
                raise RecipeError(f"betas[{i}]", f"must be in [0, 1), got {beta!r}")
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("eps", self.eps)
        _positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("grad_clip", self.grad_clip, allow_none=True)
        _choice("schedule", self.schedule, typing.get_args(Schedule))


@dataclass(kw_only=True)
class ParallelConfig:
    """How the job is laid out over processes.

    ``workers`` ranks train; they form ``replicas = workers // shards`` copies of the
    model state, each FSDP-sharded ``shards`` ways (``shards = 1`` is plain DDP). Every
    worker consumes its own slice of the global batch. ``spares`` extra processes wait
    idle and take over a failed worker's shard, copied from a healthy replica.
    """

    workers: int = 2
    """Active training ranks."""

    spares: int = 0
    """Hot-spare ranks kept idle for recovery."""

    shards: int = 1
    """FSDP shard degree (ranks that split one copy of the state); 1 = DDP."""

    dtype: DType = "float32"
    """Parameter / compute dtype; ``bfloat16`` keeps fp32 master weights in the optimizer."""

    backend: Backend = "gloo"
    """Data plane: ``gloo`` or ``nccl`` (CUDA only; control messages then run on a gloo group
    beside it). The ``--backend`` of ``checkpointless demo`` and ``launch``."""

    device: Device | None = None
    """Where the ranks train: ``cuda`` (each process on ``cuda:<its slot on the host>``) or ``cpu``;
    unset: ``cuda`` with ``backend: nccl``, else ``cpu``."""

    def __post_init__(self) -> None:
        _positive("workers", self.workers)
        _positive("spares", self.spares, allow_zero=True)
        _positive("shards", self.shards)
        if self.workers % self.shards:
            raise RecipeError(
                "shards",
                f"shards={self.shards} does not divide workers={self.workers} (replicas x shards ranks)",
            )
        _choice("dtype", self.dtype, typing.get_args(DType))
        _choice("backend", self.backend, typing.get_args(Backend))
        if self.device is not None:
            _choice("device", self.device, typing.get_args(Device))
        if self.backend == "nccl" and self.device == "cpu":
            raise RecipeError(
                "device", "cpu cannot train with backend 'nccl' (NCCL carries CUDA tensors only)"
            )

    @property
    def device_type(self) -> str:
        """``cpu`` or ``cuda``: ``device``, or the backend's (``JobConfig.device_type``)."""
        return self.device or ("cuda" if self.backend == "nccl" else "cpu")

    @property
    def replicas(self) -> int:
        """Number of full copies of the model state (``workers // shards``)."""
        return self.workers // self.shards

    @property
    def world_size(self) -> int:
        """All processes, workers plus spares."""
        return self.workers + self.spares


@dataclass(kw_only=True)
class TrainConfig:
    """Length and bookkeeping of the run."""

    steps: int = 100
    """Optimizer steps to run."""

    seed: int = 0
    """Seed for model init and data order (identical on every rank)."""

    log_every: int = 10
    """Rank 0 prints the step, loss and learning rate to its log (``logs/w0.log``) every this many steps."""

    def __post_init__(self) -> None:
        _positive("steps", self.steps)
        _positive("seed", self.seed, allow_zero=True)
        _positive("log_every", self.log_every)


@dataclass(kw_only=True)
class RecipeConfig:
    """A complete training recipe."""

    name: str
    """Human-readable recipe name (used for run directories and logs)."""

    model: ModelConfig
    """Model architecture."""

    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and batch shape."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Process layout."""

    train: TrainConfig = field(default_factory=TrainConfig)
    """Run length, seed, logging."""

    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """Every recovery setting (``checkpointless.RecoveryConfig``: detection timeouts, consistency
    checks, the durable tier); ``--hang-timeout`` and the other flags override them."""

    def __post_init__(self) -> None:
        if not self.name:
            raise RecipeError("name", "must be a non-empty string")
        data, par, model = self.data, self.parallel, self.model
        if data.global_batch % par.workers:
            raise RecipeError(
                "data.global_batch",
                f"{data.global_batch} is not divisible by parallel.workers={par.workers} "
                f"(every worker, across {par.replicas} replica(s) x {par.shards} shard(s), takes an equal slice)",
            )
        if data.seq_len > model.max_position_embeddings:
            raise RecipeError(
                "data.seq_len",
                f"{data.seq_len} exceeds model.max_position_embeddings={model.max_position_embeddings}",
            )
        if data.tokenizer_vocab_size > model.vocab_size:
            raise RecipeError(
                "model.vocab_size",
                f"{model.vocab_size} is smaller than the {data.tokenizer} tokenizer's "
                f"{data.tokenizer_vocab_size} ids (data.tokenizer / data.vocab_size)",
            )
        if self.optim.warmup_steps > self.train.steps:
            raise RecipeError(
                "optim.warmup_steps", f"{self.optim.warmup_steps} exceeds train.steps={self.train.steps}"
            )

    @property
    def micro_batch(self) -> int:
        """Sequences each worker processes per step."""
        return self.data.global_batch // self.parallel.workers

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed per optimizer step across the job."""
        return self.data.global_batch * self.data.seq_len

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (tuples as lists), suitable for ``yaml.safe_dump`` and round-tripping."""

        def plain(obj: Any) -> Any:
            if isinstance(obj, dict):
                return {k: plain(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return [plain(v) for v in obj]
            return obj

        return typing.cast(dict[str, Any], plain(dataclasses.asdict(self)))


# ----------------------------------------------------------------------------- loading (see loader.py)


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str], *, source: str = "") -> dict[str, Any]:
    """Apply ``key=value`` overrides to a raw recipe mapping (in place) and return it.

    Keys are dotted paths (``optim.lr``); values are YAML (``"optim.betas=[0.9, 0.99]"``).
    Keys are checked against the config dataclasses, so an override can only set a field
    that exists; below ``model.extra`` any key is allowed.
    """
    return loader.apply_overrides(RecipeConfig, raw, overrides, source=source)


def recipe_from_dict(
    raw: Mapping[str, Any],
    overrides: Iterable[str] = (),
    *,
    source: str = "",
    check_data: bool = True,
) -> RecipeConfig:
    """Validate a raw mapping (as read from YAML) into a :class:`RecipeConfig`.

    ``raw`` is copied (refusing recursive or oversized structures), not changed.
    ``source`` names the origin in error messages. With ``check_data`` a directory
    ``data.source`` must exist and the corpus is opened as the workers will open it (see
    :func:`check_recipe_data`), a ``model.pretrained`` checkpoint must fit the recipe
    (:func:`check_pretrained`) and ``model.lora`` must apply to the model (:func:`check_lora`).
    """
    recipe = loader.from_mapping(RecipeConfig, raw, overrides, source=source, what="recipe")
    if check_data:
        check_pretrained(recipe, source=source)
        check_lora(recipe, source=source)
        check_recipe_data(recipe, source=source)
    return recipe


def open_dataset(recipe: RecipeConfig) -> TokenDataset:
    """The recipe's training data, opened exactly as every worker opens it."""
    from checkpointless.corpus import TokenDataset

    dc = recipe.data
    return TokenDataset(
        None if dc.is_stdlib else dc.source,
        seq_len=dc.seq_len,
        global_batch=dc.global_batch,
        seed=recipe.train.seed,
        val_fraction=dc.heldout_fraction,
        tokenizer=dc.tokenizer,
        vocab_size=dc.tokenizer_vocab_size,
    )


def check_recipe_data(recipe: RecipeConfig, *, source: str = "") -> None:
    """Open ``recipe``'s corpus exactly as every worker will, or raise :class:`RecipeError`.

    Builds :class:`~checkpointless.corpus.TokenDataset` with the recipe's corpus,
    tokenizer, ``seq_len``, ``global_batch`` and held-out fraction (tokenizing into the token
    cache on first use, verifying the cache otherwise: about 0.2 s for the standard library).
    Catches, naming ``data.source``: a missing, unreadable or empty directory, an invalid
    JSONL line (``file:line``), a corpus too short for one ``seq_len + 1`` window in the
    train or held-out split (with the sizes), and out-of-vocabulary token ids.
    """
    dc = recipe.data
    if not dc.is_stdlib:
        path = Path(dc.source).expanduser()
        if not path.is_dir():
            raise RecipeError(
                "data.source",
                f"data directory {str(path)!r} does not exist or is not a directory",
                source=source,
            )
    try:
        open_dataset(recipe)
    except ImportError as exc:
        raise RecipeError("data.tokenizer", " ".join(str(exc).split()), source=source) from None
    except ValueError as exc:
        raise RecipeError("data.source", " ".join(str(exc).split()), source=source) from None
    except OSError as exc:
        raise RecipeError("data.source", f"cannot prepare the token cache: {exc}", source=source) from None


def _architecture(model: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` keys that decide the weights' shapes, with the recipe's effective values."""
    arch: dict[str, Any] = {
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_hidden_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim or model.hidden_size // model.num_attention_heads,
        "tie_word_embeddings": model.tie_word_embeddings,
    }
    if model.family == "gpt_oss":
        arch["num_local_experts"] = model.num_local_experts
        arch["num_experts_per_tok"] = model.num_experts_per_tok
    return arch


#: Files of which a checkpoint directory must hold one: its weights (``save_pretrained``'s names).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_pretrained(recipe: RecipeConfig, *, source: str = "") -> None:
    """Check ``model.pretrained`` (if set) as every worker will read it, or raise :class:`RecipeError`.

    The directory must exist and hold a Hugging Face checkpoint (``config.json`` and one of
    :data:`WEIGHT_FILES`) whose ``model_type`` is the recipe's family and whose architecture (the
    fields that decide the weights' shapes: sizes, layers, heads, experts, tied embeddings) is the
    recipe's, so the run cannot start from weights that do not fit. Reads ``config.json`` only.
    """
    model = recipe.model
    if model.pretrained is None:
        return
    path = Path(model.pretrained).expanduser()

    def error(key: str, message: str) -> RecipeError:
        return RecipeError(f"model.{key}", message, source=source)

    if not path.is_dir():
        raise error("pretrained", f"directory {str(path)!r} does not exist or is not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise error(
            "pretrained", f"{str(path)!r} has no config.json: not a Hugging Face checkpoint (save_pretrained)"
        )
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise error("pretrained", f"{str(path)!r} holds no weights (none of {', '.join(WEIGHT_FILES)})")
    try:
        saved = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error("pretrained", f"cannot read {str(config)!r}: {' '.join(str(exc).split())}") from None
    if not isinstance(saved, dict):
        raise error("pretrained", f"{str(config)!r} is not a JSON object")
    if saved.get("model_type") != model.family:
        raise error(
            "family",
            f"{model.family!r}, but the checkpoint in {str(path)!r} is a {saved.get('model_type')!r} model",
        )
    if saved.get("head_dim") is None and isinstance(saved.get("hidden_size"), int):
        heads = saved.get("num_attention_heads") or 1
        saved["head_dim"] = saved["hidden_size"] // heads
    if saved.get("num_key_value_heads") is None:
        saved["num_key_value_heads"] = saved.get("num_attention_heads")
    saved.setdefault("tie_word_embeddings", True)  # transformers' PretrainedConfig default
    for key, value in _architecture(model).items():
        if saved.get(key) != value:
            raise error(key, f"{value!r}, but the checkpoint in {str(path)!r} has {saved.get(key)!r}")


def check_lora(recipe: RecipeConfig, *, source: str = "") -> None:
    """Apply ``model.lora`` to the model built on the meta device (no memory, no checkpoint read),
    so that a target that matches nothing, or ``peft`` missing, is one :class:`RecipeError` before
    any worker starts rather than every worker's crash. Imports ``transformers`` and ``peft``."""
    if recipe.model.lora is None:
        return
    # here, not at the top: models.py imports torch (this module stays cheap); it imports this
    # module for the type checker only, so no circle closes at run time
    from checkpointless.recipes.models import build_hf_model

    try:
        build_hf_model(recipe.model, seed=0, device="meta")
    except RecipeError as err:
        raise err.located(err.key, source) from None


def load_recipe(
    path: str | Path,
    overrides: Iterable[str] = (),
    *,
    check_data: bool = True,
) -> RecipeConfig:
    """Load, override and validate the YAML recipe at ``path``.

    ``overrides`` are ``"dotted.key=value"`` strings applied before validation. With
    ``check_data`` (default) the corpus is opened as the workers will open it (see
    :func:`check_recipe_data`; this tokenizes it into the token cache on first use) and a
    ``model.pretrained`` checkpoint is checked (:func:`check_pretrained`); with
    ``check_data=False`` neither is looked at (for dry runs of recipes meant for
    another machine). Every problem raises :class:`RecipeError` (a :class:`ValueError`)
    naming the file and the dotted key, in one line.
    """
    raw = safe_yaml.load_file(path, what="recipe")
    return recipe_from_dict(raw, overrides, source=str(path), check_data=check_data)
