"""A spare that catches up in the background while the survivors train (``recovery.never_wait``).

A generation's plan may name followers: ready spares, each with a source rank (``Plan.followers``).
The source:

1. at the end of its entry into the generation (a step boundary) takes its registered state as it
   is: the parameters and the optimizer's state by reference (nothing else changes them before
   the optimizer's next step, which waits until they are sent), everything else copied (buffers
   that a forward pass updates, progress, user state: small);
2. from then on records, at every call of its optimizer's ``step`` (a pre-hook), what the optimizer
   is given: every parameter's gradient (None where it has none; copied into pooled buffers, given
   back once sent, ``GradBuffers``) and every parameter group's settings but its parameters (the
   learning rate a scheduler set, the betas, ...): ``step_log.py``;
3. a sender thread forms a group of two with the follower (``keys.catch_up_prefix``), sends the
   copy, then each call as it is made (while the optimizer steps), the commit of each step (how
   many calls it made) and a drop for a failed attempt's calls, in order (``send_state``:
   authenticated with the job's secret, checked before anything is loaded);
4. when a plan makes the follower a member (``Plan.caught_up``) it sends the end: the last step
   committed, whose calls the follower then holds; any other plan gives the catch-up up.

The follower loads the copy into its own tensors and, once a step's commit arrives, sets the
gradients and the groups' settings of each of its calls and calls its own optimizer's ``step``: the
same implementation on the same values gives the same bits. At the join its source sends the rest
of the state (buffers, progress, the scheduler, user state: everything but the parameters and the
optimizer's per-parameter state, ``light_state``) and the digest of the whole, which the follower
checks its own against (``following.JoinCheck``); a difference (a script that changes its
parameters outside the optimizer's step) sends everything, as for any replacement. A step whose
optimizer is called with a closure (LBFGS) cannot be followed: the catch-up is given up, and the
spare joins later like any other.

What the survivors wait for: the source's first optimizer step after the catch-up started waits
until the state is sent (the forward and backward passes of that step run meanwhile); with a step
longer than the transfer, nothing. Bounded: at most ``MAX_BEHIND`` committed steps wait to be sent
(each one set of gradient buffers); a follower further behind is given up. No copy of the
parameters or the optimizer state is made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from checkpointless.comm import Group
from checkpointless.errors import CatchUpFailed
from checkpointless.state import TransferStats, recv_state, send_state
from checkpointless.step_log import Buffers, StepLog, apply_step, copy_state, optimizer_storages

log = logging.getLogger(__name__)

MAX_BEHIND = 8  # committed steps whose records may wait to be sent
SENDER_NICE = 10  # the sender thread's nice (a thread's own, on Linux)
CONNECT_WAIT_S = 5.0  # how long a source's optimizer step waits for its follower to connect


def light_state(state: dict[str, Any], params: set[str]) -> dict[str, Any]:
    """``state`` (a registry's) without what a caught-up follower holds already: the model's
    parameters (``params``: their names in its state dict) and the optimizer's per-parameter state."""
    out = dict(state)
    if "model" in out:
        out["model"] = {k: v for k, v in out["model"].items() if k not in params}
    if isinstance(out.get("optimizer"), dict) and "state" in out["optimizer"]:
        out["optimizer"] = {**out["optimizer"], "state": {}}
    return out


def fill_light(received: dict[str, Any], own: dict[str, Any], params: set[str]) -> dict[str, Any]:
    """A light state completed with the follower's own parameters and optimizer state."""
    out = dict(received)
    if "model" in out:
        out["model"] = {**out["model"], **{k: v for k, v in own["model"].items() if k in params}}
    if isinstance(out.get("optimizer"), dict) and "state" in out["optimizer"]:
        out["optimizer"] = {**out["optimizer"], "state": own["optimizer"]["state"]}
    return out


class CatchUpSource:
    """The source side (see the module docstring): the state taken at construction, its sender
    thread started by ``start``; ``committed`` after each commit, ``drop`` after a failed attempt,
    ``finish`` or ``abandon`` at the next plan."""

    def __init__(
        self, follower: str, state: dict[str, Any], step: int, optimizer: torch.optim.Optimizer | None,
        *, secret: bytes, connect: Callable[[], Group], on_sent: Callable[[TransferStats], None],
    ) -> None:  # fmt: skip
        self.follower = follower
        self._snapshot: dict[str, Any] | None = {
            "step": step,
            "state": copy_state(state, optimizer_storages(optimizer)),
        }
        self._connected = threading.Event()  # the pair group formed (or the catch-up over)
        self._sent = threading.Event()  # the snapshot is out (or the catch-up over): the optimizer may step
        self._log = StepLog(optimizer, self._wait_sent, self._call)
        self._secret, self._connect, self._on_sent = secret, connect, on_sent
        self._queue: queue.Queue[tuple[dict[str, Any], list[Buffers]] | None] = queue.Queue()
        self._group: Group | None = None
        self._lock = threading.Lock()
        self.error: str | None = None
        self.last_step = step  # the last step queued
        self._behind = 0  # committed steps queued, not yet sent
        self._thread = threading.Thread(target=self._send, name=f"catch-up-{follower}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        # the first record's buffers written ahead, beside the training thread, not in its step
        threading.Thread(target=self._touch, name=f"catch-up-{self.follower}-buffers", daemon=True).start()

    def _touch(self) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SENDER_NICE)
        self._log.buffers.touch()

    def _call(self, call: dict[str, Any], bufs: Buffers) -> None:
        """A call of the optimizer's step, recorded: queued at once (sent while the optimizer
        steps); the follower applies it once the step's commit follows."""
        if self.error is None:
            self._queue.put(({"call": call}, [bufs]))
        else:
            self._log.buffers.release(bufs)

    def committed(self, step: int) -> None:
        """A step committed: the follower told to apply its calls (or the catch-up given up)."""
        calls = self._log.calls
        self._log.take()
        with self._lock:
            behind = self._behind
        if self._log.closure:
            self._fail("the optimizer's step was called with a closure: a follower cannot replay it")
        elif behind >= MAX_BEHIND:
            self._fail(f"the follower fell more than {MAX_BEHIND} steps behind")
        if self.error is not None:
            self._log.close()  # given up: the steps that follow record nothing
            return
        with self._lock:
            self._behind += 1
        self._queue.put(({"step": step, "calls": calls}, []))
        self.last_step = step

    def drop(self) -> None:
        """A failed attempt: the follower drops the calls it was sent for it."""
        if self._log.calls and self.error is None:
            self._queue.put(({"drop": True}, []))
        self._log.drop()

    def finish(self, step: int, timeout: float) -> bool:
        """The follower joins at ``step`` (the last committed): the end sent once every record is;
        whether the follower has it all."""
        self._log.close()
        if self.error is None and self.last_step == step:
            self._queue.put(({"step": step, "end": True}, []))
        else:
            self._fail(self.error or f"the follower holds step {self.last_step}, not {step}")
        self._thread.join(timeout)
        ok = self.error is None and not self._thread.is_alive()
        if not ok:
            self._fail(self.error or "the end of the catch-up was not sent in time")
        return ok

    def abandon(self, why: str) -> None:
        """Given up (a plan that does not take the follower): the thread stopped, the pair group torn
        down (the follower's wait fails at once)."""
        self._log.close()
        self._fail(why)
        self._thread.join(5.0)

    def _wait_sent(self) -> None:
        """Before the optimizer changes what the snapshot refers to: until it is sent (or given up).
        A follower that has not connected ``CONNECT_WAIT_S`` later (it died, or it is slow) is given
        up: the step does not wait for a formation that may never end."""
        if self._sent.is_set():
            return
        self._connected.wait(CONNECT_WAIT_S)
        with self._lock:
            connected = self._group is not None
            if not connected and self.error is None:
                self.error = "the follower had not connected when the next step's optimizer ran"
        if connected:
            self._sent.wait()

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = why
            group = self._group
        self._queue.put(None)
        if group is not None:
            group.release()

    def _send(self) -> None:
        group: Group | None = None
        with contextlib.suppress(OSError):  # the training thread comes first on this process's core
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SENDER_NICE)
        try:
            group = self._connect()
            with self._lock:
                self._group = group
                self._connected.set()
                if self.error is not None:
                    return
            assert self._snapshot is not None
            stats = send_state(group, 1, self._snapshot, key=self._secret)
            self._snapshot = None
            self._sent.set()
            self._on_sent(stats)
            while True:
                item = self._queue.get()
                if item is None:
                    return
                record, bufs = item
                send_state(group, 1, record, key=self._secret)
                for b in bufs:
                    self._log.buffers.release(b)
                if "calls" in record:
                    with self._lock:
                        self._behind -= 1
                if record.get("end"):
                    ack = torch.zeros(1, dtype=torch.int64)
                    group.recv(ack, 1)  # the follower applied everything: the group may go
                    return
        except Exception as e:  # the follower died, or the group was released: given up
            with self._lock:
                if self.error is None:
                    self.error = f"{type(e).__name__}: {e}"
            log.warning("catch-up of %s ended: %s", self.follower, self.error)
        finally:
            self._snapshot = None
            self._connected.set()
            self._sent.set()
            if group is not None:
                group.abort()


def follow(
    group: Group, secret: bytes, into: dict[str, Any], load: Callable[[dict[str, Any]], None],
    optimizer: torch.optim.Optimizer | None, applied: Callable[[int], None],
) -> int:  # fmt: skip
    """The follower's side: the source's copy loaded (``load``; ``into``: the registry's own
    tensors, received in place), then its records applied in order until the end; the step it
    then holds. ``applied(step)`` after each step. ``CatchUpFailed`` if the source gives up."""
    try:
        first, _ = recv_state(group, 0, key=secret, into={"step": 0, "state": into})
        load(first["state"])
        step = int(first["step"])
        applied(step)
        calls: list[dict[str, Any]] = []  # the current step's, sent as the source's optimizer made them
        while True:
            record, _ = recv_state(group, 0, key=secret)
            if "call" in record:
                calls.append(record["call"])
                continue
            if record.get("drop"):  # the attempt failed: its calls go
                calls = []
                continue
            if record.get("end"):
                if int(record["step"]) != step or calls:
                    raise CatchUpFailed(
                        f"the catch-up ends at step {record['step']} but this spare holds {step}"
                    )
                group.send(torch.ones(1, dtype=torch.int64), 0)
                return step
            if int(record["step"]) != step + 1:
                raise CatchUpFailed(f"step {record['step']} came after step {step}")
            if int(record["calls"]) != len(calls):
                raise CatchUpFailed(
                    f"step {record['step']} made {record['calls']} call(s), {len(calls)} came"
                )
            apply_step(optimizer, calls)
            calls = []
            step = int(record["step"])
            applied(step)
    except CatchUpFailed:
        raise
    except Exception as e:  # the source gave up or died: a spare again
        raise CatchUpFailed(f"{type(e).__name__}: {e}") from None
