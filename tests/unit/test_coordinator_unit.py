"""Table-driven unit tests of the coordinator's decisions (``control/coordinator.py``).

The coordinator is built as the launcher builds it (``launch.py``): a
``SignedStore`` over the control store, the job's config, a ``spawn_spare``
callback and an ``emit`` sink, then ``start`` and ``tick`` in a loop. Only the
boundary is faked (``tests/fakes.py``): the store is in memory, processes are
handles the test ends by hand, the clock moves when told, and the workers'
writes are made in their real format, sealed with the job's secret.

One tick is one heartbeat interval (0.25 s, a binary fraction so that every
deadline is hit exactly): each tick the processes whose heartbeat thread runs
(``Job.beating``) flush their heartbeat, then the coordinator ticks.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from checkpointless.config import JobConfig, RecoveryConfig
from checkpointless.control.auth import SignedStore
from checkpointless.control.coordinator import Coordinator, JobFailed
from checkpointless.control.plan import Plan
from checkpointless.control.size_requests import SizeRequests
from checkpointless.protocol import keys
from tests.fakes import FakeProcess, FakeStore, FakeWorker, ManualClock

pytestmark = pytest.mark.timeout(30)

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))  # a stranger's (another job's) secret
DT = 0.25  # one tick: one heartbeat interval
RECOVERY: dict[str, Any] = {
    "hang_timeout_s": 2.0,
    "heartbeat_interval_s": DT,
    "progress_timeout_s": 8.0,
    "start_timeout_s": 30.0,
    "collective_timeout_s": 5.0,  # below progress_timeout_s: the recovery deadline is the latter
}


class Job:
    """A coordinator with its fake store, processes and clock."""

    def __init__(
        self, workers: int = 2, spares: int = 1, *, bell: bool = False, sizes: SizeRequests | None = None,
        **recovery: Any,
    ) -> None:  # fmt: skip
        self.clock = ManualClock()
        self.t0 = self.clock.now
        self.raw = FakeStore()
        self.rejected: list[str] = []  # keys the coordinator found forged (its on_reject)
        self.signed = SignedStore(self.raw, SECRET, self.rejected.append)  # the coordinator's
        self.store = SignedStore(self.raw, SECRET)  # the test's reads
        self.stranger = SignedStore(self.raw, OTHER_SECRET)
        self.events: list[dict[str, Any]] = []
        self.procs: dict[str, FakeProcess] = {}
        self.fakes: dict[str, FakeWorker] = {}
        self.beating: set[str] = set()
        self.spawned: list[tuple[str, float]] = []
        self.spawn_log = ""
        self._next_spare = spares
        self.config = JobConfig(
            workers=workers, spares=spares, recovery=RecoveryConfig(**{**RECOVERY, **recovery})
        )
        # the launcher's ReportBell, at its boundary: the store's bell key, taken (deleted) when read
        bell_name = self.signed.name(keys.REPORT_BELL)
        self.coord = Coordinator(
            self.signed, self.config, 100, self._spawn_spare, self.events.append, clock=self.clock,
            report_bell=(lambda: self.raw.delete_key(bell_name)) if bell else None, sizes=sizes,
        )  # fmt: skip
        self.coord.start(
            [self._proc(f"w{r}") for r in range(workers)], [self._proc(f"s{i}") for i in range(spares)]
        )

    def _proc(self, name: str, log: str = "") -> FakeProcess:
        self.procs[name] = FakeProcess(name, log)
        return self.procs[name]

    def _spawn_spare(self) -> FakeProcess:
        name = f"s{self._next_spare}"
        self._next_spare += 1
        self.spawned.append((name, self.clock.now))
        return self._proc(name, self.spawn_log)

    def __getitem__(self, name: str) -> FakeWorker:
        """The fake of process ``name``'s writes; its heartbeat thread runs from the first use."""
        if name not in self.fakes:
            self.fakes[name] = FakeWorker(self.raw, SECRET, name)
            self.beating.add(name)
        return self.fakes[name]

    # -- driving ------------------------------------------------------------------------
    def tick(self, n: int = 1, dt: float = DT) -> None:
        for _ in range(n):
            self.clock.advance(dt)
            for name in sorted(self.beating):
                self.fakes[name].heartbeat()
            self.coord.tick()

    def tick_until(self, t: float) -> None:
        """Tick while the next tick is at or before ``t``."""
        while self.clock.now + DT <= t:
            self.tick()

    def steady(self, committed: int = -1, spares_ready: bool = True) -> None:
        """Every worker joined generation 0 (and committed ``committed``); spares waiting."""
        for r in range(self.config.workers):
            self[f"w{r}"].enter(r, 0, committed)
        if spares_ready:
            for i in range(self.config.spares):
                self[f"s{i}"].ready_spare()
        self.tick()

    def exit(self, name: str, code: int) -> None:
        self.beating.discard(name)
        self.procs[name].exit(code)

    # -- observing ----------------------------------------------------------------------
    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def faults(self) -> list[tuple[str, str]]:
        return [(e["reason"], e["target"]) for e in self.kinds("fault_detected")]

    def kills(self) -> dict[str, int]:
        return {n: p.kills for n, p in self.procs.items() if p.kills}

    def plan(self, gen: int) -> Plan | None:
        text = self.store.get(keys.plan(gen))
        return None if text is None else Plan.from_json(text)


# == 1. hang: a silent heartbeat ====================================================================


@pytest.mark.parametrize(("silent", "rank", "ticks_after"), [("w1", 1, 1), ("w1", 1, 40), ("s0", None, 40)])
def test_silent_heartbeat_is_killed_exactly_once(silent: str, rank: int | None, ticks_after: int) -> None:
    job = Job()
    job.steady()
    job.beating.discard(silent)  # stopped (SIGSTOP): its last heartbeat was read at this tick
    last = job.clock.now
    hang = job.config.recovery.hang_timeout_s
    job.tick_until(last + hang)
    assert job.clock.now == last + hang
    assert job.faults() == [] and job.kills() == {}
    job.tick()
    (fault,) = job.kinds("fault_detected")
    assert (fault["reason"], fault["target"], fault["rank"]) == ("heartbeat_timeout", silent, rank)
    assert fault["silent_s"] == hang + DT
    assert job.kills() == {silent: 1}
    if rank is not None:
        # a member: its generation is aborted at once, and its peer leaves it and reports
        assert job.store.get(keys.abort(0)) == "1"
        job["w0"].recover()
    job.tick(ticks_after)  # the SIGKILL is pending: the process is still alive
    assert job.faults() == [("heartbeat_timeout", silent)] and job.kills() == {silent: 1}
    # a member's generation is aborted at once (its peers report while the kill is confirmed); no
    # plan until it is seen dead. A spare is no member: nothing is aborted
    assert job.store.get(keys.abort(0)) == ("1" if rank is not None else None)
    assert job.plan(1) is None


def test_the_coordinators_own_stall_is_not_the_processes_silence() -> None:
    """The launcher was not scheduled for longer than the hang timeout (a loaded host): at its first
    read after the stall no heartbeat of that time has arrived yet, for any process. No process is
    killed for the coordinator's own stall; one that stays silent after it still is, that much later."""
    job = Job(workers=4)
    job.steady()
    hang = job.config.recovery.hang_timeout_s
    job.beating.discard("w3")  # w3 really stops beating, just before the stall
    last_w3 = job.clock.now
    job.clock.advance(1.5 * hang)  # the coordinator (and its store) did not run
    job.coord.tick()  # its first read: nothing new from anyone yet
    assert job.faults() == [] and job.kills() == {}
    while not job.faults():
        job.tick()
    assert job.faults() == [("heartbeat_timeout", "w3")]
    assert job.clock.now >= last_w3 + hang + 1.5 * hang  # its silence minus the stall reached the timeout


def test_a_stall_the_processes_beat_through_credits_a_silent_one_one_hang_timeout_at_most() -> None:
    """The coordinator stalls again and again (each loop slower than its reads: many hosts on few
    cores) while its processes keep beating: each read brings news from most of them, so a dead one
    is found within one hang timeout of credit, not never; one just late (its beat right after the
    read) is spared."""
    job = Job(workers=4)
    job.steady()
    hang = job.config.recovery.hang_timeout_s
    job.beating.discard("w3")  # w3 dies
    last_w3 = job.clock.now
    late = "w2"
    for i in range(40):
        job.clock.advance(0.6 * hang)  # a stall: the coordinator did not run, the processes did
        for name in sorted(job.beating):
            if name != late or i % 2:  # w2's beat lands just after every other read
                job[name].heartbeat()
        job.coord.tick()
        if job.faults():
            break
    assert job.faults() == [("heartbeat_timeout", "w3")] and job.kills() == {"w3": 1}
    assert job.clock.now <= last_w3 + 2 * hang + 0.6 * hang  # its silence, one timeout of credit, a stall


@pytest.mark.parametrize("cpu_per_tick", [0.0, 0.02])
def test_silent_and_idle_is_hung_at_the_timeout(cpu_per_tick: float) -> None:
    """A process the coordinator can see: silent and not using CPU (stopped; blocked, with a
    runtime's thread using 8% of a core) is hung at the same moment as one it cannot see."""
    job = Job()
    job.steady()
    job.procs["w1"].cpu = 5.0
    job.beating.discard("w1")
    last, hang = job.clock.now, job.config.recovery.hang_timeout_s
    while not job.faults():
        job.procs["w1"].cpu += cpu_per_tick
        job.tick()
    assert job.clock.now == last + hang + DT
    assert job.faults() == [("heartbeat_timeout", "w1")] and job.kinds("fault_detected")[0]["busy"] is False


def test_silent_but_using_cpu_is_not_hung_until_the_progress_timeout() -> None:
    """A full garbage collection, or native code holding the GIL, silences the heartbeat thread but
    not the process: no kill while it uses CPU; killed once it stops using it, within the hang
    timeout; and a process silent and busy for the whole progress timeout is killed too."""
    job = Job()
    job.steady()
    job.procs["w1"].cpu = 5.0
    job.beating.discard("w1")
    last, rc = job.clock.now, job.config.recovery
    while job.clock.now < last + 3 * rc.hang_timeout_s:  # a 6 s pause, busy all along
        job.procs["w1"].cpu += 0.2
        job.tick()
    assert job.faults() == [] and job.kills() == {}
    stopped = job.clock.now  # now it stops (SIGSTOP): its CPU time no longer moves
    job.tick_until(stopped + 1.5 * rc.hang_timeout_s)
    assert job.faults() == [("heartbeat_timeout", "w1")] and job.kills() == {"w1": 1}
    assert job.kinds("fault_detected")[0]["busy"] is False

    job = Job()
    job.steady()
    job.procs["w1"].cpu = 5.0
    job.beating.discard("w1")
    last = job.clock.now
    while not job.faults():
        job.procs["w1"].cpu += 0.2
        job.tick()
    assert job.clock.now == last + rc.progress_timeout_s + DT
    assert job.kinds("fault_detected")[0]["busy"] is True


def test_a_busy_process_on_another_host_is_judged_between_its_agents_reports() -> None:
    """Another host's process: its CPU figure moves only when its agent reports (here every 3
    ticks, each report's figure aged 0 to 2 ticks when read). A window between two reads of the
    same report is no evidence of idleness: busy all along, it is not killed before the progress
    timeout; stopped, it is killed once two reports show no CPU used."""
    job = Job()
    job.steady()
    w1 = job.procs["w1"]
    w1.cpu, used = 5.0, 5.0
    job.beating.discard("w1")
    last, rc = job.clock.now, job.config.recovery
    n = 0
    while job.clock.now < last + 3 * rc.hang_timeout_s:  # a 6 s pause, busy all along
        n += 1
        used += 0.2
        if n % 3 == 0:
            w1.cpu, w1.cpu_age_s = used, 0.0  # the agent's report
        else:
            w1.cpu_age_s += DT
        job.tick()
    assert job.faults() == [] and job.kills() == {}
    stopped = job.clock.now  # stopped: the next reports show the same figure
    while not job.faults():
        n += 1
        if n % 3 == 0:
            w1.cpu, w1.cpu_age_s = used, 0.0
        else:
            w1.cpu_age_s += DT
        job.tick()
    assert job.faults() == [("heartbeat_timeout", "w1")] and job.kinds("fault_detected")[0]["busy"] is False
    assert job.clock.now <= stopped + 2 * rc.hang_timeout_s


def test_a_heartbeat_after_a_busy_pause_clears_it() -> None:
    job = Job()
    job.steady()
    job.procs["w1"].cpu = 5.0
    job.beating.discard("w1")
    for _ in range(12):  # 3 s silent and busy
        job.procs["w1"].cpu += 0.2
        job.tick()
    job.beating.add("w1")  # the pause ends
    job.tick(2)
    job.beating.discard("w1")  # and it is stopped: a new silence, judged afresh
    last = job.clock.now
    job.tick_until(last + job.config.recovery.hang_timeout_s + DT)
    assert job.faults() == [("heartbeat_timeout", "w1")]


# == 2. a dead worker is replaced by the ready spare ================================================


@pytest.mark.parametrize(
    "order", ["dies_then_survivor_reports", "survivor_reports_then_dies", "dead_reported_too"]
)
def test_dead_worker_is_replaced_by_the_ready_spare(order: str) -> None:
    job = Job(workers=2, spares=1)
    job.steady(committed=4)
    if order == "dies_then_survivor_reports":
        job.exit("w1", -9)
        job.tick()
        assert job.store.get(keys.abort(0)) == "1"
        job.tick(4)
        assert job.plan(1) is None  # w0 is not accounted for yet
        job["w0"].recover()
        job.tick()
    elif order == "survivor_reports_then_dies":
        job["w0"].recover()
        job.tick()
        assert job.store.get(keys.abort(0)) == "1"
        job.tick(4)
        assert job.plan(1) is None  # w1 is alive and has not reported
        job.exit("w1", -9)
        job.tick()
    else:
        job["w1"].recover("exception")
        job.tick(4)
        assert job.plan(1) is None
        job.exit("w1", -9)
        job["w0"].recover()
        job.tick()
    assert job.plan(1) == Plan(
        gen=1, world_size=2, shards=1, members={0: "w0", 1: "s0"}, resume_step=5, sources={1: 0},
        replaced={1: "w1"}, hosts={0: "localhost", 1: "localhost"},
    )  # fmt: skip
    assert job.store.get(keys.LATEST_GEN) == "1"
    assert job.store.get(keys.assign("s0")) == "1" and job.store.get(keys.assign("w0")) is None
    (exited,) = job.kinds("process_exited")
    assert (exited["target"], exited["exitcode"], exited["rank"], exited["joined"]) == ("w1", -9, 1, True)
    assert job.faults() == [("process_exit", "w1")]
    (assigned,) = job.kinds("spare_assigned")
    assert (assigned["rank"], assigned["gen"], assigned["target"], assigned["replaces"]) == (1, 1, "s0", "w1")
    job.tick(20)
    assert job.raw.sets[keys.plan(1)] == 1 and job.plan(2) is None
    assert [e["gen"] for e in job.kinds("generation_started")] == [0, 1]
    assert job.spawned == []  # the pool is refilled once the recovery is done
    job["w0"].enter(0, 1, 4)
    job["s0"].enter(1, 1, 4)
    job.tick()
    assert job.kinds("recovery_done") == [] and job.spawned == []
    job["w0"].commit(5, 0.5)
    job["s0"].commit(5, 0.5)
    job.tick()
    (done,) = job.kinds("recovery_done")
    assert (done["gen"], done["step"]) == (1, 5)
    assert job.spawned == [("s1", job.clock.now)]
    assert job.kills() == {}


# == 3. spares: not ready yet, none left ===========================================================


@pytest.mark.parametrize("spare_heartbeat", [None, "starting"])
def test_plan_waits_for_a_spare_that_is_still_starting(spare_heartbeat: str | None) -> None:
    job = Job(workers=2, spares=1)
    if spare_heartbeat is not None:
        job["s0"].heartbeat(phase=spare_heartbeat)
    job.steady(committed=4, spares_ready=False)
    job.exit("w1", -9)
    job["w0"].recover()
    job.tick(20)
    assert job.plan(1) is None and job.kinds("spare_assigned") == []
    assert job.store.get(keys.assign("s0")) is None
    job["s0"].ready_spare()
    job.tick()
    plan = job.plan(1)
    assert plan is not None and plan.members == {0: "w0", 1: "s0"} and plan.sources == {1: 0}
    assert job.store.get(keys.assign("s0")) == "1"


@pytest.mark.parametrize(
    ("spares", "spare_dies", "match"),
    [
        (0, False, r"^generation 0: 1 rank\(s\) lost and 0 spare\(s\) left \(--min-workers lets a job go on smaller"),
        (1, True, r"^generation 0: 1 rank\(s\) lost and 0 spare\(s\) left .*; spares keep dying at start-up: "
                  r"s0 exited with code 1 before joining the job; last log line: ImportError: libfoo\.so$"),
    ],
)  # fmt: skip
def test_failure_with_no_spare_alive_and_none_due_fails_the_job(
    spares: int, spare_dies: bool, match: str
) -> None:
    job = Job(workers=2, spares=spares, spare_restart_limit=0)
    job.steady(committed=4, spares_ready=False)
    if spare_dies:
        job.procs["s0"].log = "Traceback (most recent call last):\nImportError: libfoo.so\n"
        job.exit("s0", 1)
        job.tick()
        (exhausted,) = job.kinds("spare_pool_exhausted")
        assert exhausted["target"] == "s0" and exhausted["failures"] == 1
    job.exit("w1", -9)
    job["w0"].recover()
    with pytest.raises(JobFailed, match=match):
        job.tick()
    assert job.plan(1) is None and job.spawned == []


def test_failure_waits_for_a_spare_whose_restart_is_due() -> None:
    job = Job(workers=2, spares=1)
    job.steady(committed=4, spares_ready=False)
    job.exit("s0", 1)  # dies at start-up: restarted in 0.5 s
    job.tick()
    died = job.clock.now
    job.exit("w1", -9)
    job["w0"].recover()
    job.tick()  # no spare alive, one due: wait
    assert job.plan(1) is None
    job.tick_until(died + 0.5)
    assert job.spawned == [("s1", died + 0.5)]
    job.tick(4)
    assert job.plan(1) is None
    job["s1"].ready_spare()
    job.tick()
    plan = job.plan(1)
    assert plan is not None and plan.members == {0: "w0", 1: "s1"}


# == 4. no progress: computing while a peer waits in the reduction =================================


@pytest.mark.parametrize(
    ("step_time", "peer", "limit"),
    [
        (1.0, "reduce", 8.0),  # progress_timeout_s
        (4.0, "reduce", 20.0),  # five median steps
        (None, "reduce", None),  # no step committed yet: the first step may be slow, never killed for it
        (1.0, "compute", None),  # no peer waits for it: a long step, not a hang
    ],
)
def test_member_computing_while_a_peer_reduces_is_killed_after_the_allowance(
    step_time: float | None, peer: str, limit: float | None
) -> None:
    job = Job(workers=2, spares=1, progress_timeout_s=8.0)
    job.steady()
    if step_time is not None:
        for w in ("w0", "w1"):
            job[w].compute(0, 1)
        job.tick()
        for w in ("w0", "w1"):
            job[w].commit(0, step_time)
        job.tick()
        assert job.coord.median_step_time() == step_time
    step = 0 if step_time is None else 1
    for w in ("w0", "w1"):
        job[w].compute(step, 2)
    job.tick()
    since = job.clock.now
    if peer == "reduce":
        job["w1"].reduce()
    job.tick()
    if limit is None:
        job.tick_until(since + 3 * 8.0)
        assert job.faults() == [] and job.kills() == {}
        return
    job.tick_until(since + limit - DT)
    assert job.faults() == [] and job.kills() == {}
    job.tick()  # exactly the allowance: not yet
    assert job.clock.now == since + limit and job.kills() == {}
    job.tick()
    (fault,) = job.kinds("fault_detected")
    assert (fault["reason"], fault["target"], fault["rank"], fault["step"]) == ("no_progress", "w0", 0, 1)
    assert fault["silent_s"] == limit + DT
    job.tick(20)
    assert job.kills() == {"w0": 1} and len(job.faults()) == 1


def test_silent_member_computing_while_a_peer_reduces_is_left_to_the_heartbeat_detector() -> None:
    job = Job(workers=2, spares=1, progress_timeout_s=8.0, hang_timeout_s=16.0)
    job.steady()
    for w in ("w0", "w1"):
        job[w].commit(0, 1.0)
    job.tick()
    job["w0"].compute(1, 2)
    job["w1"].compute(1, 2)
    job.tick()
    job.beating.discard("w0")  # stopped in the step
    last = job.clock.now
    job["w1"].reduce()
    job.tick_until(last + 16.0)
    assert job.faults() == [] and job.kills() == {}  # past the progress allowance, but silent
    job.tick()
    assert job.faults() == [("heartbeat_timeout", "w0")] and job.kills() == {"w0": 1}


# == 5. a member still starting is held to start_timeout_s, not to the recovery deadline =============


@pytest.mark.parametrize(
    ("state", "reason", "killed_after"),
    [
        ("starting", "start_timeout", "start"),  # no heartbeat yet: reports when it gets there
        ("joined", "no_progress", "failure"),  # live heartbeat, never reports: the recovery deadline
        ("silent", "heartbeat_timeout", "heartbeat"),  # stopped: the hang detector
    ],
)
def test_member_that_does_not_report_a_failure(state: str, reason: str, killed_after: str) -> None:
    job = Job(workers=3, spares=2)
    rc = job.config.recovery
    if state != "starting":
        job["w2"].enter(2, 0, 4)
        if state == "silent":
            job.beating.discard("w2")
    for r in (0, 1):
        job[f"w{r}"].enter(r, 0, 4)
    for s in ("s0", "s1"):
        job[s].ready_spare()
    job.tick()
    last_heartbeat = job.clock.now
    job.exit("w1", -9)
    job["w0"].recover()
    job.tick()
    failed = job.clock.now
    expected = {
        "start": job.t0 + rc.start_timeout_s,
        "failure": failed + rc.progress_timeout_s,
        "heartbeat": last_heartbeat + rc.hang_timeout_s,
    }[killed_after] + DT
    while not job.kills() and job.clock.now < job.t0 + 60:
        job.tick()
    assert job.kills() == {"w2": 1} and job.clock.now == expected
    assert job.faults() == [("process_exit", "w1"), (reason, "w2")]
    assert job.plan(1) is None
    job.tick(8)
    assert job.kills() == {"w2": 1}
    job.exit("w2", -9)
    job.tick()
    plan = job.plan(1)
    assert plan is not None
    assert (plan.members, plan.sources, plan.resume_step) == ({0: "w0", 1: "s0", 2: "s1"}, {1: 0, 2: 0}, 5)


# == 6. the end: every rank's digest ===============================================================


@pytest.mark.parametrize(
    ("reports", "outcome"),
    [
        ([("w0", "d1", 9), ("w1", "d1", 9)], "finished"),
        (
            [("w0", "d1", 9), ("w1", "d2", 9)],
            r"^replicas diverged: 2 different final states across ranks \(rank 0: d1; rank 1: d2\)$",
        ),
        ([("w0", "d1", 9), ("w1", "d1", 8)], None),  # a rank still re-executing a step
        ([("w0", "d1", 9), ("w9", "d1", 9)], None),  # a report of a process since replaced
        ([("w0", "d1", 9)], None),  # a rank not done yet
    ],
)
def test_done_reports(reports: list[tuple[str, str, int]], outcome: str | None) -> None:
    job = Job(workers=2, spares=1)
    job.steady(committed=9)
    for rank, (proc, digest, step) in enumerate(reports):
        FakeWorker(job.raw, SECRET, proc).report_done(rank, digest, step)
        if proc in job.fakes:
            job[proc].heartbeat(phase="done")
    if outcome is not None and outcome != "finished":
        with pytest.raises(JobFailed, match=outcome):
            job.tick(4)
        assert job.store.get(keys.JOB_STOP) is None and not job.coord.finished
        return
    job.tick(4)
    if outcome is None:
        assert not job.coord.finished and job.coord.digest is None
        assert job.store.get(keys.JOB_STOP) is None and job.kinds("job_finished") == []
        return
    assert job.coord.finished and job.coord.digest == "d1"
    assert job.store.get(keys.JOB_STOP) == "1"
    (fin,) = job.kinds("job_finished")
    assert (fin["ok"], fin["digest"], fin["step"]) == (True, "d1", 9)
    job.exit("w0", 0)  # workers exit once the job is over: no longer a fault
    job.exit("s0", 0)
    job.tick(4)
    assert job.faults() == [] and len(job.kinds("job_finished")) == 1


def test_rank_lost_after_its_peer_finished_is_replaced_and_the_job_finishes() -> None:
    job = Job(workers=2, spares=1)
    job.steady(committed=9)
    job["w0"].heartbeat(phase="done")
    job["w0"].report_done(0, "d1", 9)
    job.tick()
    job.exit("w1", -9)  # dies before its own report
    job.tick()
    assert not job.coord.finished and job.store.get(keys.abort(0)) == "1"
    job["w0"].recover("peer_failure")  # Session.finish sees the abort
    job.tick()
    plan = job.plan(1)
    assert plan is not None and (plan.members, plan.resume_step) == ({0: "w0", 1: "s0"}, 10)
    for proc, rank in (("w0", 0), ("s0", 1)):  # nothing left to train: both finish at once
        job[proc].enter(rank, 1, 9)
        job[proc].heartbeat(phase="done")
        job[proc].report_done(rank, "d1", 9)
    job.tick()
    (recovered,) = job.kinds("recovery_done")
    assert (recovered["gen"], recovered["step"]) == (1, 10)
    assert job.coord.finished and job.coord.digest == "d1" and job.store.get(keys.JOB_STOP) == "1"


# == 7. exits: before the end, at start-up, spares =================================================


@pytest.mark.parametrize(
    ("joined", "code", "log", "match"),
    [
        (True, 0, "", r"^w1 \(rank 1\) exited with code 0 before the job finished \(does the loop end early"),
        (False, 1, "Traceback (most recent call last):\nModuleNotFoundError: No module named 'foo'\n\n",
         r"^w1 exited with code 1 before joining the job; last log line: "
         r"ModuleNotFoundError: No module named 'foo'$"),
        (False, 0, "", r"^w1 exited with code 0 before joining the job \(does the command create a "
                       r"checkpointless\.Session\?\); last log line: \(empty\)$"),
        # an unported script's own process group (init_process_group, accelerate's Accelerator)
        (False, 1, "Traceback (most recent call last):\nValueError: Error initializing torch.distributed using "
                   "env:// rendezvous: environment variable MASTER_ADDR expected, but not set\n",
         r"^w1 started a torch\.distributed process group of its own \(init_process_group, or accelerate's "
         r"Accelerator\): under checkpointless launch the Session forms the groups: port the loop "
         r"\(docs/guide/porting\.md\) or use an integration \(checkpointless\.integrations\.transformers / "
         r"\.lightning\); it exited with code 1; last log line: ValueError: Error initializing "
         r"torch\.distributed using env:// rendezvous: environment variable MASTER_ADDR expected, but not set$"),
    ],
)  # fmt: skip
def test_worker_exit_that_ends_the_job(joined: bool, code: int, log: str, match: str) -> None:
    job = Job(workers=2, spares=1)
    job["w0"].enter(0, 0)
    job["s0"].ready_spare()
    if joined:
        job["w1"].enter(1, 0)
    job.tick()
    job.procs["w1"].log = log
    job.exit("w1", code)
    with pytest.raises(JobFailed, match=match):
        job.tick()
    (exited,) = job.kinds("process_exited")
    assert (exited["target"], exited["exitcode"], exited["joined"]) == ("w1", code, joined)
    if not joined:
        (fault,) = job.kinds("fault_detected")
        assert (fault["reason"], fault["target"], fault["exitcode"]) == ("start_failure", "w1", code)
        assert fault["log_tail"] == job.procs["w1"].log_tail()
    assert job.store.get(keys.abort(0)) is None and job.spawned == []


@pytest.mark.parametrize("code", [1, -9])
def test_a_worker_that_joined_and_exited_between_two_reads_of_the_heartbeats_is_a_lost_rank(
    code: int,
) -> None:
    """A fast script: rank 1 joins, trains and raises (or is killed) between two of the
    coordinator's reads of the heartbeats, so no read brought its heartbeat yet. Its heartbeat is
    in the store: it joined, and its rank is lost like any other (a fault, recovered), not a
    command that failed to start."""
    job = Job(workers=2, spares=1)
    job["w0"].enter(0, 0)
    job["s0"].ready_spare()
    job.tick()
    job["w1"].enter(1, 0, 3)  # written once, never read: the exit comes before the next read
    job.exit("w1", code)
    job.tick(dt=DT / 10)
    (exited,) = job.kinds("process_exited")
    assert (exited["target"], exited["joined"]) == ("w1", True)
    assert job.faults() == [("process_exit", "w1")]
    job["w0"].recover()
    job.tick(4)
    plan = job.plan(1)
    assert plan is not None and plan.members[1] == "s0", plan


def test_a_spare_given_a_rank_as_it_left_on_a_notice_is_a_lost_rank_not_a_mistake() -> None:
    """The plan that gives spare s0 rank 1 crosses its notice: it exits 0 still a spare (its last
    heartbeat says so). Rank 1 is lost like any other (a fault, recovered), not a worker whose loop
    ended early."""
    job = Job(workers=2, spares=2)
    job.steady(committed=3)
    job.exit("w1", -9)
    job.tick()
    job["w0"].recover("peer_failure")
    job.tick()
    plan = job.plan(1)
    assert plan is not None and plan.members[1] in ("s0", "s1")
    newcomer = plan.members[1]
    job.exit(newcomer, 0)  # its heartbeat still says "spare"
    job.tick()
    assert [f for f in job.faults() if f[1] == newcomer] == [("process_exit", newcomer)]
    assert not job.coord.finished and job.store.get(keys.abort(1)) == "1"


@pytest.mark.parametrize(("limit", "delays"), [(3, [0.5, 1.0, 2.0]), (1, [0.5]), (0, [])])
def test_spares_dying_at_start_up_back_off_then_stop(limit: int, delays: list[float]) -> None:
    job = Job(workers=2, spares=1, spare_restart_limit=limit)
    job.spawn_log = job.procs["s0"].log = "RuntimeError: no accelerator found\n"
    job.steady(spares_ready=False)
    dying = "s0"
    for i, delay in enumerate(delays):
        job.exit(dying, 1)
        job.tick()
        died = job.clock.now
        scheduled = job.kinds("spare_restart_scheduled")[-1]
        assert (scheduled["target"], scheduled["delay_s"], scheduled["failures"]) == (dying, delay, i + 1)
        assert "no accelerator found" in scheduled["error"]
        job.tick_until(died + delay - DT)
        assert len(job.spawned) == i  # not before the delay
        job.tick()
        dying = f"s{i + 1}"
        assert job.spawned[-1] == (dying, died + delay)
    job.exit(dying, 1)
    job.tick()
    (exhausted,) = job.kinds("spare_pool_exhausted")
    assert (exhausted["target"], exhausted["failures"]) == (dying, limit + 1)
    assert "no accelerator found" in exhausted["error"]
    job.tick(40)
    assert [e["delay_s"] for e in job.kinds("spare_restart_scheduled")] == delays
    assert len(job.spawned) == len(delays)
    assert {reason for reason, _ in job.faults()} == {"start_failure"}
    assert job.store.get(keys.abort(0)) is None and not job.coord.finished


@pytest.mark.parametrize(
    ("heartbeat", "code", "delay"),
    [
        ("spare", -9, None),  # ready, then lost: restarted at once
        ("spare", 0, None),  # told to leave (its host drained): no fault
        ("spare", -15, None),  # SIGTERM while it waited: no fault either
        ("starting", -9, 0.5),  # joined (a Session) but died before it was ready: backoff
        (None, -9, 0.5),  # killed before its first heartbeat (e.g. out of memory while importing)
    ],
)
def test_spare_that_dies_after_start_up(heartbeat: str | None, code: int, delay: float | None) -> None:
    job = Job(workers=2, spares=1)
    job.procs["s0"].log = "building the model\n"
    if heartbeat is not None:
        job["s0"].heartbeat(phase=heartbeat)
    job.steady(spares_ready=False)
    job.exit("s0", code)
    job.tick()
    died = job.clock.now
    # a ready spare that exits 0 or by SIGTERM was told to leave (its host drained): replaced, no fault
    assert job.faults() == ([] if heartbeat == "spare" and code in (0, -15) else [("process_exit", "s0")])
    scheduled = job.kinds("spare_restart_scheduled")
    if delay is None:
        assert scheduled == [] and job.spawned == [("s1", died)]
    else:
        assert [(e["delay_s"], e["error"]) for e in scheduled] == [
            (delay, f"s0 died while starting (exit code {code}): building the model")
        ]
        job.tick_until(died + delay)
        assert job.spawned == [("s1", died + delay)]
    assert job.store.get(keys.abort(0)) is None


def test_a_spare_that_gets_ready_resets_the_backoff() -> None:
    job = Job(workers=2, spares=1)
    job.steady()
    job.exit("s0", -9)
    job.tick()
    job.exit("s1", 1)  # dies at start-up: first backoff
    job.tick()
    assert [e["delay_s"] for e in job.kinds("spare_restart_scheduled")] == [0.5]
    job.tick(2)
    assert [n for n, _ in job.spawned] == ["s1", "s2"]
    job.exit("s2", 1)  # the second in a row: twice as long
    job.tick()
    job.tick(4)
    assert [e["delay_s"] for e in job.kinds("spare_restart_scheduled")] == [0.5, 1.0]
    job["s3"].ready_spare()  # a spare that gets ready ends the run of start-up deaths
    job.tick()
    job.exit("s3", -9)
    job.tick()
    assert job.spawned[-1] == ("s4", job.clock.now)
    job.exit("s4", 1)
    job.tick()
    assert [e["delay_s"] for e in job.kinds("spare_restart_scheduled")] == [0.5, 1.0, 0.5]
    assert job.store.get(keys.abort(0)) is None


# == 8. fatal reports =============================================================================


@pytest.mark.parametrize("bell", [False, True])
@pytest.mark.parametrize(
    ("exits", "dt"),
    [
        (False, DT),  # read at the next tick (with the bell: the report rang it)
        (False, 0.01),  # ... also a tick that does not poll the heartbeats
        (True, DT),  # the reporter exits right after: its report wins over its exit
        (True, 0.01),  # ... also when the exit is seen on a tick that does not poll
    ],
)
def test_fatal_report_ends_the_job_with_its_message(exits: bool, dt: float, bell: bool) -> None:
    job = Job(workers=2, spares=1, bell=bell)
    job.steady(committed=2)
    message = "rank 1: step 3 ended without session.reduce_gradients()"
    job["w1"].report_fatal(1, message)
    if exits:
        job.exit("w1", 1)
    with pytest.raises(JobFailed) as failed:
        job.tick(dt=dt)
    assert str(failed.value) == message
    fault = job.kinds("fault_detected")[-1]
    assert (fault["reason"], fault["target"], fault["rank"], fault["error"]) == ("fatal", "w1", 1, message)
    assert job.store.get(keys.abort(0)) is None and job.plan(1) is None


# == 9. forgeries ================================================================================


def _forge(job: Job, key: str, value: str, how: str) -> None:
    if how == "other_secret":
        job.stranger.set(key, value)
    else:  # unsealed
        job.raw.set(key, value.encode())


@pytest.mark.parametrize("how", ["other_secret", "unsealed"])
def test_forged_heartbeat_neither_hides_a_hang_nor_readies_a_spare(how: str) -> None:
    job = Job(workers=2, spares=1)
    job.steady(committed=4, spares_ready=False)
    job.beating.discard("w1")  # hung; a stranger keeps "heartbeating" for it and for the spare
    last = job.clock.now
    for seq in range(100, 100 + int(job.config.recovery.hang_timeout_s / DT) + 1):
        _forge(job, keys.heartbeat("w1"), json.dumps({"seq": seq, "phase": "idle", "rank": 1, "gen": 0}), how)
        _forge(job, keys.heartbeat("s0"), json.dumps({"seq": seq, "phase": "spare"}), how)
        job.tick()
    assert job.clock.now == last + job.config.recovery.hang_timeout_s + DT
    assert job.faults() == [("heartbeat_timeout", "w1")] and job.kills() == {"w1": 1}
    assert job.coord.ready_spares() == []
    job.exit("w1", -9)
    job["w0"].recover()
    job.tick(4)
    assert job.plan(1) is None  # the forged "spare" heartbeat does not make s0 ready
    assert {"hb/w1", "hb/s0"} <= set(job.rejected)
    job["s0"].ready_spare()
    job.tick()
    plan = job.plan(1)
    assert plan is not None and plan.members == {0: "w0", 1: "s0"}


@pytest.mark.parametrize("how", ["other_secret", "unsealed"])
def test_forged_done_reports_neither_finish_nor_fail_the_job(how: str) -> None:
    job = Job(workers=2, spares=1)
    job.steady(committed=9)
    for rank in (0, 1):
        _forge(job, keys.done(rank), json.dumps({"digest": "evil", "step": 9, "proc": f"w{rank}"}), how)
    job.tick(4)
    assert not job.coord.finished and job.store.get(keys.JOB_STOP) is None
    job["w0"].report_done(0, "d1", 9)  # one real report, one forged and different: no divergence
    job.tick(4)
    assert not job.coord.finished
    job["w1"].report_done(1, "d1", 9)
    job.tick()
    assert job.coord.finished and job.coord.digest == "d1"
    assert sorted(job.rejected) == ["done/0", "done/1"]  # each forged value reported once


@pytest.mark.parametrize("how", ["other_secret", "unsealed"])
def test_forged_fatal_report_is_ignored(how: str) -> None:
    job = Job(workers=2, spares=1)
    job.steady()
    _forge(job, keys.fatal("w0"), json.dumps({"rank": 0, "error": "stop the job"}), how)
    job.raw.add(keys.FATAL_COUNT, 1)
    job.tick(20)
    assert job.faults() == [] and job.rejected == ["fatal/w0"]


@pytest.mark.parametrize("how", ["other_secret", "unsealed"])
def test_current_plan_overwritten_by_a_stranger_is_published_again_at_the_next_sweep(how: str) -> None:
    job = Job(workers=2, spares=1, bell=True)
    job.steady(committed=4)
    job.exit("w1", -9)
    job["w0"].recover()
    job.tick()
    real = job.store.get(keys.plan(1))
    assert real is not None
    forged = json.loads(real)
    forged["members"]["1"] = "evil"
    _forge(job, keys.plan(1), json.dumps(forged), how)
    _forge(job, keys.LATEST_GEN, "7", how)
    job.tick(dt=0.01)  # once the plan is out, the published keys are swept at the heartbeat pace
    assert job.store.get(keys.plan(1)) is None
    job.tick()
    assert job.store.get(keys.plan(1)) == real and job.store.get(keys.LATEST_GEN) == "1"
    assert sorted(set(job.rejected)) == ["gen/1/plan", "gen/latest"]
    # in steady state, at the next sweep of the published keys (a second after the last)
    job["w0"].enter(0, 1, 4)
    job["s0"].enter(1, 1, 4)
    job["w0"].commit(5, 0.5)
    job["s0"].commit(5, 0.5)
    job.tick()
    assert job.kinds("recovery_done")
    _forge(job, keys.plan(1), json.dumps(forged) + " ", how)
    job.tick(dt=0.01)
    assert job.store.get(keys.plan(1)) is None  # no sweep yet
    job.tick(3)
    assert job.store.get(keys.plan(1)) is None
    job.tick()
    assert job.store.get(keys.plan(1)) == real
    assert job.raw.sets[keys.plan(1)] == 5  # published, forged, repaired, forged, repaired
    assert job.plan(2) is None


def test_replayed_genuine_heartbeats_do_not_hide_a_hang() -> None:
    """Found by this suite: only a heartbeat with a higher ``seq`` counts as fresh."""
    job = Job(workers=2, spares=1)
    job.steady()
    job.tick()
    old = [job.raw.data[keys.heartbeat("w1")]]
    job.tick()
    old.append(job.raw.data[keys.heartbeat("w1")])
    job.beating.discard("w1")  # hung; a stranger replays its two last heartbeats in turn
    last = job.clock.now
    for i in range(int(2 * job.config.recovery.hang_timeout_s / DT)):
        job.raw.set(keys.heartbeat("w1"), old[i % 2])
        job.tick()
    assert job.clock.now > last + job.config.recovery.hang_timeout_s + DT
    assert job.faults() == [("heartbeat_timeout", "w1")] and job.kills() == {"w1": 1}


@pytest.mark.parametrize("forged_report", [False, True])
def test_forged_failure_report_is_ignored(forged_report: bool) -> None:
    """Found by this suite: the unsealed counter alone used to fail the generation (and kill every rank)."""
    job = Job(workers=2, spares=1)
    job.steady(committed=4)
    if forged_report:
        job.stranger.set(keys.fail(0, 1), json.dumps({"committed": 4, "reason": "x", "proc": "w1",
                                                      "has_state": True}))  # fmt: skip
    job.raw.add(keys.fail_count(0), 1)
    job.tick_until(job.clock.now + 2 * job.config.recovery.progress_timeout_s)
    assert (job.store.get(keys.abort(0)), job.faults(), job.kills()) == (None, [], {})


@pytest.mark.parametrize("key", ["assign/s0", "gen/0/abort"])
def test_write_once_values_overwritten_by_a_stranger_are_published_again(key: str) -> None:
    """Found by this suite: an overwritten assignment or abort used to stay forged."""
    job = Job(workers=2, spares=1)
    job.steady(committed=4)
    job.exit("w1", -9)
    job.tick()
    if key.startswith("assign"):
        job["w0"].recover()
        job.tick()
    assert job.store.get(key) == "1"
    job.stranger.set(key, "0")
    job.tick(2)
    assert job.store.get(key) == "1"


# == 10. the state is lost =======================================================================


@pytest.mark.parametrize("has_state", [False, True])
def test_receiver_left_alone_after_its_source_died(has_state: bool) -> None:
    job = Job(workers=2, spares=2)
    job.steady(committed=4)
    job.exit("w1", -9)
    job["w0"].recover()
    job.tick()
    plan = job.plan(1)
    assert plan is not None and plan.members == {0: "w0", 1: "s0"} and plan.sources == {1: 0}
    job["w0"].heartbeat(gen=1, phase="joining")
    job["s0"].heartbeat(rank=1, gen=1, phase="joining")
    job.tick()
    job.exit("w0", -9)  # the source dies during the transfer
    if has_state:
        job["s0"].heartbeat(committed=4)  # it had received the whole state
    job["s0"].recover(has_state=has_state)
    if not has_state:
        with pytest.raises(
            JobFailed,
            match=r"^generation 1: every live copy of the state is lost: no surviving rank holds it",
        ):
            job.tick()
        assert job.plan(2) is None
        return
    job.tick()
    assert job.plan(2) == Plan(
        gen=2, world_size=2, shards=1, members={0: "s1", 1: "s0"}, resume_step=5, sources={0: 1},
        replaced={0: "w0"}, hosts={0: "localhost", 1: "localhost"},
    )  # fmt: skip


@pytest.mark.parametrize("bell", [False, True])
def test_a_failure_report_is_read_within_a_tick_with_or_without_the_bell(bell: bool) -> None:
    """Without the launcher's report bell the coordinator reads failure reports every tick; with
    it, only when a reporter rang it (and once a second, ``_SWEEP_S``): no store read per tick in
    steady state, not even at a heartbeat poll. Either way the tick after the report fails the
    generation."""
    job = Job(workers=2, spares=1, bell=bell)
    job.steady(committed=4)
    reads: list[str] = []
    add = job.raw.add
    job.raw.add = lambda key, amount: (reads.append(key), add(key, amount))[1]  # type: ignore[method-assign]
    job.tick(3, dt=DT)  # three heartbeat polls, less than a second
    job.tick(5, dt=DT / 100)
    assert len([k for k in reads if k.endswith(keys.fail_count(0))]) == (0 if bell else 8)
    job["w1"].report_failure(0, 1, 4, "exception", True)
    job.coord.tick()  # same instant: no heartbeat poll is due
    assert job.store.get(keys.abort(0)) is not None
    assert [e["rank"] for e in job.kinds("failure_reported")] == [1]


def test_with_the_bell_silent_the_reports_are_still_read_once_a_second() -> None:
    """A report whose bell rang for nobody (the bell thread had a store error) is read at the next
    sweep of the hinted keys, a second after the last (``_SWEEP_S``)."""
    job = Job(workers=2, spares=1, bell=True)
    job.steady(committed=4)  # its tick swept
    job["w1"].report_failure(0, 1, 4, "exception", True)
    job.raw.delete_key(job.signed.name(keys.REPORT_BELL))  # the ring is lost
    job.tick(3)  # three heartbeat polls: 0.75 s
    assert job.store.get(keys.abort(0)) is None
    job.tick(1)  # a second after the last sweep
    assert job.store.get(keys.abort(0)) is not None


# == a rank whose loop ends early ==================================================================


@pytest.mark.parametrize(
    ("peer", "outcome"),
    [
        ("reduce:8", r"^rank 1 \(w1\) finished its loop after step 7 while rank 0 \(w0\) attempts step 8: "),
        ("compute:8", r"^rank 1 \(w1\) finished its loop after step 7 while rank 0 \(w0\) attempts step 8: "),
        (
            "done:9",
            r"^rank 1 \(w1\) finished its loop after step 7 while rank 0 \(w0\) finished after step 9: ",
        ),
        ("reduce:7", None),  # the last step, still reducing: the peer finishes too
        ("done:7", "finished"),
    ],
)
def test_a_rank_that_finishes_while_a_peer_expects_more_steps_ends_the_job(
    peer: str, outcome: str | None
) -> None:
    """Its peer would wait in the next step's reduction for it, a collective timeout per generation,
    forever: the job ends at once, naming both ranks and their steps."""
    job = Job(workers=2, spares=1)
    job.steady(committed=7)
    phase, step = peer.split(":")
    if phase == "done":
        job["w0"].heartbeat(phase="done", committed=int(step))
        job["w0"].report_done(0, "d1", int(step))
    else:
        job["w0"].compute(int(step), 1)
        if phase == "reduce":
            job["w0"].reduce()
    job["w1"].heartbeat(phase="done")
    job["w1"].report_done(1, "d1", 7)
    if outcome is None or outcome == "finished":
        job.tick(4)
        assert job.coord.finished == (outcome == "finished") and job.faults() == []
        return
    with pytest.raises(JobFailed, match=outcome):
        job.tick()
    assert job.faults() == [("fatal", "w1")] and job.kills() == {}


def test_a_replacement_that_finishes_early_during_the_recovery_ends_the_job() -> None:
    """The incident: a refilled spare's loop ran fewer steps; its peer could not commit the resume
    step, so the recovery never completed (the check runs while recovering too)."""
    job = Job(workers=2, spares=1)
    job.steady(committed=4)
    job.exit("w1", -9)
    job.tick()
    job["w0"].recover()
    job.tick()
    assert job.plan(1) is not None
    job["w0"].enter(0, 1, 4)
    job["s0"].enter(1, 1, 4)
    job["w0"].compute(5, 2)
    job["w0"].reduce()
    job["s0"].heartbeat(phase="done")
    job["s0"].report_done(1, "d1", 4)
    with pytest.raises(
        JobFailed, match=r"^rank 1 \(s0\) finished its loop after step 4 while rank 0 \(w0\) attempts step 5"
    ):
        job.tick()


# == periodic scans stay bounded ===================================================================


def test_the_strangers_check_reads_what_is_live_not_every_process_and_generation_ever_seen() -> None:
    """Each recovery retires a process and a generation: the check for strangers' writes (one
    store round trip per key) reads the same number of keys after six recoveries as after one,
    and still catches a stranger's write to the current generation's plan."""
    job = Job(workers=2, spares=1)
    job.steady(committed=0)
    checks: list[int] = []
    real_check = job.raw.check

    def counted() -> int:
        """The keys one check reads (one round trip each). This job's real keys are not under a
        namespace, so the check is run as if they were, with no stranger's write to find."""
        calls = 0

        def check(keys_: list[str]) -> bool:
            nonlocal calls
            calls += 1
            return False

        job.raw.check = check  # type: ignore[method-assign]
        job.signed.namespace = "job/"
        try:
            job.coord.intruders.check(job.coord.plan)
        finally:
            job.raw.check = real_check  # type: ignore[method-assign]
            job.signed.namespace = ""
        return calls

    for gen in range(6):
        victim = job.coord.members[1]
        job.exit(victim, -9)
        job.tick()
        job[job.coord.members[0]].recover()
        job.tick()
        plan = job.plan(gen + 1)
        assert plan is not None and plan.replaced == {1: victim}
        for rank, name in plan.members.items():
            job[name].enter(rank, gen + 1, gen)
        job.tick()
        for name in plan.members.values():
            job[name].commit(gen + 1, 0.5)
        job.tick()
        refill = job.spawned[-1][0]  # the pool refills once the recovery is done
        job[refill].ready_spare()
        job.tick()
        checks.append(counted())
    assert len(set(checks)) == 1 and checks[0] > 10, checks
    job.raw.set(keys.plan(7), "forged")  # a plain (un-namespaced) name: a stranger's write
    job.signed.namespace = "job/"
    job.coord.intruders.check(job.coord.plan)
    rejected = {e["key"] for e in job.kinds("message_rejected")}
    assert keys.plan(7) in rejected and not job.raw.check([keys.plan(7)])


def test_a_member_that_may_be_in_a_collective_until_its_timeout_is_waited_for() -> None:
    """gloo does not fail a send still queued on a connection that breaks: a member released by an
    abort mid-send reports only when that send times out. Its heartbeat is alive: it is killed only
    after a collective's timeout (and a hang timeout more), not at the step allowance."""
    job = Job(workers=3, spares=2, collective_timeout_s=12.0)
    rc = job.config.recovery
    for r in range(3):
        job[f"w{r}"].enter(r, 0, 4)
    for s in ("s0", "s1"):
        job[s].ready_spare()
    job.tick()
    job.exit("w1", -9)
    job["w0"].recover()
    job.tick()
    failed = job.clock.now
    while not job.kills() and job.clock.now < job.t0 + 60:
        job.tick()
    assert job.kills() == {"w2": 1}
    assert (
        job.clock.now
        == failed + rc.collective_timeout_s + rc.hang_timeout_s + DT
        > failed + rc.progress_timeout_s
    )


def test_a_sampler_built_before_the_session_is_named_in_the_error() -> None:
    """``DistributedSampler(dataset)`` before ``Session()`` returned (the default process group is
    formed with the rank): torch's line, then what it means here and what to write instead; a
    collective that failed outside the step is pointed to ``session.between_steps()``."""
    from checkpointless.control.detection import hint as _hint

    line = "ValueError: Default process group has not been initialized, please make sure to call init_process_group."
    hint = _hint(line)
    assert "DistributedSampler(dataset)" in hint and "before checkpointless.Session() returned" in hint
    assert "session.loader(...)" in hint
    closed = (
        "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    )
    assert "session.between_steps()" in _hint(closed)
    assert _hint("ZeroDivisionError: division by zero") == ""


def test_a_process_group_of_the_scripts_own_is_recognised_by_its_rendezvous_error() -> None:
    """torch's ``env://`` rendezvous error, whichever variable it misses, is an unported script's
    own process group; other errors are not."""
    from checkpointless.control.detection import own_group

    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        line = (
            "ValueError: Error initializing torch.distributed using env:// rendezvous: "
            f"environment variable {var} expected, but not set"
        )
        assert "docs/guide/porting.md" in own_group(line), var
    assert own_group("ValueError: Default process group has not been initialized") == ""
    assert own_group("ZeroDivisionError: division by zero") == ""


def test_a_failure_waiting_for_a_killed_members_exit_plans_as_the_exit_is_seen_before_reading_heartbeats() -> (
    None
):
    """A hung member's generation is aborted at its kill; its peer reports; the plan waits for the
    exit. On the tick that sees the exit the plan comes before that tick's heartbeat read (at 2,000
    hosts that read is most of a tick)."""
    job = Job(workers=2, spares=1)
    job.steady(committed=4)
    job.beating.discard("w1")  # stopped
    job.tick_until(job.clock.now + job.config.recovery.hang_timeout_s + 2 * DT)
    assert job.kills() == {"w1": 1} and job.store.get(keys.abort(0)) == "1"
    job["w0"].recover()
    job.tick(3)  # the SIGKILL is pending: no plan
    assert job.plan(1) is None
    planned_before_read: list[bool] = []
    read = job.coord.heartbeats.read

    def spy(now: float) -> Any:
        planned_before_read.append(job.plan(1) is not None)
        return read(now)

    job.coord.heartbeats.read = spy  # type: ignore[method-assign]
    job.exit("w1", -9)
    job.tick()
    assert planned_before_read == [True]
    plan = job.plan(1)
    assert plan is not None and plan.members[1] == "s0" and plan.resume_step == 5


def test_the_error_several_lost_ranks_ended_with_leads() -> None:
    from checkpointless.control.detection import same_error

    same = "[rank0]: KeyError: 'val_loss'"
    gloo = "[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    assert same_error({0: same, 1: "[rank1]: KeyError: 'val_loss'"}) == ("KeyError: 'val_loss'", [0, 1])
    # a peer that died of the others' deaths does not count against the error the rest raised
    assert same_error({0: same, 1: gloo, 2: "KeyError: 'val_loss'"}) == ("KeyError: 'val_loss'", [0, 2])
    assert same_error({0: same, 1: gloo}) is None  # one rank alone raised: a fault of its own
    assert same_error({0: same, 1: "[rank1]: ValueError: x"}) is None
    assert same_error({0: "", 1: "  "}) is None


# == never-wait: the survivors shrink, a ready spare follows, then joins once caught up =============


def test_never_wait_shrinks_names_a_follower_then_grows_it_back_once_caught_up() -> None:
    job = Job(workers=3, spares=1, min_workers=2, never_wait=True)
    job.steady(committed=4)
    job.exit("w1", -9)
    job["w0"].recover()
    job["w2"].recover()
    job.tick()
    plan = job.plan(1)
    assert plan is not None and plan.members == {0: "w0", 1: "w2"} and plan.sources == {}  # a shrink
    assert plan.followers == {"s0": 1}  # the ready spare follows a holder (the highest rank)
    assert job.store.get(keys.assign("s0")) == "1"
    assert [(e["target"], e["rank"], e["step"]) for e in job.kinds("catch_up_started")] == [("s0", 1, 4)]
    job["w0"].enter(0, 1, 4)
    job["w2"].enter(1, 1, 4)
    job["s0"].heartbeat(phase="following", applied=-1)
    job["w0"].commit(5, 0.5)
    job["w2"].commit(5, 0.5)
    job.tick()
    assert job.kinds("recovery_done") and job.store.get(keys.abort(1)) is None  # behind: no change yet
    job["s0"].heartbeat(applied=3)
    job.tick(4)
    assert job.store.get(keys.abort(1)) is None  # two steps behind still
    job["s0"].heartbeat(applied=4)
    job.tick()
    # caught up: a planned grow (the members finish the step in flight first)
    assert job.store.get(keys.planned(1)) == "1" and job.store.get(keys.abort(1)) == "1"
    (started,) = job.kinds("resize_started")
    assert (started["before"], started["replicas"], started["why"]) == (2, 3, "catch_up")
    job["w0"].recover("planned")
    job["w2"].recover("planned")
    job.tick()
    grown = job.plan(2)
    assert grown is not None and grown.members == {0: "w0", 1: "w2", 2: "s0"}
    assert grown.caught_up == [2] and grown.sources == {2: 1} and grown.followers == {}
    assert job.store.get(keys.assign("s0")) == "2"


@pytest.mark.parametrize("second", ["catches_up", "lags"])
def test_never_wait_grows_with_every_follower_in_one_join_or_after_a_grace_with_those_caught_up(
    second: str,
) -> None:
    """Two hosts' worth of followers: the first to catch up waits (up to two committed steps) for
    the other, so that one join stops the members once; a follower still behind after that is left
    out (it follows again later)."""
    job = Job(workers=4, spares=2, min_workers=2, never_wait=True)
    job.steady(committed=4)
    job.exit("w2", -9)
    job.exit("w3", -9)
    job["w0"].recover()
    job["w1"].recover()
    job.tick()
    plan = job.plan(1)
    assert plan is not None and plan.members == {0: "w0", 1: "w1"} and set(plan.followers) == {"s0", "s1"}
    for r in (0, 1):
        job[f"w{r}"].enter(r, 1, 4)
        job[f"w{r}"].commit(5, 0.5)
    job["s0"].heartbeat(phase="following", applied=5)
    job["s1"].heartbeat(phase="following", applied=2)
    job.tick(4)
    assert job.store.get(keys.abort(1)) is None  # s0 caught up, s1 close: one join for both
    if second == "catches_up":
        job["s1"].heartbeat(applied=5)
        job.tick()
        (started,) = job.kinds("resize_started")
        assert (started["before"], started["replicas"]) == (2, 4)
        return
    for step in (6, 7):
        for r in (0, 1):
            job[f"w{r}"].commit(step, 0.5)
        job["s0"].heartbeat(applied=step)
        job.tick()
    (started,) = job.kinds("resize_started")  # two steps later: s0 alone
    assert (started["before"], started["replicas"]) == (2, 3)


def test_never_wait_hands_a_rank_with_notice_to_the_others_and_the_ready_spare_follows() -> None:
    """Under never-wait a notice is a planned shrink even with a spare ready (no transfer to wait
    for): the leaving rank is dropped, the spare follows a holder; without it the spare would take
    the rank (``test_preempt``)."""
    job = Job(workers=3, spares=1, min_workers=2, never_wait=True)
    job.steady(committed=4)
    job["w1"].heartbeat(leaving=1)
    job.tick(3)
    assert job.store.get(keys.planned(0)) == "1" and job.store.get(keys.abort(0)) == "1"
    for proc in ("w0", "w1", "w2"):
        job[proc].recover("planned")
    job.tick()
    plan = job.plan(1)
    assert plan is not None and plan.members == {0: "w0", 1: "w2"} and plan.sources == {}
    assert plan.replaced == {} and "w1" in plan.dropped and plan.followers == {"s0": 1}
    assert [(e["before"], e["replicas"], e["why"]) for e in job.kinds("resized")] == [(3, 2, "handoff")]


def test_never_wait_with_no_spare_ready_shrinks_and_follows_once_capacity_beyond_the_reserve_is_ready() -> (
    None
):
    job = Job(workers=3, spares=1, min_workers=2, never_wait=True, resize_interval_s=1.0)
    job.steady(committed=4, spares_ready=False)
    job.exit("w1", -9)
    job["w0"].recover()
    job["w2"].recover()
    job.tick()
    plan = job.plan(1)
    assert plan is not None and plan.world_size == 2 and plan.followers == {}
    job["w0"].enter(0, 1, 4)
    job["w2"].enter(1, 1, 4)
    job["w0"].commit(5, 0.5)
    job["w2"].commit(5, 0.5)
    job["s0"].ready_spare()
    job.tick(8)
    assert job.kinds("resize_started") == []  # the one ready spare is the reserve for faults
    assert [name for name, _ in job.spawned] == ["s1"]  # the pool tops up for the replica it lacks
    job["s1"].ready_spare()
    job.tick(2)
    # capacity beyond the reserve: a planned change of the same size names a follower
    (started,) = job.kinds("resize_started")
    assert (started["replicas"], started["why"]) == (2, "follow")
    job["w0"].recover("planned")
    job["w2"].recover("planned")
    job.tick()
    follow = job.plan(2)
    assert follow is not None and follow.world_size == 2 and follow.grown == []
    assert len(follow.followers) == 1 and set(follow.followers.values()) == {1}
