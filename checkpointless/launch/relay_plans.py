"""The relay's copies of the plans: one read of each plan per host, not per rank.

A process waiting for generation ``n``'s plan says so in its heartbeat (``awaiting``, which the
relay reads from the host's store); this thread waits for that plan on the coordinator's store and
copies it, still sealed by the coordinator, into the host's store, where ``ControlClient.wait_plan``
reads it. A plan lists every rank (0.6 MB at 2,000 hosts x 8 ranks): every rank reading it from the
coordinator's one store thread was 10 GB per recovery there (``bench/control_scale.py``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import DistStoreError

from checkpointless.control.auth import SignedStore
from checkpointless.protocol import keys

log = logging.getLogger(__name__)


class PlanCopier:
    """See the module docstring. ``connect``: a new connection to the coordinator's store."""

    def __init__(
        self, local: SignedStore, connect: Callable[[], SignedStore], interval: float, stop: threading.Event,
        host: str,
    ) -> None:  # fmt: skip
        self._local, self._connect, self._interval, self._stop, self.host = (
            local,
            connect,
            interval,
            stop,
            host,
        )
        self.awaiting: dict[str, int] = {}  # process -> the generation whose plan it waits for
        self._copied: set[int] = set()  # generations whose plan is in the host's store
        self.copied = 0  # plans read from the coordinator's store (tests)
        self.thread = threading.Thread(target=self._run, name="agent-relay-plans", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        up: SignedStore | None = None
        while not self._stop.is_set():
            wanted = sorted({g for g in list(self.awaiting.values()) if g not in self._copied})
            if not wanted:
                self._stop.wait(self._interval / 4)
                continue
            try:
                if up is None:
                    up = self._connect()
                if not self._copy_plan(up, wanted[0]):
                    self._stop.wait(0.02)  # forged: the coordinator's own overwrites it
            except (RuntimeError, OSError) as e:  # the lease decides what a lost store means
                up = None
                log.debug("relay %s: plans: %s; reconnecting", self.host, e)
                self._stop.wait(min(self._interval, 0.05))

    def _copy_plan(self, up: SignedStore, gen: int) -> bool:
        """Wait (one heartbeat interval at most) for generation ``gen``'s plan; once published, copy
        it into the host's store as sealed by the coordinator, with a newer plan and the latest
        generation first when there are (``ControlClient.wait_plan`` reads them there). Whether it
        is copied, or not published yet; False: what is there is forged."""
        key = keys.plan(gen)
        try:
            up.raw.wait([up.name(key)], timedelta(seconds=self._interval))
        except DistStoreError:  # not published yet
            return True
        sealed = up.get_sealed(key)
        if sealed is None or up.open(key, sealed) is None:
            return False
        latest = up.get_sealed(keys.LATEST_GEN)
        text = None if latest is None else up.open(keys.LATEST_GEN, latest)
        if latest is not None and text is not None and text.isdigit() and int(text) > gen:
            newer = up.get_sealed(keys.plan(int(text)))
            if newer is not None and up.open(keys.plan(int(text)), newer) is not None:
                self._local.raw.set(self._local.name(keys.plan(int(text))), newer)
                self._local.raw.set(self._local.name(keys.LATEST_GEN), latest)
        self._local.raw.set(self._local.name(key), sealed)
        self._copied.add(gen)
        self.copied += 1
        return True
