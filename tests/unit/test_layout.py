"""The layers are folders, and the boundary holds: the public API pulls in no periphery."""

from __future__ import annotations

import json
import subprocess
import sys

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
