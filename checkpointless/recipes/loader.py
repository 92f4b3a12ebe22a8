"""Typed YAML configs: a strict mapping-to-dataclass builder and ``--set`` overrides.

This module knows nothing about recipes; :mod:`checkpointless.recipes.config` is its one
schema. Reading the YAML itself, with its limits, is :mod:`checkpointless.recipes.safe_yaml`.
It gives:

* :func:`build`: a mapping (as read from YAML) into a tree of ``kw_only`` dataclasses,
  checked against their annotations (``int``, ``float``, ``bool``, ``str``, ``Literal``,
  ``X | None``, ``list[X]``, ``tuple[X, ...]`` of fixed length, ``dict[str, X]``,
  ``Any``, nested dataclasses). Types are strict: ``"3"`` is not an ``int``, ``True`` is
  not an ``int`` and ``1`` is not a ``bool``; an ``int`` is accepted for a ``float``
  (and stored as one). Unknown and missing keys are refused, naming the dotted key.
* :func:`apply_overrides`: ``"a.b=value"`` strings (the command line's ``--set``) applied
  to the raw mapping before :func:`build`, so they pass exactly the same checks.
* :func:`from_mapping`: both, on a limited copy of the mapping.

Every problem is a :class:`~checkpointless.errors.RecipeError` (one line, exit code 2 on
the command line) naming the source file and the dotted key (``optim.betas[1]``). A
dataclass's ``__post_init__`` may raise ``RecipeError(field, message)`` itself; the
builder re-keys it to the full dotted path.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar, Union

import yaml

from checkpointless.errors import RecipeError
from checkpointless.recipes.safe_yaml import copy_limited, safe_load, yaml_message

__all__ = [
    "apply_overrides",
    "build",
    "from_mapping",
    "type_name",
]

T = TypeVar("T")

# ----------------------------------------------------------------------------- typed building


def type_name(tp: Any) -> str:
    """How an annotation reads in an error message (``mapping``, ``one of 'a', 'b'``, ...)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp))


class _TypeMismatch(Exception):
    """Internal: a value does not fit a type."""


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it in canonical form."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise _TypeMismatch
        return _build(typing.cast(type, tp), value, key, source)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _TypeMismatch
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except _TypeMismatch:
                continue
        raise _TypeMismatch
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
            return value
        raise _TypeMismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _TypeMismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _TypeMismatch
    if origin is list:
        if not isinstance(value, list):
            raise _TypeMismatch
        (item,) = typing.get_args(tp)
        return [_coerce_item(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is tuple:
        items = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(items):
            raise _TypeMismatch
        return tuple(
            _coerce_item(v, t, f"{key}[{i}]", source)
            for i, (v, t) in enumerate(zip(value, items, strict=True))
        )
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        if key_type is not str:
            raise TypeError(f"unsupported annotation {tp!r} for {key}: mapping keys must be str")
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise _TypeMismatch
        return {k: _coerce_item(v, value_type, f"{key}.{k}", source) for k, v in value.items()}
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def _coerce_item(value: Any, tp: Any, key: str, source: str) -> Any:
    """Coerce a container element, reporting mismatches with the element's own key."""
    try:
        return _coerce(value, tp, key, source)
    except _TypeMismatch:
        raise RecipeError(key, _mismatch(tp, value), source=source) from None


def _mismatch(tp: Any, value: Any) -> str:
    return f"expected {type_name(tp)}, got {type(value).__name__} ({value!r})"


def _fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _build(cls: type, raw: Mapping[str, Any], prefix: str, source: str) -> Any:
    """Build dataclass ``cls`` from mapping ``raw``; ``prefix`` is the dotted path so far."""
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)

    def dotted(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    for key in raw:
        if key not in fields:
            full = dotted(str(key))
            known = ", ".join(fields)
            raise RecipeError(
                full,
                f"unknown key (known keys here: {known})",
                source=source,
                text=f"unknown key '{full}' (known keys here: {known})",
            )
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecipeError(dotted(name), "missing required key", source=source)
            continue
        try:
            kwargs[name] = _coerce(raw[name], hints[name], dotted(name), source)
        except _TypeMismatch:
            raise RecipeError(dotted(name), _mismatch(hints[name], raw[name]), source=source) from None
    try:
        return cls(**kwargs)
    except RecipeError as err:
        if err.source:
            raise  # already located by a nested section
        raise err.located(dotted(err.key) if err.key else prefix, source) from None
    except ValueError as err:  # a dataclass of the core (RecoveryConfig): its message starts with the field
        text = str(err)
        name = text.split(" ", 1)[0]
        if name in fields:
            raise RecipeError(dotted(name), text.split(" ", 1)[1], source=source) from None
        raise RecipeError(prefix, text, source=source) from None


def build(cls: type[T], raw: Mapping[str, Any], *, source: str = "") -> T:
    """Build the dataclass ``cls`` (and its nested dataclasses) from the mapping ``raw``.

    Keys and types are checked as the module docstring says; ``source`` names the origin
    in error messages. ``raw`` should come from :func:`~checkpointless.recipes.safe_yaml.safe_load`
    or :func:`~checkpointless.recipes.safe_yaml.copy_limited` (this recurses as deep as the data).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not isinstance(raw, Mapping):
        raise RecipeError("", f"top level must be a mapping, got {type(raw).__name__}", source=source)
    return typing.cast(T, _build(cls, raw, "", source))


# ----------------------------------------------------------------------------- overrides


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise RecipeError("", f"override {item!r} is not of the form key=value")
    key, _, text = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise RecipeError("", f"override {item!r} has an empty key")
    try:
        value = safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise RecipeError(key, f"override value {shown!r} is not valid YAML: {yaml_message(exc)}") from None
    return parts, value


def _section(hint: Any) -> Any:
    """An optional section (``LoraConfig | None``) as its dataclass, so ``--set`` can reach below it."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0]
    return hint


def apply_overrides(
    cls: type, raw: dict[str, Any], overrides: Iterable[str], *, source: str = ""
) -> dict[str, Any]:
    """Apply ``key=value`` overrides to ``raw``, a raw mapping for dataclass ``cls`` (in place).

    Keys are dotted paths (``optim.lr``); values are parsed with
    :func:`~checkpointless.recipes.safe_yaml.safe_load` (``"optim.betas=[0.9, 0.99]"``). Keys
    are checked against the dataclasses, so an override can only set a field that exists;
    below a ``dict`` or ``Any`` field any key is allowed. Returns ``raw``.
    """
    for item in overrides:
        parts, value = _parse_override(item)
        key = ".".join(parts)
        schema: Any = cls
        node = raw
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            if schema is not None:
                fields = _fields(schema)
                if part not in fields:
                    raise RecipeError(
                        key,
                        "unknown key",
                        source=source,
                        text=f"override {item!r}: unknown key '{'.'.join(parts[: depth + 1])}'",
                    )
                hint = _section(typing.get_type_hints(schema)[part])
                if dataclasses.is_dataclass(hint):
                    schema = hint
                elif typing.get_origin(hint) is dict or hint is Any:
                    schema = None  # free-form mapping (model.extra): any sub-key is fine
                elif not last:
                    raise RecipeError(
                        key,
                        "not a section",
                        source=source,
                        text=f"override {item!r}: '{'.'.join(parts[: depth + 1])}' is not a section",
                    )
            if last:
                node[part] = value
                break
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise RecipeError(
                    ".".join(parts[: depth + 1]), "is not a mapping; cannot override below it", source=source
                )
            node = child
    return raw


def from_mapping(
    cls: type[T],
    raw: Mapping[str, Any],
    overrides: Iterable[str] = (),
    *,
    source: str = "",
    what: str = "config",
) -> T:
    """:func:`~checkpointless.recipes.safe_yaml.copy_limited`, :func:`apply_overrides`, then
    :func:`build`: ``raw`` is left as it was."""
    if not isinstance(raw, Mapping):
        raise RecipeError("", f"top level must be a mapping, got {type(raw).__name__}", source=source)
    data = apply_overrides(cls, copy_limited(dict(raw), source=source, what=what), overrides, source=source)
    return build(cls, data, source=source)
