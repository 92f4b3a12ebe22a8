"""The registry of a rank's transferable state: named ``Stateful`` objects.

Anything registered must follow the ``Stateful`` protocol (``state_dict`` and
``load_state_dict``, as ``nn.Module``, ``Optimizer`` and LR schedulers do).
Registered state is *replicated*: every rank of a replica group holds the same
bytes, so any of them can serve as the source for a replacement. An object whose
``per_rank`` attribute is true is the exception: moved to a replacement with the rest
(the source's stands in for the lost rank's own), never compared between replicas.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class StateRegistry:
    """Named ``Stateful`` objects that make up one rank's transferable state."""

    def __init__(self) -> None:
        self._items: dict[str, Stateful] = {}

    def register(self, name: str, obj: Stateful) -> None:
        if name in self._items:
            raise ValueError(f"state {name!r} is already registered")
        if not isinstance(obj, Stateful):
            raise TypeError(f"state {name!r} has no state_dict/load_state_dict")
        self._items[name] = obj

    def state_dict(self) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self._items.items()}

    def compared_state_dict(self) -> dict[str, Any]:
        """``state_dict`` without the ``per_rank`` objects: what every replica must hold alike."""
        return {
            name: obj.state_dict() for name, obj in self._items.items() if not getattr(obj, "per_rank", False)
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = set(self._items) ^ set(state)
        if missing:
            raise ValueError(f"state names differ between source and receiver: {sorted(missing)}")
        for name, obj in self._items.items():
            obj.load_state_dict(state[name])
