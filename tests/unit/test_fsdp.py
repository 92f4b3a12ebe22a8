"""fsdp.py in one process: a 1 x 1 generation, the shard state round trip, the socket shutdown."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from checkpointless.errors import CollectiveError
from checkpointless.fsdp import Generation, ShardedState, clear_dtensor_caches, shutdown_sockets, sockets
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
    before = sockets()
    listener = socket.create_server(("127.0.0.1", 0))
    store_side = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(listener.getsockname())
    mine, _ = listener.accept()
    store_conn = socket.create_connection(store_side.getsockname())
    store_peer, _ = store_side.accept()
    try:
        fds = {fd: link for fd, link in sockets().items() if before.get(fd) != link}
        assert shutdown_sockets(fds, keep_port=store_side.getsockname()[1]) >= 1
        peer.settimeout(5)
        assert peer.recv(1) == b""  # the peer sees the connection end at once
        late = socket.create_connection(listener.getsockname())  # the listener still accepts
        late.close()
        store_conn.sendall(b"x")  # the store's connection is untouched
        assert store_peer.recv(1) == b"x"
    finally:
        for s in (listener, store_side, peer, mine, store_conn, store_peer):
            s.close()


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
    """What a sharded spare does while it waits (Session._prewarm): build and use a model on a
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
