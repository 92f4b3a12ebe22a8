"""A member's catch-ups (``catch_up``): the followers it is the source of, started at the end of its
entry into a generation and ended at the next plan; a spare's side of one; and the light transfer
at the join, where the follower becomes a member and the two compare what they hold.

At the join the source sends what the catch-up did not bring and the digest of its whole state
(hashed while it waited for the follower to apply the last step). The follower hashes its own
beside its first step (nothing it compares changes before its optimizer's step but what a forward
pass moves, copied first) and compares before any gradient leaves it (``JoinCheck``): the
survivors do not wait for a hash of the whole state. If the two differ (a script that changes its
parameters outside the optimizer's step) the follower's attempt fails holding no valid state, and
the recovery sends it everything."""

from __future__ import annotations

import functools
import logging
import threading
from datetime import timedelta
from typing import Any

import torch

from checkpointless.catch_up import CatchUpSource, fill_light, follow, light_state
from checkpointless.comm import Group
from checkpointless.control.auth import pg_token
from checkpointless.control.client import ControlClient
from checkpointless.control.dial import connect
from checkpointless.control.plan import Plan
from checkpointless.errors import CatchUpFailed
from checkpointless.model_holder import ModelHolder, compared_state
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event, Phase
from checkpointless.state import TransferStats, combined_digest, entry_digests, recv_state, send_state
from checkpointless.step_log import copy_state, optimizer_storages

log = logging.getLogger(__name__)


def _param_names(model: torch.nn.Module | None) -> set[str]:
    return set() if model is None else {n for n, _ in model.named_parameters(remove_duplicate=False)}


class StateDigest:
    """``combined_digest`` of a holder's compared state (``Member``'s replicas compare the same),
    made in a thread: what only the optimizer's step changes is read in place (nothing changes it
    before this process's next optimizer step), the rest (buffers a forward pass moves, progress,
    user state: small) copied first."""

    def __init__(self, model: ModelHolder) -> None:
        optimizer = getattr(model, "optimizer", None)
        state = copy_state(compared_state(model.registry), optimizer_storages(optimizer))
        self._out: dict[str, bytes] = {}
        self._thread = threading.Thread(target=self._hash, args=(state,), name="cl-state-digest", daemon=True)
        self._thread.start()

    def _hash(self, state: dict[str, Any]) -> None:
        self._out["d"] = combined_digest(entry_digests(state))

    def result(self) -> bytes | None:
        """The digest (None if hashing failed)."""
        self._thread.join()
        return self._out.get("d")


class JoinCheck:
    """A caught-up follower's state against its source's digest (the module docstring): ``same``
    waits for its own digest, made beside its first step."""

    def __init__(self, model: ModelHolder, theirs: bytes) -> None:
        self._theirs, self._mine = theirs, StateDigest(model)

    def same(self) -> bool:
        return self._mine.result() == self._theirs


class CatchUps:
    """The catch-ups of one process (see the module docstring)."""

    def __init__(self, client: ControlClient, secret: bytes, model: ModelHolder, timeout: timedelta) -> None:
        self._client, self._secret, self._model, self._timeout = client, secret, model, timeout
        self._sources: dict[str, CatchUpSource] = {}  # follower -> its catch-up
        self._digest: StateDigest | None = None  # this source's, hashed from the join's settle

    def _pair(self, gen: int, follower: str, rank: int) -> Group:
        """The group of two over which ``follower`` catches up (the source is rank 0)."""
        prefix = keys.catch_up_prefix(gen, pg_token(self._secret, gen), follower)
        store = connect(self._client.addr, self._timeout)
        return Group(store, gen, rank, 2, prefix=prefix, timeout=self._timeout)

    # -- the source's side ----------------------------------------------------------------
    def settle(self, plan: Plan, rank: int, committed: int) -> None:
        """At the next plan, before its group forms: a follower the plan makes a member fed from
        this rank gets the end of its catch-up (the state's digest hashed meanwhile, for the join);
        every other catch-up is given up."""
        joins = any(self._joins(plan, rank, follower) for follower in self._sources)
        self._digest = StateDigest(self._model) if joins else None
        for follower, source in list(self._sources.items()):
            ours = self._joins(plan, rank, follower)
            if ours and source.finish(committed, self._timeout.total_seconds()):
                log.info("[gen %d] %s caught up at step %d", plan.gen, follower, committed)
            else:
                source.abandon("a new generation without it" if not ours else "it did not catch up")
                self._client.emit(Event.CATCH_UP_ENDED, sync=True, rank=rank, gen=plan.gen, target=follower,
                                  ok=False, error=str(source.error)[:300])  # fmt: skip
            del self._sources[follower]

    @staticmethod
    def _joins(plan: Plan, rank: int, follower: str) -> bool:
        """Whether ``plan`` makes ``follower`` a member fed from ``rank``."""
        new = plan.rank_of(follower)
        return new is not None and new in plan.caught_up and plan.sources.get(new) == rank

    def digest(self, fresh: bool) -> bytes:
        """This source's digest for the joins of this generation: hashed from ``settle`` on, or now
        where ``fresh`` (its state moved since: it received some in this generation)."""
        value = None if self._digest is None or fresh else self._digest.result()
        return value if value is not None else combined_digest(self._model.entries())

    def start(self, plan: Plan, rank: int, committed: int) -> None:
        """The plan's followers fed from ``rank``: each the state as it is now and a sender thread."""
        optimizer = getattr(self._model, "optimizer", None)
        for follower, src in sorted(plan.followers.items()):
            if src != rank:
                continue

            def sent(stats: TransferStats, follower: str = follower) -> None:
                self._client.emit(Event.CATCH_UP_SENT, rank=rank, gen=plan.gen, target=follower, step=committed,
                                  bytes=stats.bytes, seconds=round(stats.seconds, 4))  # fmt: skip

            source = CatchUpSource(
                follower, self._model.registry.state_dict(), committed, optimizer, secret=self._secret,
                connect=functools.partial(self._pair, plan.gen, follower, 0), on_sent=sent,
            )  # fmt: skip
            self._sources[follower] = source
            source.start()

    def committed(self, step: int) -> None:
        for source in self._sources.values():
            source.committed(step)

    def drop(self) -> None:
        for source in self._sources.values():
            source.drop()

    # -- the follower's side -------------------------------------------------------------
    def follow(self, plan: Plan) -> int | None:
        """This spare follows its source until the end (the step it holds) or until the catch-up is
        given up (None: a spare again, holding nothing valid)."""
        client, proc = self._client, self._client.proc
        client.update(phase=Phase.FOLLOWING, applied=-1)
        registry = self._model.registry
        group: Group | None = None
        try:
            group = self._pair(plan.gen, proc, 1)
            return follow(
                group, self._secret, registry.state_dict(), registry.load_state_dict,
                getattr(self._model, "optimizer", None), lambda step: client.update(applied=step),
            )  # fmt: skip
        except (CatchUpFailed, RuntimeError, OSError) as e:
            log.warning("[gen %d] catch-up given up: %s", plan.gen, e)
            client.emit(
                Event.CATCH_UP_ENDED, sync=True, gen=plan.gen, target=proc, ok=False, error=str(e)[:300]
            )
            client.update(phase=Phase.SPARE, applied=None)
            return None
        finally:
            if group is not None:
                group.abort()


def send_light(group: Group, dst: int, model: ModelHolder, secret: bytes, digest: bytes) -> None:
    """The join of a caught-up follower, source side: the state but what it holds, then the digest
    of the whole (``CatchUps.digest``), which the follower checks its own against."""
    names = _param_names(model.model)
    send_state(group, dst, light_state(model.registry.state_dict(), names), key=secret)
    group.control.send(torch.frombuffer(bytearray(digest), dtype=torch.uint8), dst)


def recv_light(
    group: Group, src: int, model: ModelHolder, secret: bytes
) -> tuple[TransferStats, JoinCheck, int | None]:
    """The join, follower side: the rest of the state loaded and the source's digest received; the
    transfer's figures, the check of this state against that digest (made beside the first step),
    and the lineage the source's state says it descends from (None if it says none)."""
    names = _param_names(model.model)
    own = model.registry.state_dict()
    received, stats = recv_state(group, src, key=secret, into=light_state(own, names))
    sent = received.get("progress", {}).get("lineage")
    model.registry.load_state_dict(fill_light(received, own, names))
    theirs = torch.zeros(32, dtype=torch.uint8)
    group.control.recv(theirs, src)
    return stats, JoinCheck(model, theirs.numpy().tobytes()), None if sent is None else int(sent)
