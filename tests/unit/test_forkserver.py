"""The fork server (``launch/forkserver.py``): a child forked from it is the process its command
would have started (argv, path, environment, working directory, log, secret, nice, its own seeds),
its name, its exit status and a kill reach the supervisor, and a command it cannot run is left to Popen."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from checkpointless.launch.forkserver_client import ForkServer, forkable
from checkpointless.protocol.env import ENV_PROC, ENV_SECRET_FD

pytestmark = pytest.mark.timeout(120)

CHILD = """
import json, os, sys
import numpy as np
from checkpointless.control.auth import read_secret_fd
fd = int(os.environ["{secret}"])
print(json.dumps({{
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "env": os.environ.get("MARK"),
    "secret": read_secret_fd(fd).hex(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
    "pgid": os.getpgid(0) == os.getpid(), "draw": float(np.random.rand()), "name": __name__,
    "comm": open("/proc/self/comm").read().strip(),
    "cmdline": open("/proc/self/cmdline", "rb").read().replace(bytes(1), b" ").decode().strip(),
}}), flush=True)
if sys.argv[1] == "sleep":
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
"""


def test_forkable_commands_are_this_interpreter_running_a_script_or_a_module() -> None:
    assert forkable([sys.executable, "train.py", "--lr", "1"]) == ("script", "train.py", ["--lr", "1"])
    assert forkable([sys.executable, "-u", "-m", "pkg.main", "x"]) == ("module", "pkg.main", ["x"])
    assert forkable([sys.executable, "-c", "print(1)"]) is None
    assert forkable([sys.executable, "-X", "dev", "train.py"]) is None
    assert forkable(["/bin/echo", "train.py"]) is None
    assert forkable([sys.executable]) is None


def _spawn(server: ForkServer, script: Path, arg: str, cwd: Path, secret: bytes, nice: int = 0) -> tuple:
    log = cwd / f"child-{arg}.log"
    read_end, write_end = os.pipe()
    with open(log, "wb") as f:
        child = server.spawn("script", str(script), [arg], env={**os.environ, "MARK": arg, ENV_PROC: f"w{arg}"}, cwd=str(cwd),
                             nice=nice, log_fd=f.fileno(), secret_fd=read_end,
                             title=f"{sys.executable} {script} {arg}")  # fmt: skip
    os.write(write_end, secret)
    os.close(read_end)
    os.close(write_end)
    return child, log


def test_a_forked_child_is_the_process_its_command_would_have_started(tmp_path: Path) -> None:
    script = tmp_path / "scripts" / "child.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(CHILD.format(secret=ENV_SECRET_FD)))
    server = ForkServer(dict(os.environ), None, tmp_path / "forkserver.log")
    try:
        secret = bytes(range(32))
        a, log_a = _spawn(server, script, "3", tmp_path, secret)
        b, log_b = _spawn(server, script, "0", tmp_path, secret, nice=5)
        assert a.wait(timeout=60) == 3 and b.wait(timeout=60) == 0
        seen_a, seen_b = (json.loads(p.read_text().splitlines()[-1]) for p in (log_a, log_b))
        assert seen_a["argv"] == [str(script), "3"] and seen_a["path0"] == str(script.parent)
        assert seen_a["cwd"] == str(tmp_path) and seen_a["env"] == "3" and seen_a["name"] == "__main__"
        assert seen_a["secret"] == secret.hex() and seen_a["pgid"]
        assert seen_a["comm"] == "cpl-w3"  # its name in ps -o comm and top
        assert (
            seen_a["cmdline"] == f"{sys.executable} {script} 3"
        )  # in ps, pgrep -f: the command it stands for
        assert seen_b["nice"] >= 5  # its own, absolute (a worker's 0 where it may lower it: root)
        assert seen_a["nice"] == 0 or os.geteuid() != 0
        assert seen_a["draw"] != seen_b["draw"]  # NumPy reseeded as in a fresh interpreter
        sleeper, _ = _spawn(server, script, "sleep", tmp_path, secret)
        assert sleeper.poll() is None
        sleeper.kill()
        assert sleeper.wait(timeout=30) == -signal.SIGKILL
    finally:
        server.close()


def test_a_gone_fork_server_is_reported_and_its_children_are_gone(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD.format(secret=ENV_SECRET_FD)))
    server = ForkServer(dict(os.environ), None, tmp_path / "forkserver.log")
    try:
        sleeper, _ = _spawn(server, script, "sleep", tmp_path, bytes(32))
        server.close()  # the supervisor's end closed, the fork server killed: its children die with it
        assert sleeper.wait(timeout=30) == -signal.SIGKILL
        with pytest.raises(OSError):
            _spawn(server, script, "0", tmp_path, bytes(32))
        assert server.broken
    finally:
        server.close()


EXITING = """
import atexit, sys, threading, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=__import__("datetime").timedelta(seconds=30))
def beat():  # as a heartbeat thread: in torch, the GIL released, most of the time
    while True:
        store.check(["x"])
threading.Thread(target=beat, daemon=True).start()
left_open = open(sys.argv[1], "w")
left_open.write("written, never closed")
atexit.register(lambda: print("atexit ran", flush=True))
time.sleep(0.3)
def main():
    raise ValueError("the script's own error")
main()
"""


def test_a_script_raising_exits_as_python_would_with_a_daemon_thread_inside_torch(tmp_path: Path) -> None:
    """An uncaught exception: exit code 1, the script's traceback only (no frame of the fork
    server's), its atexit handlers run and its open files flushed; and no ``std::terminate`` from
    a daemon thread coming back from torch while the interpreter is torn down (before: code -6 in
    about half the exits, and a second of silence from the heartbeat while it was)."""
    script = tmp_path / "exiting.py"
    script.write_text(textwrap.dedent(EXITING))
    server = ForkServer(dict(os.environ), None, tmp_path / "forkserver.log")
    try:
        for i in range(4):
            out = tmp_path / f"open-{i}.txt"
            log = tmp_path / f"exiting-{i}.log"
            read_end, write_end = os.pipe()
            with open(log, "wb") as f:
                child = server.spawn("script", str(script), [str(out)], env=dict(os.environ), cwd=str(tmp_path),
                                     nice=0, log_fd=f.fileno(), secret_fd=read_end)  # fmt: skip
            os.close(read_end)
            os.close(write_end)
            assert child.wait(timeout=60) == 1, log.read_text()
            text = log.read_text()
            assert "ValueError: the script's own error" in text and "atexit ran" in text, text
            assert "forkserver" not in text and "runpy" not in text and "terminate" not in text, text
            assert f'File "{script}", line' in text, text  # the script's path as python SCRIPT gives it
            assert out.read_text() == "written, never closed"
    finally:
        server.close()
