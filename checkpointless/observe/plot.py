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

The reader is tolerant: unknown event kinds, missing optional fields and unparsable lines are
skipped. The command ``checkpointless report RUN_DIR`` calls :func:`write_report`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpointless.observe.fault_list import derive_faults, fault_entries
from checkpointless.observe.fields import integer as _int
from checkpointless.observe.fields import number as _num
from checkpointless.observe.fields import unpacked
from checkpointless.protocol.vocab import Event, Role

__all__ = ["RunData", "format_summary", "load_run", "write_report"]

EVENTS_FILE = "events.jsonl"
REPORT_FILE = "report.json"
PNG_FILE = "timeline.png"
SUMMARY_FILE = "summary.txt"


# ---------------------------------------------------------------------------- loading


@dataclass
class RunData:
    """Parsed contents of a run directory."""

    run_dir: Path
    events: list[dict[str, Any]]
    report: dict[str, Any]
    skipped_lines: int = 0
    t0: float = 0.0


def _read_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    events: list[dict[str, Any]] = []
    skipped = 0
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1  # e.g. a line cut short by a crash
                continue
            if isinstance(ev, dict):
                events.append(ev)
            else:
                skipped += 1
    return events, skipped


def load_run(run_dir: Path) -> RunData:
    """Read ``events.jsonl`` and ``report.json`` from ``run_dir``.

    Raises:
        FileNotFoundError: the directory or one of the two files is missing.
        ValueError: ``report.json`` is not a JSON object.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    events_path, report_path = run_dir / EVENTS_FILE, run_dir / REPORT_FILE
    for p in (events_path, report_path):
        if not p.is_file():
            raise FileNotFoundError(f"missing {p.name} in {run_dir}")
    events, skipped = _read_events(events_path)
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{report_path} is not valid JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(report, dict):
        raise ValueError(f"{report_path} does not hold a JSON object")
    times = [t for t in (_num(e.get("t")) for e in events) if t is not None]
    starts = [_num(e.get("t")) for e in events if e.get("kind") == Event.JOB_STARTED]
    start_times = [t for t in starts if t is not None]
    t0 = min(start_times) if start_times else (min(times) if times else 0.0)
    return RunData(run_dir=run_dir, events=events, report=report, skipped_lines=skipped, t0=t0)


# ---------------------------------------------------------------------------- derived series


def _commits_by_rank(run: RunData) -> dict[int, list[tuple[float, int, int]]]:
    """rank -> [(seconds since start, step, generation)] in file order (generation -1 if unknown)."""
    out: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
    for ev in unpacked(run.events):  # a host's packed commits too
        if ev.get("kind") != Event.STEP_COMMITTED:
            continue
        t, rank, step = _num(ev.get("t")), _int(ev.get("rank")), _int(ev.get("step"))
        if t is None or rank is None or step is None:
            continue
        gen = _int(ev.get("gen"))
        out[rank].append((t - run.t0, step, -1 if gen is None else gen))
    return dict(out)


def _segments(pts: list[tuple[float, int, int]]) -> list[list[tuple[float, int, int]]]:
    """Split one rank's commits where the generation changes (so rollbacks are not joined up)."""
    segs: list[list[tuple[float, int, int]]] = []
    for p in pts:
        if not segs or segs[-1][-1][2] != p[2]:
            segs.append([])
        segs[-1].append(p)
    return segs


def _train_loss(run: RunData) -> list[tuple[int, float]]:
    """(step, mean loss over ranks), using each rank's latest commit of a step (replays win)."""
    latest: dict[tuple[int, int], float] = {}
    for ev in unpacked(run.events):
        if ev.get("kind") != Event.STEP_COMMITTED:
            continue
        step, loss = _int(ev.get("step")), _num(ev.get("loss"))
        if step is None or loss is None:
            continue
        rank = _int(ev.get("rank"))
        latest[(step, -1 if rank is None else rank)] = loss
    per_step: dict[int, list[float]] = defaultdict(list)
    for (step, _), loss in latest.items():
        per_step[step].append(loss)
    return [(s, sum(v) / len(v)) for s, v in sorted(per_step.items())]


def _heldout_loss(run: RunData) -> list[tuple[int, float]]:
    """(step, held-out loss) from ``eval`` events; several evals of one step are averaged."""
    per_step: dict[int, list[float]] = defaultdict(list)
    for ev in run.events:
        if ev.get("kind") != Event.EVAL:
            continue
        step, loss = _int(ev.get("step")), _num(ev.get("heldout_loss"))
        if step is None or loss is None:
            continue
        per_step[step].append(loss)
    return [(s, sum(v) / len(v)) for s, v in sorted(per_step.items())]


@dataclass
class _FaultSpan:
    """One fault on the timeline, from :func:`checkpointless.observe.fault_list.derive_faults` (the report's list)."""

    kind: str
    ranks: list[int]
    step: int | None
    start: float  # seconds since job start: injection, or detection for a real fault
    detected: float | None
    end: float | None  # recovery_done, None if never recovered (or nothing to recover: a pool spare)
    injected: bool = True
    cause: str | None = None
    signal: str | None = None
    replaced_by: str | None = None
    spare: bool = False  # a spare that died in the pool: no rank to recover


def _fault_spans(run: RunData) -> list[_FaultSpan]:
    """One span per fault, injected or only detected, each with its own figures (no index alignment)."""
    spans: list[_FaultSpan] = []
    for f in derive_faults(run.events):
        spans.append(
            _FaultSpan(
                kind=f.kind,
                ranks=list(f.ranks),
                step=f.step,
                start=f.t - run.t0,
                detected=None if f.t_detected is None else f.t_detected - run.t0,
                end=None if f.t_recovered is None else f.t_recovered - run.t0,
                injected=f.injected,
                cause=f.cause,
                signal=f.signal,
                replaced_by=f.replaced_by,
                spare=f.role == Role.SPARE and not f.ranks,
            )
        )
    return spans


def _usage_series(run: RunData) -> dict[str, list[tuple[float, float]]]:
    """From the ``host_usage`` events: per line (a host's CPU, each accelerator's utilisation),
    (seconds since job start, percent)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for e in run.events:
        if e.get("kind") != Event.HOST_USAGE or not isinstance(e.get("host"), str):
            continue
        t = _num(e.get("t"))
        if t is None:
            continue
        cpu = _num(e.get("cpu_percent"))
        if cpu is not None:
            series.setdefault(f"{e['host']} CPU", []).append((t - run.t0, cpu))
        ranks = e.get("ranks")
        for rank, share in ranks.items() if isinstance(ranks, dict) else []:
            v = _num(share)
            if v is not None:  # percent of one core: scaled to the host's cores as the host's line
                cpus = _num(e.get("cpus")) or 1.0
                series.setdefault(f"rank {rank} CPU", []).append((t - run.t0, v / cpus))
        for g in e.get("gpus") or []:
            util = _num(g.get("util_percent")) if isinstance(g, dict) else None
            if util is not None:
                series.setdefault(f"{e['host']} GPU{g.get('index')}", []).append((t - run.t0, util))
    return series


def _end_time(run: RunData) -> float:
    times = [t for t in (_num(e.get("t")) for e in run.events) if t is not None]
    return (max(times) - run.t0) if times else 0.0


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
        wall = _end_time(run)
    goodput = _num(rep.get("goodput"))
    lines = [f"run: {run.run_dir}"]
    lines.append(
        f"steps completed: {steps if steps is not None else '?'}   wall: {_fmt_s(wall, 1)}   "
        f"goodput: {'?' if goodput is None else f'{goodput:.3f}'}   "
        f"median step: {_fmt_s(rep.get('step_time_s'), 3)}"
    )
    sha = rep.get("final_state_sha256")
    lines.append(f"final state sha256: {sha[:16] + '...' if isinstance(sha, str) and sha else '?'}")
    held = _heldout_loss(run)
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

    commits = _commits_by_rank(run)
    spans = _fault_spans(run)
    t_end = _end_time(run)

    usage = _usage_series(run)
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
            for k, seg in enumerate(_segments(commits[rank])):
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
        train, held = _train_loss(run), _heldout_loss(run)
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
    ax: Any, usage: dict[str, list[tuple[float, float]]], spans: list[_FaultSpan], t_end: float
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
