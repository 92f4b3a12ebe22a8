"""Golden fault-free digests: the final state sha256 of the demo and of the tiny recipes, run
without a fault at fixed small sizes, equals the one recorded in ``tests/golden/digests.json``.

A refactor that must not change the numerics (the session's parts, the coordinator, the process
backend) is checked by these. The file is keyed per case by the environment that decides the
numbers: torch's version and ``torch.backends.cpu.get_cpu_capability()`` for every case, and for the
recipes also the Python version (their corpus is the standard library's own source) and the
versions of transformers (and peft) that build the model. A key not in the file (another torch,
another CPU) records the digest and skips, saying so: commit the file. A different digest under a
known key fails: changing the numbers is a decision to state in the commit, re-recorded with
``CHECKPOINTLESS_RECORD_GOLDEN=1``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "digests.json"
RECORD = "CHECKPOINTLESS_RECORD_GOLDEN"

# --hang-timeout: no spare, so a false hang on a loaded machine would fail the run (it changes no number)
_DEMO = ["demo", "--spares", "0", "--fault", "none", "--steps", "6", "--d-model", "32", "--layers", "1",
         "--global-batch", "16", "--seed", "0", "--hang-timeout", "10"]  # fmt: skip
_RECIPE = ["--spares", "0", "--set", "train.steps=4", "--set", "train.seed=0", "--set", "data.eval_every=0",
           "--set", "data.seq_len=32", "--set", "optim.warmup_steps=2", "--hang-timeout", "10"]  # fmt: skip


@dataclass(frozen=True)
class Case:
    name: str
    argv: tuple[str, ...]
    versions: tuple[str, ...] = ()
    """Distributions besides torch whose version is part of the key."""
    stdlib: bool = False
    """The Python version is part of the key (the recipes' corpus is the standard library's source)."""


def _recipe(name: str, recipe: str, *extra: str, versions: tuple[str, ...] = ("transformers",)) -> Case:
    argv = ("run", str(ROOT / "recipes" / f"{recipe}.yaml"), *_RECIPE, *extra)
    return Case(name, argv, versions, stdlib=True)


CASES = [
    Case("demo", (*_DEMO, "--workers", "2")),
    Case("demo-alone", (*_DEMO, "--workers", "1")),
    _recipe("llama-tiny", "llama-tiny"),
    _recipe("llama-tiny-hsdp2x2", "llama-tiny", "--workers", "4", "--set", "parallel.shards=2"),
    _recipe("gpt-oss-tiny", "gpt-oss-tiny"),
    _recipe("llama-tiny-lora", "llama-tiny-lora", versions=("transformers", "peft")),
    _recipe("gpt-oss-tiny-lora", "gpt-oss-tiny-lora", versions=("transformers", "peft")),
]
"""``demo`` runs in ``make test`` (a few seconds); the others are in tests/e2e.txt."""


def key_of(case: Case) -> str:
    parts = [f"torch {torch.__version__}", f"cpu {torch.backends.cpu.get_cpu_capability()}"]
    if case.stdlib:
        parts.append(f"python {sys.version_info.major}.{sys.version_info.minor}")
    parts += [f"{dist} {importlib.metadata.version(dist)}" for dist in case.versions]
    return ", ".join(parts)


def check_golden(path: Path, case: str, key: str, digest: str, *, record: bool) -> str | None:
    """Compare ``digest`` with the one recorded for (``case``, ``key``) in ``path``. Returns None when
    they agree; a message to skip with when the digest was recorded (a new key, or ``record``);
    raises AssertionError when it differs from the recorded one."""
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    table = json.loads(path.read_text()) if path.exists() else {}
    known = table.get(case, {}).get(key)
    if known == digest:
        return None
    if known is not None and not record:
        raise AssertionError(
            f"the fault-free numbers of {case!r} changed under {key!r}: {shown} holds {known}, "
            f"this run ends with {digest}. A refactor must not change them; if the change is meant "
            f"(new numerics), that is a decision to state in the commit: rerun with {RECORD}=1 to "
            f"re-record, and commit {shown} saying why the numbers changed."
        )
    table.setdefault(case, {})[key] = digest
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
    except OSError as e:  # a read-only checkout: say what would have been recorded
        return f"could not record {digest} for {case!r} under {key!r}: {shown} cannot be written ({e})"
    if known is None:
        return (
            f"no golden digest of {case!r} for {key!r} (another torch, CPU or library version): "
            f"recorded {digest} in {shown}; commit it so that later runs compare"
        )
    return f"re-recorded the golden digest of {case!r} for {key!r} ({RECORD}=1): {known} -> {digest}"


def run_fault_free(case: Case, out: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "checkpointless", *case.argv, "--quiet", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=270, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    digest = json.loads((out / "report.json").read_text())["final_state_sha256"]
    assert isinstance(digest, str) and len(digest) == 64, digest
    return digest


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault_free_digest_is_golden(case: Case, tmp_path: Path) -> None:
    digest = run_fault_free(case, tmp_path / "out")
    message = check_golden(GOLDEN, case.name, key_of(case), digest, record=os.environ.get(RECORD) == "1")
    if message is not None:
        pytest.skip(message)


def test_golden_file_compares_records_and_refuses(tmp_path: Path) -> None:
    """The comparison itself: agree, record a new key, refuse a change, re-record on request."""
    path = tmp_path / "digests.json"
    a, b = "a" * 64, "b" * 64
    recorded = check_golden(path, "demo", "torch 1 / cpu X", a, record=False)
    assert recorded is not None and "recorded" in recorded and "commit it" in recorded
    assert json.loads(path.read_text()) == {"demo": {"torch 1 / cpu X": a}}
    assert check_golden(path, "demo", "torch 1 / cpu X", a, record=False) is None
    with pytest.raises(AssertionError, match=f"changed.*{RECORD}=1"):
        check_golden(path, "demo", "torch 1 / cpu X", b, record=False)
    assert json.loads(path.read_text()) == {"demo": {"torch 1 / cpu X": a}}  # a failure writes nothing
    assert check_golden(path, "demo", "torch 2 / cpu X", b, record=False) is not None  # another torch
    again = check_golden(path, "demo", "torch 1 / cpu X", b, record=True)
    assert again is not None and "re-recorded" in again
    assert json.loads(path.read_text()) == {"demo": {"torch 1 / cpu X": b, "torch 2 / cpu X": b}}
    unwritable = check_golden(tmp_path / "missing" / "digests.json", "demo", "k", a, record=False)
    assert unwritable is not None and "cannot be written" in unwritable and a in unwritable


def test_every_recorded_case_is_one_the_test_runs() -> None:
    """A case renamed or dropped leaves no stale entry behind (the file stays what is checked)."""
    table = json.loads(GOLDEN.read_text())
    assert set(table) <= {c.name for c in CASES}, set(table) - {c.name for c in CASES}
    assert all(len(d) == 64 for by_key in table.values() for d in by_key.values())
