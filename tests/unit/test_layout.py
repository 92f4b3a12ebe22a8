"""The layers are folders, and the boundary holds: the public API pulls in no periphery."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PERIPHERY = ("transformers", "matplotlib", "rich", "prometheus_client", "yaml",
             "checkpointless.launch", "checkpointless.observe", "checkpointless.analysis",
             "checkpointless.recipes", "checkpointless.models")  # fmt: skip


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
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "checkpointless"
    core = [
        *(p for p in root.glob("*.py") if p.name != "__main__.py"),
        *(root / "control").glob("*.py"),
        *(root / "data").glob("*.py"),
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


def test_event_kinds_and_reasons_are_named_from_the_vocabulary() -> None:
    """No emitter or reader in the package or the benchmarks spells an event kind or a reason as a string."""
    import ast

    from checkpointless.control.vocab import Event, Phase, Reason

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
