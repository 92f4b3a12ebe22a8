"""``bench/control_load.py``: the role of each process under a job, whether the fork server forked
it (its ``/proc/PID/environ`` is the fork server's: the role is in its name) or it was started the
usual way (the role is in its environment), and its Python threads counted as such."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench import control_load
from checkpointless.launch.forkserver_client import ForkServer
from checkpointless.protocol.env import ENV_PROC

pytestmark = pytest.mark.timeout(120)

CHILD = """
import sys, threading, time
def burn():  # a side thread, as a heartbeat or a prefetcher: started after the process was named
    while True:
        sum(range(1000))
threading.Thread(target=burn, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def _ready(log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while "ready" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.05)


def test_a_forked_worker_is_found_by_its_name_and_its_side_thread_counted(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    env = {k: v for k, v in os.environ.items() if k not in (ENV_PROC, "RANK")}
    server = ForkServer(env, None, tmp_path / "forkserver.log")
    try:
        log = tmp_path / "child.log"
        read_end, write_end = os.pipe()
        with open(log, "wb") as f:
            child = server.spawn("script", str(script), [], env={**env, ENV_PROC: "w3"}, cwd=str(tmp_path),
                                 nice=0, log_fd=f.fileno(), secret_fd=read_end, title="")  # fmt: skip
        os.close(read_end)
        os.close(write_end)
        try:
            _ready(log)
            environ = Path(f"/proc/{child.pid}/environ").read_bytes()  # the fork server's
            assert f"{ENV_PROC}=".encode() not in environ
            assert control_load._role(child.pid) == "w3"
            a = control_load._snapshot(os.getpid())  # the child is the fork server's, under this process
            time.sleep(0.5)
            b = control_load._snapshot(os.getpid())
            assert "w3" in a and "w3" in b
            kinds = control_load._delta(a["w3"], b["w3"])
            assert kinds["python"][0] > 0.1  # the burning side thread, named as its main thread
        finally:
            child.kill()
            child.wait(timeout=30)
    finally:
        server.close()


def _started(env: dict[str, str]) -> subprocess.Popen[str]:
    """A sleeping interpreter, once it runs (before its ``exec``, its environ is still this one's)."""
    p = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True); import time; time.sleep(60)"],
                         env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    except BaseException:
        p.kill()
        p.wait(timeout=30)
        raise
    return p


@pytest.mark.parametrize(("var", "value", "role"), [(ENV_PROC, "s1", "s1"), ("RANK", "2", "r2")])
def test_a_process_started_the_usual_way_is_found_by_its_environment(var: str, value: str, role: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_PROC, "RANK")}
    p = _started({**env, var: value})
    with p:  # closes its pipe and waits for it
        try:
            assert control_load._role(p.pid) == role
        finally:
            p.kill()


def test_a_process_without_a_role_has_none() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_PROC, "RANK")}
    p = _started(env)
    with p:  # closes its pipe and waits for it
        try:
            assert control_load._role(p.pid) is None
        finally:
            p.kill()
