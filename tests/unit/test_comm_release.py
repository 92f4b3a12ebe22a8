"""``Group.release``: a member leaves its generation from another thread while its main thread is
blocked in a collective on a live peer (the coordinator aborted the generation; the peer, cut off
from the coordinator, has noticed nothing). Ranks are threads with their own store connection and
gloo group (real sockets)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from checkpointless import comm, group_works
from checkpointless.comm import Group
from checkpointless.errors import CollectiveError
from tests.unit.test_reducer import run_ranks

pytestmark = pytest.mark.timeout(60)

TIMEOUT = timedelta(seconds=30)


def test_release_from_another_thread_fails_a_collective_blocked_on_a_live_peer() -> None:
    """Rank 0 blocks in an all-reduce rank 1 has not joined; a third thread releases rank 0's group
    (as the heartbeat thread does on the abort): the all-reduce fails at once, not at the
    collective timeout, and rank 1's next collective fails too (its connections were shut down
    from the other end): both leave the generation."""
    released = threading.Event()

    def rank_fn(rank: int, store: TCPStore) -> Any:
        g = Group(store, 0, rank, 2, prefix="release/", timeout=TIMEOUT)
        g.allreduce_([torch.ones(2)])  # the group works
        if rank == 0:
            threading.Timer(0.3, g.release).start()
            t0 = time.monotonic()
            with pytest.raises(CollectiveError):
                g.allreduce_([torch.ones(4)])
            waited = time.monotonic() - t0
            released.set()
            g.abort()
            return waited
        assert released.wait(20)
        with pytest.raises(CollectiveError):
            g.allreduce_([torch.ones(4)])
        g.abort()
        return None

    waited, _ = run_ranks(2, rank_fn)
    assert waited < TIMEOUT.total_seconds() / 3, waited  # released, not timed out


def test_release_leaves_the_other_threads_connections_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection another thread of the process opens while the group forms (a logger's, a data
    loader's) survives the release; the group's own connections do not. The interleaving is
    forced: the other thread connects right after rank 0's formation took its socket snapshot."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    theirs: list[socket.socket] = []
    real_sockets = comm.sockets

    def snapshot_then_another_thread_connects() -> dict[int, str]:
        before = real_sockets()
        if threading.current_thread().name == "rank0" and not theirs:
            t = threading.Thread(target=lambda: theirs.append(socket.create_connection(("127.0.0.1", port))))
            t.start()
            t.join()
        return before

    monkeypatch.setattr(comm, "sockets", snapshot_then_another_thread_connects)

    def rank_fn(rank: int, store: TCPStore) -> Any:
        threading.current_thread().name = f"rank{rank}"
        g = Group(store, 0, rank, 2, prefix="others/", timeout=TIMEOUT)
        g.allreduce_([torch.ones(2)])
        if rank == 0:
            g.release()
        with pytest.raises(CollectiveError):  # both ends: the group's connections are shut down
            g.allreduce_([torch.ones(2)])
        g.abort()
        return None

    try:
        run_ranks(2, rank_fn)
        deadline = time.monotonic() + 5
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        (conn,) = theirs
        conn.sendall(b"still here")
        assert accepted[0].recv(16) == b"still here"
    finally:
        for s in (*theirs, *accepted, server):
            s.close()


def _stop_then_release(at: float, pid: int, group: Group) -> None:
    """From a thread of its own: at ``at``, stop the peer ``pid`` (SIGSTOP: a host cut off
    mid-transfer, no reset comes back), and release ``group`` 0.3 s later, as the heartbeat thread
    does when the coordinator aborts the generation."""

    def run() -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.3)
        group.release()

    threading.Thread(target=run, daemon=True).start()


_PEER = """
import sys
from datetime import timedelta
import torch
from torch.distributed import TCPStore
from checkpointless.comm import Group
torch.set_num_threads(1)
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
g = Group(store, 0, 1, 2, prefix=sys.argv[3], timeout=timedelta(seconds=int(sys.argv[2])))
x = torch.zeros(16 * 1024 * 1024)
print("formed", flush=True)
while True:
    g.broadcast_([x])
"""


def test_release_ends_a_wait_on_a_send_to_a_peer_that_stopped_reading() -> None:
    """The root of a 64 MB broadcast waits only for its sends; its peer stops reading (SIGSTOP, as
    a host cut off mid-transfer: no reset comes back) at a random point of a broadcast; a third
    thread releases the group 0.3 s later. gloo does not notify a send whose bytes are queued when
    its connection is shut down (comm's module doc), so before the sliced wait this waited for the
    collective timeout whenever the stop fell inside a transfer (2 of 4 stops in a development run).
    Every stop must end in a prompt failure, wherever it fell, and the abort must not block."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    timeout_s = 20
    rng = random.Random(7)
    for trial in range(4):
        peer = subprocess.Popen(
            [sys.executable, "-c", _PEER, str(master.port), str(timeout_s), f"stopped{trial}/"],
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        try:
            store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))
            g = Group(store, 0, 0, 2, prefix=f"stopped{trial}/", timeout=timedelta(seconds=timeout_s))
            assert peer.stdout is not None and peer.stdout.readline().strip() == "formed"
            x = torch.ones(16 * 1024 * 1024)
            stop_at = time.monotonic() + 0.3 + rng.random() * 0.5
            _stop_then_release(stop_at, peer.pid, g)
            with pytest.raises(CollectiveError):
                while True:
                    g.broadcast_([x])
            waited = time.monotonic() - stop_at
            t0 = time.monotonic()
            g.abort()
            aborted = time.monotonic() - t0
            assert waited < 3.0, f"trial {trial}: released after {waited:.1f} s (timeout {timeout_s} s)"
            assert aborted < 1.0, f"trial {trial}: abort blocked {aborted:.1f} s"
        finally:
            peer.kill()
            peer.wait(10)


_STATE_PEER = """
import sys
from datetime import timedelta
import torch
from torch.distributed import TCPStore
from checkpointless.comm import Group
from checkpointless.state import recv_state, send_state
torch.set_num_threads(1)
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30))
g = Group(store, 0, 1, 2, prefix=sys.argv[3], timeout=timedelta(seconds=int(sys.argv[2])))
state = {"w": torch.ones(16 * 1024 * 1024), "step": 3}
print("formed", flush=True)
while True:
    if sys.argv[4] == "send":  # the peer sends, the test receives
        send_state(g, 0, state)
    else:
        recv_state(g, 0)
"""


@pytest.mark.parametrize("direction", ["send", "recv"])
def test_release_ends_a_state_transfer_with_a_peer_that_stopped(direction: str) -> None:
    """A state transfer of 64 MB, again and again; its peer stops (SIGSTOP, as a host cut off
    mid-transfer) at a random point, and a third thread releases the group 0.3 s later, as the
    heartbeat thread does when the coordinator aborts the generation. A gloo transfer's wait cannot
    wait in slices (a timed wait ends a send), so before its wait ran in a thread of its own a source
    whose receiver was cut off waited for gloo's timeout (H1: 61 s). The sender (``send``: the peer
    receives) and the receiver must both give up at once, and the abort must not block."""
    from checkpointless.state import recv_state, send_state

    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    timeout_s = 20
    rng = random.Random(11)
    state = {"w": torch.ones(16 * 1024 * 1024), "step": 3}
    for trial in range(2):
        prefix = f"transfer-{direction}{trial}/"
        peer = subprocess.Popen(
            [sys.executable, "-c", _STATE_PEER, str(master.port), str(timeout_s), prefix,
             "recv" if direction == "send" else "send"],
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        try:
            store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))
            g = Group(store, 0, 0, 2, prefix=prefix, timeout=timedelta(seconds=timeout_s))
            assert peer.stdout is not None and peer.stdout.readline().strip() == "formed"
            stop_at = time.monotonic() + 0.3 + rng.random() * 0.5
            _stop_then_release(stop_at, peer.pid, g)
            transfers = 0
            with pytest.raises(CollectiveError):
                while True:
                    if direction == "send":
                        send_state(g, 1, state)
                    else:
                        received, _ = recv_state(g, 1)
                        assert torch.equal(received["w"], state["w"]) and received["step"] == 3
                    transfers += 1
            waited = time.monotonic() - stop_at
            t0 = time.monotonic()
            g.abort()
            aborted = time.monotonic() - t0
            assert transfers >= 1, "no transfer went through before the stop"
            assert waited < 3.0, f"trial {trial}: released after {waited:.1f} s (timeout {timeout_s} s)"
            assert aborted < 1.0, f"trial {trial}: abort blocked {aborted:.1f} s"
        finally:
            peer.kill()
            peer.wait(10)


def test_a_transfer_on_a_wrapped_group_gives_up_when_its_owner_releases_it() -> None:
    """A sharded generation's group is torch's default group, which ``Group`` only wraps; its owner
    (``fsdp.Generation``) releases it. A receive from a peer that has not sent gives up as soon as the
    owner's flag says released, not at gloo's timeout; the wait given up ends in its thread once the
    peer sends after all, and the thread with the group's abort."""
    released, gave_up = threading.Event(), threading.Event()
    before = set(threading.enumerate())  # (an earlier test's wait given up may still be in its thread)

    def waiters() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("cpl-p2p-") and t not in before]

    def rank_fn(rank: int, store: TCPStore) -> Any:
        pg = torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore("wrapped/", store), rank, 2, TIMEOUT
        )
        g = Group.wrap(pg, 0, rank, 2, released=released.is_set)
        if rank == 0:
            g.send(torch.ones(4), 1)  # the group works
            threading.Timer(0.3, released.set).start()
            t0 = time.monotonic()
            with pytest.raises(CollectiveError, match="released"):
                g.recv(torch.empty(4), 1)
            waited = time.monotonic() - t0
            gave_up.set()
            g.abort()
            return waited
        x = torch.empty(4)
        g.recv(x, 0)
        assert torch.equal(x, torch.ones(4))
        assert gave_up.wait(20)
        g.send(torch.ones(4), 0)  # what rank 0 gave up waiting for
        g.abort()
        return None

    waited, _ = run_ranks(2, rank_fn)
    assert waited < TIMEOUT.total_seconds() / 3, waited
    deadline = time.monotonic() + 10
    while waiters() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not waiters(), waiters()


def test_the_exit_aborts_the_groups_still_formed_even_with_a_transfer_pending() -> None:
    """A process that exits with its groups formed (a script that never closed them, a test
    leaving one behind) has them aborted by the exit hook while the interpreter still runs: a
    gloo group destroyed during finalization with work holding tensors can abort the process.
    Here rank 0 leaves a receive nobody answers; the hook aborts both groups and the receive's
    wait ends (failed) within the hook's bound."""
    kept: list[Group] = []
    recv: list[Any] = []

    def rank_fn(rank: int, store: TCPStore) -> None:
        g = Group(store, 0, rank, 2, prefix="atexit/", timeout=TIMEOUT)
        g.allreduce_([torch.ones(2)])
        if rank == 0:
            recv.append(g.pg.recv([torch.zeros(4)], 1, 0))  # never sent
        kept.append(g)

    run_ranks(2, rank_fn)
    assert all(g in group_works.live for g in kept)
    t0 = time.monotonic()
    group_works._abort_at_exit()
    assert time.monotonic() - t0 < group_works.EXIT_WAIT_S + 5
    assert not any(g in group_works.live for g in kept)
    assert all(g.pg is None for g in kept)
    with pytest.raises(RuntimeError):
        recv[0].wait(timedelta(seconds=10))
