"""What a process's exit means: a fault to recover from, a spare to restart, or a mistake that ends
the job (a bad command, a loop that ends early, the same error twice, a worker's fatal report).
The coordinator asks (``ProcessWatch._on_exit``, ``control/watch.py``) and acts on the answer."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable

from checkpointless.control.auth import SignedStore
from checkpointless.control.detection import hint, own_group, same_error
from checkpointless.control.processes import ProcessTable, ProcessView
from checkpointless.control.spares import SparePool
from checkpointless.errors import JobFailed
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event, Phase, Reason, Role

LEFT_CODES = (0, -signal.SIGTERM)
"""How a spare that was told to leave exits (the job's word, or a notice's SIGTERM): no fault."""


class ExitJudge:
    """Judges the job's exits (see the module docstring); ``emit(kind, **fields)`` records them."""

    def __init__(
        self, store: SignedStore, table: ProcessTable, spares: SparePool, emit: Callable[..., None]
    ) -> None:
        self._store, self._table, self._spares, self._emit = store, table, spares, emit
        self._crash_lines: dict[int, str] = {}  # rank -> last log line of its process that raised
        self._fatal_checked = float("-inf")  # the tick whose exits were looked at for a fatal report

    def judge(self, name: str, p: ProcessView, role: Role, rank: int | None, now: float) -> bool:
        """Process ``name`` (which held ``role`` and ``rank``) exited: whether its rank is now lost
        to the job (a fault to recover from). Raises ``JobFailed`` for a mistake no spare fixes."""
        if self._fatal_checked != now:  # a worker that reported a fatal mistake exits right after;
            self._fatal_checked = now  # once for the exits of one tick (a lost host's 8 at once: a
            self.check_fatal()  # round trip each, on a loaded store, before the plan)
        code = p.handle.exitcode()
        tail = p.handle.log_tail()
        self._emit(Event.PROCESS_EXITED, rank=rank, target=name, role=role, exitcode=code, joined=p.joined)
        if not p.joined and not p.killed and code is not None and code >= 0:
            # It exited on its own before joining: a bad command or script, not a machine fault.
            self._emit(Event.FAULT_DETECTED, rank=rank, reason=Reason.START_FAILURE, target=name, role=role,
                       exitcode=code, log_tail=tail)  # fmt: skip
            what = f"{name} exited with code {code} before joining the job"
            if own_group(tail):  # the script's own process group: say so first, its error after
                what = f"{name} {own_group(tail)}; it exited with code {code}"
            elif code == 0:
                what += " (does the command create a checkpointless.Session?)"
            if role == Role.SPARE:
                self._spares.died_starting(name, f"{what}; last log line: {tail or '(empty)'}", now)
                return False
            raise JobFailed(f"{what}; last log line: {tail or '(empty)'}{hint(tail)}")
        if code in LEFT_CODES and not p.killed and p.hb.get("phase") in (Phase.SPARE, Phase.FOLLOWING):
            # a spare told to leave while it waited (its host drained: the job's word, or SIGTERM):
            # not a fault. One given a rank as it left (the plan crossed the notice) lost that
            # rank: a fault, below.
            if role == Role.SPARE:
                self._spares.replace_now(now)
                return False
        elif role == Role.WORKER and code == 0 and not p.killed:
            raise JobFailed(
                f"{name} (rank {rank}) exited with code 0 before the job finished "
                "(does the loop end early, or is session.finish() missing?)"
            )
        self._emit(Event.FAULT_DETECTED, rank=rank, reason=Reason.PROCESS_EXIT, target=name, role=role, exitcode=code,
                   log_tail=tail if code else "")  # fmt: skip
        if role == Role.WORKER and rank is not None and code and not p.killed:
            # An exception outside the step ended the process. Replaced once (a machine fault may
            # strike once); the same line from the replacement is the script's: no spare fixes it.
            if tail and self._crash_lines.get(rank) == tail:
                raise JobFailed(
                    f"rank {rank} failed twice with the same error, outside the step: {tail}{hint(tail)}"
                )
            self._crash_lines[rank] = tail
        if role == Role.WORKER and rank is not None:
            return True
        if role == Role.SPARE:
            if p.was_ready:
                self._spares.replace_now(now)
            else:
                self._spares.died_starting(
                    name, f"{name} died while starting (exit code {code}): {tail or '(no output)'}", now
                )
        return False

    def check_fatal(self) -> None:
        """A worker reported a mistake that no recovery can fix: end the job with its words."""
        if self._store.add(keys.FATAL_COUNT, 0) == 0:
            return
        for name in self._table.procs:
            text = self._store.get(keys.fatal(name))
            if text is not None:
                d = json.loads(text)
                self._emit(Event.FAULT_DETECTED, rank=d.get("rank"), reason=Reason.FATAL, target=name,
                           error=d["error"])  # fmt: skip
                raise JobFailed(str(d["error"]))

    def script_mistake(self, gen: int, dead: list[int], starting: int) -> str | None:
        """A mistake every lost rank made (the same error line): what to end the job with, else None."""
        ended = {r: self._crash_lines[r] for r in dead if self._crash_lines.get(r)}
        lead = same_error(ended)
        if lead is None:
            return None
        line, ranks = lead
        return (
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ended with the same "
            f"error: {line} (a mistake in the script: no spare can fix it; generation {gen}, "
            f"{len(dead)} rank(s) lost and {starting} spare(s) left)"
        )

    def out_of_spares(self, gen: int, dead: list[int], starting: int) -> str:
        """Why generation ``gen`` cannot recover: ``dead`` ranks lost, ``starting`` spares left. A
        mistake every lost rank made (the same error line) leads; else the pool's state and each
        rank's last line."""
        mistake = self.script_mistake(gen, dead, starting)
        if mistake is not None:  # a mistake every rank made: the script's error first
            return mistake
        ended = {r: self._crash_lines[r] for r in dead if self._crash_lines.get(r)}
        why = f"; spares keep dying at start-up: {self._spares.last_death}" if self._spares.exhausted else ""
        lines = "".join(f"; rank {r}'s process ended with: {text}" for r, text in ended.items())
        return (
            f"generation {gen}: {len(dead)} rank(s) lost and {starting} spare(s) left "
            f"(--min-workers lets a job go on smaller){why}{lines}"
        )
