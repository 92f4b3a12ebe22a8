"""The private members of transformers, accelerate and Lightning that the integrations use, pinned
(STYLE.md items 18 and 23): one test per entry of ``integrations._hf_compat.PINS`` and
``integrations.lightning._compat.PINS`` that fails when a release changes the member, the releases
the pins ran on, and no other private member of theirs touched outside those two modules."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import re
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet

from checkpointless._compat import Pin

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from checkpointless.integrations import _hf_compat
from checkpointless.integrations.lightning import _compat as lightning_compat

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
INTEGRATIONS = ROOT / "checkpointless" / "integrations"
COMPAT = {INTEGRATIONS / "_hf_compat.py", INTEGRATIONS / "lightning" / "_compat.py"}
PINS = [*_hf_compat.PINS, *lightning_compat.PINS]


def _resolve(path: str) -> Any:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _parameters(owner: Any, name: str) -> list[inspect.Parameter]:
    """``owner.name``'s parameters, without ``self`` for a method of a class."""
    params = list(inspect.signature(getattr(owner, name)).parameters.values())
    static = isinstance(inspect.getattr_static(owner, name), staticmethod | classmethod)
    return params if static or not inspect.isclass(owner) else params[1:]


def _ours(pin: Pin) -> Any:
    """The integration's class that overrides ``pin`` where it subclasses the host's (else None)."""
    if pin.owner == "transformers:Trainer":
        from checkpointless.integrations.transformers import Trainer

        return Trainer
    return None


@pytest.mark.parametrize("pin", PINS, ids=[f"{p.owner.split(':')[1]}.{p.name}" for p in PINS])
def test_pin(pin: Pin) -> None:
    owner = _resolve(pin.owner)
    if pin.use == "attribute":
        source = inspect.getsource(_resolve(pin.where))
        assigned = re.compile(rf"\.{re.escape(pin.name)}\s*(?::[^=\n]+)?=(?!=)")
        assert assigned.search(source), f"{pin.where} no longer assigns {pin.name}"
        return
    assert pin.use in ("call", "override"), pin.use
    assert hasattr(owner, pin.name), f"{pin.owner} has no {pin.name}"
    assert callable(getattr(owner, pin.name))
    params = _parameters(owner, pin.name)
    names = [p.name for p in params]
    if pin.use == "override":  # called by the host with its parameters: ours take the same
        assert names == list(pin.params), (
            f"{pin.owner}.{pin.name}{inspect.signature(getattr(owner, pin.name))}"
        )
        ours = _ours(pin)
        if ours is not None:
            assert [p.name for p in _parameters(ours, pin.name)] == names
        return
    # called with pin.params first (by position or by name), the rest left to their defaults
    assert names[: len(pin.params)] == list(pin.params), (
        f"{pin.owner}.{pin.name}{inspect.signature(getattr(owner, pin.name))}"
    )
    rest = params[len(pin.params) :]
    assert all(
        p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in rest
    ), f"{pin.name}: parameters without a default that the integration does not pass: {rest}"


def _extra(name: str) -> dict[str, SpecifierSet]:
    """The distributions of pyproject.toml's extra ``name`` and their version ranges."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    out = {}
    for requirement in pyproject["project"]["optional-dependencies"][name]:
        dist, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement).groups()  # type: ignore[union-attr]
        out[dist] = SpecifierSet(spec)
    return out


@pytest.mark.parametrize(
    ("extra", "tested"), [("transformers", _hf_compat.TESTED), ("lightning", lightning_compat.TESTED)]
)
def test_the_pins_ran_on_the_installed_releases_inside_the_extras(extra: str, tested: dict[str, Any]) -> None:
    ranges = _extra(extra)
    assert set(tested) == set(ranges), (tested, ranges)
    for dist, (major, minor) in tested.items():
        assert ranges[dist].contains(f"{major}.{minor}"), (
            f"{dist} {major}.{minor} is outside the extra's {ranges[dist]}"
        )
        installed = tuple(int(x) for x in importlib.metadata.version(dist).split(".")[:2])
        # a fresh install takes the newest release inside the extra: the pins above decide whether
        # it still works; a release they never ran on is said, not failed (as torch's gate does)
        if installed != (major, minor):
            warnings.warn(
                f"{dist} {installed[0]}.{installed[1]} is installed, the pins record {major}.{minor}: if "
                "these pins pass on it, record it in TESTED",
                stacklevel=1,
            )


def _host_members() -> set[str]:
    """The private members of the host classes the integrations subclass."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy
    from transformers import Seq2SeqTrainer

    return {n for c in (Seq2SeqTrainer, ParallelStrategy, pl.Callback) for n in dir(c) if n.startswith("_")}


def test_no_private_host_member_outside_the_compat_modules() -> None:
    """Outside the two compatibility modules, a private name an integration touches is its own
    (defined in ``integrations/``, none of the host classes' own) or an override pinned there; a
    pinned member that is called or set is reached only through its function."""
    files = [p for p in sorted(INTEGRATIONS.rglob("*.py")) if p not in COMPAT]
    trees = {p: ast.parse(p.read_text()) for p in files}
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                own.add(node.attr)
    overrides = {p.name for p in PINS if p.use == "override"}
    reached = {p.name for p in PINS if p.use != "override"}
    host = _host_members()
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "name", None)
            if not isinstance(node, ast.Attribute | ast.FunctionDef) or not isinstance(name, str):
                continue
            if not name.startswith("_") or name.startswith("__") or name in overrides:
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
            if name in reached:
                found.append(where + " (reach it through its compat function)")
            elif name not in own or name in host:
                found.append(where + " (a host library's private member: pin it in a compat module)")
    assert found == []


def test_the_scan_can_fail() -> None:
    """A host member the scan must name: one of transformers.Trainer's privates is in ``_host_members``."""
    assert {"_get_train_sampler", "_save_checkpoint", "_inner_training_loop"} <= _host_members()
