"""What a recipe needs of this machine, checked before any worker starts: its corpus opens as every
worker will open it (:func:`check_recipe_data`), its ``model.pretrained`` checkpoint fits the
recipe (:func:`check_pretrained`), its ``model.lora`` applies to the model (:func:`check_lora`).
Each problem is one :class:`~checkpointless.errors.RecipeError` naming the dotted key and the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointless.errors import RecipeError

if TYPE_CHECKING:
    from checkpointless.corpus import TokenDataset
    from checkpointless.recipes.config import RecipeConfig
    from checkpointless.recipes.model_config import ModelConfig

__all__ = ["WEIGHT_FILES", "check_lora", "check_pretrained", "check_recipe_data", "open_dataset"]


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
    cache on first use, verifying the cache otherwise).
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
    # here, not at the top: models.py imports torch (this module stays cheap); it imports the
    # schema for the type checker only, so no circle closes at run time
    from checkpointless.recipes.models import build_hf_model

    try:
        build_hf_model(recipe.model, seed=0, device="meta")
    except RecipeError as err:
        raise err.located(err.key, source) from None
