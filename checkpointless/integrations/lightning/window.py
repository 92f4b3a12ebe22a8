"""The attempt of the optimizer step under way: what the strategy's step keeps between Lightning's
calls of ``optimizer_step`` (one per micro-batch with gradient accumulation)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpointless.progress import Attempt
    from checkpointless.session import Session


class Window:
    """The attempt of the optimizer step under way, open from its first micro-batch's closure to its
    update (one micro-batch without accumulation), and the closures run in it so far: after a
    recovery the next attempt runs them again, in order, before the Trainer's loop goes on."""

    def __init__(self, zero_grad: dict[str, Any]) -> None:
        self.closures: list[Callable[[], Any]] = []
        self.zero_grad = zero_grad  # Lightning's zero_grad count before the step: one attempt's counts
        self._stack: ExitStack | None = None
        self._attempt: Attempt | None = None

    @property
    def open(self) -> bool:
        return self._stack is not None

    def enter(self, session: Session) -> None:
        self._stack = ExitStack()
        self._attempt = self._stack.enter_context(session.attempt())

    def fail(self, exc: BaseException) -> bool:
        """End the attempt with ``exc``: True when the session recovered (the step runs again),
        False when ``exc`` is to be raised (one process, a fatal error)."""
        stack, self._stack = self._stack, None
        assert stack is not None
        return bool(stack.__exit__(type(exc), exc, exc.__traceback__))

    def commit(self) -> None:
        stack, self._stack = self._stack, None
        assert stack is not None and self._attempt is not None
        stack.close()
        assert self._attempt.committed
