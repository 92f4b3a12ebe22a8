"""Live progress and end-of-run summaries on the terminal (rich)."""

from __future__ import annotations

import os
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from checkpointless.control.coordinator import Coordinator
from checkpointless.observe import fault_list
from checkpointless.observe.progress import STEP_WINDOW, StepStats
from checkpointless.protocol.vocab import Role

_NOT_A_TERMINAL_WIDTH = 1000
"""Columns of the console when stderr is not a terminal (a pipe, a CI log): rich would assume 80
and cut the fault table's cells (``dete…``); lines there are not wrapped at all."""


def stderr_console() -> Console:
    """The command line's console, on stderr: a terminal's width, ``COLUMNS`` if set, else wide
    enough that nothing is cut or wrapped (a log file has no width)."""
    console = Console(stderr=True)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=True, width=_NOT_A_TERMINAL_WIDTH)


class LiveProgress:
    """A progress line, from the events the launcher records (``add``, a ``Launcher.listen``
    listener); faults are counted over the events it keeps (``Launcher.events``).

    Shows steps completed, the loss of the lowest rank's latest commit, tokens/s since the last
    line, goodput, faults so far, the generation and the ready spares. Steps and goodput are
    :class:`~checkpointless.observe.progress.StepStats` figures and the fault count is
    :func:`count_faults`: what ``report.json`` will say for the same events.
    """

    def __init__(
        self,
        total_steps: int | None,
        events: list[dict[str, Any]],
        console: Console | None = None,
        every_s: float = 1.0,
    ) -> None:
        self.total = total_steps
        self.events = events
        self.console = console or stderr_console()
        self.every_s = every_s
        self.stats = StepStats(window=STEP_WINDOW)
        self._faults = 0
        self._faults_changed = False
        self._last = 0.0
        self._rate_from: tuple[float, int] | None = None  # (time, tokens) of the last line
        self._tokens_per_s = 0.0

    def add(self, ev: dict[str, Any]) -> None:
        """One event as it is recorded (``Launcher.listen``)."""
        self.stats.add(ev)
        self._faults_changed |= ev.get("kind") in fault_list.FAULT_EVENT_KINDS

    def line(self, coord: Coordinator, now: float) -> str:
        """The progress line as of ``now``, from the events added so far."""
        if self._faults_changed:
            self._faults_changed = False
            self._faults = count_faults(self.events)
        stats = self.stats
        if self._rate_from is not None and now > self._rate_from[0]:
            self._tokens_per_s = (stats.tokens - self._rate_from[1]) / (now - self._rate_from[0])
        self._rate_from = (now, stats.tokens)
        parts = [f"step {stats.steps_completed}" + (f"/{self.total}" if self.total else "")]
        latest = stats.latest[min(stats.latest)] if stats.latest else {}
        if isinstance(loss := latest.get("loss"), float):
            parts.append(f"loss {loss:.4f}")
        parts.append(f"tok/s {self._tokens_per_s:,.0f}")
        if stats.steps_completed:
            parts.append(f"goodput {stats.goodput:.2f}")
        parts.append(f"faults {self._faults}")
        parts.append(f"gen {coord.plan.gen if coord.plan else 0}")
        parts.append(f"spares ready {len(coord.ready_spares())}")
        return "  ".join(parts)

    def __call__(self, coord: Coordinator) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        self.console.print(self.line(coord, now), highlight=False)


def count_faults(events: list[dict[str, Any]]) -> int:
    """Faults in ``events`` so far: the length ``report.json``'s list has for the same events.

    The launcher's live list holds its own, the coordinator's and (collected every 0.2 s) the
    processes' events; :func:`checkpointless.observe.fault_list.derive_faults` reads any prefix of it.
    """
    return fault_list.count_faults(events)


def _cause_cell(f: dict[str, Any]) -> str:
    cause = f.get("cause")
    if not cause:
        return "undetected" if f.get("injected") else "-"
    if f.get("signal"):
        return f"{cause} ({f['signal']})"
    if f.get("exitcode") not in (None, 0):
        return f"{cause} (exit {f['exitcode']})"
    return str(cause)


def _kind_cell(f: dict[str, Any]) -> str:
    """The fault's kind, and whose it was when not a worker's in a step: ``kill (spare)`` for a spare
    (one in the pool, or one killed as it took a rank: ``kill:spare@recovery|join``),
    ``kill (source)`` for a survivor killed as it sent state, ``crash (in recovery)`` for a
    worker's real fault detected while a recovery was under way."""
    kind, target = str(f.get("kind")), f.get("target")
    if f.get("role") == Role.SPARE or (f.get("injected") and target in ("recovery", "join")):
        return f"{kind} (spare)"
    if f.get("injected") and target == "source":
        return f"{kind} (source)"
    if not f.get("injected") and target == "recovery":
        return f"{kind} (in recovery)"
    return kind


def _opt(x: Any, fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def summary_table(report_: dict[str, Any]) -> Table:
    """The report's faults, one row each: injected ones name their spec, real ones say "detected"."""
    t = Table(title="faults", show_lines=False)
    for col in ("kind", "cause", "injected", "ranks", "proc", "step", "detection s", "stall s",
                "lost steps", "replaced by"):  # fmt: skip
        t.add_column(col)
    for f in report_.get("faults", []):
        ranks = f.get("ranks") or []
        t.add_row(
            _kind_cell(f),
            _cause_cell(f),
            str(f.get("spec") or "yes") if f.get("injected", True) else "no (detected)",
            ",".join(map(str, ranks)) if ranks else "-",
            _opt(f.get("proc")),
            _opt(f.get("step")),
            _opt(f.get("detection_s"), "{:.3f}"),
            _opt(f.get("stall_s"), "{:.3f}"),
            _opt(f.get("lost_steps")),
            _opt(f.get("replaced_by")),
        )
    return t
