"""The run report: what ``report.json`` says, computed from the event log alone.

Definitions (the contract other tools read):

- ``steps_completed``, ``step_time_s``, ``wall_s``, ``goodput`` (at most 1): as
  :mod:`checkpointless.observe.progress` defines them; the live console and the
  Prometheus feed read the same :class:`~checkpointless.observe.progress.StepStats`.
- ``faults``: one entry per fault, in time order, derived from the detections
  (:func:`checkpointless.observe.fault_list.derive_faults`, whose docstring defines each field).
- ``durable``: how fresh the durable tier was (:func:`durable_summary`).
- ``loss_by_step`` and ``replicas_by_step``: :func:`by_step`.
- ``catch_ups``: every spare that caught up in the background (``recovery.never_wait``):
  :func:`catch_ups`.
"""

from __future__ import annotations

from typing import Any

from checkpointless.observe.fault_list import fault_entries
from checkpointless.observe.fields import integer, number, unpacked
from checkpointless.observe.progress import StepStats
from checkpointless.protocol.vocab import Event

__all__ = ["build_report", "by_step", "catch_ups", "durable_summary"]


def by_step(events: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, int]]:
    """``loss_by_step`` (``{"<step>": loss}``: the mean of the ranks' logged ``loss`` over the step's
    whole global batch, each rank's value weighted by the shares it computed, its ``share_count``,
    1 without one; steps with no loss logged are left out) and ``replicas_by_step`` (``{"<step>":
    the replicas that committed it}``: its ranks, sharded in whole replicas of the job's ``shards``),
    from the commits of the generation that committed each step."""
    started = next((e for e in events if e.get("kind") == Event.JOB_STARTED), None)
    shards = max(1, integer(started.get("shards")) or 1) if started is not None else 1
    newest: dict[int, tuple[int, list[dict[str, Any]]]] = {}  # step -> (gen, its commits in it)
    for ev in unpacked(events):
        step, gen = integer(ev.get("step")), integer(ev.get("gen")) or 0
        if ev.get("kind") != Event.STEP_COMMITTED or step is None:
            continue
        seen = newest.get(step)
        if seen is None or gen > seen[0]:
            newest[step] = (gen, [ev])
        elif gen == seen[0]:
            seen[1].append(ev)
    losses: dict[str, float] = {}
    replicas: dict[str, int] = {}
    for step in sorted(newest):
        rows = newest[step][1]
        replicas[str(step)] = len({integer(r.get("rank")) for r in rows}) // shards
        weighted = [(value, integer(r.get("share_count")) or 1) for r in rows
                    if (value := number(r.get("loss"))) is not None]  # fmt: skip
        if weighted:
            losses[str(step)] = sum(v * w for v, w in weighted) / sum(w for _, w in weighted)
    return losses, replicas


def catch_ups(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per catch-up, in time order: the spare (``target``), its source rank and the
    generation that named it, the step of the copy it received, that copy's ``bytes`` and
    ``copy_s`` (sending it), how it ended (``ok``: it joined and the digests matched; else
    ``error``, or None while it had not ended) and ``seconds`` from its start to that end."""
    out: list[dict[str, Any]] = []
    started = [e for e in events if e.get("kind") == Event.CATCH_UP_STARTED]
    for i, s in enumerate(started):
        target, t0 = s.get("target"), number(s.get("t")) or 0.0
        nxt = next((number(x.get("t")) for x in started[i + 1 :] if x.get("target") == target), None)

        def mine(e: dict[str, Any], t0: float = t0, nxt: float | None = nxt, target: Any = target) -> bool:
            t = number(e.get("t")) or 0.0
            return t >= t0 and (nxt is None or t < nxt) and target in (e.get("target"), e.get("proc"))

        sent = next((e for e in events if e.get("kind") == Event.CATCH_UP_SENT and mine(e)), None)
        ended = next((e for e in events if e.get("kind") == Event.CATCH_UP_ENDED and mine(e)), None)
        out.append({
            "target": target, "source_rank": integer(s.get("rank")), "gen": integer(s.get("gen")),
            "from_step": integer(s.get("step")),
            "bytes": None if sent is None else integer(sent.get("bytes")),
            "copy_s": None if sent is None else number(sent.get("seconds")),
            "ok": None if ended is None else bool(ended.get("ok")),
            "error": None if ended is None else ended.get("error"),
            "seconds": None if ended is None else round((number(ended.get("t")) or t0) - t0, 4),
        })  # fmt: skip
    return out


def durable_summary(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How fresh the durable tier was: snapshots started, written, failed and skipped, the newest
    step every shard wrote (the step a rollback would return to), the last error. ``None`` when
    the job ran without the tier."""
    kinds = (Event.DURABLE_SAVED, Event.DURABLE_WRITTEN, Event.DURABLE_FAILED, Event.DURABLE_SKIPPED)
    mine = [e for e in events if e["kind"] in kinds]
    if not mine:
        return None

    def of(kind: str) -> list[dict[str, Any]]:
        return [e for e in mine if e["kind"] == kind]

    shards = {int(e.get("shard") or 0) for e in mine}
    written: dict[int, set[int]] = {}
    for e in of(Event.DURABLE_WRITTEN):
        written.setdefault(int(e["step"]), set()).add(int(e.get("shard") or 0))
    complete = [step for step, by in written.items() if by >= shards]
    failed = of(Event.DURABLE_FAILED)
    seconds = sorted(float(e["seconds"]) for e in of(Event.DURABLE_WRITTEN))
    return {
        "started": len(of(Event.DURABLE_SAVED)),
        "written": len(seconds),
        "failed": len(failed),
        "skipped": len(of(Event.DURABLE_SKIPPED)),
        "newest_complete_step": max(complete, default=None),
        "write_s_median": seconds[len(seconds) // 2] if seconds else None,
        "last_error": str(failed[-1].get("error")) if failed else None,
    }


def build_report(
    events: list[dict[str, Any]],
    *,
    total_steps: int | None,
    digest: str | None,
    stats: StepStats | None = None,
) -> dict[str, Any]:
    """``report.json`` from a time-sorted event list; ``stats``: the step figures of every commit,
    where ``events`` holds only some of them (``observe/event_log.py``)."""
    stats = stats if stats is not None else StepStats.of(events)
    recoveries = [float(e["seconds"]) for e in events if e["kind"] == Event.RECOVERY_DONE]
    evals = [(int(e["step"]), float(e["heldout_loss"])) for e in events if e["kind"] == Event.EVAL]
    finished = [e for e in events if e["kind"] == Event.JOB_FINISHED]
    losses, replicas = by_step(events)
    return {
        "steps_completed": stats.steps_completed,
        "total_steps": total_steps,
        "final_state_sha256": digest,
        # everything registered (user state, the optimizer's param_groups, ...) but per-rank RNG
        "final_registered_sha256": finished[-1].get("registered_digest") if finished else None,
        "goodput": round(stats.goodput, 4),
        "wall_s": round(stats.wall_s, 4),
        "step_time_s": round(stats.step_time_s, 5),
        "generations": max((int(e.get("gen") or 0) for e in events), default=0),
        "recovery_s": recoveries,
        "heldout_loss": evals,
        "faults": fault_entries(events, step_time=stats.step_time_s),
        "durable": durable_summary(events),
        "loss_by_step": losses,
        "replicas_by_step": replicas,
        "catch_ups": catch_ups(events),
    }
