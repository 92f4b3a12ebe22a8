"""Live progress and end-of-run summaries on the terminal (rich)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

from checkpointless.control.coordinator import Coordinator
from checkpointless.observe import report


class LiveProgress:
    """A progress line refreshed from the coordinator's view.

    Shows step, loss, tokens/s, live goodput, faults so far, generation and ready spares.
    ``events`` is the launcher's event list (``Launcher.events``), used to count faults.
    """

    def __init__(
        self,
        total_steps: int | None,
        console: Console | None = None,
        every_s: float = 1.0,
        events: list[dict[str, Any]] | None = None,
    ) -> None:
        self.total = total_steps
        self.console = console or Console(stderr=True)
        self.every_s = every_s
        self.events = events
        self._last = 0.0
        self._last_step = -1
        self._last_t = time.monotonic()
        self._first_commit_t: float | None = None
        self._tokens_per_s = 0.0

    def __call__(self, coord: Coordinator) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        status = coord.member_status()
        hb0: dict[str, Any] = status.get(0, {})
        step = int(hb0.get("committed", -1))
        if step >= 0 and self._first_commit_t is None:
            self._first_commit_t = now
        if step > self._last_step >= 0 and now > self._last_t:
            tokens = int(hb0.get("tokens", 0)) * len(status)
            self._tokens_per_s = (step - self._last_step) * tokens / (now - self._last_t)
        if step != self._last_step:
            self._last_step, self._last_t = step, now
        parts = [f"step {step + 1}" + (f"/{self.total}" if self.total else "")]
        loss = hb0.get("loss")
        if isinstance(loss, float):
            parts.append(f"loss {loss:.4f}")
        parts.append(f"tok/s {self._tokens_per_s:,.0f}")
        if self._first_commit_t is not None and now > self._first_commit_t and step > 0:
            goodput = min(1.0, step * coord.median_step_time() / (now - self._first_commit_t))
            parts.append(f"goodput {goodput:.2f}")
        if self.events is not None:
            parts.append(f"faults {count_faults(self.events)}")
        parts.append(f"gen {coord.plan.gen if coord.plan else 0}")
        parts.append(f"spares ready {len(coord.ready_spares())}")
        self.console.print("  ".join(parts), highlight=False)


def count_faults(events: list[dict[str, Any]]) -> int:
    """Faults in ``events`` so far: the length ``report.json``'s list has for the same events.

    The launcher's live list holds its own and the coordinator's events (worker events are
    collected at the end); :func:`checkpointless.observe.report.derive_faults` reads either.
    """
    return report.count_faults(events)


def _cause_cell(f: dict[str, Any]) -> str:
    cause = f.get("cause")
    if not cause:
        return "undetected" if f.get("injected") else "-"
    if f.get("signal"):
        return f"{cause} ({f['signal']})"
    if f.get("exitcode") not in (None, 0):
        return f"{cause} (exit {f['exitcode']})"
    return str(cause)


def _opt(x: Any, fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def summary_table(report_: dict[str, Any]) -> Table:
    """The report's faults, one row each: injected ones name their spec, real ones say "detected"."""
    t = Table(title="faults", show_lines=False)
    for col in ("kind", "cause", "injected", "ranks", "proc", "step", "detection s", "stall s",
                "lost steps", "replaced by"):  # fmt: skip
        t.add_column(col)
    for f in report_.get("faults", []):
        spare = f.get("target") == "recovery" or f.get("role") == "spare"
        ranks = f.get("ranks") or []
        t.add_row(
            str(f.get("kind")) + (" (spare)" if spare else ""),
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
