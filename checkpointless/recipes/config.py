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

The ``model`` section (:class:`~checkpointless.recipes.model_config.ModelConfig`, with its LoRA
adapter) is :mod:`checkpointless.recipes.model_config`; the value checks every section uses are
:mod:`checkpointless.recipes.field_checks`.

With ``check_data`` (the default, and what ``checkpointless run`` uses before launching
anything), :func:`load_recipe` also opens the corpus exactly as every worker will, so a
missing or empty ``data.source``, an invalid JSONL line, a corpus too short for one
``seq_len + 1`` window per split or a damaged token cache is reported up front, as one
:class:`RecipeError` naming ``data.source``; likewise a ``model.pretrained`` directory that is
missing, holds no Hugging Face checkpoint, or holds one of another architecture than the recipe
says (:func:`~checkpointless.recipes.preflight.check_pretrained`), naming the ``model.`` key.
These checks against this machine are :mod:`checkpointless.recipes.preflight`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from checkpointless.config import RecoveryConfig
from checkpointless.corpus import BYTE_VOCAB_SIZE  # 256 byte values + end-of-document
from checkpointless.errors import RecipeError
from checkpointless.recipes import loader, safe_yaml
from checkpointless.recipes.field_checks import require_finite, require_one_of, require_positive
from checkpointless.recipes.model_config import ModelConfig
from checkpointless.recipes.preflight import check_lora, check_pretrained, check_recipe_data
from checkpointless.recipes.safe_yaml import MAX_YAML_DEPTH, MAX_YAML_NODES

__all__ = [
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "DataConfig",
    "OptimConfig",
    "ParallelConfig",
    "RecipeConfig",
    "RecipeError",
    "TrainConfig",
    "apply_overrides",
    "load_recipe",
    "recipe_from_dict",
]

Tokenizer = Literal["byte", "bpe"]
Schedule = Literal["constant", "cosine"]
DType = Literal["float32", "bfloat16"]
Backend = Literal["gloo", "nccl"]
Device = Literal["cpu", "cuda"]


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
        require_one_of("tokenizer", self.tokenizer, typing.get_args(Tokenizer))
        if self.tokenizer == "bpe":
            require_positive("vocab_size", self.vocab_size)
            assert self.vocab_size is not None
            if self.vocab_size <= BYTE_VOCAB_SIZE:
                raise RecipeError("vocab_size", f"a bpe vocabulary needs > {BYTE_VOCAB_SIZE} ids")
        elif self.vocab_size not in (None, BYTE_VOCAB_SIZE):
            raise RecipeError(
                "vocab_size", f"the byte tokenizer has {BYTE_VOCAB_SIZE} ids, got {self.vocab_size}"
            )
        require_positive("seq_len", self.seq_len)
        require_positive("global_batch", self.global_batch)
        require_finite("heldout_fraction", self.heldout_fraction)
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise RecipeError("heldout_fraction", f"must be in [0, 1), got {self.heldout_fraction!r}")
        require_positive("eval_every", self.eval_every, allow_zero=True)
        require_positive("eval_batches", self.eval_batches)
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
        require_one_of("name", self.name, ("adamw",))
        require_positive("lr", self.lr)
        if len(self.betas) != 2:
            raise RecipeError("betas", f"must have two entries, got {len(self.betas)}")
        for i, beta in enumerate(self.betas):
            require_finite(f"betas[{i}]", beta)
            if not 0.0 <= beta < 1.0:
                raise RecipeError(f"betas[{i}]", f"must be in [0, 1), got {beta!r}")
        require_positive("weight_decay", self.weight_decay, allow_zero=True)
        require_positive("eps", self.eps)
        require_positive("warmup_steps", self.warmup_steps, allow_zero=True)
        require_positive("grad_clip", self.grad_clip, allow_none=True)
        require_one_of("schedule", self.schedule, typing.get_args(Schedule))


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
        require_positive("workers", self.workers)
        require_positive("spares", self.spares, allow_zero=True)
        require_positive("shards", self.shards)
        if self.workers % self.shards:
            raise RecipeError(
                "shards",
                f"shards={self.shards} does not divide workers={self.workers} (replicas x shards ranks)",
            )
        require_one_of("dtype", self.dtype, typing.get_args(DType))
        require_one_of("backend", self.backend, typing.get_args(Backend))
        if self.device is not None:
            require_one_of("device", self.device, typing.get_args(Device))
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
        require_positive("steps", self.steps)
        require_positive("seed", self.seed, allow_zero=True)
        require_positive("log_every", self.log_every)


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
