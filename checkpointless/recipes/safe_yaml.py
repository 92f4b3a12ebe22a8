"""Safe YAML reading: a limited ``safe_load`` and the same limits on mappings built in Python.

* :func:`safe_load`: ``yaml.safe_load`` with YAML 1.2 exponent floats (``1e-3`` is a
  number) and limits: an alias that refers to the node containing it (a recursive
  structure), a document that expands to more than :data:`MAX_YAML_NODES` values once
  every alias is expanded (a "billion laughs"), or nesting deeper than
  :data:`MAX_YAML_DEPTH`, counted with aliases expanded, is refused with a one-line
  error while the document is composed, before any Python object is built. Ordinary
  anchors and aliases (``&seq 128`` ... ``*seq``) keep working.
* :func:`load_file`: a YAML file read with :func:`safe_load`, every problem one
  :class:`~checkpointless.errors.RecipeError` naming the file.
* :func:`copy_limited`: nested dicts and lists (a mapping built in Python) copied under the
  same limits.

This module knows nothing about dataclasses; :mod:`checkpointless.recipes.loader` builds typed
configs from what it reads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from checkpointless.errors import RecipeError

__all__ = [
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "copy_limited",
    "load_file",
    "safe_load",
    "yaml_message",
]

MAX_YAML_NODES = 100_000
"""Most values a document may hold once every YAML alias is expanded (a real recipe has ~100)."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and sequences, aliases expanded (a real recipe has 4)."""


class _YAMLLimitError(yaml.YAMLError):
    """Internal: a document exceeds the loader's limits (message is one line)."""


def _at(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown position"


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2 exponent floats and limits on aliases and nesting.

    PyYAML implements YAML 1.1, where ``1e-3`` is a *string*; YAML 1.2 (and every human)
    reads it as a number. Aliases are checked while the document is composed, before any
    Python object is built: one that refers to a node still being composed (its own
    container) is refused, and so is a document whose size with every alias expanded
    exceeds :data:`MAX_YAML_NODES`, or that nests deeper than :data:`MAX_YAML_DEPTH`
    (an alias counts with the height of the node it stands for). Everything else is
    plain ``safe_load``.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._open_anchors: set[str] = set()
        self._expanded = 0  # values in the document so far, aliases expanded
        # id(node) -> (expanded size, expanded height); nodes stay alive while composing
        self._measured: dict[int, tuple[int, int]] = {}
        self._depth = 0

    def _grow(self, n: int, mark: Any) -> None:
        self._expanded += n
        if self._expanded > MAX_YAML_NODES:
            raise _YAMLLimitError(
                f"document expands to more than {MAX_YAML_NODES} values once its aliases are expanded "
                f"(at {_at(mark)}); refusing it (nested aliases, a 'billion laughs'?)"
            )

    def _measure(self, node: yaml.Node) -> tuple[int, int]:
        """``(values, levels)`` of ``node`` with aliases expanded (memoized; levels <= MAX_YAML_DEPTH)."""
        known = self._measured.get(id(node))
        if known is not None:
            return known
        size, below = 1, 0
        if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            children: list[yaml.Node] = (
                list(node.value)
                if isinstance(node, yaml.SequenceNode)
                else [n for pair in node.value for n in pair]
            )
            for child in children:
                s, h = self._measure(child)
                size += s
                below = max(below, h)
        height = 1 + below  # levels the node occupies, itself included
        self._measured[id(node)] = (size, height)
        return size, height

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                raise _YAMLLimitError(
                    f"recursive alias *{event.anchor} at {_at(event.start_mark)}: it refers to a node "
                    f"that contains it"
                )
            node = super().compose_node(parent, index)
            if node is not None:
                size, height = self._measure(node)
                self._grow(size, event.start_mark)
                if self._depth + height > MAX_YAML_DEPTH:
                    raise _YAMLLimitError(
                        f"nesting deeper than {MAX_YAML_DEPTH} levels at {_at(event.start_mark)} "
                        f"once alias *{event.anchor} is expanded"
                    )
            return node
        self._grow(1, event.start_mark)
        if self._depth >= MAX_YAML_DEPTH:
            raise _YAMLLimitError(f"nesting deeper than {MAX_YAML_DEPTH} levels at {_at(event.start_mark)}")
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._open_anchors.add(anchor)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor is not None:
                self._open_anchors.discard(anchor)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` with YAML 1.2-style exponent floats and the limits above.

    Raises :class:`yaml.YAMLError`; :func:`yaml_message` turns it into one line.
    """
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader subclass
    except RecursionError:
        raise _YAMLLimitError("nested too deeply") from None


def yaml_message(exc: yaml.YAMLError) -> str:
    """One line: what PyYAML found wrong, and where."""
    if isinstance(exc, yaml.MarkedYAMLError):
        parts = [p for p in (exc.context, exc.problem) if p]
        mark = exc.problem_mark or exc.context_mark
        return f"{': '.join(parts) or 'syntax error'} ({_at(mark)})"
    return " ".join(str(exc).split())


def load_file(path: str | Path, *, what: str = "file") -> Any:
    """Read and :func:`safe_load` the YAML file at ``path``.

    An unreadable file, invalid YAML, a document over the limits or an empty one raises
    :class:`RecipeError` naming the file (``what`` names the kind of file: ``"recipe"``).
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError("", f"cannot read {what}: {exc}", source=source) from None
    try:
        raw = safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError("", f"invalid YAML: {yaml_message(exc)}", source=source) from None
    if raw is None:
        raise RecipeError("", f"{what} is empty", source=source)
    return raw


def copy_limited(obj: Any, *, source: str = "", what: str = "config") -> Any:
    """Copy nested dicts and lists, refusing self-containing or oversized structures.

    YAML from :func:`safe_load` is already limited; this guards mappings built in Python
    (shared sub-objects are copied per use, so the same limits hold). ``what`` names the
    kind of data in the messages.
    """
    budget = MAX_YAML_NODES
    active: set[int] = set()

    def copy(o: Any, depth: int) -> Any:
        nonlocal budget
        budget -= 1
        if budget < 0:
            raise RecipeError("", f"{what} holds more than {MAX_YAML_NODES} values", source=source)
        if not isinstance(o, (dict, list)):
            return o
        if id(o) in active:
            raise RecipeError("", f"{what} is a recursive structure (a value contains itself)", source=source)
        if depth >= MAX_YAML_DEPTH:
            raise RecipeError("", f"{what} nests deeper than {MAX_YAML_DEPTH} levels", source=source)
        active.add(id(o))
        try:
            if isinstance(o, dict):
                return {k: copy(v, depth + 1) for k, v in o.items()}
            return [copy(v, depth + 1) for v in o]
        finally:
            active.discard(id(o))

    return copy(obj, 0)
