"""A finished job leaves nothing running in the process that launched it: the control store's
server (a c10d ``TCPStore``: a thread, a listener and its connections) ends when ``Launcher.run``
returns, not at a later full collection of the launcher's reference cycles (a test session or a
notebook running many jobs in one process kept every job's server: over a thousand descriptors)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from checkpointless.launch.launcher import Launcher
from tests.jobs import run_job

pytestmark = pytest.mark.timeout(120)


def _store_threads() -> int:
    n = 0
    for task in os.listdir("/proc/self/task"):
        try:
            n += Path(f"/proc/self/task/{task}/comm").read_text().strip() == "pt_tcpstore_uv"
        except OSError:
            continue  # a thread that ended meanwhile
    return n


def test_the_control_store_ends_with_the_job(tmp_path: Path) -> None:
    gc.collect()  # whatever earlier tests left in cycles goes now, not during the job
    before = _store_threads()
    held: list[Launcher] = []
    gc.disable()  # no collection may end the server for the launcher
    try:
        result = run_job(workers=1, spares=0, steps=3, out=tmp_path / "run", launcher=held)
        after = _store_threads()
    finally:
        gc.enable()
    assert result.ok, result.error
    assert after == before
    with pytest.raises(RuntimeError, match="control store is closed"):
        held[0].store.set("probe", "1")
