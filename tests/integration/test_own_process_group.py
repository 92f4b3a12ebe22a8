"""An unported script under the launcher starts a process group of its own (issue 43): torch's
``init_process_group("gloo")``, or accelerate's ``Accelerator()`` (which starts one when it sees
``LOCAL_RANK``). The job ends at once, non-zero, with one line that says so and points at the
porting guide and the integrations; no spare is spent on it and no traceback reaches the console."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

import pytest

from tests.integration.test_cli import cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

SCRIPTS = {
    "init_process_group": 'import torch.distributed as dist\ndist.init_process_group("gloo")\nprint("formed")\n',
    "accelerate": 'from accelerate import Accelerator\nAccelerator()\nprint("formed")\n',
}


@pytest.mark.parametrize("how", list(SCRIPTS))
def test_a_process_group_of_the_scripts_own_ends_the_job_in_one_line(how: str, tmp_path: Path) -> None:
    if how == "accelerate" and importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed")
    script, out = tmp_path / "train.py", tmp_path / "run"
    script.write_text(SCRIPTS[how])
    began = time.monotonic()
    # TMPDIR: the launcher keeps a failed job's process logs in a temporary directory
    r = cli("launch", "--workers", "2", "--spares", "1", "--quiet", "--out", str(out), "--",
            "python", str(script), env={"TMPDIR": str(tmp_path)})  # fmt: skip
    assert time.monotonic() - began < 30, "the job did not end promptly"
    assert r.returncode == 1, r.stderr
    console = r.stdout + r.stderr
    assert "Traceback" not in console, console
    assert len([line for line in r.stderr.splitlines() if line.startswith("error:")]) == 1, r.stderr
    error = " ".join(r.stderr[r.stderr.index("error:") :].split())  # the console wraps it at COLUMNS
    assert re.match(r"error: w[01] started a torch\.distributed process group of its own", error), error
    assert "docs/guide/porting.md" in error and "checkpointless.integrations" in error, error
    report = json.loads((out / "report.json").read_text())
    assert "started a torch.distributed process group of its own" in report["error"], report["error"]
    kinds = [json.loads(line)["kind"] for line in (out / "events.jsonl").read_text().splitlines()]
    assert "spare_assigned" not in kinds, kinds  # a script's mistake: no spare is spent on it
