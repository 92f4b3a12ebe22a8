"""The heartbeat lease: a worker survives a control store that fails for less than its lease, and
exits (code 3) once the store has left it without an answer for longer. Real processes, a real
``TCPStore``, and a proxy whose link is cut (connections reset) or frozen (a partition)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from checkpointless.config import RecoveryConfig
from checkpointless.control.auth import SignedStore, job_namespace
from checkpointless.launch.relay import Relay
from checkpointless.protocol import keys
from tests.netcut import CutProxy

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "scripts" / "heartbeat_child.py"
SECRET = bytes(range(32))
LEASE = 1.5
INTERVAL = 0.05


def _server(port: int = 0) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


class Child:
    """``heartbeat_child.py`` connected to ``addr``; killed on ``close``."""

    def __init__(self, addr: str, relay: str | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.popen = subprocess.Popen(
            [sys.executable, str(CHILD), addr, str(LEASE), str(INTERVAL), SECRET.hex(), *([relay] if relay else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        assert self.popen.stdout is not None
        line = self.popen.stdout.readline()
        assert line.strip() == "ready", line + self.stderr()

    def ask(self, line: str) -> str:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()
        return self.popen.stdout.readline().strip()

    def stderr(self) -> str:
        if self.popen.poll() is None or self.popen.stderr is None:
            return ""
        return self.popen.stderr.read()[-3000:]

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=10)
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if f is not None:
                f.close()


def _seq(server: TCPStore) -> int:
    """The child's last heartbeat on ``server`` (0: none)."""
    view = SignedStore(server, SECRET, namespace=job_namespace(SECRET))
    text = view.get(keys.heartbeat("w0"))
    return 0 if text is None else int(json.loads(text)["seq"])


def _beats_again(server: TCPStore, after: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _seq(server) > after:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def link() -> Iterator[tuple[TCPStore, CutProxy, Child]]:
    server = _server()
    proxy = CutProxy(("127.0.0.1", server.port))
    child = None
    try:
        child = Child(proxy.addr)
        assert _beats_again(server, 0)
        yield server, proxy, child
    finally:
        if child is not None:
            child.close()
        proxy.close()


@pytest.mark.parametrize("how", ["cut", "freeze"])
def test_a_store_unreachable_for_less_than_the_lease_does_not_kill_the_worker(
    how: str, link: tuple[TCPStore, CutProxy, Child]
) -> None:
    server, proxy, child = link
    for _ in range(2):  # twice: the lease is renewed after the first outage
        getattr(proxy, how)()
        time.sleep(0.4 * LEASE)
        before = _seq(server)
        proxy.restore()
        assert _beats_again(server, before), (
            f"no heartbeat arrived after the link came back: {child.stderr()}"
        )
        time.sleep(0.5)
    time.sleep(LEASE)
    assert child.popen.poll() is None, f"exit code {child.popen.poll()}: {child.stderr()}"
    # the main connection (plans, reports) reconnects too
    assert child.ask("pub probe") == "ok probe"
    view = SignedStore(server, SECRET, namespace=job_namespace(SECRET))
    deadline = time.monotonic() + 5  # a ``set`` has no reply: "ok" means sent, not arrived
    while view.get("probe") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert view.get("probe") == "1"


@pytest.mark.parametrize("how", ["cut", "freeze"])
def test_a_store_unreachable_for_longer_than_the_lease_ends_the_worker(
    how: str, link: tuple[TCPStore, CutProxy, Child]
) -> None:
    """``freeze``: writes vanish without an error; only the acknowledged round trip sees it."""
    _server, proxy, child = link
    t0 = time.monotonic()
    getattr(proxy, how)()
    code = child.popen.wait(timeout=LEASE + 10)
    waited = time.monotonic() - t0
    assert code == 3, child.stderr()
    assert LEASE - 4 * INTERVAL <= waited <= LEASE + 1.5, waited
    assert "no answer from the control store" in child.stderr()


def test_a_pause_holding_the_gil_while_a_round_trip_is_answered_does_not_kill_the_worker(
    link: tuple[TCPStore, CutProxy, Child],
) -> None:
    """A full garbage collection (here: native code holding the GIL) longer than the lease, begun
    while a round trip was under way: its answer arrives during the pause and the heartbeat thread
    can take it only after. The lease thread, late itself, must leave it that chance."""
    import threading

    server, proxy, child = link
    for _ in range(3):
        proxy.freeze()
        time.sleep(0.2)  # the next round trip is sent and held: under way when the pause begins
        replies: list[str] = []

        def hold_the_gil(replies: list[str] = replies) -> None:
            replies.append(child.ask(f"gil {2 * LEASE}"))

        pause = threading.Thread(target=hold_the_gil)
        pause.start()
        time.sleep(0.3)
        proxy.restore()  # the answer arrives while the child holds the GIL
        pause.join(timeout=30)
        assert replies == ["ok gil"], f"{replies} {child.stderr()}"
        assert _beats_again(server, _seq(server)), child.stderr()
    assert child.popen.poll() is None, f"exit code {child.popen.poll()}: {child.stderr()}"


def test_a_restarted_store_server_does_not_kill_the_worker() -> None:
    server = _server()
    port = server.port
    child = Child(f"127.0.0.1:{port}")
    try:
        assert _beats_again(server, 0)
        del server  # the server stops: the child's connections are reset
        time.sleep(0.4 * LEASE)
        server = _server(port)
        assert _beats_again(server, 0), child.stderr()
        time.sleep(LEASE)
        assert child.popen.poll() is None, child.stderr()
    finally:
        child.close()


def test_lease_timing_rule_is_validated() -> None:
    rc = RecoveryConfig()
    assert (rc.lease_s, rc.hang_timeout_s, rc.heartbeat_interval_s) == (0.25, 0.5, 0.1)
    assert rc.lease_s + rc.heartbeat_interval_s <= 0.75 * rc.hang_timeout_s  # the default keeps the rule
    assert RecoveryConfig(hang_timeout_s=0.4, heartbeat_interval_s=0.1).lease_s == 0.2  # hang / 4 passes
    assert RecoveryConfig(hang_timeout_s=0.3, heartbeat_interval_s=0.3 / 4).lease_s == 0.15
    assert RecoveryConfig(hang_timeout_s=2.0, heartbeat_lease_s=1.4).lease_s == 1.4
    for bad in (
        {"hang_timeout_s": 2.0, "heartbeat_lease_s": 1.5},  # + interval > 0.75 x hang_timeout_s
        {"heartbeat_lease_s": 0.3},  # + interval > 0.75 x the default 0.5 s
        {"heartbeat_lease_s": 0.15},  # < 2 heartbeats
        {"hang_timeout_s": 1.0, "heartbeat_interval_s": 0.3},  # default lease 0.5 < 2 x 0.3
    ):
        with pytest.raises(ValueError, match=r"heartbeat_lease_s.*heartbeat_interval_s.*hang_timeout_s"):
            RecoveryConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="heartbeat_lease_s must be a positive"):
        RecoveryConfig(heartbeat_lease_s=float("nan"))


_STORE_PROCESS = """
import time
from datetime import timedelta
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
print(s.port, flush=True)
time.sleep(80)
"""


def test_a_store_whose_process_is_stalled_past_the_lease_does_not_end_the_worker() -> None:
    """The launcher not scheduled (a loaded host), here stopped outright for twice the lease: its
    store answers nothing, but its kernel still accepts a connection, so the worker waits for it
    rather than give up its rank (every worker would at once: the job lost). Once the store is
    killed, the worker exits as before."""
    import signal

    server = subprocess.Popen([sys.executable, "-c", _STORE_PROCESS], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        child = Child(f"127.0.0.1:{port}")
        time.sleep(0.5)
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(2 * LEASE)
        os.kill(server.pid, signal.SIGCONT)
        time.sleep(LEASE)
        assert child.popen.poll() is None, f"exit code {child.popen.poll()}: {child.stderr()}"
        assert child.ask("pub probe") == "ok probe"
        server.kill()
        assert child.popen.wait(timeout=LEASE + 10) == 3, child.stderr()
    finally:
        if child is not None:
            child.close()
        server.kill()
        server.wait(timeout=10)


def _relayed_seq(server: TCPStore) -> int:
    """The child's last heartbeat as its host's relay forwarded it (0: none)."""
    view = SignedStore(server, SECRET, namespace=job_namespace(SECRET))
    text = view.get(keys.node_relay("h"))
    return int(json.loads(text)["procs"].get("w0", {}).get("seq", 0)) if text else 0


@pytest.fixture
def relayed() -> Iterator[tuple[TCPStore, CutProxy, Child]]:
    """The child beats into a host agent's relay (this process), whose link to the store is cut."""
    server = _server()
    proxy = CutProxy(("127.0.0.1", server.port))
    relay = Relay("h", proxy.addr, SECRET, names=lambda: ["w0"], interval=INTERVAL, lease_s=LEASE)
    relay.start()
    child = None
    try:
        child = Child(proxy.addr, relay=relay.addr)
        deadline = time.monotonic() + 10
        while _relayed_seq(server) == 0:
            assert time.monotonic() < deadline, child.stderr()
            time.sleep(0.05)
        yield server, proxy, child
    finally:
        if child is not None:
            child.close()
        relay.close()
        proxy.close()


@pytest.mark.parametrize("how", ["cut", "freeze"])
def test_a_relayed_worker_whose_host_is_cut_off_for_longer_than_the_lease_exits(
    how: str, relayed: tuple[TCPStore, CutProxy, Child]
) -> None:
    """Its relay still answers, the store behind it does not: the lease is the relay's last answer."""
    _server, proxy, child = relayed
    t0 = time.monotonic()
    getattr(proxy, how)()
    code = child.popen.wait(timeout=LEASE + 10)
    waited = time.monotonic() - t0
    assert code == 3, child.stderr()
    assert LEASE - 4 * INTERVAL <= waited <= LEASE + 1.5, waited
    assert f"no answer from the control store at {proxy.addr}" in child.stderr()


def test_a_relayed_worker_survives_a_cut_shorter_than_the_lease(
    relayed: tuple[TCPStore, CutProxy, Child],
) -> None:
    server, proxy, child = relayed
    for _ in range(2):
        proxy.cut()
        time.sleep(0.4 * LEASE)
        before = _relayed_seq(server)
        proxy.restore()
        deadline = time.monotonic() + 5
        while _relayed_seq(server) <= before:
            assert time.monotonic() < deadline, (
                f"no relayed heartbeat after the link came back: {child.stderr()}"
            )
            time.sleep(0.05)
        time.sleep(0.5)
    time.sleep(LEASE)
    assert child.popen.poll() is None, f"exit code {child.popen.poll()}: {child.stderr()}"
