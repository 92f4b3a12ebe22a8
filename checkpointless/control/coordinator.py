"""The coordinator: failure detection and recovery plans over the job's membership.

It runs in the launcher process (never in a worker, so any worker may die) and
talks to the processes only through the control store. One ``tick`` reads every
heartbeat and failure report, decides, and publishes; the launcher calls it in
a loop. Its layers: ``Membership`` (``membership.py``: the process table, the
spare pool, the published values) under ``Detection`` (``detection.py``: which
process failed, and how) under ``Coordinator`` (here: the loop, and a failure's
course from reports to a plan, the recovery's end and the job's).

Every value read from the store is verified against the job's secret
(``control/auth.py``); forgeries are ignored and recorded as
``message_rejected`` events.

A plan for generation n+1 is published only once every member of generation n
is accounted for (dead or reported), so the highest committed step is known
exactly and no survivor is left behind in a dead group.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any

from checkpointless.control import keys
from checkpointless.control.detection import Detection
from checkpointless.control.membership import ProcessHandle, _Failure
from checkpointless.control.plan import Plan, PlanError, first_difference, make_plan
from checkpointless.control.vocab import Event, Phase, Reason, Role
from checkpointless.durable import job_key, latest_complete
from checkpointless.errors import JobFailed

log = logging.getLogger(__name__)

_SWEEP_S = 1.0  # steady state: how often the keys behind the wake-ups are read anyway
_INTRUDER_CHECK_S = 5.0  # how often the plain (un-namespaced) key names are checked for strangers' writes

__all__ = ["Coordinator", "JobFailed", "ProcessHandle"]


class Coordinator(Detection):
    """Control plane of one job (see the module docstring for the protocol)."""

    # -- the loop -----------------------------------------------------------------
    def next_tick_s(self, tick_s: float = 0.01) -> float:
        """How long the caller may wait before the next ``tick`` if nothing wakes it earlier: one
        ``tick_s`` during a failure (until the plan is out); otherwise, a recovery under way too,
        until the next heartbeat poll or due spare start. The caller must also tick at once when a
        process exits or a failure report rings (``ReportBell``): what the coordinator waits for
        besides the clock."""
        if self._failure is not None or self.plan is None:
            return tick_s
        now = self._clock()
        due = [self._last_poll + self.job.recovery.heartbeat_interval_s, *self._spares_due]
        return max(tick_s, min(due) - now)

    def tick(self) -> None:
        """One round of observe, decide, publish. Raises ``JobFailed``.

        Every store read is a round trip that wakes the launcher and the store's thread on cores
        the workers train on (and a worker preempted for it delays every rank). So in steady state
        a tick reads only the heartbeats (one ``multi_get``), at their own pace; what a steady
        state waits for besides them comes with a wake-up: a failure or fatal report rings the
        report bell, an exit is a pidfd, a finished rank says so in its heartbeat. The keys
        behind those hints are also swept once a ``_SWEEP_S`` (a lost ring must not stall a job),
        strangers' writes once an ``_INTRUDER_CHECK_S``. During a failure, until the plan is out,
        every tick reads everything. Once it is out, the recovery is the members' to make (join,
        transfer, re-execute): the coordinator reads at the heartbeat pace (everything, at each
        poll), so that its reads do not wake the cores the transfer runs on 100 times a second; a
        new failure still comes with a wake-up, and ``recovery_done`` is seen at the next poll.
        """
        assert self.plan is not None
        now = self._clock()
        steady = self._failure is None  # a recovery under way too (the docstring)
        poll = not steady or now - self._last_poll >= self.job.recovery.heartbeat_interval_s
        bell = self._report_bell
        # without a bell (a coordinator driven by hand, or the bell failed), the keys it stands
        # for are read every tick
        hinted = bell() if bell is not None else True
        # once a plan is out, what a recovery waits for (a re-published plan) at the heartbeat pace
        sweep = (
            not steady
            or hinted
            or now - self._last_sweep >= _SWEEP_S
            or (poll and self._recovering is not None)
        )
        if sweep:
            self._last_sweep = now
        if not steady and self._check_exits(now):
            # a failure waits for these ranks: its plan at once, before this tick's reads (reading
            # every host's value is most of a tick at 2,000 hosts: the plan came a tick late)
            self._try_recover(now)
        if poll:
            self._last_poll = now
            self._read_heartbeats(now)
        if sweep:
            self._check_fatal()
            self._prune_published()
            self._check_published()
        if now - self._last_intruder_check >= _INTRUDER_CHECK_S:
            self._last_intruder_check = now
            self._check_intruders()
        self._check_processes(now)
        self._start_due_spares(now)
        if self._failure is None and poll:
            self._check_progress(now)
            self._check_early_finish()
        if sweep or self.relayed_reports:
            self._check_reports(direct=sweep)
        if self._failure is not None:
            self._try_recover(now)
        elif self._recovering is not None:
            self._check_recovered()
        if self._failure is None and self._recovering is None and (sweep or (poll and self._any_done())):
            self._check_done()
            if self.finished:
                self._check_intruders()  # a stranger's last writes are recorded too

    def _any_done(self) -> bool:
        """Whether a member's heartbeat says it finished its loop (its done report is then written)."""
        return any(
            self.procs[n].hb.get("phase") == Phase.DONE for n in self.members.values() if n in self.procs
        )

    def _check_reports(self, direct: bool = True) -> None:
        """The members' failure reports: those that came in relayed heartbeats since the last call,
        then (``direct``) those written to the store by processes that beat into it themselves."""
        assert self.plan is not None
        gen = self.plan.gen
        relayed, self.relayed_reports = self.relayed_reports, []
        for name, d in relayed:
            rank = d.get("rank")
            if d.get("gen") != gen or not isinstance(rank, int) or self.members.get(rank) != name:
                continue  # an older generation's (or not this member's: its relay vouches for it only)
            p = self.procs[name]
            if p.killed or p.role == Role.GONE:
                # fenced: a process judged hung (a host cut off) that reported while cut off; its
                # relay forwards the report once the link is back, and it must count for nothing:
                # the plan waits for its exit instead
                continue
            failure = self._failure
            if failure is None or (rank not in failure.reported and rank not in failure.dead):
                self._reported(gen, rank, d)
        if not direct or self.store.add(keys.fail_count(gen), 0) == 0:
            return  # the counter is only a hint (anyone can bump it): the sealed reports decide
        failure = self._failure
        known = set() if failure is None else set(failure.reported) | failure.dead
        # the list is a hint (anyone who lists the store's keys can name it): it says which sealed
        # reports to open, and a forged or cut list only delays them to ``_try_recover``'s deadline
        ranks = [r for r in self._reported_ranks(gen) if r not in known]
        texts = self._read_reports(gen, ranks)
        for rank in ranks:
            text = texts.get(rank)
            if text is not None:
                self._reported(gen, rank, json.loads(text))

    def _reported(self, gen: int, rank: int, d: dict[str, Any]) -> None:
        failure = self._fail(self._clock())
        failure.reported[rank] = int(d["committed"])
        if d.get("has_state", True):
            failure.holders.add(rank)
        self._emit(Event.FAILURE_REPORTED, rank=rank, gen=gen, reason=d["reason"], committed=d["committed"])

    def _reported_ranks(self, gen: int) -> list[int]:
        """The members whose failure reports the list ``keys.fail_ranks`` names (each member appends
        its rank after its sealed report): the reports to read, not every member's key every tick
        (16,000 round trips at 2,000 hosts). A hint only: the sealed reports decide."""
        name = self.store.name(keys.fail_ranks(gen))
        if not self.store.raw.check([name]):
            return []
        members = self.members
        out: dict[int, None] = {}  # in the order listed, once each (a list's ``in`` was quadratic:
        # 6.6 s of the coordinator's loop for 16,000 reports at 2,000 hosts, bench/control_scale.py)
        for word in bytes(self.store.raw.get(name)).decode(errors="replace").split(","):
            if word.strip().isdigit() and int(word) in members:
                out[int(word)] = None
        return list(out)

    def _read_reports(self, gen: int, ranks: list[int]) -> dict[int, str]:
        """The verified failure reports of ``ranks``: in one round trip when every key exists (as
        the list promises), else key by key."""
        names = [keys.fail(gen, r) for r in ranks]
        if not names:
            return {}
        if self.store.raw.check([self.store.name(n) for n in names]):
            raws = self.store.get_sealed_present(names)
            texts = {r: self.store.open(n, raw) for r, n, raw in zip(ranks, names, raws, strict=True)}
        else:
            texts = {r: self.store.get(n) for r, n in zip(ranks, names, strict=True)}
        return {r: t for r, t in texts.items() if t is not None}

    def _try_recover(self, now: float) -> None:
        assert self._failure is not None and self.plan is not None
        f = self._failure
        missing = [r for r in self.members if r not in f.dead and r not in f.reported]
        if missing:
            self.probe([self.members[r] for r in missing])  # their hosts' agents: alive?
            # A live member that neither dies nor reports is stuck: the same allowance as a step
            # with no progress, and at least a collective's timeout: gloo does not fail a send
            # still queued on a connection that breaks (its pair's error reaches the receives and
            # old-style buffers, not an unbound buffer's pending write), so a member released by
            # the abort in the middle of a large send reports only once that send times out; a kill
            # before that costs a rank (the job, without spares). One still starting (no heartbeat
            # yet) reports when it gets there; a silent one is the heartbeat detector's case.
            rc = self.job.recovery
            deadline = max(
                rc.progress_timeout_s,
                3 * self.median_step_time(),
                rc.collective_timeout_s + rc.hang_timeout_s,
            )
            if now - f.started > deadline:
                for r in missing:
                    p = self.procs[self.members[r]]
                    if p.killed or not p.joined or now - p.last_change > 3 * rc.heartbeat_interval_s:
                        continue
                    self._emit(Event.FAULT_DETECTED, rank=r, reason=Reason.NO_PROGRESS, target=p.handle.name,
                               silent_s=round(now - f.started, 3))  # fmt: skip
                    p.killed = True
                    p.handle.kill()
            return
        committed = {r: c for r, c in f.reported.items() if r not in f.dead}
        spares = self.ready_spares()
        if len(f.dead) > len(spares):
            self._start_refills()  # a new failure before the last recovery finished
            starting = [n for n, p in self.procs.items() if p.role == Role.SPARE and p.handle.alive()]
            if len(f.dead) > len(starting) + len(self._spares_due):
                why = (
                    f"; spares keep dying at start-up: {self._last_spare_death}"
                    if self._pool_exhausted
                    else ""
                )
                ended = {r: self._crash_lines[r] for r in sorted(f.dead) if self._crash_lines.get(r)}
                lead = same_error(ended)
                if lead is not None:  # a mistake every rank made: the script's error first
                    line, ranks = lead
                    raise JobFailed(
                        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ended with "
                        f"the same error: {line} (a mistake in the script: no spare can fix it; generation "
                        f"{f.gen}, {len(f.dead)} rank(s) lost and {len(starting)} spare(s) left)"
                    )
                lines = "".join(f"; rank {r}'s process ended with: {text}" for r, text in ended.items())
                raise JobFailed(
                    f"generation {f.gen}: {len(f.dead)} rank(s) lost and {len(starting)} spare(s) left "
                    f"(elastic shrink without spares is not supported yet){why}{lines}"
                )
            return  # wait for spares that are still starting
        try:
            rc = self.job.recovery
            durable_on = bool(rc.durable_every and rc.durable_dir)
            step = self._durable_step(committed) if durable_on else None
            plan = make_plan(
                self.plan,
                committed,
                spares,
                holders=f.holders,
                durable_on=durable_on,
                durable_step=step,
                hosts={name: p.handle.host for name, p in self.procs.items()},
            )
        except PlanError as e:
            raise JobFailed(f"generation {f.gen}: {e}") from e
        self._retries[plan.resume_step] += 1
        if self._retries[plan.resume_step] > self.job.recovery.max_retries_per_step:
            raise JobFailed(
                f"step {plan.resume_step} failed {self._retries[plan.resume_step]} times; giving up"
            )
        self._publish(plan, f)

    def _durable_step(self, committed: dict[int, int]) -> int | None:
        """The durable snapshot a rollback may use: complete and intact for every shard, of this job's
        shape and seed, and no newer than the highest step the job committed (a newer one is another
        run's). A damaged newer one (files gone) is skipped with a warning; the ranks verify the rest
        as they load it, and fall back to an older one of their own run."""
        rc = self.job.recovery
        assert rc.durable_dir is not None
        highest = max(
            [*committed.values(), *(int(p.hb.get("committed", -1)) for p in self.procs.values())], default=-1
        )
        damaged: list[tuple[int, str]] = []
        step = latest_complete(
            rc.durable_dir, self.job.shards, job=job_key(self.job), at_most=highest, damaged=damaged
        )
        for bad, why in damaged:
            if step is None or bad > step:
                log.warning("durable snapshot of step %d is damaged, not used: %s", bad, why)
                self._emit(Event.DURABLE_FAILED, step=bad, during="restore", error=why)
        return step

    def _publish(self, plan: Plan, f: _Failure) -> None:
        self._publish_value(keys.plan(plan.gen), plan.to_json())
        self._publish_value(keys.LATEST_GEN, str(plan.gen))
        for rank, old in plan.replaced.items():
            self.procs[old].role = Role.GONE
            new = plan.members[rank]
            self.procs[new].role = Role.WORKER
            self._publish_value(keys.assign(new), str(plan.gen))
        self.plan = plan
        self._emit(
            Event.GENERATION_STARTED, gen=plan.gen, members=plan.members, resume_step=plan.resume_step,
            sources=plan.sources, replaced=plan.replaced, committed=f.reported, restore=plan.restore,
        )  # fmt: skip
        for rank, old in plan.replaced.items():
            self._emit(Event.SPARE_ASSIGNED, rank=rank, gen=plan.gen, target=plan.members[rank], replaces=old)
        # refill the pool after the recovery: a starting spare (importing torch) would compete
        # with the state transfer for CPU
        self._refills += len(plan.replaced)
        self._recovering = (f.started, plan)
        self._failure = None

    def _check_recovered(self) -> None:
        assert self._recovering is not None
        started, plan = self._recovering
        for _rank, name in plan.members.items():
            hb = self.procs[name].hb
            if hb.get("gen") != plan.gen:
                return
            if hb.get("committed", -1) < plan.resume_step and hb.get("phase") != Phase.DONE:
                return
        self._emit(Event.RECOVERY_DONE, gen=plan.gen, step=plan.resume_step, seconds=self._clock() - started)
        self._recovering = None
        self._start_refills()

    def _check_done(self) -> None:
        if self.finished:
            return
        done = self._done  # verified reports are kept: a stranger overwriting one later cannot stall the end
        for rank in self.members:
            if rank not in done or done[rank]["proc"] != self.members[rank]:
                text = self.store.get(keys.done(rank))
                if text is None:
                    return
                done[rank] = json.loads(text)
            if done[rank]["proc"] != self.members[rank]:
                return  # a report of a process that has since been replaced
        if len({d["step"] for d in done.values()}) != 1:
            return  # a rank is still re-executing a step after a late recovery
        shards = self.job.shards
        per_shard: list[str] = []
        for shard in range(shards):
            digests = {d["digest"] for r, d in done.items() if r % shards == shard}
            if len(digests) != 1:
                of = "" if shards == 1 else f" of shard {shard}"
                holders: dict[str, list[int]] = {}
                for r in sorted(done):
                    if r % shards == shard:
                        holders.setdefault(done[r]["digest"], []).append(r)
                who = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {d[:8]}"
                                for d, rs in holders.items())  # fmt: skip
                raise JobFailed(
                    f"replicas{of} diverged: {len(digests)} different final states across ranks ({who})"
                )
            per_shard.append(digests.pop())
        registered = [self._registered_digest(done, shard) for shard in range(shards)]
        # one shard: its digest; several: the SHA-256 of the shards' digests in shard order
        self.digest = (
            per_shard[0] if shards == 1 else hashlib.sha256(":".join(per_shard).encode()).hexdigest()
        )
        self.registered_digest = hashlib.sha256(":".join(registered).encode()).hexdigest()
        self.finished = True
        self.store.set(keys.JOB_STOP, "1")  # the launcher re-asserts it while the ranks exit
        self._emit(
            Event.JOB_FINISHED, ok=True, step=done[0]["step"], digest=self.digest,
            registered_digest=self.registered_digest,
        )  # fmt: skip

    def _registered_digest(self, done: dict[int, dict[str, Any]], shard: int) -> str:
        """The replicas of ``shard`` must hold everything registered alike (user state, the
        optimizer's learning rate, ...; not the per-rank RNG): its digest, or ``JobFailed``
        naming the first entry that differs and the ranks."""
        ranks = sorted(r for r in done if r % self.job.shards == shard)
        entries = {r: [(str(p), str(d)) for p, d in done[r].get("entries", [])] for r in ranks}
        ref = ranks[0]
        for r in ranks[1:]:
            if entries[r] != entries[ref]:
                path = first_difference(entries[ref], entries[r])
                raise JobFailed(
                    f"replicas diverged at the end: registered state {path!r} differs between rank "
                    f"{ref} and rank {r} (the final state digests agree: state outside the model and "
                    "optimizer tensors, or the optimizer's param_groups, drifted)"
                )
        h = hashlib.sha256()
        for path, d in entries[ref]:
            h.update(f"{len(path)}:{path}={d};".encode())
        return h.hexdigest()


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
_PEER_ERROR = ("gloo", "connection reset", "connection closed", "broken pipe", "nccl")


def same_error(lines: dict[int, str]) -> tuple[str, list[int]] | None:
    """The error line that several lost ranks' processes ended with (torch's ``[rankN]:`` prefix
    aside) and those ranks, when it is one line: the ranks that died of a peer's death (gloo's or
    NCCL's dying words) do not count against it. None when the ranks ended differently, or one
    rank alone raised (a fault of that rank's, for the usual message)."""
    own: dict[int, str] = {}
    for r, line in lines.items():
        text = _RANK_PREFIX.sub("", line.strip())
        if text and not any(w in text.lower() for w in _PEER_ERROR):
            own[r] = text
    if len(own) < 2 or len(set(own.values())) != 1:
        return None
    return next(iter(own.values())), sorted(own)
