"""Live progress and end-of-run summaries on the terminal (rich)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

from checkpointless.control.coordinator import Coordinator


class LiveProgress:
    """A progress line refreshed from the coordinator's view: step, loss, tokens/s, generation, faults."""

    def __init__(self, total_steps: int | None, console: Console | None = None, every_s: float = 1.0) -> None:
        self.total = total_steps
        self.console = console or Console(stderr=True)
        self.every_s = every_s
        self._last = 0.0
        self._last_step = -1
        self._last_t = time.monotonic()
        self._tokens_per_s = 0.0

    def __call__(self, coord: Coordinator) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        status = coord.member_status()
        hb0: dict[str, Any] = status.get(0, {})
        step = int(hb0.get("committed", -1))
        if step > self._last_step >= 0 and now > self._last_t:
            self._tokens_per_s = (
                (step - self._last_step) * int(hb0.get("tokens", 0)) * len(status) / (now - self._last_t)
            )
        if step != self._last_step:
            self._last_step, self._last_t = step, now
        loss = hb0.get("loss")
        total = f"/{self.total}" if self.total else ""
        phases = ",".join(sorted({str(h.get("phase", "?")) for h in status.values()}))
        self.console.print(
            f"[bold]step {step + 1}{total}[/bold]  loss {loss:.4f}  "
            if isinstance(loss, float)
            else f"step {step + 1}{total}  ",
            f"tok/s {self._tokens_per_s:,.0f}  gen {coord.plan.gen if coord.plan else 0}  "
            f"spares ready {len(coord.ready_spares())}  [{phases}]",
            sep="",
            highlight=False,
        )


def summary_table(report: dict[str, Any]) -> Table:
    t = Table(title="faults", show_lines=False)
    for col in ("kind", "ranks", "step", "detection s", "stall s", "lost steps", "replaced by"):
        t.add_column(col)
    for f in report.get("faults", []):
        t.add_row(
            str(f["kind"]) + (" (spare)" if f.get("target") == "recovery" else ""),
            ",".join(map(str, f["ranks"])),
            str(f["step"]),
            "-" if f["detection_s"] is None else f"{f['detection_s']:.3f}",
            f"{f['stall_s']:.3f}",
            str(f["lost_steps"]),
            str(f["replaced_by"]),
        )
    return t
