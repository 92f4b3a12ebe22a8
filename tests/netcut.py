"""A TCP proxy whose link a test can cut (connections reset, new ones refused) or freeze (bytes
held, no error, and no new connection: a partition), then restore. Threads in the test process;
``close`` ends them."""

from __future__ import annotations

import select
import socket
import threading
import time


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether ``sock`` has something to read within ``timeout_s`` (``poll``: any descriptor number;
    ``select`` fails past 1024, which a long test session's process reaches)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


class CutProxy:
    """Forwards ``127.0.0.1:port`` to ``target``; ``cut``, ``freeze`` and ``restore`` the link."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener: socket.socket | None = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._up = threading.Event()  # forwarding (set) or frozen (clear)
        self._up.set()
        self._refusing = False
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Reset every open connection and refuse new ones until ``restore``."""
        with self._lock:
            self._refusing = True
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                _reset(s)

    def freeze(self) -> None:
        """Stop forwarding: connections stay open, requests get no answer, and nothing new
        connects (the listener closes: a partition lets no handshake through) until ``restore``."""
        self._up.clear()
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    def restore(self) -> None:
        with self._lock:
            self._refusing = False
            if self._listener is None:
                self._listener = socket.create_server(("127.0.0.1", self.port))
        self._up.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._up.set()
        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for t in self._threads:
            t.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            listener = self._listener
            if listener is None:  # frozen: no listener until ``restore``
                time.sleep(0.05)
                continue
            try:
                if not _readable(listener, 0.05):
                    continue
                conn, _ = listener.accept()
            except (OSError, ValueError):
                continue  # closed by ``freeze`` or ``close`` meanwhile
            with self._lock:
                refusing = self._refusing
            if refusing:
                _reset(conn)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(conn)
                continue
            with self._lock:
                self._pairs.append((conn, upstream))
            for a, b in ((conn, upstream), (upstream, conn)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self._closed:
            self._up.wait()
            try:
                if not _readable(src, 0.05):
                    continue
                if not self._up.is_set():
                    continue  # frozen while it waited: hold the bytes
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
            except (OSError, ValueError):  # reset, or closed by ``cut``
                break
        for s in (src, dst):
            _reset(s)


def _reset(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
