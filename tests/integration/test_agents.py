"""A job on several hosts with the coordinator and the agents started by hand, as on a cluster
(here every host on this machine's loopback, each agent with its own host name): a killed host is
replaced bitwise; the coordinator's loss stops every agent and process within the lease."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpointless.control.auth import new_secret, write_secret_file
from checkpointless.launch.demo import DemoModel, worker_command
from checkpointless.observe.fields import unpacked
from tests.jobs import COMMITTED, pids_whose_command

CLI = [sys.executable, "-m", "checkpointless"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
HANG = "2"  # every host shares this machine's cores (as cluster's default)


def _digest(text: str) -> str:
    return (
        next(ln for ln in text.splitlines() if ln.startswith("final state sha256:")).split(":", 1)[1].strip()
    )


class Job:
    """A coordinator and one agent per host, started by hand."""

    def __init__(
        self, tmp: Path, steps: int, fault: str, seed: int, extra_of: dict[str, list[str]] | None = None
    ) -> None:
        self.secret = tmp / "secret"
        write_secret_file(self.secret, new_secret())
        self.out = tmp / "out"
        self.coordinator_err = tmp / "coordinator.err"
        self.coordinator = subprocess.Popen(
            [*CLI, "coordinator", "--nodes", "2", "--nproc-per-node", "1", "--spare-nodes", "1",
             "--secret-file", str(self.secret), "--steps", str(steps), "--fault", fault, "--seed", str(seed),
             "--hang-timeout", HANG, "--out", str(self.out), "--quiet", "--join-timeout", "120"],
            stdout=subprocess.DEVNULL, stderr=self.coordinator_err.open("w"), env=ENV,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        m = None
        while m is None and time.monotonic() < deadline and self.coordinator.poll() is None:
            m = re.search(r"listening on (\S+);", self.coordinator_err.read_text())
            time.sleep(0.1)
        assert m, self.coordinator_err.read_text()
        self.addr = m.group(1)
        self.command = worker_command(DemoModel(steps=steps, seed=seed, global_batch=16))
        # their output to files: a pipe no one reads fills up and blocks the writer
        self.errs = {host: tmp / f"agent-{host}.err" for host in "abc"}
        self.agents = {
            host: subprocess.Popen(
                [
                    *CLI,
                    "agent",
                    "--coordinator",
                    self.addr,
                    "--secret-file",
                    str(self.secret),
                    "--nproc-per-node",
                    "1",
                    "--host-name",
                    host,
                    "--log-dir",
                    str(tmp / "logs" / host),
                    *extra,
                    *(extra_of or {}).get(host, []),
                    "--",
                    *self.command,
                ],
                stdout=subprocess.DEVNULL,
                stderr=self.errs[host].open("w"),
                env=ENV,
            )
            for host, extra in (("a", ["--node-rank", "0"]), ("b", ["--node-rank", "1"]), ("c", ["--spare"]))
        }

    def close(self) -> None:
        for p in (self.coordinator, *self.agents.values()):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def _workers_of(seed: int) -> list[int]:
    """Pids of the demo processes of this test (their command line carries its seed)."""
    token = f'"seed": {seed},'
    return pids_whose_command(
        lambda cmd: "checkpointless.launch.demo" in cmd and token in cmd and " agent " not in cmd
    )


@pytest.mark.timeout(400)
def test_agents_started_by_hand_replace_a_killed_host_bitwise(tmp_path: Path) -> None:
    job = Job(tmp_path, steps=12, fault="kill:node=1@step=5", seed=7)
    try:
        job.coordinator.wait(timeout=300)
        assert job.coordinator.returncode == 0, job.coordinator_err.read_text()[-3000:]
        codes = {h: a.wait(timeout=60) for h, a in job.agents.items()}
    finally:
        job.close()
    assert codes["a"] == 0 and codes["c"] == 0 and codes["b"] == -signal.SIGKILL, codes  # b lost power
    ref = subprocess.run(
        [*CLI, "demo", "--workers", "2", "--spares", "0", "--steps", "12", "--seed", "7", "--fault", "none",
         "--quiet"],
        capture_output=True, text=True, timeout=300, env=ENV,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    report = json.loads((job.out / "report.json").read_text())
    assert report["final_state_sha256"] == _digest(ref.stderr) != "None"
    events = [json.loads(line) for line in (job.out / "events.jsonl").read_text().splitlines()]
    assert [e["host"] for e in events if e["kind"] == "host_lost"] == ["b"]
    assert [e["target"] for e in events if e["kind"] == "spare_assigned"] == ["s0"]
    assert _workers_of(7) == []


@pytest.mark.timeout(300)
def test_losing_the_coordinator_stops_every_agent_and_process_within_the_lease(tmp_path: Path) -> None:
    """SIGKILL of the coordinator's process: every agent fences its host (kills its processes,
    exit 3, saying why) within its lease plus a margin; the events up to the loss are on disk."""
    job = Job(tmp_path, steps=100000, fault="none", seed=8)
    try:
        events = job.out / "events.jsonl"
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not COMMITTED.search(
            events.read_text() if events.exists() else ""
        ):
            time.sleep(0.2)
        assert len(_workers_of(8)) == 3  # two workers and the spare host's spare
        job.coordinator.send_signal(signal.SIGKILL)
        lost = time.monotonic()
        codes = {h: a.wait(timeout=60) for h, a in job.agents.items()}
        took = time.monotonic() - lost
        errs = {h: job.errs[h].read_text() for h in job.agents}
    finally:
        job.close()
    assert codes == {"a": 3, "b": 3, "c": 3}, (codes, errs)
    lease = 4 * float(HANG) / 2  # the agents' lease: half the host timeout
    assert took < lease + 5, took
    assert all("lost the coordinator" in e for e in errs.values()), errs
    time.sleep(1)
    assert _workers_of(8) == []
    assert COMMITTED.search(events.read_text())


@pytest.mark.timeout(300)
def test_agents_waiting_out_their_rejoin_window_for_a_dead_coordinator_stay_quiet(tmp_path: Path) -> None:
    """SIGKILL of the coordinator, agents with a rejoin window: each fences its host, waits the window
    out retrying the coordinator, then exits 3, writing a few lines to its stderr, not a stream of
    the store client's stack traces (one per failed attempt, 20 a second, before)."""
    window = 6.0
    job = Job(tmp_path, steps=100000, fault="none", seed=9,
              extra_of={h: ["--rejoin-window", str(window)] for h in ("a", "b", "c")})  # fmt: skip
    try:
        events = job.out / "events.jsonl"
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not COMMITTED.search(
            events.read_text() if events.exists() else ""
        ):
            time.sleep(0.2)
        job.coordinator.send_signal(signal.SIGKILL)
        lost = time.monotonic()
        codes = {h: a.wait(timeout=90) for h, a in job.agents.items()}
        took = time.monotonic() - lost
        errs = {h: job.errs[h].read_text() for h in job.agents}
    finally:
        job.close()
    assert codes == {"a": 3, "b": 3, "c": 3}, (codes, errs)
    assert took > window, took  # they waited the window out
    for host, text in errs.items():
        assert "did not come back" in text, text[-2000:]
        # the store client's warning (with its C++ stack) once per connection as it breaks, at most
        warnings = [ln for ln in text.splitlines() if ln.startswith("[W")]
        assert len(warnings) <= 6 and len(text) < 20_000, (host, len(text), warnings)


@pytest.mark.timeout(400)
def test_a_host_whose_clock_is_30_s_ahead_reports_on_the_coordinators_time(tmp_path: Path) -> None:
    """Host a's processes stamp their events and heartbeats 30 s ahead (``agent --clock-skew``:
    libfaketime breaks Python's timed waits, Debian's 0.9.10 fails ``time.sleep`` with EINVAL when
    it leaves the monotonic clock alone and hangs ``Event.wait`` when it does not); host b is lost
    at step 5. Every event lands on the coordinator's clock: the ranks' commits of one step on the
    two hosts are close together, the recovery's stall is seconds (not 30 more or less), the
    report names the skewed host's offset."""
    job = Job(tmp_path, steps=12, fault="kill:node=1@step=5", seed=9, extra_of={"a": ["--clock-skew", "30"]})
    try:
        job.coordinator.wait(timeout=300)
        assert job.coordinator.returncode == 0, job.coordinator_err.read_text()[-3000:]
    finally:
        job.close()
    report = json.loads((job.out / "report.json").read_text())
    offsets = report["clock_offsets"]
    assert set(offsets) == {"a"}, offsets  # a's relay; b, c and the coordinator share a clock
    assert abs(offsets["a"]["offset_s"] - 30) < 0.5, offsets
    events = [json.loads(line) for line in (job.out / "events.jsonl").read_text().splitlines()]
    commits: dict[int, dict[str, float]] = {}
    for e in unpacked(events):  # a host's commits come packed (``observe.fields.commits``)
        if e["kind"] == "step_committed":
            commits.setdefault(e["step"], {})[e["proc"]] = e["t"]
    together = [s for s, by in commits.items() if len(by) == 2]
    assert together, commits
    for s in together:
        a, b = commits[s].values()
        assert abs(a - b) < 2.0, (s, commits[s])
    stalls = [f["stall_s"] for f in report["faults"]]
    assert len(stalls) == 1 and 0 < stalls[0] < 25, report["faults"]
