"""The layers are folders, and the boundary holds: the public API pulls in no periphery."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = "checkpointless"

PERIPHERY = ("transformers", "matplotlib", "rich", "prometheus_client", "yaml",
             "checkpointless.launch", "checkpointless.observe", "checkpointless.analysis",
             "checkpointless.recipes", "checkpointless.models", "checkpointless.cli", "checkpointless.corpus")  # fmt: skip


def test_public_api_imports_no_periphery() -> None:
    code = (
        "import json, sys, checkpointless as cl; "
        "assert cl.Session and cl.Attempt and cl.Stateful; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True, timeout=50).stdout)  # fmt: skip
    leaked = [m for m in loaded if any(m == p or m.startswith(p + ".") for p in PERIPHERY)]
    assert leaked == [], f"the core imports the periphery: {leaked}"


def test_core_modules_never_import_the_layers_above_them() -> None:
    root = Path(__file__).resolve().parents[2] / "checkpointless"
    core = [
        *(p for p in root.glob("*.py") if p.name != "__main__.py"),
        *(root / "control").glob("*.py"),
        *(root / "protocol").glob("*.py"),
        *(root / "loaders").glob("*.py"),
        *(root / "corpus").glob("*.py"),
    ]
    above = (
        "checkpointless.launch",
        "checkpointless.observe",
        "checkpointless.analysis",
        "checkpointless.recipes",
    )
    for path in core:
        text = path.read_text()
        for name in above:
            assert f"import {name}" not in text and f"from {name}" not in text, f"{path.name} imports {name}"


# ----------------------------------------------------------------------------- every folder's layer

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # The design's layers, from the bottom up: a layer may use the ones below it, never above. Each
    # entry names modules or folders under checkpointless/, placed as docs/design/modules.md places
    # them ("" is the package's own __init__, the session's public face); every module is placed.
    ("protocol", ("protocol",)),
    ("config", ("errors", "_compat", "config", "devices", "fault_grammar")),
    ("comm", ("comm", "group_works", "sockets")),
    (
        "state",
        (
            "state",
            "ddp",
            "exact_sum",
            "module_state",
            "fsdp",
            "durable",
            "durable_snapshots",
            "replicas",
            "shards",
        ),
    ),
    ("control", ("control",)),
    ("loaders", ("loaders",)),
    ("faults", ("faults",)),
    (
        "recovery",
        (
            "",
            "session",
            "step_loop",
            "commit",
            "seeds",
            "progress",
            "model_holder",
            "sharded_model",
            "sharded_exact",
            "share_loop",
            "member",
            "aborts",
            "entry",
            "takeover",
            "arrival",
            "formation",
            "recovery_source",
            "consistency",
            "joining",
            "catch_up",
            "step_log",
            "following",
            "ending",
            "notice",
        ),
    ),
    ("corpus", ("corpus",)),
    ("metrics", ("observe",)),
    (
        "launch / recipes / cli",
        ("launch", "recipes", "models", "analysis", "integrations", "cli", "__main__"),
    ),
]


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    """The module it loads (``checkpointless.x.y``)."""
    kind: str
    """``module`` (at import time), ``function`` (inside a def: when called) or ``type`` (under
    ``if TYPE_CHECKING:``: never at run time)."""
    names: tuple[str, ...] = ()
    """The names it takes from ``target`` (``from target import a, b``)."""
    alias: str | None = None
    """The local name a module import binds (``from checkpointless.launch import cli``: ``cli``)."""
    used: tuple[str, ...] = ()
    """The attributes read through ``alias`` (``cli._Parser``: ``_Parser``)."""
    in_init: bool = False
    """The importer is a folder's ``__init__.py``."""


def module_name(file: str) -> str:
    parts = list(Path(file).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(sources: dict[str, str]) -> list[Import]:
    """Every import of a package module by a package module; ``sources`` maps a file path relative
    to the repository (``checkpointless/x.py``) to its text."""
    modules = {module_name(f): f for f in sources}
    found: list[Import] = []
    for file, text in sorted(sources.items()):
        me = module_name(file)
        package = me if file.endswith("__init__.py") else me.rpartition(".")[0]
        tree = ast.parse(text, file)
        used: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                used.setdefault(node.value.id, set()).add(node.attr)

        init = file.endswith("__init__.py")

        def bound(
            target: str, kind: str, alias: str | None, me: str = me, used: dict = used, init: bool = init
        ) -> Import:
            return Import(
                me, target, kind, alias=alias, used=tuple(sorted(used.get(alias or "", ()))), in_init=init
            )

        for node, kind in _walk_imports(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == PACKAGE:
                        found.append(bound(a.name, kind, a.asname))
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] != PACKAGE:
                continue
            plain = []
            for a in node.names:
                if f"{source}.{a.name}" in modules:  # from package import module
                    found.append(bound(f"{source}.{a.name}", kind, a.asname or a.name))
                else:
                    plain.append(a.name)
            if plain:
                found.append(Import(me, source, kind, tuple(plain), in_init=init))
    return found


def _walk_imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    out: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.append((child, kind))
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(child, "function" if kind == "module" else kind)
            elif isinstance(child, ast.If) and ast.unparse(child.test) in (
                "TYPE_CHECKING",
                "typing.TYPE_CHECKING",
            ):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), "type")
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), kind)
            else:
                visit(child, kind)

    visit(tree, "module")
    return out


def layer_of(module: str) -> int | None:
    rel = module.removeprefix(PACKAGE).removeprefix(".")
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            if rel == name or (name and rel.startswith(name + ".")):
                return i
    return None


def layering(found: list[Import]) -> dict[tuple[str, ...], str]:
    """(``layer``, importer, target) for each import of a layer above the importer's (a type-only
    import too: a lower layer that names an upper one's type knows it)."""
    out = {}
    for imp in found:
        low, high = layer_of(imp.importer), layer_of(imp.target)
        if low is not None and high is not None and high > low:
            out[("layer", imp.importer, imp.target)] = (
                f"{LAYERS[low][0]} imports {LAYERS[high][0]} ({imp.kind} level)"
            )
    return out


def circles(found: list[Import]) -> dict[tuple[str, ...], str]:
    """(``circle``, modules) for each set of modules that import one another at import time;
    (``function circle``, modules) where the circle closes only through imports inside functions.
    Imports under ``if TYPE_CHECKING:`` do not count. A module also loads the packages above it
    (their ``__init__``), the package's own root aside."""
    at_import: dict[str, set[str]] = {}
    at_run: dict[str, set[str]] = {}
    for imp in found:
        if imp.kind == "type":
            continue
        targets = {imp.target}
        parts = imp.target.split(".")
        for i in range(2, len(parts)):
            parent = ".".join(parts[:i])
            if not imp.importer.startswith(parent + ".") and imp.importer != parent:
                targets.add(parent)
        for t in targets - {imp.importer}:
            at_run.setdefault(imp.importer, set()).add(t)
            if imp.kind == "module":
                at_import.setdefault(imp.importer, set()).add(t)
    out: dict[tuple[str, ...], str] = {}
    hard = [c for c in _components(at_import) if len(c) > 1]
    for c in hard:
        out[("circle", *sorted(c))] = "import-time circle: " + _edges(c, at_import)
    for c in _components(at_run):
        if len(c) > 1 and c not in hard:
            out[("function circle", *sorted(c))] = "closed by imports inside functions: " + _edges(c, at_run)
    return out


def _edges(component: set[str], graph: dict[str, set[str]]) -> str:
    short = [f"{a} -> {b}" for a in sorted(component) for b in sorted(graph.get(a, ())) if b in component]
    return ", ".join(e.replace(PACKAGE + ".", "") for e in short)


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            out.append(comp)

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def reexports(found: list[Import]) -> dict[tuple[str, ...], str]:
    """(``re-export``, package, target) where a folder's ``__init__`` takes names from outside its
    own folder (the package's root, the public API, aside)."""
    out = {}
    for imp in found:
        if imp.kind == "type" or imp.importer == PACKAGE or not imp.names:
            continue
        if imp.in_init and not imp.target.startswith(imp.importer + "."):
            out[("re-export", imp.importer, imp.target)] = ", ".join(imp.names)
    return out


def private_names(found: list[Import]) -> dict[tuple[str, ...], str]:
    """(``private name``, importer, ``target._x``) where a module takes a private name from another
    one, by ``from target import _x`` or as ``module._x``: what crosses a file has a public name."""
    out = {}
    for imp in found:
        for name in (*imp.names, *imp.used):
            if name.startswith("_") and not name.startswith("__") and imp.target != imp.importer:
                how = "read as an attribute of the module" if name in imp.used else "imported by name"
                out[("private name", imp.importer, f"{imp.target}.{name}")] = how
    return out


def _package_sources() -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    files = sorted((root / PACKAGE).rglob("*.py"))
    sources = {p.relative_to(root).as_posix(): p.read_text() for p in files}
    return sources


def _known(rule: str, importer: str, why: str, targets: list[str]) -> dict[tuple[str, ...], str]:
    return {(rule, f"{PACKAGE}.{importer}".rstrip("."), f"{PACKAGE}.{t}"): why for t in targets}


KNOWN_LAYOUT: dict[tuple[str, ...], str] = {
    # (rule, module, what) -> why it is still there. The list may only shrink.
    **_known("re-export", "state", "checkpointless.state.IntegrityError, the import path users had before errors.py held every exception (tests/unit/test_errors.py keeps old paths working)", ["errors"]),
}  # fmt: skip

LAYOUT_RULES = {
    "layer": (layering, {"layer"}),
    "circle": (circles, {"circle", "function circle"}),
    "re-export": (reexports, {"re-export"}),
    "private name": (private_names, {"private name"}),
}


@pytest.fixture(scope="module")
def package_imports() -> list[Import]:
    return imports(_package_sources())


@pytest.mark.parametrize("rule", list(LAYOUT_RULES))
def test_every_folder_keeps_its_layer_and_no_import_circles(package_imports: list[Import], rule: str) -> None:
    """Every module of every folder (integrations/ and state/ included) imports only its own layer
    and the ones below, in no circle, and takes no private name from another module; today's
    exceptions are KNOWN_LAYOUT, which may only shrink."""
    from tests.unit.test_structure import ratchet

    check, kinds = LAYOUT_RULES[rule]
    known = [k for k in KNOWN_LAYOUT if k[0] in kinds]
    problems = ratchet(rule, check(package_imports), known, "tests/unit/test_layout.py KNOWN_LAYOUT")
    if problems:
        pytest.fail(problems, pytrace=False)


def test_every_module_has_a_layer_and_every_layer_entry_a_module() -> None:
    modules = {module_name(f) for f in _package_sources()}
    assert [m for m in sorted(modules) if layer_of(m) is None] == [], "place it in LAYERS"
    for _, names in LAYERS:
        for name in names:
            full = f"{PACKAGE}.{name}".rstrip(".")
            assert any(m == full or m.startswith(full + ".") for m in modules), f"LAYERS names {full}: gone"


def _crafted_imports(sources: dict[str, str]) -> list[Import]:
    return imports({f: textwrap.dedent(t) for f, t in sources.items()})


def test_the_layout_rules_can_fail() -> None:
    """Crafted modules: an import up the layers (a type-only one too), circles at import time and
    through a function, a folder re-exporting another's name, a private name taken by name and as
    a module's attribute, relative imports resolved."""
    found = _crafted_imports({
        "checkpointless/__init__.py": "",
        "checkpointless/config.py": """
            from typing import TYPE_CHECKING

            from checkpointless.errors import CheckpointlessError

            if TYPE_CHECKING:
                from checkpointless.session import Session
        """,
        "checkpointless/errors.py": "",
        "checkpointless/session.py": "from checkpointless.corpus import loader\n",
        "checkpointless/corpus/__init__.py": "",
        "checkpointless/corpus/loader.py": """
            from . import sampling
            from .sampling import _order


            def build():
                from checkpointless.corpus.sampling import make
        """,
        "checkpointless/corpus/sampling.py": """
            from checkpointless.corpus.loader import build
            from checkpointless.state.codec import _encode


            def make():
                from checkpointless.corpus import loader

                return loader._private_helper
        """,
        "checkpointless/state/__init__.py": "from checkpointless.control.plan import first_difference as first_difference\n",
        "checkpointless/state/codec.py": """
            def f():
                from checkpointless.launch import cli
        """,
        "checkpointless/control/__init__.py": "",
        "checkpointless/control/plan.py": "",
        "checkpointless/launch/__init__.py": "",
        "checkpointless/launch/cli.py": "from checkpointless.state.codec import f\n",
    })  # fmt: skip
    assert set(layering(found)) == {
        ("layer", "checkpointless.config", "checkpointless.session"),  # a type-only import
        ("layer", "checkpointless.session", "checkpointless.corpus.loader"),
        ("layer", "checkpointless.state.codec", "checkpointless.launch.cli"),
        ("layer", "checkpointless.state", "checkpointless.control.plan"),
    }
    assert set(circles(found)) == {
        ("circle", "checkpointless.corpus.loader", "checkpointless.corpus.sampling"),
        ("function circle", "checkpointless.launch.cli", "checkpointless.state.codec"),
    }
    assert set(reexports(found)) == {("re-export", "checkpointless.state", "checkpointless.control.plan")}
    assert set(private_names(found)) == {
        ("private name", "checkpointless.corpus.loader", "checkpointless.corpus.sampling._order"),
        ("private name", "checkpointless.corpus.sampling", "checkpointless.state.codec._encode"),
        ("private name", "checkpointless.corpus.sampling", "checkpointless.corpus.loader._private_helper"),
    }


def test_event_kinds_and_reasons_are_named_from_the_vocabulary() -> None:
    """No emitter or reader in the package or the benchmarks spells an event kind or a reason as a string."""
    import ast

    from checkpointless.protocol.vocab import Event, Phase, Reason

    # values that are also words of another vocabulary (fault kinds, roles, key names, dry-run rows)
    shared = {"exception", "fatal", "spare", "done", "starting", "start_failure", "compute"}
    words = {m.value for vocab in (Event, Phase, Reason) for m in vocab} - shared
    root = Path(__file__).resolve().parents[2]
    found = []
    for path in sorted([*(root / "checkpointless").rglob("*.py"), *(root / "bench").rglob("*.py")]):
        if path.name == "vocab.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in words:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    assert found == []


def test_the_declared_floors_are_what_ci_tests() -> None:
    """pyproject's torch floor is the version the Makefile installs for CI; Python's is the one running."""
    import re

    import torch

    root = Path(__file__).resolve().parents[2]
    pyproject = (root / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', pyproject)
    pinned = re.search(r"TORCH_SPEC \?= torch==(\d+)\.(\d+)\.\d+", (root / "Makefile").read_text())
    assert floor and pinned, "torch floor (pyproject) or pin (Makefile) not found"
    assert floor.groups() == pinned.groups(), "CI must test the torch floor that pyproject.toml declares"
    installed = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert installed >= tuple(int(x) for x in floor.groups())
    py = re.search(r'requires-python = ">=3\.(\d+)"', pyproject)
    assert py and sys.version_info[:2] >= (3, int(py.group(1)))
