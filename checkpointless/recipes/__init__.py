"""Training recipes: typed YAML configs, Hugging Face model builders and a dry-run estimator.

``config`` is the recipe schema (its ``model`` section in ``model_config``, the value checks in
``field_checks``, the checks against this machine in ``preflight``), ``loader`` the schema-free
YAML-to-dataclass loader it uses and ``safe_yaml`` the limited YAML reading below both (PyYAML
only); ``models`` and ``dryrun`` import ``torch`` and, lazily, ``transformers`` (the ``recipes``
extra).
"""

from __future__ import annotations

from checkpointless.recipes.config import (
    DataConfig,
    OptimConfig,
    ParallelConfig,
    RecipeConfig,
    RecipeError,
    TrainConfig,
    apply_overrides,
    load_recipe,
    recipe_from_dict,
)
from checkpointless.recipes.model_config import ModelConfig
from checkpointless.recipes.preflight import check_recipe_data

__all__ = [
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RecipeConfig",
    "RecipeError",
    "TrainConfig",
    "apply_overrides",
    "check_recipe_data",
    "load_recipe",
    "recipe_from_dict",
]
