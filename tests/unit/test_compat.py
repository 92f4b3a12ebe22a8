"""_compat: every private torch name checkpointless uses, pinned (fails when a torch release
changes one), and the version gate that picks their implementations."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from checkpointless import _compat
from checkpointless._compat import UnsupportedTorch

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def default_group() -> object:
    _compat.reset_group_count()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# -- the gate ---------------------------------------------------------------------------------


def test_versions_are_read_and_mapped_to_a_tested_release() -> None:
    assert _compat.torch_version("2.13.0+cpu") == (2, 13)
    assert _compat.torch_version("2.14.0a0+git1234") == (2, 14)
    newest = max(_compat.TESTED)
    assert _compat.pick(newest) == newest
    assert _compat.pick((newest[0], newest[1] + 1)) == newest  # untested and newer: the newest's
    with pytest.raises(UnsupportedTorch, match="older than every release"):
        _compat.pick((2, 0))
    with pytest.raises(UnsupportedTorch, match="cannot read"):
        _compat.torch_version("nightly")
    assert set(_compat._IMPLEMENTATIONS) == set(_compat.TESTED)  # one set per tested release


def test_an_untested_torch_warns_once_and_a_changed_name_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    _compat._release.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="not 2.99.0"):
            _compat.process_groups()
        _compat.process_groups()  # once per process: no second warning (filterwarnings=error would raise)
        monkeypatch.delattr(distributed_c10d._World, "pg_map")
        with pytest.raises(UnsupportedTorch, match=r"has no _world\.pg_map"):
            _compat.process_groups()
    finally:
        _compat._release.cache_clear()
    with pytest.raises(UnsupportedTorch, match="is a int, not the"):
        _compat._attr(distributed_c10d._world, "group_count", dict)


def test_no_private_torch_name_outside_the_gate() -> None:
    """Every private torch name sits in _compat (STYLE.md item 18): none elsewhere in the package."""
    names = re.compile(
        r"_world\b|(?<!self)\._timeout\b|_execution_engine|_redistribute|_collective_utils|_op_dispatcher"
        r"|_clear_sharding_prop_cache|torch\._C\b|distributed_c10d\._"
    )
    root = Path(_compat.__file__).parent
    known: set[tuple[str, str]] = set()
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for line in path.read_text().splitlines():
            code = line.split("#", 1)[0]
            docs = code.lstrip().startswith(("``", '"'))
            if names.search(code) and not docs and (path.name, code.strip()) not in known:
                found.append(f"{path.relative_to(root)}: {line.strip()}")
    assert not found, found


# -- the pins: one per private name -------------------------------------------------------------


def test_group_count_is_torchs_group_name_counter() -> None:
    assert isinstance(distributed_c10d._world, distributed_c10d._World)
    assert isinstance(distributed_c10d._world.group_count, int)
    distributed_c10d._world.group_count = 7  # what a formation that failed before its default group leaves
    _compat.reset_group_count()
    assert distributed_c10d._world.group_count == 0
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sub, world = dist.new_group([0]), dist.group.WORLD
        assert world is not None
        assert distributed_c10d._world.pg_names[world] == "0"  # the names follow the counter
        assert distributed_c10d._world.pg_names[sub] == "1"
    finally:
        dist.destroy_process_group()


def test_pg_map_lists_every_process_group(default_group: object) -> None:
    sub = dist.new_group([0])
    assert isinstance(distributed_c10d._world.pg_map, dict)
    groups = _compat.process_groups()
    assert default_group in groups and sub in groups
    assert all(callable(getattr(pg, "abort", None)) for pg in groups)  # what release calls on them


def test_dtensor_caches_fill_and_clear(default_group: object) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        _collective_utils,
        _redistribute,
        debug,
        distribute_tensor,
    )

    propagator = DTensor._op_dispatcher.sharding_propagator
    lru: list[Any] = [
        propagator._propagate_tensor_meta_cached,
        propagator.propagate_op_sharding,  # what debug._clear_sharding_prop_cache clears
        _redistribute._gen_transform_infos,
        _collective_utils.MeshTopoInfo.build_from_mesh,
    ]
    assert all(callable(c.cache_clear) and callable(c.cache_info) for c in lru)
    assert isinstance(_redistribute._planner_cache, dict)
    assert callable(debug._clear_sharding_prop_cache)

    mesh = init_device_mesh("cpu", (1,))
    x = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    (x @ x.T).redistribute(mesh, [Replicate()])  # type: ignore[attr-defined]
    assert _redistribute._planner_cache and _redistribute._gen_transform_infos.cache_info().currsize
    assert _collective_utils.MeshTopoInfo.build_from_mesh.cache_info().currsize
    _compat.clear_dtensor_caches()
    assert not _redistribute._planner_cache
    assert all(c.cache_info().currsize == 0 for c in lru)


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch has no NCCL")
def test_nccl_options_timeout_is_a_timedelta() -> None:
    opts = dist.ProcessGroupNCCL.Options()
    assert isinstance(opts._timeout, timedelta)
    _compat.set_nccl_timeout(opts, timedelta(seconds=17))
    assert opts._timeout == timedelta(seconds=17)


def test_end_of_backward_callback_runs_once_after_the_pass() -> None:
    w = torch.ones(3, requires_grad=True)
    seen: list[object] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        _compat.queue_end_of_backward(lambda: seen.append(w.grad))  # queued mid-pass
        return grad

    w.register_hook(hook)
    (w * 2).sum().backward()
    assert len(seen) == 1 and seen[0] is not None  # ran once, after the gradient was accumulated
