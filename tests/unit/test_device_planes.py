"""No CPU tensor reaches an NCCL group, proved without a GPU.

The doubles (``tests/devicefake.py``) sit at the network boundary: the data plane refuses any
tensor not on its declared device (the pretend accelerator, as NCCL refuses CPU tensors), the
control plane any tensor not on the CPU. The state transfer runs through them in process; the
session's own collectives (the gradient reduction, the buffer broadcast, the layout check, the
consistency digests, barriers, a replacement's state transfer) run through them in a real job
with a kill, from a script that trains on the pretend device.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

from checkpointless.comm import Group
from checkpointless.state import recv_state, send_state, transfer
from tests import devicefake
from tests.devicefake import PRETEND, PlaneGroup, Pretend, PretendMode

pytestmark = pytest.mark.timeout(120)

KEY = b"k" * 32
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pretend_device.py"


@pytest.fixture(autouse=True)
def _fresh_counts() -> None:
    devicefake.calls.clear()
    devicefake.violations.clear()


def run_planes(fn: Callable[[Group], Any], device: torch.device = PRETEND) -> list[Any]:
    """``fn(group)`` on ranks 0 and 1 of a ``PlaneGroup`` pair (two threads, each in ``PretendMode``)."""
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    results: list[Any] = [None, None]

    def target(rank: int) -> None:
        store = TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))
        group = PlaneGroup(store, 0, rank, 2, timeout=timedelta(seconds=10), device=device)
        try:
            with PretendMode():
                results[rank] = fn(group)
        except Exception as e:
            traceback.clear_frames(e.__traceback__)
            results[rank] = e
        finally:
            group.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results


def _state(seed: int) -> dict[str, Any]:
    """A state as a GPU job holds it: parameters and moments on the device, RNG states and an
    optimizer's step count on the CPU, a bool mask, an empty tensor and a tensor of several pieces."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": Pretend(torch.randn(3, 5, generator=g)),
            "mask": Pretend(torch.rand(7, generator=g) > 0.5),
            "empty": Pretend(torch.zeros(0)),
            "big": Pretend(torch.randn(transfer._MAC_PIECE // 4 + 3, generator=g)),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(seed)), "exp_avg": Pretend(torch.randn(4, generator=g))}}
        },
        "rng": torch.get_rng_state() if seed == 1 else torch.zeros_like(torch.get_rng_state()),
    }


def _leaves(state: Any, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, dict):
        out: dict[str, torch.Tensor] = {}
        for k, v in state.items():
            out.update(_leaves(v, f"{path}/{k}"))
        return out
    return {path: state}


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.inner if isinstance(t, Pretend) else t


@pytest.mark.parametrize("device", [PRETEND, torch.device("cpu")], ids=["nccl-like", "gloo-like"])
def test_transfer_moves_device_tensors_on_the_data_plane_and_nothing_else(device: torch.device) -> None:
    """NCCL-like: device tensors go over the data plane as they are, CPU ones (RNG, step counts) over
    the control group with the header, metadata and trailer. Gloo-like (a data plane that sends
    host memory only): device tensors are staged through the CPU, both ways. Received in place."""

    def fn(group: Group) -> Any:
        if group.rank == 0:
            send_state(group, 1, _state(1), key=KEY)
            return None
        mine = _state(2)
        received, _ = recv_state(group, 0, key=KEY, into=mine)
        return mine, received

    r = run_planes(fn, device)
    assert r[0] is None, r[0]
    mine, received = r[1]
    sent, got, into = _leaves(_state(1)), _leaves(received), _leaves(mine)
    assert sent.keys() == got.keys()
    for path, t in sent.items():
        assert type(got[path]) is type(t) and got[path].device == t.device, path  # back on its device
        assert torch.equal(_plain(got[path]), _plain(t)), path
        assert _plain(got[path]).data_ptr() == _plain(into[path]).data_ptr() or not t.numel(), (
            path
        )  # in place
    assert devicefake.violations == []
    calls = devicefake.calls
    assert calls["control.send"] == 3 + (2 if device == PRETEND else 0)  # header, meta, trailer (+ step, rng)
    pieces_on_data = (
        1 + 1 + 2 + 1 + (2 if device.type == "cpu" else 0)
    )  # w, mask, big (2), exp_avg (+ step, rng)
    assert calls["data.send"] == calls["data.recv"] == pieces_on_data


def test_the_doubles_refuse_the_wrong_tensors() -> None:
    """The check bites: a CPU tensor on the data plane, a device tensor on the control plane, and
    a transfer that sent CPU tensors over the data plane (as a version routing everything there would)."""

    def fn(group: Group) -> list[str]:
        seen = []
        for call in (
            lambda: group.allreduce_([torch.zeros(1)]),
            lambda: group.control.allgather(Pretend(torch.zeros(2))),
            lambda: group.broadcast_([torch.zeros(1)]),
        ):
            with pytest.raises(RuntimeError, match="device plane violation"):
                call()
            seen.append(devicefake.violations[-1])
        return seen

    r = run_planes(fn)
    assert all(isinstance(x, list) and len(x) == 3 for x in r), r

    devicefake.violations.clear()

    def headers_on_the_data_plane(group: Group) -> Any:
        group.control, ctl = group, group.control  # as a transfer without a control group would
        try:
            return send_state(group, 1, _state(1)) if group.rank == 0 else recv_state(group, 0)
        finally:
            group.control = ctl

    r = run_planes(headers_on_the_data_plane)
    assert all(isinstance(x, RuntimeError) and "device plane violation" in str(x) for x in r), r
    assert any(v.startswith("data.send: Tensor on cpu") for v in devicefake.violations), devicefake.violations


def test_barrier_and_control_collectives_stay_on_the_control_group() -> None:
    def fn(group: Group) -> None:
        group.barrier()
        group.control.allgather(torch.zeros(4, dtype=torch.uint8))
        group.allreduce_([Pretend(torch.ones(3))])

    assert run_planes(fn) == [None, None]
    assert devicefake.violations == []
    assert devicefake.calls["control.allreduce"] == 2 and devicefake.calls["data.allreduce"] == 2
