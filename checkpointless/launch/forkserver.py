"""A fork server: one process per host that imports torch and the package once, then forks the
job's Python processes from that state. A worker or spare started this way skips the interpreter's
start and torch's import, most of what a job's start and a spare's refill cost (``bench/startup.py``
measures it). On unless ``CHECKPOINTLESS_FORK_SERVER=0``.

The supervisor asks it over a Unix socket (one JSON line per request, the child's log and secret
descriptors passed with ``SCM_RIGHTS``); it answers with the child's pid and later with its exit
status, as ``waitpid`` gives it. A forked child is what ``python SCRIPT ARGS`` or ``python -m
MODULE ARGS`` would have been: its own process group, its environment, working directory, nice
value, ``argv``, ``sys.path[0]``, stdout and stderr on its log, fresh random seeds; it dies with
the fork server, which dies with the supervisor (``PR_SET_PDEATHSIG``). A command that is not the
launcher's own interpreter running a script or a module is started the usual way.

Started as ``python -m checkpointless.launch.forkserver FD``: ``FD`` is its end of the socket. This
module is the fork server's side; the supervisor's (``ForkServer``, ``Forked``) is ``forkserver_client.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import selectors
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from checkpointless.protocol.env import ENV_PROC, ENV_SECRET_FD

MAX_FDS = 2  # a request passes the child's log and its secret's pipe
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
RECV_BYTES = 1 << 20  # the most one read of the socket takes (the supervisor's too)


def _serve(sock: socket.socket) -> None:
    """Answer requests until the supervisor closes its end; report every child's exit."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    server_pid = os.getpid()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    buf = b""
    fds: list[int] = []
    while True:
        for key, _ in sel.select():
            if key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(sock)
                continue
            msg, got, _, _ = socket.recv_fds(sock, RECV_BYTES, MAX_FDS)
            if not msg:
                return  # the supervisor is gone: its children die with this process
            buf += msg
            fds.extend(got)
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                log_fd, secret_fd = fds[:2]
                del fds[:2]
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_r, wake_w, sock.fileno()):
                        os.close(fd)
                    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                    if os.getppid() != server_pid:
                        os._exit(1)
                    _exit(_run_child(json.loads(line), log_fd, secret_fd))
                os.close(log_fd)
                os.close(secret_fd)
                sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        sock.sendall(json.dumps({"exit": pid, "code": code}).encode() + b"\n")


def _run_child(request: dict[str, Any], log_fd: int, secret_fd: int) -> int:
    """In the forked child: become the process the command would have started, run it, and return
    its exit code (``_exit`` then ends the child as the interpreter would)."""
    import runpy

    os.setpgid(0, 0)
    if os.getpriority(os.PRIO_PROCESS, 0) != int(request["nice"]):  # absolute, as the supervisor's children
        with contextlib.suppress(PermissionError):  # lower than the fork server's: root only
            os.setpriority(os.PRIO_PROCESS, 0, int(request["nice"]))
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    env = dict(request["env"])
    env[ENV_SECRET_FD] = str(secret_fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    _name_process(str(request.get("title", "")), env.get(ENV_PROC, ""))
    _fresh_state(env)
    kind, target, args = request["kind"], request["target"], list(request["args"])
    try:
        if kind == "module":
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()
            _KEPT.append(runpy.run_module(target, run_name="__main__", alter_sys=True))
        else:
            sys.argv = [target, *args]
            sys.path[0] = str(Path(target).resolve().parent)
            _KEPT.append(runpy.run_path(os.path.abspath(target), run_name="__main__"))
    except SystemExit as e:
        _KEPT.append(e.__traceback__)
        if e.code is None or isinstance(e.code, int):
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # as the interpreter does for an uncaught exception
        tb = _script_frames(e.__traceback__)
        e.__traceback__ = tb
        sys.last_type, sys.last_value, sys.last_traceback = type(e), e, tb
        _KEPT.append(tb)
        sys.excepthook(type(e), e, tb)
        return 1
    return 0


def _exit(code: int) -> None:
    """End the child as the interpreter ends a script, less its last collection and teardown: wait
    for its threads that are not daemons, run its ``atexit`` handlers (the session's among them),
    flush the files it left open, then ``os._exit``. The teardown would write to every page shared
    with the fork server (copy-on-write) for up to a second, in which the heartbeat stops, and a
    daemon thread coming back from torch then kills the process (``std::terminate``)."""
    import atexit
    import io

    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    except BaseException:  # a join interrupted (Ctrl-C): exit anyway, as Python does
        pass
    atexit._run_exitfuncs()
    for obj in gc.get_objects():  # unclosed files, as their finalizers would at teardown
        if isinstance(obj, io.IOBase):
            with contextlib.suppress(Exception):
                if not obj.closed and obj.writable():
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


_KEPT: list[Any] = []
"""The script's globals, or the frames of its exit, kept to the interpreter's end as a fresh
interpreter keeps them: its ``atexit`` handlers run with its objects alive, and torch's objects are
not torn down under threads that still use them."""


def _script_frames(tb: Any) -> Any:
    """The traceback without this module's and runpy's frames, as ``python SCRIPT`` prints it."""
    while (
        tb is not None
        and tb.tb_next is not None
        and (
            tb.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
            or tb.tb_frame.f_globals.get("__name__") == "runpy"
        )
    ):
        tb = tb.tb_next
    return tb


def _name_process(title: str, proc: str) -> None:
    """Show the child in ``ps`` with the command it stands for (``setproctitle`` writes it where
    its command line is read, as long as the fork server's own command line and environment hold
    it), and name it ``cpl-w3``, ``cpl-s0``... (``ps -o comm``, ``top``)."""
    if title:
        with contextlib.suppress(ImportError):
            import setproctitle

            setproctitle.setproctitle(title)
    if proc:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(f"cpl-{proc}".encode()[:15]), 0, 0, 0)


def _fresh_state(env: dict[str, str]) -> None:
    """What a fresh interpreter has that a fork shares with its siblings: random seeds (``random``
    reseeds itself after a fork; NumPy's global generator does not) and torch's thread count as
    the child's environment sets it."""
    import numpy as np
    import torch

    np.random.seed()
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    # what every job process imports first: once here, shared by every child
    import numpy  # noqa: F401
    import torch
    import torch._dynamo  # every optimizer's constructor imports it: about a second
    import torch.distributed  # noqa: F401

    import checkpointless.session  # noqa: F401

    with contextlib.suppress(ImportError):  # it finds where the command line lies while the
        import setproctitle  # environment is still the one the process started with

        setproctitle.getproctitle()
    sys.argv = sys.argv[:1]
    # what the imports made stays out of the children's collections: a collection there would
    # otherwise write to every page of it (copy-on-write), at every full collection and at exit
    gc.collect()
    gc.freeze()
    _serve(sock)


if __name__ == "__main__":
    main()
