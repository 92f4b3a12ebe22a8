"""Hardening: real processes, real signals, real sockets, real full disks; no mock of the logic.

What the launcher promises (``checkpointless/launch/launcher.py``, module doc), tried the hard way:

1. children die with the launcher at any moment; a stranger on the port (a process of another job:
   tests/scripts/adv_stranger.py) can neither forge nor destroy what steers a job, nor join its group;
2. the control store listens on 127.0.0.1 only;
3. SIGTERM / SIGINT stop a job with a partial report, one error line, exit 143 / 130 and nothing
   left behind; events reach ``events.jsonl`` while the job runs (a SIGKILL keeps them);
4. a previous run's files are set aside, outputs are written atomically, a full disk is an error
   line and not a traceback;
6. no ``/dev/shm/checkpointless-<job id>`` directory outlives a job (checked after every job here:
   tests/scripts/adv_shm_train.py caches its batches there, as recipes do).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from checkpointless.cli.job_run import print_result
from checkpointless.config import JobConfig, RecoveryConfig
from checkpointless.control.coordinator import Coordinator, JobFailed
from checkpointless.corpus.shm_cache import ShmBatchCache
from checkpointless.fault_grammar import parse_faults
from checkpointless.launch.launcher import JobResult, Launcher, open_store
from checkpointless.protocol import keys
from tests.jobs import logs_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
STEPS = 10
FAKE_DIGEST = "0" * 64  # what the stranger reports as the final state (tests/scripts/adv_stranger.py)


# -- processes ------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    # a wide console: the CLI's lines are not wrapped, so they can be matched whole
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "250"}


def _cli(*args: str, stdout: Any = subprocess.PIPE, tmp: Path | None = None) -> subprocess.Popen[str]:
    """``checkpointless ARGS`` as a launcher of its own, in a session of its own (``tmp``: its TMPDIR)."""
    env = _env() if tmp is None else {**_env(), "TMPDIR": str(tmp)}
    return subprocess.Popen(
        [sys.executable, "-m", "checkpointless", *args], cwd=REPO, env=env, text=True,
        stdout=stdout, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def _children(pid: int) -> set[int]:
    """Live descendants of ``pid`` (every thread's list of children: a child belongs to the thread
    that forked it; the job's processes are the fork server's children, ``launch/forkserver.py``)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                with contextlib.suppress(OSError):
                    new = {int(p) for p in (task / "children").read_text().split()} - found
                    found |= new
                    todo.extend(new)
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _ours(pid: int) -> bool:
    """A process one of these tests started (guards the final kills against a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"checkpointless" in cmdline or b"adv_" in cmdline


def _kill(pids: set[int] | list[int]) -> None:
    for pid in pids:
        if _alive(pid) and _ours(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # every child leads a session (and group) of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _wait_gone(pids: set[int], within_s: float) -> list[int]:
    """The pids still alive after ``within_s`` seconds (polling)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = sorted(p for p in pids if _alive(p))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@contextlib.contextmanager
def _launcher_tree(proc: subprocess.Popen[str]) -> Iterator[set[int]]:
    """Yield the set of children seen (tests add to it); on exit, kill whatever is left of the tree."""
    seen: set[int] = set()
    try:
        yield seen
    finally:
        seen |= _children(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError, OSError):
                proc.communicate(timeout=10)
        _kill(seen)


def _poll(
    until: Callable[[], bool],
    timeout_s: float,
    what: str,
    proc: subprocess.Popen[str] | None = None,
    seen: set[int] | None = None,
) -> None:
    """Poll ``until`` every 20 ms (collecting ``proc``'s children into ``seen``); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not until():
        if proc is not None and seen is not None:
            seen |= _children(proc.pid)
        if proc is not None and proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"the launcher exited ({proc.returncode}) before {what}:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


# -- files ----------------------------------------------------------------------------------------


def _events(path: Path) -> list[dict[str, Any]]:
    """Every line of an events.jsonl, each a JSON object (fails on a torn or garbled line)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _commits(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.read_text().count('"step_committed"')
    return 0


def _steps_done(path: Path, ranks: int) -> int:
    """The steps every one of ``ranks`` ranks has committed in the file so far (its lowest rank's
    count): total commits alone can be one step of each of 4 ranks."""
    top: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            if '"step_committed"' in line:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    ev = json.loads(line)
                    top[int(ev["rank"])] = max(top.get(int(ev["rank"]), -1), int(ev["step"]))
    return min(top.values()) + 1 if len(top) >= ranks else 0


def _job_id(events: list[dict[str, Any]]) -> str:
    (started,) = [e for e in events if e["kind"] == "job_started"]
    return str(started["job_id"])


def _shm_dir(job_id: str) -> Path:
    """The job's node cache directory (``/dev/shm/checkpointless-<job id>``); the handle creates nothing."""
    return ShmBatchCache(job_id, cleanup_on_exit=False).path


def _no_traceback(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr[-4000:]


def _text(path: Path) -> str:
    """A file's text, or "" while it does not exist."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _interrupt(proc: subprocess.Popen[str], seen: set[int], out: Path) -> str:
    """Ctrl-C to a launcher started by ``_cli``: it exits 130 with one error line and no traceback,
    its event log ends with ``job_finished``, and none of its children is left; its stderr."""
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=40)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    _no_traceback(stderr)
    assert len([ln for ln in stderr.splitlines() if ln.startswith("error:")]) == 1, stderr
    assert _events(out / "events.jsonl")[-1]["kind"] == "job_finished"
    left = _wait_gone(seen, 5)
    assert len(seen) >= 4 and not left, f"children {sorted(seen)}, alive after exit: {left}"
    return stderr


# -- in-process jobs --------------------------------------------------------------------------------


def _launcher(
    *, seed: int = 1, spares: int = 1, faults: list[str] | None = None, port: int = 0, out: Path | None = None,
    steps: int = STEPS, pause_s: float = 0.0, timeout_s: float = 60.0,
) -> Launcher:  # fmt: skip
    """A 2-worker job of ``_script(...)`` (seed in the job config too), as ``checkpointless launch``."""
    job = JobConfig(
        workers=2, spares=spares, seed=seed, faults=parse_faults(faults or []),
        recovery=RecoveryConfig(hang_timeout_s=2.0, collective_timeout_s=30.0, plan_timeout_s=60.0),
    )  # fmt: skip
    command = _script(steps=steps, pause_s=pause_s, seed=seed)
    return Launcher(job, command, total_steps=steps, port=port, out_dir=out, timeout_s=timeout_s)


def _run(launcher: Launcher) -> JobResult:
    """Run the job; whatever happens, leave none of its processes behind (and check that it didn't)."""
    try:
        result = launcher.run()
    finally:
        pids = {c.popen.pid for c in launcher.children.values()}
        left = _wait_gone(pids, 5)
        _kill(pids)
    assert not left, f"processes left behind by the launcher: {left}"
    assert not _shm_dir(launcher.job_id).exists(), f"{_shm_dir(launcher.job_id)} outlived the job"
    return result


def _script(steps: int = STEPS, pause_s: float = 0.0, seed: int = 0) -> list[str]:
    """tests/scripts/adv_shm_train.py: a Session job that keeps its batches in the /dev/shm node cache."""
    return [sys.executable, str(SCRIPTS / "adv_shm_train.py"), str(steps), str(pause_s), str(seed)]


_DIGESTS: dict[tuple[int, int], str] = {}  # (seed, steps) -> final state of the fault-free, undisturbed job


def _reference_digest(seed: int, steps: int = STEPS) -> str:
    """Final state of the fault-free, undisturbed job of ``_script(steps, seed=seed)`` (run once per
    session)."""
    if (seed, steps) not in _DIGESTS:
        result = _run(_launcher(seed=seed, spares=0, steps=steps))
        assert result.ok and result.digest, f"{result.error}\n{logs_of(result)}"
        _DIGESTS[seed, steps] = result.digest
    return _DIGESTS[seed, steps]


# -- sockets ----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listeners(port: int) -> list[str]:
    """Local addresses of the sockets listening on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                address, hexport = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


LOOPBACK = {
    "0100007F",  # 127.0.0.1
    "00000000000000000000000001000000",  # ::1
    "0000000000000000FFFF00000100007F",  # ::ffff:127.0.0.1
}


def _other_addresses() -> list[tuple[int, str]]:
    """This machine's non-loopback addresses, as (family, address)."""
    found: set[tuple[int, str]] = set()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout
        for addr in out.split():
            found.add((socket.AF_INET6 if ":" in addr else socket.AF_INET, addr))
    with contextlib.suppress(OSError):
        for family, _, _, _, sockaddr in socket.getaddrinfo(socket.gethostname(), None):
            found.add((family, str(sockaddr[0])))
    return sorted((f, a) for f, a in found if not a.startswith(("127.", "::1")) and not a.startswith("fe80"))


# == 1. orphans ======================================================================================


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("children", "delay_s"),
    [(1, 0.0), (3, 0.3)],
    ids=["at-its-first-fork", "while-children-import-torch"],
)
def test_children_die_with_a_sigkilled_launcher(children: int, delay_s: float, tmp_path: Path) -> None:
    # TMPDIR: a killed launcher cannot remove its temporary log directory
    proc = _cli("demo", "--workers", "2", "--spares", "1", "--steps", "50", "--quiet", "--fault", "none",
                "--d-model", "32", "--layers", "1", stdout=subprocess.DEVNULL, tmp=tmp_path)  # fmt: skip
    with _launcher_tree(proc) as seen:
        deadline = time.monotonic() + 30
        while len(seen) < children:  # tight: the first child is caught as early as possible
            seen |= _children(proc.pid)
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the launcher started no children within 30 s"
            time.sleep(0.001)
        time.sleep(delay_s)
        seen |= _children(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        left = _wait_gone(seen, 5)
        assert not left, f"children of a SIGKILLed launcher still alive 5 s later: {left} (of {sorted(seen)})"


# == 4a. a previous run's files (this run is also the seed-1 reference of the stranger tests) =======


@pytest.mark.timeout(60)
def test_new_run_sets_the_previous_run_aside(tmp_path: Path) -> None:
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "report.json").write_text(json.dumps({"job_id": "old", "error": None}))
    (out / "events.jsonl").write_text(json.dumps({"t": 0, "kind": "job_started", "job_id": "old"}) + "\n")
    (out / "timeline.png").write_bytes(b"\x89PNG old")
    (out / "summary.txt").write_text("old summary\n")
    (out / "logs" / "w0.log").write_text("old log\n")
    launcher = _launcher(seed=1, spares=0, out=out)
    result = _run(launcher)  # (6.) checks that no /dev/shm/checkpointless-<job id> is left
    assert result.ok and result.digest, f"{result.error}\n{logs_of(result)}"
    assert _DIGESTS.setdefault(1, result.digest) == result.digest  # the reference of the stranger tests
    report = json.loads((out / "report.json").read_text())
    assert report["job_id"] == launcher.job_id != "old"
    assert _job_id(_events(out / "events.jsonl")) == launcher.job_id
    assert not (out / "timeline.png").exists() and not (out / "summary.txt").exists()
    assert "old log" not in (out / "logs" / "w0.log").read_text()
    previous = out / "previous"
    assert json.loads((previous / "report.json").read_text())["job_id"] == "old"
    assert (previous / "timeline.png").read_bytes() == b"\x89PNG old"
    assert (previous / "summary.txt").read_text() == "old summary\n"
    assert (previous / "logs" / "w0.log").read_text() == "old log\n"
    assert _job_id(_events(previous / "events.jsonl")) == "old"
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary file left


@pytest.mark.timeout(90)
def test_reruns_killed_at_their_start_keep_the_last_complete_run(tmp_path: Path) -> None:
    """Two reruns into the same --out, each SIGKILLed as soon as it has started (its events.jsonl
    exists): the last complete run (it has its report) is still whole in previous/, the last killed
    one in unfinished/, and the run in out/ is the last one started."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "report.json").write_text(json.dumps({"job_id": "old", "error": None}))
    (out / "events.jsonl").write_text(json.dumps({"t": 0, "kind": "job_started", "job_id": "old"}) + "\n")
    (out / "logs" / "w0.log").write_text("old log\n")
    job_ids: list[str] = []
    for _ in range(2):
        # a worker that never joins: the launcher waits for it, cheaply, until it is killed
        proc = _cli("launch", "--workers", "1", "--spares", "0", "--quiet", "--out", str(out), "--",
                    sys.executable, "-c", "import time; time.sleep(60)", tmp=tmp_path)  # fmt: skip
        with _launcher_tree(proc) as seen:
            _poll(
                lambda: _started_job(out) not in ("", "old", *job_ids),
                60,
                "the rerun's events.jsonl",
                proc,
                seen,
            )
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        job_ids.append(_job_id(_events(out / "events.jsonl")))
        assert not (out / "report.json").exists()
        previous = out / "previous"
        assert json.loads((previous / "report.json").read_text())["job_id"] == "old"
        assert (previous / "logs" / "w0.log").read_text() == "old log\n"
        assert _job_id(_events(previous / "events.jsonl")) == "old"
    assert _job_id(_events(out / "unfinished" / "events.jsonl")) == job_ids[0] != job_ids[1]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], list(out.iterdir())


def _started_job(out: Path) -> str:
    """The job id in ``out/events.jsonl`` ("" while there is none)."""
    with contextlib.suppress(OSError, ValueError):
        return _job_id(_events(out / "events.jsonl"))
    return ""


# == 1b. strangers =================================================================================


@contextlib.contextmanager
def _stranger(port: int, status: Path, attacks: str | None = None) -> Iterator[Callable[[], dict[str, Any]]]:
    """Run tests/scripts/adv_stranger.py against ``port``; yield a reader of its status."""
    args = [sys.executable, str(SCRIPTS / "adv_stranger.py"), "127.0.0.1", str(port), str(status), "90"]
    proc = subprocess.Popen([*args, *([attacks] if attacks else [])], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip

    def read() -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads(status.read_text()))
        return {"rounds": 0}

    try:
        yield read  # started with the job: it imports torch while the job's processes do
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)


class _Watch:
    """``on_tick`` of a job under attack: holds the job until the stranger attacks and looks at the store's
    listening socket. ``strict`` (a job where nothing is injected) ends the job at once when something
    fails, or when every rank has been done for ``stall_s`` and the job still has not finished."""

    def __init__(
        self, launcher: Launcher, port: int, stranger: Callable[[], dict[str, Any]], *, strict: bool,
        go: Path | None = None,
    ) -> None:  # fmt: skip
        self.launcher, self.port, self.stranger, self.strict = launcher, port, stranger, strict
        self.go = go  # created once the coordinator has seen w0 join (starts adv_stranger.py's flood)
        self.listeners: list[str] | None = None
        self.stall_s = 10.0
        self._all_done_since: float | None = None

    def __call__(self, coord: Coordinator) -> None:
        if self.listeners is None:
            self.listeners = _listeners(self.port)
            deadline = time.monotonic() + 30  # the job's processes are importing torch meanwhile
            while self.stranger()["rounds"] < 1:
                if time.monotonic() > deadline:
                    raise JobFailed("the stranger never attacked")
                time.sleep(0.02)
        if self.go is not None and not self.go.exists() and coord.member_status().get(0):
            self.go.touch()
        if not self.strict:
            return
        for e in self.launcher.events:
            if e["kind"] in ("fault_detected", "failure_reported", "process_exited") or (
                e["kind"] == "generation_started" and e["gen"] != 0
            ):
                raise JobFailed(f"the stranger steered the job (nothing was injected): {e}")
        status = coord.member_status()
        if status and all(hb.get("phase") == "done" for hb in status.values()):
            self._all_done_since = self._all_done_since or time.monotonic()
            if time.monotonic() - self._all_done_since > self.stall_s:
                raise JobFailed(f"every rank has been done for {self.stall_s:.0f}s; the job never finished")
        else:
            self._all_done_since = None


def _check_rejected(result: JobResult, stranger: dict[str, Any], expected: set[str]) -> None:
    """Every key in ``expected`` (a trailing ``/``: some key under it) was rejected, and only forgeries."""
    rejected = {e["key"] for e in result.events if e["kind"] == "message_rejected"}
    missing = {
        k for k in expected if not any(r == k or (k.endswith("/") and r.startswith(k)) for r in rejected)
    }
    assert not missing, f"not rejected: {sorted(missing)}; rejected: {sorted(rejected)}"
    assert rejected <= set(stranger["keys"]), sorted(rejected - set(stranger["keys"]))  # only forgeries
    assert {e["proc"] for e in result.events} <= {"launcher", "coordinator", "w0", "w1", "s0", "s1"}
    committed = [e for e in result.events if e["kind"] == "step_committed"]
    assert stranger["first_t"] < min(e["t"] for e in committed), "the attack began after training did"
    assert stranger["last_t"] > max(e["t"] for e in committed), "the attack ended before training did"
    assert stranger["rounds"] >= 10, stranger


@pytest.mark.timeout(120)
def test_forgeries_of_a_stranger_are_rejected_through_a_recovery(tmp_path: Path) -> None:
    """Seed 1, a worker killed at step 4, a stranger forging every key all along: the same result.

    Also 6.: the refill spare started after the recovery, as the job ends, leaves no node cache.
    """
    reference = _reference_digest(1)
    port = _free_port()
    with _stranger(port, tmp_path / "stranger.json") as stranger:
        # a pause per step: the job forked from the fork server starts and ends within ten rounds otherwise
        launcher = _launcher(
            seed=1, faults=["kill:rank=1@step=4"], port=port, out=tmp_path / "run", pause_s=0.2
        )
        watch = _Watch(launcher, port, stranger, strict=False)
        launcher.on_tick = [watch]
        result = _run(launcher)
        attack = stranger()
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.digest == reference != FAKE_DIGEST
    report = result.report
    assert report["steps_completed"] == STEPS and report["generations"] == 1, report
    (fault,) = report["faults"]
    assert fault["spec"] == "kill:rank=1@step=4", fault  # it fired
    assert fault["replaced_by"] == "s0" and fault["lost_steps"] == 0, fault
    assert sorted(result.pids) == ["s0", "s1", "w0", "w1"]  # s1: the refill
    # 2. the job's store listens on the loopback interface only
    assert watch.listeners and set(watch.listeners) <= LOOPBACK, watch.listeners
    # the rejections are in the events (and on disk), naming the keys. Not events/w1/: the launcher
    # reads a process's next chunk only while it lives, and whether the stranger forged w1's before
    # it was killed at step 4 is a race (a loaded fresh-clone run lost it); w0's and s0's live on
    _check_rejected(result, attack, {"gen/0/plan", "gen/latest", "hb/w0", "hb/s0", "fatal/w0", "events/w0/",
                                     "events/s0/"})  # fmt: skip
    on_disk = _events(tmp_path / "run" / "events.jsonl")
    assert "hb/w0" in {e.get("key") for e in on_disk if e["kind"] == "message_rejected"}
    # the guessable rendezvous prefixes lead nowhere: the real one is derived from the job's secret
    assert attack["pg"] and not any(p["joined"] for p in attack["pg"]), attack["pg"]


@pytest.mark.timeout(90)
def test_a_stranger_cannot_steer_a_job(tmp_path: Path) -> None:
    """Seed 1, no fault, a stranger forging every key and bumping every counter: nothing but the stranger
    can make anything fail, recover or stall, and it must not."""
    reference = _reference_digest(1)
    port = _free_port()
    with _stranger(port, tmp_path / "stranger.json") as stranger:
        launcher = _launcher(seed=1, port=port, timeout_s=45, pause_s=0.2)  # ten rounds at least, as above
        launcher.on_tick = [_Watch(launcher, port, stranger, strict=True)]
        result = _run(launcher)
        attack = stranger()
    assert result.ok, result.error
    assert result.digest == reference
    assert result.report["generations"] == 0
    _check_rejected(result, attack, {"gen/0/plan", "gen/latest", "hb/w0", "done/0", "fatal/w0", "job/stop"})


@pytest.mark.timeout(90)
def test_a_stranger_who_lists_the_keys_cannot_abort_or_stop_a_job(tmp_path: Path) -> None:
    """A stranger who reads the job's namespace off ``list_keys()`` and writes the abort of every
    generation and the job's stop under it (sealed with another secret, or not at all), from before
    the first step to the end: nothing aborts, nothing stops, the result is the fault-free one, and
    the forgeries are counted in the report as messages from outside the job."""
    reference = _reference_digest(1, 30)
    port = _free_port()
    with _stranger(port, tmp_path / "stranger.json", "list") as stranger:
        launcher = _launcher(seed=1, port=port, steps=30, pause_s=0.02, timeout_s=60)
        launcher.on_tick = [_Watch(launcher, port, stranger, strict=True)]
        result = _run(launcher)
        attack = stranger()
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.digest == reference
    assert result.report["generations"] == 0
    ns = launcher.store.namespace
    assert ns and any(k == keys.abort(0) for k in attack["keys"]), attack  # it named the real keys
    rejected = result.report["rejected_messages"]
    assert rejected["count"] > 0 and keys.abort(0) in rejected["keys"], rejected
    # what the command prints of this result names them as messages from outside the job
    console = Console(file=io.StringIO(), record=True, width=250)
    print_result(console, result, "demo")
    said = " ".join(console.export_text().split())
    assert (
        f"ignored {rejected['count']} control message(s) not sealed with this job's secret (someone else "
        "writes to the job's store)"
    ) in said, said


@pytest.mark.timeout(120)
def test_a_stranger_who_lists_the_keys_through_a_recovery(tmp_path: Path) -> None:
    """The same stranger beside a job that loses a worker at step 4: the recovery's own abort is
    sealed and acted on, the forged ones are not; the job ends ok with the fault-free result."""
    reference = _reference_digest(1, 30)
    port = _free_port()
    with _stranger(port, tmp_path / "stranger.json", "list") as stranger:
        launcher = _launcher(seed=1, faults=["kill:rank=1@step=4"], port=port, steps=30, pause_s=0.02)
        launcher.on_tick = [_Watch(launcher, port, stranger, strict=False)]
        result = _run(launcher)
        stranger()
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.digest == reference
    assert result.report["generations"] == 1, result.report["generations"]
    (fault,) = result.report["faults"]
    assert fault["replaced_by"] == "s0" and fault["lost_steps"] == 0, fault
    assert result.report["rejected_messages"]["count"] > 0


@pytest.mark.timeout(90)
def test_a_heartbeat_flood_does_not_kill_a_live_worker(tmp_path: Path) -> None:
    """A stranger overwriting hb/w0 in a tight loop (faster than w0 beats) from when w0 has joined:
    sealing stops forgery, not destruction, so only keys a stranger cannot name keep w0 alive."""
    port = _free_port()
    status = tmp_path / "stranger.json"
    with _stranger(port, status, "hbflood") as stranger:
        # 80 steps of 50 ms: the job outlasts the hang timeout (2 s) after the flood begins
        launcher = _launcher(seed=1, port=port, steps=80, pause_s=0.05, timeout_s=60)
        go = status.with_name(status.name + ".go")
        launcher.on_tick = [_Watch(launcher, port, stranger, strict=True, go=go)]
        result = _run(launcher)
        attack = stranger()
    assert attack.get("floods", 0) > 1000, attack
    assert result.ok, result.error
    assert result.report["generations"] == 0


@pytest.mark.timeout(90)
def test_a_strangers_junk_is_counted_not_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stranger writing junk all along (plain protocol names, and a forged fatal report under the
    job's own namespace, as one who learnt it would): every write is rejected and counted, but the
    launcher keeps the first of each key only; its memory, events.jsonl and log do not grow with it."""
    import checkpointless.control.coordinator as coordinator

    monkeypatch.setattr(coordinator, "INTRUDER_CHECK_S", 0.0)  # the plain names checked every tick
    launcher = _launcher(seed=1, steps=80, pause_s=0.05, out=tmp_path / "run")
    written: set[str] = set()
    rounds = [0]

    def junk(coord: Coordinator) -> None:
        store, ns = launcher.store.raw, launcher.store.namespace
        rounds[0] += 1
        plain = [keys.heartbeat("w0"), keys.JOB_STOP, keys.plan(0), keys.done(0), keys.fatal("w1")]
        for key in plain:
            store.set(key, f"junk {rounds[0]}")
        if rounds[0] == 1:
            store.add(ns + keys.FATAL_COUNT, 1)  # a counter: the coordinator then reads the fatal reports
        store.set(ns + keys.fatal("w0"), f"0{rounds[0]:063d}.junk")  # a new forged value every tick
        written.update([*plain, keys.fatal("w0")])

    launcher.on_tick = [junk]
    result = _run(launcher)
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert result.report["generations"] == 0
    kept = [e for e in result.events if e["kind"] == "message_rejected"]
    counted = result.report["rejected_messages"]
    assert counted["count"] >= 100 and rounds[0] >= 20, (counted, rounds)
    assert sorted(counted["keys"]) == sorted({e["key"] for e in kept}) and set(counted["keys"]) <= written
    assert {keys.fatal("w0"), keys.heartbeat("w0"), keys.JOB_STOP} <= set(counted["keys"]), counted
    assert len(kept) == len(counted["keys"]), [e["key"] for e in kept]  # the first of each key only
    on_disk = _events(tmp_path / "run" / "events.jsonl")
    assert sum(e["kind"] == "message_rejected" for e in on_disk) == len(kept)
    assert json.loads((tmp_path / "run" / "report.json").read_text())["rejected_messages"] == counted


# == 2. the store's socket =========================================================================


@pytest.mark.timeout(30)
def test_control_store_listens_on_loopback_only() -> None:
    store = open_store("127.0.0.1", 0)
    try:
        port = int(store.port)
        listeners = _listeners(port)
        assert listeners and set(listeners) <= LOOPBACK, listeners
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        others = _other_addresses()
        for family, address in others:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                with pytest.raises(OSError):  # refused: nothing listens there
                    s.connect((address, port))
    finally:
        del store
    if not others:
        pytest.skip("this machine has no non-loopback address to try (the listener check passed)")


# == 3. interrupted runs ===========================================================================


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("signum", "how"),
    [(signal.SIGTERM, "kill"), (signal.SIGINT, "ctrl-c"), (signal.SIGINT, "ctrl-c-sharded")],
    ids=["SIGTERM-launch-shm-script", "SIGINT-ctrl-c-demo", "SIGINT-ctrl-c-hsdp2x2"],
)
def test_interrupted_run_stops_reports_and_cleans_up(signum: int, how: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    if how == "kill":  # a script that fills the job's /dev/shm cache, as recipes do
        args = ["launch", "--workers", "2", "--spares", "1", "--quiet", "--out", str(out), "--",
                *_script(steps=400, pause_s=0.05)]  # fmt: skip
    elif how == "ctrl-c-sharded":  # FSDP2 HSDP 2x2: four ranks blocked in a generation's groups
        args = ["launch", "--workers", "4", "--shards", "2", "--spares", "1", "--quiet", "--out", str(out),
                "--", sys.executable, str(REPO / "examples" / "sharded_loop.py"), "--steps", "400"]  # fmt: skip
    else:  # steps of ~8 ms: 4000 outlast the launcher's grace period (a job that ends within it is
        # reported finished: test_a_job_that_finishes_during_the_grace_period_is_reported_finished)
        args = ["demo", "--workers", "2", "--spares", "1", "--steps", "4000", "--fault", "none", "--quiet",
                "--d-model", "32", "--layers", "1", "--out", str(out)]  # fmt: skip
    proc = _cli(*args)
    with _launcher_tree(proc) as seen:
        # streaming: committed steps reach the file while the job runs
        ranks = 4 if how == "ctrl-c-sharded" else 2  # every rank two steps in: the report's steps_completed
        _poll(
            lambda: _steps_done(out / "events.jsonl", ranks) >= 2,
            60,
            "committed steps in events.jsonl",
            proc,
            seen,
        )
        job_id = _job_id(_events(out / "events.jsonl"))
        if how == "kill":
            assert _shm_dir(job_id).is_dir(), "the script should have cached batches in /dev/shm"
            os.kill(proc.pid, signum)  # kill -TERM <launcher>
        else:
            os.killpg(proc.pid, signum)  # Ctrl-C: the terminal signals the foreground process group
        at_signal = _commits(out / "events.jsonl")  # per rank; the file may lag the job
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=40)
        took = time.monotonic() - t0
        assert proc.returncode == 128 + signum, stderr[-3000:]
        name = signal.Signals(signum).name
        _no_traceback(stderr)
        assert f"error: interrupted by {name}" in stderr, stderr
        assert len([ln for ln in stderr.splitlines() if ln.startswith("error:")]) == 1, stderr
        report = json.loads((out / "report.json").read_text())
        assert name in report["error"] and report["job_id"] == job_id, report
        events = _events(out / "events.jsonl")  # rewritten whole, in time order
        assert _job_id(events) == job_id
        assert [e["t"] for e in events] == sorted(e["t"] for e in events)
        assert events[-1]["kind"] == "job_finished" and events[-1]["ok"] is False, events[-1]
        assert sum(e["kind"] == "step_committed" for e in events) >= 4 and report["steps_completed"] >= 2
        if how == "ctrl-c":  # stopped at the next step boundary, not after the grace period
            # (before: 44 to 600 more steps of ~8 ms in the 5 s grace)
            assert report["steps_completed"] <= at_signal // 2 + 25, (at_signal, report["steps_completed"])
        assert not list(out.glob(".*tmp*")), list(out.iterdir())
        left = _wait_gone(seen, 2)
        assert len(seen) >= 3 and not left, f"children {sorted(seen)}, alive after exit: {left}"
        assert not _shm_dir(job_id).exists(), f"{_shm_dir(job_id)} leaked (stopped in {took:.1f}s)"


@pytest.mark.timeout(90)
def test_a_job_that_finishes_during_the_grace_period_is_reported_finished(tmp_path: Path) -> None:
    """SIGTERM to the launcher while the ranks are in their last (slow) step: job/stop is set at
    once, and the ranks, finishing that step within the grace period, end the job; it is reported
    finished, with the same final state as an undisturbed run, not as interrupted without a digest."""
    steps = 5
    job = JobConfig(
        workers=2, spares=0, recovery=RecoveryConfig(hang_timeout_s=5.0, collective_timeout_s=30.0)
    )
    command = [sys.executable, str(SCRIPTS / "slow_last_step.py"), str(steps), "1.5"]
    reference = _run(Launcher(job, command, total_steps=steps, timeout_s=60))
    assert reference.ok and reference.digest, f"{reference.error}\n{logs_of(reference)}"

    launcher = Launcher(job, command, total_steps=steps, out_dir=tmp_path / "run", timeout_s=60)
    signalled: list[float] = []
    stops: list[float] = []
    store_set = None

    def on_tick(coord: Coordinator) -> None:
        nonlocal store_set
        if store_set is None:  # see when the launcher sets job/stop (a spy: every call goes through)
            store_set = launcher.store.set

            def spy(key: str, value: str) -> None:
                if key == keys.JOB_STOP:
                    stops.append(time.monotonic())
                store_set(key, value)  # type: ignore[misc]

            launcher.store.set = spy  # type: ignore[method-assign]
        status = coord.member_status()
        if (
            not signalled
            and len(status) == 2
            and all(hb.get("committed") == steps - 2 for hb in status.values())
        ):
            signalled.append(time.monotonic())  # both ranks are in the last step, which takes 1.5 s
            os.kill(os.getpid(), signal.SIGTERM)

    launcher.on_tick = [on_tick]
    result = _run(launcher)
    assert signalled, "the ranks never reached the last step"
    assert stops and stops[0] - signalled[0] < 0.5, (stops, signalled)  # at once, not after the grace
    assert result.ok and result.interrupted is None and result.error is None, result.error
    assert result.digest == reference.digest
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["error"] is None and report["final_state_sha256"] == reference.digest, report
    assert report["steps_completed"] == steps, report
    finished = [e for e in _events(tmp_path / "run" / "events.jsonl") if e["kind"] == "job_finished"]
    assert [e["ok"] for e in finished] == [True], finished


@pytest.mark.timeout(60)
def test_sigkilled_launcher_keeps_streamed_events_and_takes_its_children(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _cli("launch", "--workers", "2", "--spares", "1", "--quiet", "--out", str(out), "--",
                *_script(steps=400, pause_s=0.05))  # fmt: skip
    job_id = ""
    try:
        with _launcher_tree(proc) as seen:
            _poll(
                lambda: _commits(out / "events.jsonl") >= 4, 60, "committed steps in events.jsonl", proc, seen
            )
            seen |= _children(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            left = _wait_gone(seen, 5)
            assert len(seen) >= 3 and not left, (
                f"children {sorted(seen)}, alive 5 s after the launcher: {left}"
            )
            events = _events(out / "events.jsonl")  # whole lines only: flushed line by line
            job_id = _job_id(events)
            committed = [e for e in events if e["kind"] == "step_committed"]
            assert len(committed) >= 4 and {e["proc"] for e in committed} == {"w0", "w1"}
            assert not (out / "report.json").exists()
    finally:
        if job_id:  # nobody is left to clean the node cache after a SIGKILL: not this test's subject
            shutil.rmtree(_shm_dir(job_id), ignore_errors=True)


# == 4b. full disks ==================================================================================


@contextlib.contextmanager
def _small_disk(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True, timeout=20)  # fmt: skip
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=20)


def _fill(disk: Path, leave_pages: int = 0) -> None:
    """Fill ``disk`` up, leaving ``leave_pages`` free pages."""
    st = os.statvfs(disk)
    fd = os.open(disk / f"filler-{time.monotonic_ns()}", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"\0" * max(0, st.f_bavail - leave_pages) * st.f_bsize)
        if not leave_pages:
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    assert os.statvfs(disk).f_bavail == leave_pages


def _result_and_error_lines(stderr: str) -> None:
    text = " ".join(stderr.split())  # the console wraps long lines
    assert re.search(r"run: (ok|FAILED) steps \d+", text), stderr
    assert re.search(r"error: [^\n]*No space left on device", text), stderr


@pytest.mark.timeout(60)
def test_report_on_a_full_disk_is_an_error_line_not_a_traceback(tmp_path: Path) -> None:
    """The disk has room for the streamed events (one page) but not for report.json."""
    with _small_disk(tmp_path / "disk", "64k") as disk:
        _fill(disk, leave_pages=1)
        out = disk / "run"
        proc = _cli("demo", "--workers", "1", "--spares", "0", "--steps", "4", "--fault", "none", "--quiet",
                    "--d-model", "32", "--layers", "1", "--out", str(out))  # fmt: skip
        with _launcher_tree(proc):
            _, stderr = proc.communicate(timeout=50)
        _no_traceback(stderr)
        assert proc.returncode == 1, stderr
        assert "run: ok" in stderr, stderr  # the job itself succeeded, and says so
        assert re.search(r"final state sha256: \s*[0-9a-f]{64}", stderr), stderr
        _result_and_error_lines(stderr)
        assert not (out / "report.json").exists()
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")], list(out.iterdir())


@pytest.mark.timeout(60)
def test_disk_filling_up_during_the_run_is_an_error_line_not_a_traceback(tmp_path: Path) -> None:
    with _small_disk(tmp_path / "disk", "1m") as disk:
        out = disk / "run"
        proc = _cli("demo", "--workers", "1", "--spares", "0", "--steps", "100", "--fault", "none",
                    "--quiet", "--d-model", "32", "--layers", "1", "--out", str(out))  # fmt: skip
        with _launcher_tree(proc) as seen:
            _poll(
                lambda: _commits(out / "events.jsonl") >= 2, 60, "committed steps in events.jsonl", proc, seen
            )
            _fill(disk)
            _, stderr = proc.communicate(timeout=50)
        _no_traceback(stderr)
        assert proc.returncode == 1, stderr
        assert "run: ok" in stderr, stderr  # the outputs failed, not the training
        assert re.search(r"final state sha256: \s*[0-9a-f]{64}", stderr), stderr
        _result_and_error_lines(stderr)


@pytest.mark.timeout(120)
def test_a_full_dev_shm_skips_the_batch_cache_and_the_job_finishes(tmp_path: Path) -> None:
    """A container's /dev/shm, full: every worker and spare used to die in the batch cache (``OSError``
    from the write, ``step 0 failed 6 times``). The job runs in a mount namespace of its own whose
    /dev/shm is a 64 KiB tmpfs filled up (the machine's /dev/shm is not touched): it must finish with
    the undisturbed job's final state, and the workers' logs say why nothing was cached."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) to give the job a /dev/shm of its own")
    reference = _reference_digest(1)
    out = tmp_path / "run"
    launch = [sys.executable, "-m", "checkpointless", "launch", "--workers", "2", "--spares", "1",
              "--seed", "1", "--quiet", "--out", str(out), "--", *_script(seed=1)]  # fmt: skip
    shell = (
        "mount -t tmpfs -o size=64k tmpfs /dev/shm || exit 99; "
        "cat /dev/zero > /dev/shm/filler 2>/dev/null; "
        '[ "$(stat -f -c %a /dev/shm)" = 0 ] || exit 98; exec "$@"'
    )
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell, "sh", *launch],
        cwd=REPO, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    with _launcher_tree(proc):
        _, stderr = proc.communicate(timeout=90)
    if proc.returncode in (98, 99) or "unshare failed" in stderr:
        pytest.skip(f"cannot mount a private /dev/shm here: {stderr.strip()[-300:]}")
    _no_traceback(stderr)
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["final_state_sha256"] == reference and report["steps_completed"] == STEPS, report
    assert report["generations"] == 0 and report["faults"] == [], report
    logs = "\n".join(p.read_text() for p in sorted((out / "logs").glob("w*.log")))
    warnings = [ln for ln in logs.splitlines() if "batch cache: cannot write to /dev/shm" in ln]
    assert len(warnings) == 2, logs[-3000:]  # once per worker
    assert "No space left on device" in warnings[0] and "MiB free of 0.1 MiB" in warnings[0], warnings
    assert not list(Path("/dev/shm").glob(f"checkpointless-{report['job_id']}")), "left in the real /dev/shm"


@pytest.mark.timeout(300)
def test_a_job_forked_from_the_fork_server_recovers_bitwise_and_dies_with_its_launcher(
    tmp_path: Path,
) -> None:
    """The fork server (on unless ``CHECKPOINTLESS_FORK_SERVER=0``): the workers and spares are forked from one process that
    imported torch once (``launch/forkserver.py``); a kill ends where the usual start does, and the
    whole tree dies with a SIGKILLed launcher."""
    env = {**os.environ, "CHECKPOINTLESS_FORK_SERVER": "1", "OMP_NUM_THREADS": "1"}
    digests = []
    for fork in ("0", "1"):
        out = tmp_path / f"fork{fork}"
        run = subprocess.run(
            [sys.executable, "-m", "checkpointless", "demo", "--workers", "4", "--spares", "1", "--steps", "30",
             "--fault", "kill:rank=2@step=12", "--quiet", "--out", str(out)],
            capture_output=True, text=True, timeout=240, env={**env, "CHECKPOINTLESS_FORK_SERVER": fork},
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        digests.append(json.loads((out / "report.json").read_text())["final_state_sha256"])
        assert (out / "logs" / "forkserver.log").exists() == (fork == "1")
    assert digests[0] == digests[1] != "None"
    proc = subprocess.Popen(
        [sys.executable, "-m", "checkpointless", "demo", "--workers", "2", "--spares", "1", "--steps", "400",
         "--fault", "none", "--quiet", "--out", str(tmp_path / "killed")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    with _launcher_tree(proc) as seen:
        deadline = time.monotonic() + 60
        while len(seen) < 4:  # the fork server, two workers and a spare
            seen |= _children(proc.pid)
            assert proc.poll() is None and time.monotonic() < deadline, seen
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        left = _wait_gone(seen, 5)
        assert not left, f"alive 5 s after the launcher was SIGKILLed: {left} (of {sorted(seen)})"
