"""A failure's course, from the abort of a generation to the end of its recovery.

1. ``fail``: the generation is aborted (its abort published): its members leave it and report.
2. The members' failure reports come in (``FailureReports``; ``reported``), and the dead ones are
   counted as their exits are seen.
3. Once every member is accounted for (dead or reported), the plan: who replaces whom, who sends
   state to whom, the step to resume at (``make_plan``), published with the spares' assignments.
   Members that neither die nor report are waited for up to a deadline, then killed.
4. The recovery is the members' to make (join, transfer, re-execute); it is done when every member
   is in the new generation and has committed the resume step (``check_recovered``); the spare
   pool is refilled then, not before (a starting spare competes with the transfer for the CPU).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from checkpointless.config import JobConfig
from checkpointless.control.elastic_plans import replicas_to_drop, resize_plan, shrink_plan
from checkpointless.control.exits import ExitJudge
from checkpointless.control.outcome import Outcome
from checkpointless.control.pace import Pace
from checkpointless.control.plan import Plan, PlanError, make_plan
from checkpointless.control.processes import ProcessTable
from checkpointless.control.published import Published
from checkpointless.control.reports import FailureReports
from checkpointless.control.spares import SparePool
from checkpointless.durable_snapshots import job_key, latest_complete
from checkpointless.errors import JobFailed
from checkpointless.protocol import keys
from checkpointless.protocol.vocab import Event, Phase, Reason, Role

log = logging.getLogger(__name__)


@dataclass
class Failure:
    """A failed generation, until its plan is out: who is dead, who reported what."""

    gen: int
    started: float
    dead: set[int] = field(default_factory=set)
    reported: dict[int, int] = field(default_factory=dict)  # rank -> its committed step
    holders: set[int] = field(default_factory=set)  # ranks that still hold their state
    #: a change of size that nothing forced (``FailureCourse.resize``): (the size, why); a member
    #: lost meanwhile makes it an ordinary failure
    resize: tuple[int, str] | None = None
    #: ranks whose process has notice (``FailureCourse.hand_off``): a spare takes each, or the others
    leaving: set[int] = field(default_factory=set)
    #: a grow whose new ranks go to these followers, which caught up (``recovery.never_wait``)
    newcomers: list[str] = field(default_factory=list)

    @property
    def planned(self) -> bool:
        """A change nothing forced (of size, or a handoff), with every member alive."""
        return (self.resize is not None or bool(self.leaving)) and not self.dead


@dataclass(kw_only=True)
class CourseParts:
    """What a failure's course works with: the coordinator's parts."""

    table: ProcessTable
    spares: SparePool
    reports: FailureReports
    published: Published
    exits: ExitJudge
    outcome: Outcome
    pace: Pace


class FailureCourse:
    """The current plan and a failure's course (see the module docstring). ``emit(kind, **fields)``
    records its events; ``probe(names)`` asks the hosts of silent members for a sign of life."""

    def __init__(
        self,
        job: JobConfig,
        parts: CourseParts,
        emit: Callable[..., None],
        clock: Callable[[], float],
        probe: Callable[[list[str]], None] | None = None,
        target: Callable[[], int] | None = None,
    ) -> None:
        """``target()``: the replicas the job aims for (``Sizing``), which followers make up."""
        self._job, self._p, self._emit, self._clock, self._probe = job, parts, emit, clock, probe
        self._target = target or (lambda: job.workers)
        self.plan: Plan | None = None
        self.failure: Failure | None = None
        self.recovering: tuple[float, Plan] | None = None  # (when its failure started, its plan)
        self._retries: Counter[int] = Counter()
        self._planned: Event | None = (
            None  # the recovery under way is a change nothing forced: its done event
        )

    def start(self, plan: Plan) -> None:
        """Generation 0's plan, published."""
        self.plan = plan
        self._p.published.publish(keys.plan(0), plan.to_json())
        self._p.published.publish(keys.LATEST_GEN, "0")

    def fail(self, now: float, *, planned: bool = False) -> Failure:
        """The current generation's failure: started (its abort published) if none is under way.
        ``planned``: a change nothing forced: the members finish the step in flight first."""
        assert self.plan is not None
        if self.failure is None:
            self._p.outcome.reset()  # finished ranks recover too, and report again
            self.failure = Failure(self.plan.gen, now)
            if planned:
                self._p.published.publish(keys.planned(self.plan.gen), "1")
            self._p.published.publish(keys.abort(self.plan.gen), "1")
            self.recovering = None
        return self.failure

    def resize(self, size: int, why: str, now: float, newcomers: list[str] | None = None) -> None:
        """Change the job's size to ``size`` ranks (whole replicas; ``why``: ``request``, ``capacity``): the
        generation is aborted as for a failure, but planned (the members finish the step in flight
        and leave as the next one begins), every member reports, and ``resize_plan`` makes the next
        one, which the spares join or the highest ranks leave."""
        assert self.failure is None
        failure = self.fail(now, planned=True)
        failure.resize, failure.newcomers = (size, why), list(newcomers or [])
        shards = self.plan.shards if self.plan else 1
        before = self.plan.world_size if self.plan else 0
        self._emit(Event.RESIZE_STARTED, replicas=size // shards, before=before // shards, why=why)

    def hand_off(self, ranks: set[int], now: float) -> None:
        """Move ``ranks``, whose processes have notice, to ready spares (to the other replicas in an
        elastic job without enough spares): the generation is aborted as for a failure, every member
        reports (the leaving ones too: they hold the state, and they exit once the plan is out)."""
        assert self.failure is None and self.plan is not None
        self.fail(now, planned=True).leaving = set(ranks)
        for rank in sorted(ranks):
            self._emit(Event.HANDOFF_STARTED, rank=rank, target=self.plan.members[rank])

    def check_reports(self, direct: bool = True) -> None:
        """The members' failure reports: those that came in relayed heartbeats since the last call,
        then (``direct``) those written to the store by processes that beat into it themselves."""
        assert self.plan is not None
        gen, members = self.plan.gen, self.plan.members
        for name, d in self._p.reports.take_relayed():
            rank = d.get("rank")
            if d.get("gen") != gen or not isinstance(rank, int) or members.get(rank) != name:
                continue  # an older generation's (or not this member's: its relay vouches for it only)
            p = self._p.table[name]
            if p.killed or p.role == Role.GONE:
                # fenced: a process judged hung (a host cut off) that reported while cut off; its
                # relay forwards the report once the link is back, and it must count for nothing:
                # the plan waits for its exit instead
                continue
            failure = self.failure
            if failure is None or (rank not in failure.reported and rank not in failure.dead):
                self._reported(gen, rank, d)
        if not direct:
            return
        failure = self.failure
        known = set() if failure is None else set(failure.reported) | failure.dead
        for rank, d in self._p.reports.read(gen, members, known):
            self._reported(gen, rank, d)

    def _reported(self, gen: int, rank: int, d: dict[str, Any]) -> None:
        failure = self.fail(self._clock())
        failure.reported[rank] = int(d["committed"])
        if d.get("has_state", True):
            failure.holders.add(rank)
        self._emit(Event.FAILURE_REPORTED, rank=rank, gen=gen, reason=d["reason"], committed=d["committed"])

    def try_recover(self, now: float) -> None:
        """The plan, once every member is accounted for and enough spares are ready; ``JobFailed``
        when none can be made (no spares left, a plan error, a step that keeps failing)."""
        assert self.failure is not None and self.plan is not None
        f, table = self.failure, self._p.table
        missing = [r for r in self.plan.members if r not in f.dead and r not in f.reported]
        if missing:
            self._wait_for(f, missing, now)
            return
        committed = {r: c for r, c in f.reported.items() if r not in f.dead}
        spares = table.ready_spares()
        if f.planned and f.resize is not None:
            self._resize(f, committed, spares)
            return
        shrink = False
        rc = self._job.recovery
        if f.planned and self.can_hand_off(f.leaving, len(spares)):
            # the leaving ranks are planned as lost ones, their state not needed
            committed = {r: c for r, c in committed.items() if r not in f.leaving}
            f.holders -= f.leaving
            # never-wait: the others take their shares now (no transfer to wait for) while ready
            # spares follow in the background, as after a loss
            shrink = len(f.leaving) > len(spares) or self._never_wait_shrink(len(f.leaving))
        # else (a spare died since the handoff began) the leaving ranks stay: the generation forms
        # again as it was, and the coordinator tries the handoff again
        if not f.planned and f.dead and self._never_wait_shrink(len(f.dead)):
            shrink = True  # the survivors take the lost shares now; ready spares follow, then join
        elif not f.planned and len(f.dead) > len(spares):
            self._p.spares.refill(self._clock())  # a new failure before the last recovery finished
            starting = table.live_spares()
            if len(f.dead) > len(starting) + len(self._p.spares.due):
                exits = self._p.exits
                if not self._job.elastic:
                    raise JobFailed(exits.out_of_spares(f.gen, sorted(f.dead), len(starting)))
                mistake = exits.script_mistake(f.gen, sorted(f.dead), len(starting))
                if mistake is not None:  # no smaller job can fix it either
                    raise JobFailed(mistake)
                shrink = True  # an elastic job goes on smaller, its shares spread over the survivors
            else:
                return  # wait for spares that are still starting
        try:
            durable_on = bool(rc.durable_every and rc.durable_dir)
            step = self._durable_step(committed) if durable_on else None
            hosts = {name: p.handle.host for name, p in table.procs.items()}
            if shrink:
                plan = shrink_plan(
                    self.plan, committed, [] if rc.never_wait else spares, holders=f.holders,
                    min_size=self._job.min_size,
                    durable_on=durable_on, durable_step=step, hosts=hosts,
                )  # fmt: skip
            else:
                plan = make_plan(
                    self.plan, committed, spares, holders=f.holders, durable_on=durable_on, durable_step=step,
                    hosts=hosts,
                )  # fmt: skip
        except PlanError as e:
            raise JobFailed(f"generation {f.gen}: {e}") from e
        plan = self._with_followers(plan, f)
        self._retries[plan.resume_step] += 0 if f.planned else 1
        if self._retries[plan.resume_step] > rc.max_retries_per_step:
            raise JobFailed(
                f"step {plan.resume_step} failed {self._retries[plan.resume_step]} times; giving up"
            )
        self._publish(plan, f)

    def _never_wait_shrink(self, going: int) -> bool:
        """``recovery.never_wait``: whether ``going`` ranks may leave by a shrink (a replicated job
        keeping at least ``min_workers``)."""
        assert self.plan is not None
        return (
            self._job.recovery.never_wait and self.plan.shards == 1
            and self.plan.world_size - going >= self._job.min_size
        )  # fmt: skip

    def can_hand_off(self, leaving: set[int], spares: int) -> bool:
        """Whether ``leaving`` ranks can go: to ``spares`` ready spares, or (an elastic job) to the
        other replicas, while at least ``min_workers`` stay. Sharded, a leaving rank's replica
        leaves with it unless a spare takes its place (``replicas_to_drop``, as after a loss)."""
        assert self.plan is not None
        if len(leaving) <= spares:
            return True
        going = replicas_to_drop(sorted(leaving), spares, self.plan.shards)
        return self._job.elastic and self.plan.world_size - len(going) >= self._job.min_size

    def _resize(self, f: Failure, committed: dict[int, int], spares: list[str]) -> None:
        """The plan of a change of size; as many new ranks as spares are still ready."""
        assert self.plan is not None and f.resize is not None
        table, before = self._p.table, self.plan
        if f.newcomers:  # followers that caught up: the new ranks are theirs, fed by their sources
            spares = [n for n in f.newcomers if n in before.followers and table[n].handle.alive()]
        size = min(f.resize[0], before.world_size + len(spares))
        hosts = {name: p.handle.host for name, p in table.procs.items()}
        try:
            plan = resize_plan(before, committed, size, spares, hosts=hosts)
        except PlanError as e:
            raise JobFailed(f"generation {f.gen}: {e}") from e
        if f.newcomers:
            fed = {r: before.followers[plan.members[r]] for r in plan.grown}
            plan = replace(plan, sources={**plan.sources, **fed}, caught_up=sorted(fed))
        self._publish(self._with_followers(plan, f), f)

    def _with_followers(self, plan: Plan, f: Failure) -> Plan:
        """``recovery.never_wait``: ready spares that the job lacks follow a rank of the plan in
        the background (``catch_up``), each from another holder of the state where there are
        several (the highest ranks first: rank 0 often does more, a log line, an evaluation)."""
        if not self._job.recovery.never_wait or plan.restore is not None or plan.shards != 1:
            return plan
        want = self._target() - plan.world_size
        ready = [n for n in self._p.table.ready_spares() if plan.rank_of(n) is None]
        holders = [r for r in sorted(plan.members, reverse=True) if r not in plan.sources]
        if want <= 0 or not ready or not holders:
            return plan
        followers = {n: holders[i % len(holders)] for i, n in enumerate(ready[:want])}
        return replace(plan, followers=followers)

    def _wait_for(self, f: Failure, missing: list[int], now: float) -> None:
        """Members that neither died nor reported yet. A live member that neither dies nor reports
        is stuck: the same allowance as a step with no progress, and at least a collective's
        timeout: gloo does not fail a send still queued on a connection that breaks (its pair's
        error reaches the receives and old-style buffers, not an unbound buffer's pending write),
        so a member released by the abort in the middle of a large send reports only once that
        send times out; a kill before that costs a rank (the job, without spares). One still
        starting (no heartbeat yet) reports when it gets there; a silent one is the heartbeat
        detector's case."""
        assert self.plan is not None
        members = self.plan.members
        if self._probe is not None:
            self._probe([members[r] for r in missing])  # their hosts' agents: alive?
        rc = self._job.recovery
        deadline = max(
            rc.progress_timeout_s, 3 * self._p.pace.median(), rc.collective_timeout_s + rc.hang_timeout_s
        )
        if now - f.started <= deadline:
            return
        for r in missing:
            p = self._p.table[members[r]]
            if p.killed or not p.joined or now - p.last_change > 3 * rc.heartbeat_interval_s:
                continue
            self._emit(Event.FAULT_DETECTED, rank=r, reason=Reason.NO_PROGRESS, target=p.handle.name,
                       silent_s=round(now - f.started, 3))  # fmt: skip
            p.kill()

    def _durable_step(self, committed: dict[int, int]) -> int | None:
        """The durable snapshot a rollback may use: complete and intact for every shard, of this job's
        shape and seed, and no newer than the highest step the job committed (a newer one is another
        run's). A damaged newer one (files gone) is skipped with a warning; the ranks verify the rest
        as they load it, and fall back to an older one of their own run."""
        rc = self._job.recovery
        assert rc.durable_dir is not None
        views = self._p.table.procs.values()
        highest = max([*committed.values(), *(int(p.hb.get("committed", -1)) for p in views)], default=-1)
        damaged: list[tuple[int, str]] = []
        step = latest_complete(
            rc.durable_dir, self._job.shards, job=job_key(self._job), at_most=highest, damaged=damaged
        )
        for bad, why in damaged:
            if step is None or bad > step:
                log.warning("durable snapshot of step %d is damaged, not used: %s", bad, why)
                self._emit(Event.DURABLE_FAILED, step=bad, during="restore", error=why)
        return step

    def _publish(self, plan: Plan, f: Failure) -> None:
        published, table = self._p.published, self._p.table
        published.publish(keys.plan(plan.gen), plan.to_json())
        published.publish(keys.LATEST_GEN, str(plan.gen))
        for rank, old in plan.replaced.items():
            table[old].retire()
            new = plan.members[rank]
            table[new].assign()
            published.publish(keys.assign(new), str(plan.gen))
        for rank in plan.grown:
            new = plan.members[rank]
            table[new].assign()
            published.publish(keys.assign(new), str(plan.gen))
        for old in plan.dropped:
            table[old].retire()
        for follower in plan.followers:
            published.publish(keys.assign(follower), str(plan.gen))
        before = self.plan.world_size if self.plan is not None else plan.world_size
        self.plan = plan
        self._emit(
            Event.GENERATION_STARTED, gen=plan.gen, members=plan.members, resume_step=plan.resume_step,
            sources=plan.sources, replaced=plan.replaced, committed=f.reported, restore=plan.restore,
        )  # fmt: skip
        for rank, old in plan.replaced.items():
            self._emit(Event.SPARE_ASSIGNED, rank=rank, gen=plan.gen, target=plan.members[rank], replaces=old)
        for rank in plan.grown:
            self._emit(
                Event.SPARE_ASSIGNED, rank=rank, gen=plan.gen, target=plan.members[rank], replaces=None
            )
        for follower, src in plan.followers.items():
            self._emit(
                Event.CATCH_UP_STARTED, rank=src, gen=plan.gen, target=follower, step=plan.resume_step - 1
            )
        if plan.world_size != before:
            why = "lost" if not f.planned else f.resize[1] if f.resize is not None else "handoff"
            self._emit(Event.RESIZED, gen=plan.gen, step=plan.resume_step, replicas=plan.world_size // plan.shards,
                       before=before // plan.shards, dropped=plan.dropped, grown=plan.grown, why=why)  # fmt: skip
        self._p.spares.replace_later(len(plan.replaced))
        self.recovering = (f.started, plan)
        self._planned = (
            None if not f.planned else Event.RESIZE_DONE if f.resize is not None else Event.HANDOFF_DONE
        )
        self.failure = None

    def check_recovered(self) -> None:
        """The recovery is done once every member is in its generation and committed its resume
        step (or finished): ``recovery_done``, and the spare pool is refilled."""
        assert self.recovering is not None
        started, plan = self.recovering
        for _rank, name in plan.members.items():
            hb = self._p.table[name].hb
            if hb.get("gen") != plan.gen:
                return
            if hb.get("committed", -1) < plan.resume_step and hb.get("phase") != Phase.DONE:
                return
        done = self._planned or Event.RECOVERY_DONE
        self._emit(done, gen=plan.gen, step=plan.resume_step, seconds=self._clock() - started,
                   replicas=plan.world_size // plan.shards)  # fmt: skip
        self.recovering = None
        self._p.spares.refill(self._clock())
