"""The supervisor's side of the fork server (``forkserver.py``): ``ForkServer``, its handle on its
host's fork server, and ``Forked``, a child the fork server started, used as ``subprocess.Popen`` is.
``forkable`` tells which commands it can start (this interpreter running a script or a module)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from checkpointless.launch.forkserver import RECV_BYTES

SPAWN_TIMEOUT_S = 120.0
"""How long a request waits for its child's pid (the first waits for the fork server's imports);
past it the fork server is given up and processes are started the usual way."""


def forkable(command: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """``("script" | "module", target, args)`` if ``command`` is this interpreter running a script
    or a module (``-u`` allowed: the job's processes are unbuffered anyway), else None."""
    if len(command) < 2:
        return None
    exe = command[0] if os.sep in command[0] else (shutil.which(command[0]) or "")
    if not exe or os.path.realpath(exe) != os.path.realpath(sys.executable):
        return None
    rest = list(command[1:])
    while rest and rest[0] == "-u":
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return ("module", rest[1], rest[2:])
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return ("script", rest[0], rest[1:])
    return None


class Forked:
    """A process the fork server started, as ``subprocess.Popen`` is used: ``pid``, ``poll``,
    ``wait``, ``kill``. Its exit status comes from the fork server (its parent)."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid, self._server = pid, server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.status(self.pid, block=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            code = self._server.status(self.pid, block=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self.returncode = code
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


class ForkServer:
    """The supervisor's handle on its host's fork server: ``start()`` it early, so that its imports
    overlap the launcher's own start (``spawn`` starts it if nothing did)."""

    def __init__(self, env: dict[str, str], preexec: Any, log_path: Path) -> None:
        self._env, self._preexec, self._log_path = env, preexec, log_path
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()
        self.broken = False

    def start(self) -> None:
        """Start the fork server process without waiting for its imports; a failure to start it
        marks it broken (processes are then started the usual way)."""
        with self._lock:
            if self._sock is None and not self.broken:
                try:
                    self._start()
                except OSError:
                    self.broken = True

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(self._env)
        env["PYTHONUNBUFFERED"] = "1"
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "checkpointless.launch.forkserver", str(theirs.fileno())],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                pass_fds=(theirs.fileno(),), preexec_fn=self._preexec, process_group=0,
            )  # fmt: skip
        theirs.close()
        self._sock = ours
        return ours

    def spawn(self, kind: str, target: str, args: list[str], *, env: dict[str, str], cwd: str, nice: int,
              log_fd: int, secret_fd: int, title: str = "") -> Forked:  # fmt: skip
        """Fork ``python SCRIPT ARGS`` (``kind`` ``script``) or ``python -m MODULE ARGS``, its command
        line in ``ps`` ``title``; raises ``OSError`` if the fork server cannot (the caller then starts
        the process itself)."""
        with self._lock:
            sock = self._sock or self._start()
            request = {"kind": kind, "target": target, "args": args, "env": env, "cwd": cwd, "nice": nice,
                       "title": title}  # fmt: skip
            try:
                socket.send_fds(sock, [json.dumps(request).encode() + b"\n"], [log_fd, secret_fd])
                while True:
                    line = self._line(SPAWN_TIMEOUT_S)
                    if line is None:
                        raise OSError(f"no answer within {SPAWN_TIMEOUT_S:g} s")
                    if "pid" in line:
                        return Forked(int(line["pid"]), self)
                    self._exits[int(line["exit"])] = int(line["code"])
            except OSError:
                self.broken = True
                raise

    def status(self, pid: int, block: float | None) -> int | None:
        """The exit status of ``pid`` once the fork server has reaped it; waits up to ``block``
        seconds for it (None: for ever), 0: only what has arrived."""
        deadline = None if block is None else time.monotonic() + block
        with self._lock:
            while pid not in self._exits:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    line = self._line(left)
                except OSError:  # the fork server is gone: so are its children (they die with it)
                    self._exits.setdefault(pid, -int(signal.SIGKILL))
                    break
                if line is None:
                    return None
                if "exit" in line:
                    self._exits[int(line["exit"])] = int(line["code"])
            return self._exits.get(pid)

    def _line(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message of the fork server; None if none came within ``timeout``."""
        assert self._sock is not None
        while b"\n" not in self._buf:
            self._sock.settimeout(timeout)
            try:
                data = self._sock.recv(RECV_BYTES)
            except (TimeoutError, BlockingIOError):
                return None
            finally:
                self._sock.settimeout(None)
            if not data:
                raise OSError("the fork server is gone")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return dict(json.loads(line))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
