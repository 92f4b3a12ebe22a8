"""A rerun into the same ``--out`` sets the run there aside and never loses the last complete run,
even when its launcher is killed in the middle of doing so (the kill is simulated at each rename)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from checkpointless.launch.outputs import set_aside_previous_run

pytestmark = pytest.mark.timeout(30)


class _Killed(BaseException):
    """The launcher died here (nothing after this point ran)."""


def _run_files(d: Path, job: str, *, complete: bool) -> None:
    """What a run leaves in ``d``: its events and logs, and its report if it completed."""
    (d / "logs").mkdir(parents=True)
    (d / "logs" / "w0.log").write_text(f"log of {job}\n")
    (d / "events.jsonl").write_text(json.dumps({"kind": "job_started", "job_id": job}) + "\n")
    if complete:
        (d / "report.json").write_text(json.dumps({"job_id": job}))
        (d / "summary.txt").write_text(f"summary of {job}\n")


def _files(d: Path) -> dict[str, str]:
    """Every file under ``d`` (relative path -> text)."""
    return {str(p.relative_to(d)): p.read_text() for p in sorted(d.rglob("*")) if p.is_file()}


def _job(d: Path) -> str:
    return str(json.loads((d / "report.json").read_text())["job_id"])


def _set_aside(out: Path, monkeypatch: pytest.MonkeyPatch, kill_at: int = 0) -> int:
    """Set ``out``'s run aside, the launcher dying just before its ``kill_at``-th rename (0: never);
    how many renames it made."""
    calls = [0]
    real = os.replace

    def replace(*args: Any) -> None:
        calls[0] += 1
        if calls[0] == kill_at:
            raise _Killed
        real(*args)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        if kill_at:
            with pytest.raises(_Killed):
                set_aside_previous_run(out)
        else:
            set_aside_previous_run(out)
    return calls[0]


def _scenario(root: Path, *, last_complete: bool) -> Path:
    out = root / "run"
    _run_files(out / "previous", "A", complete=True)
    _run_files(out, "B", complete=last_complete)
    return out


def _not_previous(out: Path) -> dict[str, str]:
    return {k: v for k, v in _files(out).items() if not k.startswith("previous/")}


@pytest.mark.parametrize("last_complete", [True, False], ids=["complete", "killed-before-its-report"])
def test_set_aside_without_a_kill(tmp_path: Path, last_complete: bool) -> None:
    out = _scenario(tmp_path, last_complete=last_complete)
    b = _not_previous(out)
    set_aside_previous_run(out)
    if last_complete:  # B replaces A as the previous complete run
        assert _files(out / "previous") == b and _job(out / "previous") == "B"
    else:  # B never completed: A stays the previous complete run, B is kept beside it
        assert _job(out / "previous") == "A"
        assert _files(out / "unfinished") == b
    assert sorted(p.name for p in out.iterdir()) == ["previous"] + ([] if last_complete else ["unfinished"])


@pytest.mark.parametrize("last_complete", [True, False], ids=["complete", "killed-before-its-report"])
def test_a_launcher_killed_while_it_sets_a_run_aside_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, last_complete: bool
) -> None:
    """Killed before any of its renames: nothing of the last complete run is gone, and the next
    launcher completes the move as if nothing had happened."""
    clean = _scenario(tmp_path / "clean", last_complete=last_complete)
    renames = _set_aside(clean, monkeypatch)
    expected = _files(clean)
    assert renames >= 3
    for n in range(1, renames + 1):
        out = _scenario(tmp_path / f"killed-{n}", last_complete=last_complete)
        last = _not_previous(out) if last_complete else _files(out / "previous")
        _set_aside(out, monkeypatch, kill_at=n)
        # every file of the last complete run still exists, somewhere under out/
        now = {str(p.relative_to(out)): p.read_text() for p in out.rglob("*") if p.is_file()}
        for rel, text in last.items():
            assert any(k.endswith(rel) and v == text for k, v in now.items()), (n, rel, now)
        set_aside_previous_run(out)  # the next run's launcher
        assert _files(out) == expected, n
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")], n
        set_aside_previous_run(out)  # and the one after it (nothing new in out/ meanwhile)
        assert _files(out) == expected, n
