"""Tests for checkpointless.recipes.loader and safe_yaml: the schema-free YAML-to-dataclass loader."""

from __future__ import annotations

import ast
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from checkpointless.errors import RecipeError
from checkpointless.recipes import loader, safe_yaml
from checkpointless.recipes.safe_yaml import MAX_YAML_DEPTH, MAX_YAML_NODES

pytestmark = pytest.mark.timeout(60)


@dataclass(kw_only=True)
class Inner:
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    label: str = "x"
    mode: Literal["a", "b"] = "a"
    maybe: int | None = None
    items: list[int] = field(default_factory=list)
    pair: tuple[float, float] = (0.0, 1.0)
    table: dict[str, int] = field(default_factory=dict)
    free: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.count < 0:
            raise RecipeError("count", f"must be >= 0, got {self.count}")


@dataclass(kw_only=True)
class Outer:
    name: str
    inner: Inner = field(default_factory=Inner)


def _build(raw: dict[str, Any], overrides: tuple[str, ...] = ()) -> Outer:
    return loader.from_mapping(Outer, raw, overrides, source="cfg.yaml")


@pytest.mark.parametrize(
    ("module", "allowed"),
    [
        (loader, {"checkpointless.errors", "checkpointless.recipes.safe_yaml"}),
        (safe_yaml, {"checkpointless.errors"}),
    ],
    ids=["loader", "safe_yaml"],
)
def test_loader_knows_nothing_about_recipes(module: Any, allowed: set[str]) -> None:
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    ours = {m for m in imported if m.startswith("checkpointless")}
    assert ours == allowed, ours


def test_builds_nested_dataclasses_in_canonical_form() -> None:
    cfg = _build(
        {
            "name": "n",
            "inner": {"count": 3, "ratio": 2, "pair": [1, 2], "table": {"k": 4}, "free": {"x": [1]}},
        }
    )
    assert cfg == Outer(
        name="n", inner=Inner(count=3, ratio=2.0, pair=(1.0, 2.0), table={"k": 4}, free={"x": [1]})
    )
    assert isinstance(cfg.inner.ratio, float) and isinstance(cfg.inner.pair[0], float)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("count", "3", "inner.count: expected int, got str ('3')"),
        ("count", True, "inner.count: expected int, got bool (True)"),
        ("count", 2.0, "inner.count: expected int, got float (2.0)"),
        ("ratio", "0.5", "inner.ratio: expected float, got str ('0.5')"),
        ("ratio", False, "inner.ratio: expected float, got bool (False)"),
        ("flag", 1, "inner.flag: expected bool, got int (1)"),
        ("flag", "yes", "inner.flag: expected bool, got str ('yes')"),
        ("label", 5, "inner.label: expected str, got int (5)"),
        ("mode", "c", "inner.mode: expected one of 'a', 'b', got str ('c')"),
        ("maybe", "1", "inner.maybe: expected int or null, got str ('1')"),
        ("items", "12", "inner.items: expected list[int], got str ('12')"),
        ("items", [1, "2"], "inner.items[1]: expected int, got str ('2')"),
        ("pair", [1.0], "inner.pair: expected tuple[float, float], got list ([1.0])"),
        ("pair", [1.0, None], "inner.pair[1]: expected float, got NoneType (None)"),
        ("table", {"k": "v"}, "inner.table.k: expected int, got str ('v')"),
        ("table", {1: 2}, "inner.table: expected dict[str, int], got dict ({1: 2})"),
        ("free", [1], "inner.free: expected dict[str, Any], got list ([1])"),
        ("count", -1, "inner.count: must be >= 0, got -1"),  # from __post_init__, re-keyed
    ],
)
def test_types_are_strict_and_errors_name_the_dotted_key(key: str, value: object, message: str) -> None:
    with pytest.raises(RecipeError) as info:
        _build({"name": "n", "inner": {key: value}})
    assert str(info.value) == f"cfg.yaml: {message}"
    assert info.value.key.startswith("inner.")


def test_unknown_and_missing_keys_are_named() -> None:
    with pytest.raises(
        RecipeError, match=r"^cfg\.yaml: unknown key 'inner\.cuont' \(known keys here: count, ratio"
    ):
        _build({"name": "n", "inner": {"cuont": 1}})
    with pytest.raises(
        RecipeError, match=r"^cfg\.yaml: unknown key 'nmae' \(known keys here: name, inner\)$"
    ):
        _build({"nmae": "n"})
    with pytest.raises(RecipeError, match=r"^cfg\.yaml: name: missing required key$"):
        _build({})
    with pytest.raises(RecipeError, match=r"^cfg\.yaml: inner: expected mapping, got int \(3\)$"):
        _build({"name": "n", "inner": 3})
    with pytest.raises(RecipeError, match=r"^cfg\.yaml: top level must be a mapping, got list$"):
        loader.from_mapping(Outer, [1], source="cfg.yaml")  # type: ignore[arg-type]


def test_overrides_are_checked_like_the_file_and_leave_the_input_alone() -> None:
    raw: dict[str, Any] = {"name": "n", "inner": {"count": 1}}
    cfg = _build(raw, ("inner.count=7", "inner.pair=[0.1, 0.2]", "inner.free.deep.x=1e-3", "name=m"))
    assert cfg.inner.count == 7 and cfg.inner.pair == (0.1, 0.2) and cfg.name == "m"
    assert cfg.inner.free == {"deep": {"x": 1e-3}}
    assert raw == {"name": "n", "inner": {"count": 1}}
    assert _build({"name": "n"}, ("inner.maybe=null",)).inner.maybe is None
    for override, needle in [
        ("inner.cuont=1", "override 'inner.cuont=1': unknown key 'inner.cuont'"),
        ("iner.count=1", "unknown key 'iner'"),
        ("inner.count.x=1", "'inner.count' is not a section"),
        ("inner.count=many", "inner.count: expected int, got str ('many')"),
        ("inner.count", "is not of the form key=value"),
        ("inner..count=1", "has an empty key"),
        ("inner.count=[1", "inner.count: override value '[1' is not valid YAML"),
    ]:
        with pytest.raises(RecipeError) as info:
            _build({"name": "n"}, (override,))
        assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_exponent_floats_are_numbers() -> None:
    assert safe_yaml.safe_load("a: 1e-3\nb: 2E5\nc: 3.0e+2\nd: '1e-3'\ne: 1_000\n") == {
        "a": 1e-3,
        "b": 2e5,
        "c": 300.0,
        "d": "1e-3",
        "e": 1000,
    }


def test_load_file_errors_are_one_line_and_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"nope\.yaml: cannot read thing:"):
        safe_yaml.load_file(tmp_path / "nope.yaml", what="thing")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n", encoding="utf-8")
    with pytest.raises(RecipeError, match=r"empty\.yaml: thing is empty$"):
        safe_yaml.load_file(empty, what="thing")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\nb: {\n", encoding="utf-8")
    with pytest.raises(RecipeError, match=r"bad\.yaml: invalid YAML: .*line \d+, column \d+\)$") as info:
        safe_yaml.load_file(bad)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- hostile input


def _nest(k: int, inner: str) -> str:
    return "[" * k + inner + "]" * k


@pytest.mark.parametrize("k", [MAX_YAML_DEPTH - 4, MAX_YAML_DEPTH - 3, MAX_YAML_DEPTH - 2])
def test_an_alias_counts_as_deep_as_what_it_expands_to(k: int) -> None:
    """Depth is the same whether a subtree is written out or reached through an alias."""
    inline = f"a: {_nest(k, '1')}\nb: [{_nest(k, '1')}]\n"
    aliased = f"a: &a {_nest(k, '1')}\nb: [*a]\n"

    def outcome(text: str) -> object:
        try:
            return safe_yaml.safe_load(text)
        except yaml.YAMLError as exc:
            return "refused: " + safe_yaml.yaml_message(exc)

    written, via_alias = outcome(inline), outcome(aliased)
    # b's scalar sits k + 3 levels down: the document mapping, b's list, k lists, the scalar
    assert isinstance(written, str) == (k > MAX_YAML_DEPTH - 3)
    if isinstance(written, str):
        assert isinstance(via_alias, str) and f"nesting deeper than {MAX_YAML_DEPTH} levels" in via_alias
        assert "once alias *a is expanded" in via_alias
    else:
        assert via_alias == written


def _alias_chain(levels: int, per: int = 8) -> str:
    """Each anchor wraps the previous one ``per`` levels deeper: depth ``levels * per`` once expanded."""
    lines = [f"a0: &a0 {_nest(per, '1')}"]
    lines += [f"a{i}: &a{i} {_nest(per, f'*a{i - 1}')}" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (_alias_chain(10), "nesting deeper than 64 levels at line 8, column 17 once alias *a6 is expanded"),
        (_alias_chain(2000), "nesting deeper than 64 levels at line 8, column 17 once alias *a6 is expanded"),
        (_alias_chain(2000, per=1), "nesting deeper than 64 levels at line 63, column 12 once alias *a61"),
        (
            "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(
                f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n"
                for p, c in zip("abcdefg", "bcdefgh", strict=True)
            ),
            f"more than {MAX_YAML_NODES} values",
        ),
        ("a: &a {b: *a}\n", "recursive alias *a"),
        ("- " * 5000 + "x\n", "nesting deeper than 64 levels"),
        ("{" * 5000 + "}" * 5000 + "\n", "nesting deeper than 64 levels"),
    ],
    ids=[
        "alias-chain",
        "long-alias-chain",
        "thin-alias-chain",
        "billion-laughs",
        "recursive",
        "block",
        "flow",
    ],
)
def test_hostile_yaml_is_refused_quickly_in_one_line(tmp_path: Path, text: str, needle: str) -> None:
    limit = sys.getrecursionlimit()
    start = time.perf_counter()
    with pytest.raises(yaml.YAMLError) as info:
        safe_yaml.safe_load(text)
    message = safe_yaml.yaml_message(info.value)
    assert needle in message and "\n" not in message, message
    path = tmp_path / "hostile.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(RecipeError, match=r"hostile\.yaml: invalid YAML: ") as err:
        safe_yaml.load_file(path)
    assert needle in str(err.value)
    if text[0].isalpha():  # a mapping: the same document as a --set value, in flow style
        flow = "{" + text.strip().replace("\n", ", ") + "}"
        with pytest.raises(RecipeError, match=r"inner\.free\.x: override value ") as err:
            _build({"name": "n"}, (f"inner.free.x={flow}",))
        assert needle.split(" at line")[0] in str(err.value) and "\n" not in str(err.value)
    assert time.perf_counter() - start < 2
    assert sys.getrecursionlimit() == limit


def test_python_mappings_are_copied_within_the_limits() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(RecipeError, match=r"^cfg\.yaml: config is a recursive structure"):
        _build({"name": "n", "inner": {"free": loop}})
    deep: list[Any] = [1]
    for _ in range(MAX_YAML_DEPTH + 10):
        deep = [deep]
    with pytest.raises(RecipeError, match=f"nests deeper than {MAX_YAML_DEPTH} levels"):
        _build({"name": "n", "inner": {"free": {"x": deep}}})
    wide: list[Any] = ["x"] * 10
    for _ in range(6):
        wide = [wide] * 10  # 10**7 values once expanded, a few dozen objects in memory
    with pytest.raises(RecipeError, match=f"more than {MAX_YAML_NODES} values"):
        _build({"name": "n", "inner": {"free": {"x": wide}}})
    shared = {"k": 1}
    cfg = _build({"name": "n", "inner": {"free": {"a": shared, "b": shared}}})
    assert cfg.inner.free == {"a": {"k": 1}, "b": {"k": 1}}
    assert cfg.inner.free["a"] is not cfg.inner.free["b"]  # shared sub-objects are copied per use
