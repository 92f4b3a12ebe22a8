"""Forming a generation's group: in a helper thread with a store connection of its own, given up
as soon as the coordinator aborts the generation (a peer died while the group formed). A formation
that does not end at once is kept and joined before the next one starts: the process has one
default group."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from checkpointless.comm import CollectiveError, Group
from checkpointless.control.auth import pg_token
from checkpointless.control.client import ControlClient, connect
from checkpointless.control.plan import Plan
from checkpointless.errors import Unrecoverable
from checkpointless.fsdp import Generation
from checkpointless.protocol import keys
from checkpointless.sockets import release_formation, sockets


def _drop(result: dict[str, Any]) -> None:
    """Tear down what an abandoned formation built (its groups hold the process's default group)."""
    if "generation" in result:
        result["generation"].close()
    if "group" in result:
        result["group"].abort()


class Formation:
    """Forms each generation's group (replicated: a ``Group``, also ``torch.distributed``'s default
    group; sharded: a ``Generation``, its groups and mesh) for one process."""

    def __init__(self, client: ControlClient, secret: bytes, *, backend: str, device_type: str,
                 timeout: timedelta, sharded: bool) -> None:  # fmt: skip
        self._client, self._secret = client, secret
        self._backend, self._device_type, self._timeout = backend, device_type, timeout
        self._sharded = sharded
        self._abandoned: tuple[threading.Thread, dict[str, Any]] | None = None

    def form(self, plan: Plan, rank: int) -> Group | Generation:
        """``plan``'s group for ``rank``; ``CollectiveError`` if the coordinator aborts the
        generation or a peer fails meanwhile, ``Unrecoverable`` for anything else (a bug, not a peer)."""
        client, timeout = self._client, self._timeout
        result: dict[str, Any] = {}
        prefix = keys.pg_prefix(plan.gen, pg_token(self._secret, plan.gen))
        if self._abandoned is not None:
            # a formation abandoned by an abort: the default group is global, so it must
            # end (it fails at the latest at the collective timeout) before the next one starts
            stale, stale_result = self._abandoned
            stale.join(timeout.total_seconds() + 5)
            if stale.is_alive():
                raise Unrecoverable(f"a group formation abandoned before generation {plan.gen} did not end")
            _drop(stale_result)
            self._abandoned = None

        def run() -> None:
            try:
                store = connect(client.addr, timeout)
                if self._sharded:
                    result["generation"] = Generation(
                        store, gen=plan.gen, prefix=prefix, rank=rank, world=plan.world_size,
                        shards=plan.shards, backend=self._backend, timeout=timeout,
                        device_type=self._device_type,
                    )  # fmt: skip
                    if self._backend != "gloo":  # the control messages' gloo group (comm.Group)
                        result["generation"].group.use_control(
                            Group(
                                store,
                                plan.gen,
                                rank,
                                plan.world_size,
                                prefix=prefix + "ctl/",
                                timeout=timeout,
                            )
                        )
                else:
                    result["group"] = Group(
                        store, plan.gen, rank, plan.world_size, prefix=prefix, backend=self._backend,
                        timeout=timeout, default=True,
                    )  # fmt: skip
            except (RuntimeError, OSError, TimeoutError) as e:  # the store or a peer failed
                result["error"] = f"{type(e).__name__}: {e}"
            except Exception as e:  # a bug, not a peer: no recovery fixes it
                result["fatal"] = f"{type(e).__name__}: {e}"

        before = sockets()
        t = threading.Thread(target=run, name=f"form-gen-{plan.gen}", daemon=True)
        t.start()
        while t.is_alive():
            t.join(timeout=0.01)
            if t.is_alive() and client.is_set(keys.abort(plan.gen)):
                # The helper waits on a peer that will never come (up to the collective timeout).
                # Shut down the connections it opened (its store connection, those its group's
                # listener accepted; not what other threads opened meanwhile): its wait fails
                # now, and the formation, which holds the process's one default group, ends
                # before the next one starts (a fresh spare in the next generation would
                # otherwise wait for this rank in vain, and time out in turn)
                release_formation(before, client.addr)
                t.join(timeout=5.0)
                if t.is_alive():
                    self._abandoned = (t, result)
                else:  # ended, or formed just as the abort came
                    _drop(result)
                raise CollectiveError(f"gen {plan.gen}: aborted by the coordinator during group formation")
        if "fatal" in result:
            raise Unrecoverable(f"forming generation {plan.gen}'s process group failed: {result['fatal']}")
        if "error" in result:
            raise CollectiveError(str(result["error"]))
        formed: Group | Generation = result["generation"] if self._sharded else result["group"]
        return formed
