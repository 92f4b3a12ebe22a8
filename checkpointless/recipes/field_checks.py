"""The value checks of the recipe schema: each section's ``__post_init__`` calls them on its fields.

Each raises :class:`~checkpointless.errors.RecipeError` naming the field (``key``); the loader
re-keys it to the full dotted path (``optim.lr``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from checkpointless.errors import RecipeError

__all__ = ["require_finite", "require_finite_tree", "require_one_of", "require_positive"]


def require_one_of(key: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        raise RecipeError(key, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")


def require_positive(
    key: str, value: float | None, *, allow_none: bool = False, allow_zero: bool = False
) -> None:
    if value is None:
        if not allow_none:
            raise RecipeError(key, "is required")
        return
    require_finite(key, value)
    if value < 0 or (value == 0 and not allow_zero):
        raise RecipeError(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def require_finite(key: str, value: object) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise RecipeError(key, f"must be a finite number, got {value!r}")


def require_finite_tree(key: str, value: object) -> None:
    """``require_finite`` on every float in a (nested) mapping or list, naming the dotted key."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            require_finite_tree(f"{key}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            require_finite_tree(f"{key}[{i}]", v)
    else:
        require_finite(key, value)
