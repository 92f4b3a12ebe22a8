"""One job run from the command line: the launcher with the live progress line and the metrics
endpoint, the result printed, and the command's exit code."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from checkpointless.config import JobConfig
from checkpointless.control.coordinator import Coordinator
from checkpointless.errors import UsageError
from checkpointless.launch.cluster import LocalCluster
from checkpointless.launch.launcher import JobResult, Launcher
from checkpointless.observe.event_log import EventLog


def run_job(
    job: JobConfig,
    command: list[str],
    args: argparse.Namespace,
    console: Console,
    *,
    steps: int | None,
    out: Path | None,
    metrics_port: int | None = None,
    topology: LocalCluster | None = None,
) -> JobResult:
    """Run one job with the live progress line (unless --quiet) and, if asked, a metrics endpoint;
    ``topology``: on the hosts ``checkpointless cluster`` makes."""
    control_port = getattr(args, "control_port", None)
    if topology is not None:
        with topology.hosts(command, out) as (addr, spec, secret):
            return run_launcher(job, command, args, console, steps=steps, metrics_port=metrics_port, host=addr,
                                port=args.port, out_dir=out, cluster=spec, secret=secret, control_port=control_port)  # fmt: skip
    return run_launcher(job, command, args, console, steps=steps, metrics_port=metrics_port, port=args.port,
                        out_dir=out, control_port=control_port)  # fmt: skip


def run_launcher(
    job: JobConfig,
    command: list[str],
    args: argparse.Namespace,
    console: Console,
    *,
    steps: int | None,
    metrics_port: int | None,
    **where: Any,
) -> JobResult:
    """``Launcher(job, command, total_steps=steps, **where).run()`` with the progress line (unless
    ``args.quiet``) and the metrics endpoint (a bad or taken ``--metrics-port``: a
    :class:`UsageError`), both fed from the job's event log and called at every tick."""
    from checkpointless.observe.console import LiveProgress

    log = EventLog()
    callbacks: list[Callable[[Coordinator], None]] = []
    if not args.quiet:
        progress = LiveProgress(steps, log.events, console)
        log.listeners.append(progress.add)
        callbacks.append(progress)
    metrics = None
    if metrics_port is not None:
        if not 0 <= metrics_port < 65536:
            raise UsageError(f"--metrics-port must be in 0..65535, got {metrics_port}")
        from checkpointless.observe.live_metrics import MetricsFeed
        from checkpointless.observe.metrics import JobMetrics

        metrics = JobMetrics(metrics_port)
        try:
            metrics.start()
        except (OSError, ValueError) as e:
            raise UsageError(f"--metrics-port {metrics_port}: {e}") from e
        console.print(f"metrics: http://127.0.0.1:{metrics.port}/metrics", highlight=False)
        feed = MetricsFeed(metrics, log.events)
        log.listeners.append(feed.add)
        callbacks.append(feed)
    try:
        return Launcher(job, command, total_steps=steps, on_tick=callbacks, event_log=log, **where).run()
    finally:
        if metrics is not None:
            metrics.stop()


def print_result(console: Console, result: JobResult, label: str) -> None:
    """The job's outcome: its line, the fault table, the durable tier, errors and warnings, the
    final state's digest."""
    from checkpointless.observe.console import summary_table

    r = result.report
    console.print(
        f"[bold]{label}[/bold]: {'ok' if result.ok else 'FAILED'}  steps {r['steps_completed']}  "
        f"wall {r['wall_s']:.2f}s  step {r['step_time_s'] * 1000:.1f}ms  goodput {r['goodput']:.3f}  "
        f"generations {r['generations']}",
        highlight=False,
    )
    if r["faults"]:
        console.print(summary_table(r))
    durable = r.get("durable")
    if durable:
        newest = durable["newest_complete_step"]
        console.print(
            f"durable tier: {durable['written']} shard snapshot(s) written, newest complete step "
            f"{'none' if newest is None else newest}, {durable['skipped']} skipped (the previous one "
            f"still writing), {durable['failed']} failed",
            highlight=False,
        )
        if durable["last_error"]:
            console.print(
                f"[yellow]warning:[/yellow] durable snapshot failed: {durable['last_error']}", highlight=False
            )
    rejected = r.get("rejected_messages") or {}
    if result.error:
        # a job under attack fails for its attacker's reasons: say so before any peer is blamed
        outside = (
            f"control messages from outside the job were written to its store ({rejected['count']} "
            "rejected); the job's control and data ports must be reachable by its hosts only: "
            if rejected.get("count")
            else ""
        )
        console.print(f"[red]error:[/red] {outside}{result.error}", highlight=False)
    if rejected.get("count"):
        keys = rejected.get("keys") or []
        console.print(
            f"[yellow]warning:[/yellow] ignored {rejected['count']} control message(s) not sealed with "
            f"this job's secret (someone else writes to the job's store), on {', '.join(keys[:6])}"
            f"{', ...' if len(keys) > 6 else ''}",
            highlight=False,
        )
    unfired = r.get("unfired_faults")
    if unfired:
        # an injection run that injected nothing tested nothing: an error (exit 1) unless the job
        # failed anyway
        console.print(
            f"{'[red]error:[/red]' if result.ok else '[yellow]warning:[/yellow]'} "
            f"{len(unfired)} injected fault(s) never fired: {', '.join(unfired)} (the job committed "
            f"{r['steps_completed']} step(s); is --steps the script's step count?)",
            highlight=False,
        )
    console.print(f"final state sha256: {result.digest}", highlight=False)
    for name, what in (r.get("after_finish") or {}).items():
        where = f"; log: {result.logs[name]}" if name in result.logs else ""
        console.print(f"[red]error:[/red] {name} {what} (its work after training may be incomplete{where})",
                      highlight=False)  # fmt: skip
    if result.write_error:
        console.print(f"[red]error:[/red] {result.write_error}", highlight=False)


def exit_code(result: JobResult) -> int:
    """128 + the signal that stopped the job; 1 if it failed, its files could not be written, a fault
    it was to inject never fired, or a rank's process failed after the job finished; else 0."""
    if result.interrupted is not None:
        return 128 + result.interrupted
    r = result.report
    failed = not result.ok or result.write_error or r.get("unfired_faults") or r.get("after_finish")
    return 1 if failed else 0
