"""How a session's process ends: a stop seen at a step boundary, ``finish()`` (the final check, the
done report, then serving as a recovery source until the job ends), and the exit handler that
ships the last commits and names a missing ``finish()``."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from checkpointless.comm import CollectiveError
from checkpointless.errors import IntegrityError
from checkpointless.progress import StepState
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Phase, Reason

if TYPE_CHECKING:
    from checkpointless.consistency import ReplicaCheck
    from checkpointless.member import Member
    from checkpointless.model_holder import ModelHolder

log = logging.getLogger(__name__)


class Ending:
    """The end of one process's part in the job (``finished``: it ended as it should)."""

    def __init__(self, member: Member, model: ModelHolder, steps: StepState, check: ReplicaCheck) -> None:
        self._member, self._model, self._steps, self._check = member, model, steps, check
        self.finished = False

    def spare_unused(self) -> None:
        """The job ended while this spare waited: it ends as it should."""
        self.finished = True

    def leave_if_stopped(self) -> None:
        """At a step boundary: if the job was stopped (Ctrl-C, SIGTERM to the launcher), exit now
        instead of training on through the launcher's grace period (the heartbeat thread looks
        for the stop: ``ControlClient.stop_requested``)."""
        m = self._member
        client = m.client
        if client is None or not client.stop_requested:
            return
        log.warning("[gen %d rank %d] the job was stopped: leaving before step %d", m.generation, m.rank,
                    self._steps.next)  # fmt: skip
        if m.durable is not None:
            m.durable.wait()  # a snapshot being written completes
        self.finished = True
        client.close()
        raise SystemExit(0)

    def finish(self) -> str:
        """``Session.finish``: report the final state and stay available as a recovery source until
        the job ends; the final state digest."""
        m, steps = self._member, self._steps
        client = m.client
        if client is not None:
            # done with its loop before the final check: a rank whose loop ended early (its peers
            # still in a step, waiting for it in a collective) is named by the coordinator at once
            client.update(phase=Phase.DONE)
            self._final_check()
        digest = self._model.digest(steps.committed)
        if m.durable is not None:
            m.durable.wait()  # a snapshot still being written completes before the job ends
        if client is None:
            self.finished = True
            return digest
        client.update(phase=Phase.DONE)
        entries = self._model.entries()
        client.report_done(m.rank, digest, steps.committed, entries)
        last_report = time.monotonic()
        while True:
            if client.is_set(keys.JOB_STOP):
                break
            if client.is_set(keys.abort(m.generation)):
                m.recover(Reason.PEER_FAILURE)
                # a rank that joined this generation (a replacement, a newcomer) runs the final
                # check from its own finish(): every member runs it, or none (``due``)
                self._final_check()
                digest = self._model.digest(steps.committed)
                entries = self._model.entries()
                client.update(phase=Phase.DONE)
                client.report_done(m.rank, digest, steps.committed, entries)
                continue
            if time.monotonic() - last_report > 1.0:  # a forged overwrite must not hide our report
                client.report_done(m.rank, digest, steps.committed, entries)
                last_report = time.monotonic()
            time.sleep(0.02)
        self.finished = True
        client.close()
        return digest

    def _final_check(self) -> None:
        """The replicas compare their final state, as at a periodic check, unless the loop's last
        check ran at this very step (``ReplicaCheck.due``: a function of the committed step, so
        every rank, a replacement too, agrees on it): a replica corrupted since the last check is
        named and re-synced from its shard's majority (the job ends with the majority's state), and
        without a majority the job stops naming which ranks hold which state. A fault inside it is
        recovered as in a step and the check runs again in the new generation, which a replacement
        joins from its own ``finish``."""
        m = self._member
        while (
            m.group is not None and m.world_size > 1 and self._steps.committed >= 0 and not self._check.due()
        ):
            try:
                self._check.run()
                return
            except (CollectiveError, IntegrityError, TimeoutError) as e:
                m.on_failure(e, self._steps.next)

    def at_exit(self) -> None:
        """The process exits: its last commits are shipped; without ``finish()`` after a loop that
        ended, the job ends naming the mistake (unless a fatal report already gave the reason)."""
        m = self._member
        if m.client is None or self.finished:
            return
        # the process ends outside a step (the script raised in its own code, or returned): its
        # last commits, left to the heartbeat thread's next beat, are shipped before it goes
        with contextlib.suppress(RuntimeError, OSError):
            m.client.flush()
        if self._steps.loop_done and not m.fatal_sent:
            with contextlib.suppress(RuntimeError, OSError):  # the launcher may be gone already
                m.client.report_fatal(
                    m.rank,
                    f"rank {m.rank}: the process exited after its last step without calling "
                    "session.finish() (every rank must call it after the loop)",
                )
