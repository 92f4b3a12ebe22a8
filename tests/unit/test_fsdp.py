"""fsdp.py in one process: a 1 x 1 generation, the shard state round trip, the socket shutdown."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from checkpointless.errors import CollectiveError
from checkpointless.fsdp import Generation, ShardedState, clear_dtensor_caches
from checkpointless.sockets import (
    group_connections,
    listeners,
    release_formation,
    shutdown_sockets,
    sockets,
    sockets_since,
    store_endpoints,
)
from checkpointless.state import combined_digest, entry_digests

pytestmark = pytest.mark.timeout(60)


def _build(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _digest(state: dict[str, Any]) -> bytes:
    return combined_digest(entry_digests(state))


def test_shard_state_survives_a_new_generation_bit_for_bit() -> None:
    gen = Generation(dist.HashStore(), gen=0, prefix="t0/", rank=0, world=1, shards=1)
    try:
        model, opt = _build(gen.mesh)
        _train(model, opt, 3)
        state = ShardedState(model, opt).state_dict()
        assert all(type(t) is torch.Tensor for t in state["params"].values())  # plain tensors, no DTensor
        assert set(state["sharded"]["0.weight"]) == {"exp_avg", "exp_avg_sq"}  # "step" is not a shard
        before = _digest(state)
        del model, opt
    finally:
        gen.close()
    assert not dist.is_initialized()
    gen = Generation(dist.HashStore(), gen=1, prefix="t1/", rank=0, world=1, shards=1)
    try:
        fresh, fresh_opt = _build(gen.mesh)
        _train(fresh, fresh_opt, 1)  # different values, so that loading must overwrite them
        ShardedState(fresh, fresh_opt).load_state_dict(state)
        assert _digest(ShardedState(fresh, fresh_opt).state_dict()) == before
        _train(fresh, fresh_opt, 1)  # the loaded optimizer state is usable (DTensors on the new mesh)
    finally:
        gen.close()


def _formed_on_a_thread(gen: int) -> Generation:
    """A 1 x 1 generation formed as ``Formation`` forms one: on a helper thread."""
    out: dict[str, Generation] = {}
    t = threading.Thread(
        target=lambda: out.update(
            g=Generation(dist.HashStore(), gen=gen, prefix=f"tc{gen}/", rank=0, world=1, shards=1)
        )
    )
    t.start()
    t.join(30)
    return out["g"]


def test_the_training_thread_keeps_or_clears_its_own_dtensor_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """DTensor's caches are per thread. A generation of another layout clears those of the thread
    that trains (``use_caches``), not of the one that formed it: else a model built on the new mesh
    came out of the cache on an older mesh of the same shape, whose groups were gone (a sharded
    job that shrank and grew back failed every step with 'Could not resolve the process group')."""
    from checkpointless import fsdp

    first = _formed_on_a_thread(0)
    try:
        first.use_caches()
        model, opt = _build(first.mesh)
        _train(model, opt, 1)  # fills this thread's caches on the first mesh
        kept = next(model.parameters()).device_mesh
        del model, opt
    finally:
        first.close()
    second = _formed_on_a_thread(1)
    try:
        monkeypatch.setattr(fsdp, "_cache_signature", ("a generation of another layout",))
        second.use_caches()
        model, opt = _build(second.mesh)
        _train(model, opt, 1)
        assert next(model.parameters()).device_mesh is second.mesh
        assert next(model.parameters()).device_mesh is not kept
    finally:
        second.close()


def test_a_second_default_group_is_refused() -> None:
    gen = Generation(dist.HashStore(), gen=0, prefix="t2/", rank=0, world=1, shards=1)
    try:
        with pytest.raises(RuntimeError, match="already exists"):
            Generation(dist.HashStore(), gen=1, prefix="t3/", rank=0, world=1, shards=1)
    finally:
        gen.close()


def test_a_failed_formation_leaves_group_names_as_a_fresh_process_has_them() -> None:
    """A formation that fails before its default group exists (its peer never comes) advances
    torch's group-name counter; the next generation must name its groups as a fresh spare does,
    or their rendezvous keys never meet (found by a spare killed as it joined a rollback)."""
    with pytest.raises(CollectiveError, match="group formation failed"):
        Generation(
            dist.HashStore(), gen=0, prefix="t4/", rank=0, world=2, shards=1, timeout=timedelta(seconds=1)
        )
    assert not dist.is_initialized()
    gen = Generation(dist.HashStore(), gen=1, prefix="t5/", rank=0, world=1, shards=1)
    try:
        fresh = [str(i) for i in range(3)]  # the default group, then the mesh's two sub-groups
        assert sorted(dist.distributed_c10d._world.pg_names.values()) == fresh
    finally:
        gen.close()


def test_dtensor_caches_clear() -> None:
    clear_dtensor_caches()  # pins the private torch APIs it calls (they move between releases)


def test_shutdown_fails_connections_but_leaves_listeners_and_the_store() -> None:
    store_side = socket.create_server(("127.0.0.1", 0))
    before = sockets()
    listener = socket.create_server(("127.0.0.1", 0))  # the group's, opened while it forms
    peer = socket.create_connection(listener.getsockname())
    mine, _ = listener.accept()
    store_conn = socket.create_connection(store_side.getsockname())
    store_peer, _ = store_side.accept()
    try:
        fds = group_connections(sockets_since(before))
        assert mine.fileno() in fds and store_conn.fileno() not in fds and listener.fileno() not in fds
        assert shutdown_sockets(fds) >= 1
        peer.settimeout(5)
        assert peer.recv(1) == b""  # the peer sees the connection end at once
        late = socket.create_connection(listener.getsockname())  # the listener still accepts
        late.close()
        store_conn.sendall(b"x")  # the store's connection is untouched
        assert store_peer.recv(1) == b"x"
    finally:
        for s in (listener, store_side, peer, mine, store_conn, store_peer):
            s.close()


def test_a_groups_connections_are_told_apart_from_other_threads() -> None:
    """Opened while a group formed: a connection its listener accepted, one to a peer's listener,
    one to the store (the group's), and one a logger thread opened to a server of its own."""
    servers = {name: socket.create_server(("127.0.0.1", 0)) for name in ("peer", "store", "logger")}
    before = sockets()
    own = socket.create_server(("127.0.0.1", 0))
    conns = {
        "in": socket.create_connection(own.getsockname()),
        "out": socket.create_connection(servers["peer"].getsockname()),
        "store": socket.create_connection(servers["store"].getsockname()),
        "logger": socket.create_connection(servers["logger"].getsockname()),
    }
    accepted, _ = own.accept()
    try:
        new = sockets_since(before)
        assert listeners(new) == [own.getsockname()]
        peer_ep = servers["peer"].getsockname()
        store_ep = ("::ffff:127.0.0.1", servers["store"].getsockname()[1])  # as TCPStore connects
        picked = group_connections(new, peers=[peer_ep], store=[store_ep])
        # conns["in"] is the peer's end of the accepted connection (here in the same process):
        # it connects to our listener, which a peer's list would name; the accepted end is ours
        assert accepted.fileno() in picked
        assert conns["out"].fileno() in picked and conns["store"].fileno() in picked
        assert conns["logger"].fileno() not in picked
        assert conns["store"].fileno() not in group_connections(new, peers=[peer_ep])  # Generation's
        any_ip = ("0.0.0.0", peer_ep[1])  # a listener on every address matches by its port
        assert conns["out"].fileno() in group_connections(new, peers=[any_ip])
        assert store_endpoints(f"localhost:{store_ep[1]}") >= {("127.0.0.1", store_ep[1])}
    finally:
        for s in (*servers.values(), own, *conns.values(), accepted):
            s.close()


def test_an_aborted_formation_spares_another_threads_connection() -> None:
    """What formation.Formation does when the coordinator aborts a formation whose peer never
    comes: the formation ends at once, and a connection another thread opened meanwhile (a
    logger's, to a server of its own) survives it."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = f"127.0.0.1:{server.port}"
    logger_server = socket.create_server(("127.0.0.1", 0))
    before = sockets()
    result: dict[str, Any] = {}

    def form() -> None:
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
        try:  # rank 1 never comes: this waits in the store up to the timeout
            result["generation"] = Generation(
                store, gen=0, prefix="t6/", rank=0, world=2, shards=1, timeout=timedelta(seconds=30)
            )
        except CollectiveError as e:
            result["error"] = e

    t = threading.Thread(target=form)
    t.start()
    logger: dict[str, socket.socket] = {}
    opener = threading.Thread(
        target=lambda: logger.update(conn=socket.create_connection(logger_server.getsockname()))
    )
    opener.start()
    opener.join()
    logger_end, _ = logger_server.accept()
    try:
        time.sleep(0.5)  # the formation waits for rank 1
        assert t.is_alive()
        start = time.monotonic()
        assert release_formation(before, addr) >= 1  # the formation's store connection
        t.join(10)
        assert not t.is_alive() and "error" in result, result
        assert time.monotonic() - start < 5  # not the 30 s timeout
        assert not dist.is_initialized()
        logger["conn"].sendall(b"log")  # the logger's connection survived, both ways
        logger_end.settimeout(5)
        assert logger_end.recv(3) == b"log"
        logger_end.sendall(b"ok")
        logger["conn"].settimeout(5)
        assert logger["conn"].recv(2) == b"ok"
    finally:
        t.join(35)
        for s in (logger_server, logger_end, *logger.values()):
            s.close()


_PEER = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from checkpointless.fsdp import Generation

store = dist.TCPStore("127.0.0.1", {port}, is_master=False, timeout=timedelta(seconds=30))
gen = Generation(store, gen=0, prefix="t7/", rank=1, world=2, shards=1, timeout=timedelta(seconds=30))
print("formed", flush=True)
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))  # rank 0 never joins: only its release ends this wait
except RuntimeError:
    pass
print(round(time.monotonic() - start, 2), flush=True)
gen.close()
"""


def test_a_generation_releases_its_peer_through_the_connections_it_publishes() -> None:
    """Two processes form a generation; each publishes its group listeners and reads the other's.
    Every connection between them is the group's (whichever rank connected), the store's is not,
    and rank 0's release ends rank 1's pending collective at once."""
    import subprocess
    import sys

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    peer = subprocess.Popen(
        [sys.executable, "-c", _PEER.format(port=server.port)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
        before = sockets()
        gen = Generation(store, gen=0, prefix="t7/", rank=0, world=2, shards=1, timeout=timedelta(seconds=30))
        try:
            assert peer.stdout is not None and peer.stdout.readline().strip() == "formed"
            tcp = _tcp_connections(sockets_since(before))
            # the store's connections: its client's (the formation's) and, here, its server's
            to_store = {fd for fd, ports in tcp.items() if server.port in ports}
            to_peer = set(tcp) - to_store
            assert to_peer and to_peer <= set(gen._fds)  # every connection to rank 1 is the group's
            assert not to_store & set(gen._fds)
            time.sleep(0.5)  # rank 1 waits in its all-reduce
        finally:
            gen.close()
        assert float(peer.stdout.readline()) < 10  # released, not the 30 s timeout
        assert peer.wait(30) == 0
    finally:
        peer.kill()
        peer.wait()


def _tcp_connections(fds: dict[int, str]) -> dict[int, tuple[int, int]]:
    """fd -> (local port, remote port) of the connected TCP sockets among ``fds``."""
    out = {}
    for fd in fds:
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(fd))
            try:
                if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                    out[fd] = (s.getsockname()[1], s.getpeername()[1])
            finally:
                s.close()
    return out


_SPARE_WARMUP = """
import os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from unit.test_fsdp import _build, _train
from checkpointless.fsdp import Generation, forget_dtensor_caches

def loops():
    tasks = os.listdir("/proc/self/task")
    return sum(open(f"/proc/self/task/{{t}}/comm").read().strip() == "gloo_tcp_loop" for t in tasks)

torch.set_num_threads(1)
warm = Generation(dist.HashStore(), gen=-1, prefix="prewarm/", rank=0, world=1, shards=1)
model, opt = _build(warm.mesh)
_train(model, opt, 2)
live = loops()
del model, opt
warm.close()
del warm
forget_dtensor_caches()
time.sleep(0.2)
print(live, loops())
"""


def test_a_closed_generation_leaves_no_gloo_thread_behind() -> None:
    """What a sharded spare does while it waits (ShardedModel.prepare_spare): build and use a model on a
    1 x 1 mesh, then close it. Nothing of it may keep waking up: every gloo event loop wakes 100
    times a second, CPU the workers beside an idle spare need. Runs in a fresh interpreter: the
    leak this guards against came from importing DTensor's modules while a group was alive."""
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", _SPARE_WARMUP.format(tests=tests)],
        capture_output=True, text=True, timeout=50, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    live, left = (int(x) for x in out.stdout.split())
    assert live >= 1 and left == 0, f"gloo event loops: {live} while the model lived, {left} after close"


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a collective failed here")


def test_a_forward_failed_after_the_roots_gather_is_resharded() -> None:
    """A forward that fails inside a child, after the root gathered its parameters (the root does
    not reshard after forward): ``reshard()`` alone left the root's parameters gathered, and a
    leaving rank saved its state at full size, which the next generation's shards could not take
    (a fresh-clone CI run: "The size of tensor a (16) must match the size of tensor b (32)").
    ``reshard_failed`` puts the sharded parameters back."""
    from torch.distributed.tensor import DTensor

    from checkpointless._compat import reshard_failed

    gen = Generation(dist.HashStore(), gen=0, prefix="t9/", rank=0, world=1, shards=1)
    try:
        for reshard in (lambda m: m.reshard(), reshard_failed):
            model, _ = _build(gen.mesh)
            model.append(_Fails())
            with pytest.raises(RuntimeError, match="a collective failed here"):
                model(torch.randn(4, 6))
            gathered = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
            assert gathered == ["1.weight", "1.bias", "2.weight", "2.bias"]  # the root's own
            reshard(model)
            left = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
            assert left == ([] if reshard is reshard_failed else gathered)
            del model
    finally:
        gen.close()
