"""A pretend accelerator and data-plane doubles, to prove without a GPU that no CPU tensor reaches
an NCCL group (and no device tensor the gloo control group).

- ``Pretend``: a tensor that reports device ``meta`` (the pretend accelerator: a real device type,
  so autograd and ``torch.device`` accept it, that no code of the project uses for anything else)
  and holds real CPU data. Every operation on it runs on that data and wraps the result again;
  ``.cpu()`` / ``.to("cpu")`` gives a plain CPU tensor, as from a GPU.
- ``PretendMode``: also makes factory calls with ``device=meta`` (``torch.zeros(..., device=p.device)``,
  ``x.to(session.device)``) build ``Pretend`` tensors. Enter it for the whole process or test.
- ``PlaneGroup``: a ``comm.Group`` whose data plane behaves like NCCL's at the boundary: a real gloo
  group underneath, but every tensor handed to its data-plane methods must be on its declared
  ``device`` (``meta``: pretend-accelerator tensors only; a CPU tensor is refused as NCCL refuses
  it). Its ``control`` is a ``ControlGroup``, a real gloo group refusing anything but plain CPU
  tensors. Each refusal is recorded (``violations``) and raised; every accepted call is counted by
  plane and method (``calls``), so a test can show that both planes were used for what they carry.
  ``PlaneGroup(..., device=torch.device("cpu"))`` is the gloo-like variant: its data plane takes
  CPU tensors only (point to point, gloo sends host pointers), so device tensors must be staged.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from checkpointless.comm import Group

PRETEND = torch.device("meta")

violations: list[str] = []
calls: Counter[str] = Counter()


class Pretend(torch.Tensor):
    """A tensor on the pretend accelerator (device ``meta``) with real CPU data in ``inner``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Pretend:
        assert type(inner) is torch.Tensor and inner.device.type == "cpu", (type(inner), inner.device)
        t = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=PRETEND, requires_grad=inner.requires_grad,
        )  # fmt: skip
        t.inner = inner
        return t  # type: ignore[no-any-return]

    @property
    def is_meta(self) -> bool:  # type: ignore[override]
        return False  # it holds data, unlike a real meta tensor

    def data_ptr(self) -> int:
        return self.inner.data_ptr()

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Pretend({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with PretendMode():
            return func(*args, **(kwargs or {}))


def _is_pretend_device(d: Any) -> bool:
    return d is not None and torch.device(d).type == PRETEND.type


class PretendMode(TorchDispatchMode):
    """Runs every operation on the pretend device's CPU data; ``device=meta`` factories make ``Pretend``."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        wrap = False

        def unwrap(x: Any) -> Any:
            nonlocal wrap
            if isinstance(x, Pretend):
                wrap = True
                return x.inner
            if isinstance(x, torch.Tensor) and x.device.type == PRETEND.type:
                raise RuntimeError(f"{func}: a real meta tensor (no data) reached the pretend device")
            return x

        args, kwargs = tree_map(unwrap, args), tree_map(unwrap, dict(kwargs or {}))
        if "device" in kwargs and kwargs["device"] is not None:
            if _is_pretend_device(kwargs["device"]):
                kwargs["device"], wrap = torch.device("cpu"), True
            else:
                wrap = False  # an explicit copy elsewhere: ``.cpu()``
        out = func(*args, **kwargs)
        if not wrap:
            return out
        return tree_map(lambda o: Pretend(o) if type(o) is torch.Tensor else o, out)


def on_pretend(module: torch.nn.Module) -> torch.nn.Module:
    """Move ``module``'s parameters and buffers to the pretend device (call inside ``PretendMode``)."""
    return module._apply(lambda t: Pretend(t.detach()) if not isinstance(t, Pretend) else t)


def _refuse(plane: str, method: str, t: Any, why: str) -> None:
    what = f"{type(t).__name__} on {getattr(t, 'device', '?')}, {getattr(t, 'dtype', '?')} {list(getattr(t, 'shape', []))}"
    message = f"{plane}.{method}: {what}: {why}"
    violations.append(message)
    out = os.environ.get("PLANES_OUT")
    if out:
        with open(os.path.join(out, f"{os.getpid()}.violations"), "a") as f:
            f.write(message + "\n")
    raise RuntimeError(f"device plane violation: {message}")


class ControlGroup(Group):
    """The control plane (gloo): plain CPU tensors only."""

    def _check(self, method: str, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if type(t) is not torch.Tensor or t.device.type != "cpu":
                _refuse("control", method, t, "the control group takes CPU tensors only")
        calls[f"control.{method}"] += 1

    def allreduce_start(self, tensor: torch.Tensor) -> Any:
        self._check("allreduce", [tensor])
        return super().allreduce_start(tensor)

    def broadcast_(self, tensors: list[torch.Tensor], root: int = 0) -> None:
        self._check("broadcast", tensors)
        super().broadcast_(tensors, root)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self._check("allgather", [tensor])
        return super().allgather(tensor)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        self._check("send", [tensor])
        return super().isend(tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        self._check("recv", [tensor])
        return super().irecv(tensor, src, tag)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._check("send", [tensor])
        super().send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._check("recv", [tensor])
        super().recv(tensor, src)


class PlaneGroup(Group):
    """The data plane of an accelerator job: tensors on ``device`` only (``meta``: like NCCL)."""

    def __init__(
        self,
        store: dist.Store,
        gen: int,
        rank: int,
        world_size: int,
        *,
        prefix: str | None = None,
        backend: str = "gloo",
        timeout: timedelta = timedelta(seconds=60),
        device: torch.device | None = None,
        default: bool = False,
    ) -> None:
        prefix = prefix or f"pg/{gen}/"
        super().__init__(store, gen, rank, world_size, prefix=prefix, timeout=timeout, default=default)
        self.backend = "pretend"
        self.device = device or PRETEND
        self.control = ControlGroup(store, gen, rank, world_size, prefix=prefix + "ctl/", timeout=timeout)

    def _inner(self, method: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors gloo moves underneath (the pretend device's CPU data), once checked."""
        out = []
        for t in tensors:
            if t.device != self.device:
                _refuse("data", method, t, f"the data group carries {self.device} tensors only")
            out.append(t.inner if isinstance(t, Pretend) else t)
            if self.device == PRETEND and not isinstance(t, Pretend):
                _refuse("data", method, t, "a real meta tensor holds no data")
        calls[f"data.{method}"] += 1
        return out

    def allreduce_start(self, tensor: torch.Tensor) -> Any:
        return super().allreduce_start(self._inner("allreduce", [tensor])[0])

    def broadcast_(self, tensors: list[torch.Tensor], root: int = 0) -> None:
        super().broadcast_(self._inner("broadcast", tensors), root)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        gathered = super().allgather(self._inner("allgather", [tensor])[0])
        return [Pretend(g) for g in gathered] if self.device == PRETEND else gathered

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        return super().isend(self._inner("send", [tensor])[0], dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        return super().irecv(self._inner("recv", [tensor])[0], src, tag)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        super().send(self._inner("send", [tensor])[0], dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        super().recv(self._inner("recv", [tensor])[0], src)


def dump_calls(path: str) -> None:
    """Write this process's counts and refusals as JSON (at exit of a test script)."""
    with open(path, "w") as f:
        json.dump({"calls": dict(calls), "violations": violations}, f)
