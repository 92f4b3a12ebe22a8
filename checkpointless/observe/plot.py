"""Render a finished (or crashed) run directory into ``timeline.png`` and ``summary.txt``.

A run directory holds ``events.jsonl`` (one JSON event per line) and ``report.json`` (the job's
final report). :func:`write_report` reads both and writes:

* ``timeline.png``: top panel, committed step vs wall time per rank with a shaded span per fault
  (injection, or detection for a fault that was not injected, to recovery; injected faults in red,
  detected-only ones in purple); bottom panel, training loss (mean over ranks) and held-out loss
  vs step.
* ``summary.txt``: a short plain-text summary, also returned.

Faults, in the summary and on the plot, are the one list :func:`checkpointless.observe.fault_list.derive_faults`
makes from the events (the list ``report.json`` holds): every detected fault with its cause, injected
ones marked with their spec.

The run directory is read by :mod:`checkpointless.observe.run_data`, which is tolerant: unknown
event kinds, missing optional fields and unparsable lines are skipped. The command
``checkpointless report RUN_DIR`` calls :func:`write_report`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpointless.observe.fault_list import derive_faults, fault_entries
from checkpointless.observe.fields import integer as _int
from checkpointless.observe.fields import number as _num
from checkpointless.observe.run_data import (
    EVENTS_FILE,
    REPORT_FILE,
    FaultSpan,
    RunData,
    commits_by_rank,
    end_time,
    fault_spans,
    heldout_loss,
    load_run,
    segments,
    train_loss,
    usage_series,
)
from checkpointless.protocol.vocab import Event

__all__ = ["format_summary", "write_report"]

PNG_FILE = "timeline.png"
SUMMARY_FILE = "summary.txt"


# ---------------------------------------------------------------------------- summary


def _fmt_s(x: Any, digits: int = 2) -> str:
    v = _num(x)
    return "?" if v is None else f"{v:.{digits}f} s"


def _origin(f: dict[str, Any]) -> str:
    """``injected kill:rank=1@step=3`` or ``detected, not injected`` (old reports: injected)."""
    if f.get("injected", True) is False:
        return "detected, not injected"
    spec = f.get("spec")
    return f"injected {spec}" if isinstance(spec, str) and spec else "injected"


def _cause(f: dict[str, Any]) -> str:
    cause = f.get("cause")
    if not isinstance(cause, str) or not cause:
        return "" if "cause" not in f else "cause: not detected, "
    how = f.get("signal")
    if not isinstance(how, str) or not how:
        code = _int(f.get("exitcode"))
        how = None if code is None else f"exit code {code}"
    return f"cause {cause}" + (f" ({how})" if how else "") + ", "


def _fault_line(i: int, f: dict[str, Any]) -> str:
    ranks = f.get("ranks")
    ranks_s = ",".join(str(r) for r in ranks) if isinstance(ranks, list) else "?"
    where = f"ranks [{ranks_s}]" if ranks != [] else "spare"
    proc = f.get("proc")
    if isinstance(proc, str) and proc:
        where += f" ({proc})"
    lost = _int(f.get("lost_steps"))
    replaced = f.get("replaced_by")
    if isinstance(replaced, dict):
        replaced_s = ", ".join(f"rank {k}->{v}" for k, v in replaced.items()) or "none"
    elif isinstance(replaced, list):
        replaced_s = ", ".join(str(r) for r in replaced) or "none"
    else:
        replaced_s = "none" if replaced in (None, "") else str(replaced)
    step = f.get("step")
    detection = "-" if f.get("detection_s") is None and "cause" in f else _fmt_s(f.get("detection_s"))
    return (
        f"  #{i} {f.get('kind', '?')} [{_origin(f)}] {where} at step {'?' if step is None else step}: "
        f"{_cause(f)}detection {detection}, stall {_fmt_s(f.get('stall_s'))}, "
        f"lost {'?' if lost is None else lost} steps, replaced by {replaced_s}"
    )


def _fault_lines(run: RunData) -> list[str]:
    """The report's fault list; without one, the same list derived from the events."""
    faults = run.report.get("faults")
    if isinstance(faults, list):
        return [_fault_line(i, f) for i, f in enumerate((f for f in faults if isinstance(f, dict)), 1)]
    return [_fault_line(i, f) + " (from events)" for i, f in enumerate(fault_entries(run.events), 1)]


def format_summary(run: RunData) -> str:
    """A short plain-text summary of the run (ASCII only)."""
    rep = run.report
    steps = rep.get("steps_completed")
    wall = rep.get("wall_s")
    if _num(wall) is None and run.events:
        wall = end_time(run)
    goodput = _num(rep.get("goodput"))
    lines = [f"run: {run.run_dir}"]
    lines.append(
        f"steps completed: {steps if steps is not None else '?'}   wall: {_fmt_s(wall, 1)}   "
        f"goodput: {'?' if goodput is None else f'{goodput:.3f}'}   "
        f"median step: {_fmt_s(rep.get('step_time_s'), 3)}"
    )
    sha = rep.get("final_state_sha256")
    lines.append(f"final state sha256: {sha[:16] + '...' if isinstance(sha, str) and sha else '?'}")
    held = heldout_loss(run)
    if held:
        (s0, l0), (s1, l1) = held[0], held[-1]
        lines.append(f"held-out loss: {l0:.4f} (step {s0}) -> {l1:.4f} (step {s1}), {len(held)} evals")
    else:
        lines.append("held-out loss: no evals")
    fault_lines = _fault_lines(run)
    lines.append(f"faults: {len(fault_lines)}")
    lines.extend(fault_lines)
    if isinstance(rep.get("faults"), list):
        derived = len(derive_faults(run.events))
        if derived != len(fault_lines):
            lines.append(
                f"note: {EVENTS_FILE} yields {derived} fault(s), {REPORT_FILE} lists {len(fault_lines)}"
            )
    finished = [e for e in run.events if e.get("kind") == Event.JOB_FINISHED]
    if not finished:
        lines.append("note: no job_finished event (run still going or crashed)")
    elif finished[-1].get("ok") is False:
        lines.append("note: job finished with ok=false")
    if run.skipped_lines:
        lines.append(f"note: skipped {run.skipped_lines} unparsable line(s) in {EVENTS_FILE}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- plot


def _plot(run: RunData, out: Path) -> None:
    # An explicit Agg canvas: no pyplot, so the caller's global backend is left alone.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    commits = commits_by_rank(run)
    spans = fault_spans(run)
    t_end = end_time(run)

    usage = usage_series(run)
    fig = Figure(figsize=(11, 10 if usage else 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    if usage:  # what the hosts' resources did beside the steps: idle accelerators in a recovery
        ax_t, ax_u, ax_l = fig.subplots(3, 1, gridspec_kw={"height_ratios": [3, 2, 2]})
        _plot_usage(ax_u, usage, spans, t_end)
    else:
        ax_t, ax_l = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 2]})
    try:
        # ---- top: committed step vs wall time, per rank
        cmap = colormaps["tab10" if len(commits) <= 10 else "tab20"]
        n_points = sum(len(v) for v in commits.values())
        marker = "o" if n_points <= 600 else None
        markers = "osD^v<>ph*"
        for i, rank in enumerate(sorted(commits)):
            # Synchronous ranks overlap exactly: earlier ranks are drawn larger, underneath.
            size = max(6.0 - 0.6 * i, 2.5) if marker else 0.0
            width = max(3.0 - 0.4 * i, 1.0)
            for k, seg in enumerate(segments(commits[rank])):
                ax_t.plot(
                    [p[0] for p in seg],
                    [p[1] for p in seg],
                    marker=markers[i % len(markers)] if marker else None,
                    markersize=size,
                    linewidth=width,
                    color=cmap(i % cmap.N),
                    alpha=0.9,
                    zorder=2 + i,
                    label=f"rank {rank}" if k == 0 else None,
                )
        labelled: set[str] = set()

        def once(label: str) -> str | None:
            """A legend entry the first time only."""
            if label in labelled:
                return None
            labelled.add(label)
            return label

        for j, sp in enumerate(spans):
            # injected faults in red, faults the job only detected (real ones) in purple
            color, text_color = ("tab:red", "darkred") if sp.injected else ("tab:purple", "indigo")
            origin = "injected" if sp.injected else "detected"
            if not sp.spare:
                end = sp.end if sp.end is not None else t_end
                ax_t.axvspan(
                    sp.start,
                    max(end, sp.start),
                    color=color,
                    alpha=0.15,
                    hatch=None if sp.end is not None else "//",
                    label=once(f"{origin} fault -> recovered"),
                )
            ax_t.axvline(sp.start, color=color, linewidth=1.2, label=once(f"fault {origin}"))
            if sp.detected is not None and sp.detected != sp.start:
                ax_t.axvline(sp.detected, color=color, linestyle="--", linewidth=0.9, label=once("detected"))
            text = f"{sp.kind} r{','.join(map(str, sp.ranks))}" if sp.ranks else f"{sp.kind} (spare)"
            text += f" [{origin}]"
            if sp.cause:
                text += f"\n{sp.cause}" + (f" {sp.signal}" if sp.signal else "")
            if not sp.spare:  # a spare lost from the pool leaves nothing to recover
                text += "\nnot recovered" if sp.end is None else f"\nrecovered in {sp.end - sp.start:.1f}s"
            if sp.replaced_by:
                text += f"\n-> {sp.replaced_by}"
            ax_t.annotate(
                text,
                xy=(sp.start, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -4 - 46 * (j % 2)),
                textcoords="offset points",
                va="top",
                ha="left",
                fontsize=8,
                color=text_color,
                bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8},
            )
        ax_t.set_xlabel("wall time since job start (s)")
        ax_t.set_ylabel("committed step")
        title = f"{run.run_dir.name}: committed steps per rank"
        gp = _num(run.report.get("goodput"))
        if gp is not None:
            title += f"  (goodput {gp:.3f})"
        ax_t.set_title(title)
        ax_t.set_xlim(left=0, right=max(t_end, 1e-3) * 1.02)
        ax_t.grid(True, alpha=0.3)
        if commits or spans:
            ax_t.legend(loc="lower right", fontsize=8, ncol=2 if len(commits) > 6 else 1)
        if not commits:
            ax_t.text(0.5, 0.5, "no step_committed events", transform=ax_t.transAxes, ha="center")

        # ---- bottom: loss vs step
        train, held = train_loss(run), heldout_loss(run)
        if train:
            ax_l.plot(
                [s for s, _ in train],
                [v for _, v in train],
                color="tab:blue",
                linewidth=1.2,
                label="training loss (mean over ranks)",
            )
        if held:
            ax_l.plot(
                [s for s, _ in held],
                [v for _, v in held],
                color="tab:orange",
                marker="o",
                markersize=5,
                linewidth=1.5,
                label="held-out loss",
            )
        step_labels: set[str] = set()
        for sp in spans:
            if sp.step is not None:
                label = "fault injected" if sp.injected else "fault detected"
                ax_l.axvline(
                    sp.step,
                    color="tab:red" if sp.injected else "tab:purple",
                    linewidth=0.9,
                    alpha=0.6,
                    linestyle=":",
                    label=None if label in step_labels else label,
                )
                step_labels.add(label)
        ax_l.set_xlabel("step")
        ax_l.set_ylabel("loss")
        ax_l.set_title("loss")
        ax_l.grid(True, alpha=0.3)
        if train or held:
            ax_l.legend(loc="upper right", fontsize=8)
        else:
            ax_l.text(0.5, 0.5, "no loss data", transform=ax_l.transAxes, ha="center")
        fig.savefig(out, dpi=110)
    finally:
        fig.clear()


def _plot_usage(
    ax: Any, usage: dict[str, list[tuple[float, float]]], spans: list[FaultSpan], t_end: float
) -> None:
    for name, pts in sorted(usage.items()):
        ax.plot([t for t, _ in pts], [v for _, v in pts], linewidth=1.1, label=name,
                linestyle="--" if " GPU" in name else (":" if name.startswith("rank") else "-"))  # fmt: skip
    for i, sp in enumerate(spans):
        if sp.end is not None and not sp.spare:
            ax.axvspan(
                sp.start, sp.end, color="tab:red", alpha=0.1, label="fault to recovery" if i == 0 else None
            )
    ax.set_xlim(left=0, right=max(t_end, 1e-3) * 1.02)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since job start")
    ax.set_ylabel("percent")
    ax.set_title("hosts' CPU (all its cores = 100), each rank's share of it, accelerator utilisation")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=7, ncol=2 if len(usage) > 6 else 1)


# ---------------------------------------------------------------------------------- API


def write_report(run_dir: Path) -> str:
    """Write ``timeline.png`` and ``summary.txt`` into ``run_dir``; return the summary text.

    ``summary.txt`` is written before the plot, so it exists even if plotting fails
    (e.g. matplotlib is not installed).

    Raises:
        FileNotFoundError: ``run_dir``, ``events.jsonl`` or ``report.json`` is missing.
        ValueError: ``report.json`` is malformed.
        ImportError: matplotlib is not installed (``pip install checkpointless[report]``).
    """
    run = load_run(Path(run_dir))
    summary = format_summary(run)
    (run.run_dir / SUMMARY_FILE).write_text(summary, encoding="utf-8")
    _plot(run, run.run_dir / PNG_FILE)
    return summary
