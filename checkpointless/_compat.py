"""Every private torch name checkpointless uses, one function each, gated by torch's version.

torch moves its private names between releases without notice, so none is touched anywhere
else (STYLE.md item 18). Each function below picks its implementation from ``torch.__version__``
in ``_IMPLEMENTATIONS``: one per tested release (``TESTED``; tests/unit/test_compat.py pins
every name, its type and its behaviour, and fails when a release changes one).

An untested torch newer than the newest tested release gets that release's implementation, with
one warning per process; a private name it lacks, or that changed type, raises
``UnsupportedTorch`` naming it, at the first call. A name that keeps its type but changes what it
does goes unnoticed there: only the pins, run on that release, catch it. A torch older than the
oldest tested release is refused the same way (pyproject.toml declares that floor).
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from checkpointless.errors import UnsupportedTorch as UnsupportedTorch  # re-exported

#: the torch releases (major, minor) these implementations were tested with
TESTED: tuple[tuple[int, int], ...] = ((2, 13),)


def torch_version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``text`` (default ``torch.__version__``; ``"2.13.0+cpu"`` -> (2, 13))."""
    m = re.match(r"(\d+)\.(\d+)", text if text is not None else torch.__version__)
    if m is None:
        raise UnsupportedTorch(f"cannot read torch's version {text!r}")
    return int(m.group(1)), int(m.group(2))


def pick(version: tuple[int, int]) -> tuple[int, int]:
    """The tested release whose implementations ``version`` uses (see the module doc)."""
    if version < TESTED[0]:
        raise UnsupportedTorch(
            f"torch {version[0]}.{version[1]} is older than every release checkpointless was tested "
            f"with ({_tested()})"
        )
    return max(t for t in TESTED if t <= version)


def _tested() -> str:
    return ", ".join(f"{a}.{b}" for a, b in TESTED)


@functools.cache
def _release() -> tuple[int, int]:
    version = torch_version()
    chosen = pick(version)
    if chosen != version:
        warnings.warn(
            f"checkpointless was tested with torch {_tested()}, not {torch.__version__}: it uses "
            f"torch {chosen[0]}.{chosen[1]}'s private APIs and stops with UnsupportedTorch where "
            "they changed",
            RuntimeWarning,
            stacklevel=4,
        )
    return chosen


def _attr(obj: Any, path: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """``obj.<path>`` (dotted), checked to exist (and to be a ``kind``), else ``UnsupportedTorch``."""
    cur = obj
    for part in path.split("."):
        try:
            cur = getattr(cur, part)
        except AttributeError:
            raise UnsupportedTorch(
                f"torch {torch.__version__} has no {path} (a private torch name checkpointless "
                f"uses; tested with torch {_tested()})"
            ) from None
    if kind is not None and not isinstance(cur, kind):
        raise UnsupportedTorch(
            f"torch {torch.__version__}: {path} is a {type(cur).__name__}, not the "
            f"{getattr(kind, '__name__', kind)} of torch {_tested()}"
        )
    return cur


@dataclass(frozen=True)
class Pin:
    """A private member of a host library (transformers, accelerate, Lightning) that an integration
    uses, as its pin test checks it (the integrations' compatibility modules list them:
    ``checkpointless.integrations._hf_compat``, ``checkpointless.integrations.lightning._compat``)."""

    owner: str
    """``module:Class`` it belongs to (``transformers:Trainer``)."""
    name: str
    """The member (``_get_train_sampler``)."""
    use: str
    """``call`` (called with ``params`` first, the rest left to their defaults), ``override`` (the
    integration defines it again, or replaces it on an instance, with exactly ``params``) or
    ``attribute`` (an attribute read or written: ``where`` assigns it)."""
    params: tuple[str, ...] = ()
    """The parameters (after ``self``) a call passes, or an override's, in order."""
    where: str = ""
    """``attribute``: the ``module:function`` (or ``module:Class.method``) of the host library that
    assigns it."""


# -- torch 2.13 -----------------------------------------------------------------------------------


def _reset_group_count_2_13() -> None:
    from torch.distributed import distributed_c10d

    world = _attr(distributed_c10d, "_world")
    _attr(world, "group_count", int)
    world.group_count = 0


def _process_groups_2_13() -> list[Any]:
    from torch.distributed import distributed_c10d

    return list(_attr(distributed_c10d, "_world.pg_map", dict))


def _clear_dtensor_caches_2_13() -> None:
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute, debug

    clears: list[Callable[[], Any]] = [
        _attr(debug, "_clear_sharding_prop_cache"),
        _attr(DTensor, "_op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear"),
        _attr(_redistribute, "_planner_cache", dict).clear,
        _attr(_redistribute, "_gen_transform_infos.cache_clear"),
        _attr(_collective_utils, "MeshTopoInfo.build_from_mesh.cache_clear"),
    ]
    for clear in clears:
        clear()


def _set_nccl_timeout_2_13(options: Any, timeout: timedelta) -> None:
    _attr(options, "_timeout", timedelta)
    options._timeout = timeout


def _queue_end_of_backward_2_13(callback: Callable[[], None]) -> None:
    _attr(torch.autograd.Variable, "_execution_engine.queue_callback")(callback)


def _reshard_failed_2_13(module: Any) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = _attr(module, "_get_fsdp_state")()
    for group in _attr(state, "_fsdp_param_groups", list):
        _attr(group, "_training_state", TrainingState)
        group._training_state = TrainingState.IDLE
    module.reshard()


_IMPLEMENTATIONS: dict[tuple[int, int], dict[str, Callable[..., Any]]] = {
    (2, 13): {
        "reshard_failed": _reshard_failed_2_13,
        "reset_group_count": _reset_group_count_2_13,
        "process_groups": _process_groups_2_13,
        "clear_dtensor_caches": _clear_dtensor_caches_2_13,
        "set_nccl_timeout": _set_nccl_timeout_2_13,
        "queue_end_of_backward": _queue_end_of_backward_2_13,
    },
}


def _impl(name: str) -> Callable[..., Any]:
    return _IMPLEMENTATIONS[_release()][name]


# -- the gate: what the rest of checkpointless calls ---------------------------------------------


def reset_group_count() -> None:
    """Restart torch's process-wide group-name counter at 0 (``distributed_c10d._world.group_count``),
    so that a formation names its groups as a fresh process does."""
    _impl("reset_group_count")()


def process_groups() -> list[Any]:
    """Every process group torch knows in this process (``distributed_c10d._world.pg_map``)."""
    result: list[Any] = _impl("process_groups")()
    return result


def clear_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation and redistribution caches (they hold meshes and groups)."""
    _impl("clear_dtensor_caches")()


def set_nccl_timeout(options: Any, timeout: timedelta) -> None:
    """Set the collective timeout of a ``ProcessGroupNCCL.Options`` (its private ``_timeout``)."""
    _impl("set_nccl_timeout")(options, timeout)


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends, as ``DistributedDataParallel`` does
    (``Variable._execution_engine.queue_callback``)."""
    _impl("queue_end_of_backward")(callback)


def reshard_failed(module: Any) -> None:
    """Reshard an FSDP2 module whose forward or backward failed: ``reshard()`` alone keeps the
    parameters gathered when its group is still in the forward state and does not reshard after
    forward (the root's, by default), and this rank's state would then be saved at full size
    (``FSDPParamGroup._training_state`` set back to idle first). Not ``reset_iter_state()``: it
    waits for the failed iteration's collectives, which a released gloo group may hold for its
    timeout."""
    _impl("reshard_failed")(module)
