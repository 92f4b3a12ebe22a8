"""The job's stop: Ctrl-C and SIGTERM, every process stopped at the end, the ranks' own exits.

- SIGINT and SIGTERM stop the job (``JobStop.drive``): ``job/stop`` is set at once (the ranks stop
  at their next step boundary), children are ended after a grace period (the process backend's
  ``stop``), and the job's error names the signal; a job whose ranks finished their last step
  meanwhile is reported finished, with its final digest (``finished_anyway``);
- whatever ended the job, every process is stopped the same way (``cleanup``), a spare still
  waiting for its assignment included, and the processes' last events are collected;
- after the last step the ranks exit by themselves (a script's own work after training runs
  meanwhile, ``recovery.exit_timeout_s``): what went wrong then is kept by process
  (``after_finish``, the report's ``after_finish``).
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from checkpointless.control.auth import SignedStore
from checkpointless.control.bell import ReportBell
from checkpointless.control.coordinator import Coordinator, JobFailed
from checkpointless.control.processes import ProcessBackend
from checkpointless.errors import JobInterrupted
from checkpointless.launch.runtime import stop_signals
from checkpointless.launch.wakeups import Wakeups
from checkpointless.protocol import keys

log = logging.getLogger(__name__)

Collect = Callable[[dict[str, int] | None, dict[str, int] | None], None]
"""Move the processes' new event chunks into the log: (announced, relayed), as ``EventCollector.collect``."""


class JobStop:
    """Stops one job's processes, at its end or on a signal, for the launcher that holds it.

    ``collect`` reads the processes' last events once they are stopped; ``total_steps``: the
    launcher's (None: the scripts' own, then a signal's job is never judged finished anyway).
    """

    def __init__(
        self,
        store: SignedStore,
        backend: ProcessBackend,
        coord: Coordinator,
        *,
        bell: ReportBell | None,
        wakeups: Wakeups,
        collect: Collect,
        total_steps: int | None,
    ) -> None:
        self.store, self.backend, self.coord = store, backend, coord
        self.bell, self.wakeups = bell, wakeups
        self.collect = collect
        self.total_steps = total_steps
        self.after_finish: dict[str, str] = {}  # a rank's process that failed after the job's end

    def drive(self, job: Callable[[], None], stopped: Callable[[], None]) -> tuple[str | None, int | None]:
        """Run ``job`` with SIGINT and SIGTERM as ``JobInterrupted``; then, whatever happened,
        stop every process (``cleanup``) and call ``stopped``. Returns the job's error (None: it
        finished) and the signal that interrupted it (None: none; a signal that came once the
        training had finished counts only where it stopped a script's own work after it)."""
        error: str | None = None
        interrupted: int | None = None
        try:
            with stop_signals():
                try:
                    job()
                except JobFailed as e:
                    error = str(e)
                except JobInterrupted as e:
                    interrupted = e.signum
                    error = f"interrupted by {signal.Signals(e.signum).name}"
                except KeyboardInterrupt:
                    interrupted = signal.SIGINT
                    error = "interrupted by SIGINT"
                finally:
                    self.cleanup()
                    stopped()
                if interrupted is not None and self.finished_anyway(interrupted):
                    error = None  # the training finished; a signal that stopped the scripts' own
                    if not self.after_finish:  # work after it still ends the run as interrupted
                        interrupted = None
        except JobInterrupted as e:  # a second signal during cleanup
            interrupted = e.signum
            error = error or f"interrupted by {signal.Signals(e.signum).name}"
        return error, interrupted

    # -- the end of a job that finished ------------------------------------------------
    def wait_workers(self, timeout_s: float) -> None:
        """Let the ranks exit (a script's work after training runs meanwhile, ``exit_timeout_s``);
        ``job/stop`` is re-asserted meanwhile (a stranger may overwrite it). What went wrong after
        the end goes into ``after_finish``, by process: an exit code other than 0, a kill at the
        timeout, or a signal that stopped the work."""
        failed = self.after_finish
        children = self.backend.children
        try:
            self._wait_each(children, timeout_s, failed)
        except (JobInterrupted, KeyboardInterrupt) as e:  # Ctrl-C stops the scripts' own work too
            what = signal.Signals(e.signum).name if isinstance(e, JobInterrupted) else "SIGINT"
            for name in self.coord.members.values():
                if name not in failed and children[name].alive():
                    failed[name] = f"stopped by {what} after the job finished"
            raise

    def _wait_each(self, children: Mapping[str, Any], timeout_s: float, failed: dict[str, str]) -> None:
        backend = self.backend
        start = time.monotonic()
        deadline, told = start + timeout_s, False
        for name in self.coord.members.values():
            child = children[name]
            while child.alive() and time.monotonic() < deadline:
                if not told and time.monotonic() > start + 5.0:
                    told = True
                    log.warning("the job finished; waiting up to %.0fs for the ranks' processes to end their "
                                "own work (recovery.exit_timeout_s, --exit-timeout)", timeout_s)  # fmt: skip
                if self.store.get(keys.JOB_STOP) is None:
                    self.store.set(keys.JOB_STOP, "1")
                backend.wait_exit(child, 0.2)
            if child.alive():
                log.warning("%s did not exit within %.0fs of the job's end (--exit-timeout); killing it",
                            name, timeout_s)  # fmt: skip
                failed[name] = f"killed {timeout_s:g}s after the job finished (--exit-timeout)"
            elif child.exitcode() is None:  # no exit came: its host was lost (or its agent went silent)
                log.warning("%s was lost after finishing: %s", name, child.log_tail())
                failed[name] = f"was lost after the job finished: {child.log_tail()}"
            elif child.exitcode() != 0:
                log.warning("%s exited with code %s after finishing", name, child.exitcode())
                failed[name] = f"exited with code {child.exitcode()} after the job finished"

    # -- a signal --------------------------------------------------------------------------
    def finished_anyway(self, signum: int) -> bool:
        """Whether the job finished although a signal stopped it: the ranks completed the last
        step during the grace period (or the signal came as they exited). Then it is reported as
        finished, with its final digest: every member reported the last step done, and the
        coordinator's end-of-job check passes on their reports."""
        coord = self.coord
        if not coord.finished:
            if self.total_steps is None or coord.plan is None:
                return False  # without a step count, a rank that stopped early looks done
            try:
                for rank, name in coord.members.items():
                    text = self.store.get(keys.done(rank))
                    if text is None:
                        return False
                    done = json.loads(text)
                    if done.get("proc") != name or done.get("step") != self.total_steps - 1:
                        return False
                coord.check_done()  # the replicas agree: the digest, and the job_finished event
            except (JobFailed, RuntimeError, OSError, ValueError) as e:
                log.warning("the job's final reports do not add up (%s); it stays interrupted", e)
                return False
        if coord.finished:
            log.warning(
                "%s came, but the job had finished all its steps; reported as finished",
                signal.Signals(signum).name,
            )
        return coord.finished

    # -- every process stopped -------------------------------------------------------------
    def cleanup(self) -> None:
        """Stop every child (politely, then by force), collect their last events, free the node cache.

        ``job/stop`` is set first thing (on Ctrl-C, before anything else): the ranks stop at their
        next step boundary, while the grace period below lets them exit by themselves.
        """
        try:
            self.store.set(keys.JOB_STOP, "1")
        except (RuntimeError, OSError) as e:  # the store may be what failed (DistError is a RuntimeError)
            log.warning("could not tell the processes to stop (%s); they are stopped by signal", e)
        else:
            self._wake_waiting_spares()
        if self.bell is not None:
            self.bell.close()
        self.backend.stop()
        try:  # the relays' last counts first: a backlog is read in bulk, then probed to its end
            self.collect(None, self.coord.relay_chunks())
        except (RuntimeError, OSError) as e:
            log.warning("could not collect the processes' last events (%s); the event log may miss them", e)
        # after every child is gone, so that none can create the directory again
        self.backend.close()
        self.wakeups.close()

    def _wake_waiting_spares(self) -> None:
        """Give every spare never assigned the ``stop`` assignment (a ready one waits on that key);
        one still starting (importing torch, building its model) holds no state and would see the
        key only seconds later: it is killed at once."""
        for name in self.backend.spares:
            try:
                if self.store.get(keys.assign(name)) is None:
                    self.store.set(keys.assign(name), keys.STOP)
                    child = self.backend.children.get(name)
                    if child is not None and child.alive() and name not in self.coord.ready_spares():
                        child.kill()
            except (RuntimeError, OSError) as e:
                log.warning("could not wake the waiting spare %s (%s); it is stopped by signal", name, e)
                return
