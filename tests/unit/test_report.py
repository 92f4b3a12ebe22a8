"""report.json from an event log: the definitions, on hand-made events."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
from rich.console import Console

from checkpointless.fault_grammar import parse_faults
from checkpointless.faults import unfired
from checkpointless.observe.console import count_faults, stderr_console, summary_table
from checkpointless.observe.fault_list import derive_faults, signal_name
from checkpointless.observe.live_metrics import MetricsFeed
from checkpointless.observe.metrics import JobMetrics
from checkpointless.observe.report import build_report

pytestmark = pytest.mark.timeout(30)

Event = dict[str, Any]


def commit(t: float, rank: int, step: int, gen: int = 0) -> dict:  # type: ignore[type-arg]
    return {"t": t, "kind": "step_committed", "rank": rank, "step": step, "gen": gen, "step_time_s": 0.1}


def test_kill_fault_figures() -> None:
    events = [commit(1.0 + 0.1 * s, r, s) for s in range(5) for r in (0, 1)]
    events += [
        {
            "t": 1.45,
            "kind": "fault_injected",
            "proc": "w1",
            "rank": 1,
            "gen": 0,
            "step": 5,
            "fault": "kill",
            "ranks": [1],
            "index": 0,
        },
        {"t": 1.5, "kind": "fault_detected", "proc": "w0", "rank": 0, "reason": "collective_error"},
        {"t": 1.55, "kind": "fault_detected", "proc": "coordinator", "rank": 1, "gen": 0},
        {"t": 1.6, "kind": "spare_assigned", "rank": 1, "target": "s0"},
    ]
    events[-2].update(reason="process_exit", target="w1", exitcode=-9)
    events += [commit(2.4 + 0.1 * (s - 5), r, s, gen=1) for s in range(5, 10) for r in (0, 1)]
    events.sort(key=lambda e: e["t"])
    report = build_report(events, total_steps=10, digest="ab")
    assert report["steps_completed"] == 10
    assert report["step_time_s"] == pytest.approx(0.1)
    (f,) = report["faults"]
    assert f["detection_s"] == pytest.approx(0.05)  # the first sign: the peer's collective error
    assert f["stall_s"] == pytest.approx(2.4 - 1.4 - 0.1)  # last commit before, first after, minus a step
    assert f["lost_steps"] == 0 and f["replaced_by"] == "s0"
    assert f["injected"] is True and f["cause"] == "process_exit" and f["signal"] == "SIGKILL"
    assert f["spec"] == "kill:rank=1@step=5"
    assert 0 < report["goodput"] < 1


def test_redone_steps_are_counted_as_lost() -> None:
    events = [commit(1.0 + 0.1 * s, 0, s) for s in range(6)]
    events.append({"t": 1.55, "kind": "fault_injected", "rank": 1, "step": 6, "fault": "kill", "ranks": [1]})
    events += [
        commit(3.0 + 0.1 * i, 0, s, gen=1) for i, s in enumerate(range(4, 8))
    ]  # resumed at 4: 4, 5 redone
    report = build_report(sorted(events, key=lambda e: e["t"]), total_steps=8, digest=None)
    (f,) = report["faults"]  # injected but never detected: still listed, without a cause
    assert f["lost_steps"] == 2 and f["cause"] is None and f["injected"] is True


def test_multi_rank_fault_is_one_fault() -> None:
    inj = {"kind": "fault_injected", "step": 3, "fault": "kill", "ranks": [0, 2], "index": 0}
    events = [{**inj, "t": 1.0, "rank": 0}, {**inj, "t": 1.01, "rank": 2}]
    assert len(build_report(events, total_steps=5, digest=None)["faults"]) == 1


def test_signal_name() -> None:
    assert signal_name(-9) == "SIGKILL" and signal_name(-11) == "SIGSEGV"
    assert signal_name(0) is None and signal_name(1) is None and signal_name(None) is None


# ---------------------------------------------------------------------------- hand-made runs


class Run:
    """Builds the events a job writes, in the launcher's, coordinator's and workers' words."""

    def __init__(self, workers: int = 2, spares: int = 1, faults: tuple[str, ...] = ()) -> None:
        self.events: list[Event] = []
        self.t, self.gen, self.step = 100.0, 0, 0
        self.members = {r: f"w{r}" for r in range(workers)}
        self.spares = [f"s{i}" for i in range(spares)]
        self.ev("job_started", proc="launcher", workers=workers, spares=spares, faults=list(faults))
        self.ev("generation_started", members=dict(self.members), resume_step=0)

    def ev(self, kind: str, proc: str = "coordinator", **fields: Any) -> Event:
        e: Event = {"t": round(self.t, 6), "kind": kind, "proc": proc, "rank": None, "gen": self.gen}
        e["step"] = None
        e.update(fields)
        self.events.append(e)
        self.t += 0.001
        return e

    def train(self, n: int) -> Run:
        for _ in range(n):
            self.t += 0.1
            for rank, proc in sorted(self.members.items()):
                self.ev("step_committed", proc=proc, rank=rank, step=self.step, step_time_s=0.1)
            self.step += 1
        return self

    def wait(self, seconds: float) -> Run:
        self.t += seconds
        return self

    def inject(self, index: int, fault: str, ranks: list[int], target: str = "step") -> Run:
        for r in ranks:
            self.ev("fault_injected", proc=self.members[r], rank=r, step=self.step, index=index,
                    fault=fault, ranks=ranks, target=target)  # fmt: skip
        return self

    def exit(self, proc: str, exitcode: int, reason: str = "process_exit", **fields: Any) -> Run:
        rank = next((r for r, p in self.members.items() if p == proc), None)
        role = "worker" if rank is not None else "spare"
        self.ev("process_exited", rank=rank, target=proc, role=role, exitcode=exitcode)
        if rank is not None or reason != "process_exit":
            self.ev("fault_detected", rank=rank, reason=reason, target=proc, role=role, exitcode=exitcode,
                    **fields)  # fmt: skip
        return self

    def hang_detected(self, proc: str, reason: str = "heartbeat_timeout") -> Run:
        rank = next(r for r, p in self.members.items() if p == proc)
        self.ev("fault_detected", rank=rank, reason=reason, target=proc, silent_s=2.0)
        return self.exit(proc, -9)

    def raised(self, rank: int, error: str = "boom") -> Run:
        self.ev("fault_detected", proc=self.members[rank], rank=rank, step=self.step, reason="exception",
                error=error)  # fmt: skip
        return self

    def peers_fail(self, failed: list[int], reason: str = "exception") -> Run:
        """The healthy ranks see a collective error; the coordinator collects the reports."""
        for r, p in sorted(self.members.items()):
            if r not in failed:
                self.ev("fault_detected", proc=p, rank=r, step=self.step, reason="collective_error")
        for r in sorted(self.members):
            if r not in failed or reason == "exception":
                self.ev("failure_reported", rank=r, reason=reason if r in failed else "collective_error",
                        committed=self.step - 1)  # fmt: skip
        return self

    def recover(self, replace: list[int]) -> Run:
        self.gen += 1
        replaced = {}
        for r in replace:
            replaced[r], self.members[r] = self.members[r], self.spares.pop(0)
        self.ev("generation_started", members=dict(self.members), resume_step=self.step, replaced=replaced)
        for r in replace:
            self.ev("spare_assigned", rank=r, target=self.members[r], replaces=replaced[r])
        self.wait(0.3).ev("recovery_done", step=self.step, seconds=0.3)
        return self

    def finish(self, ok: bool = True) -> list[Event]:
        self.ev("job_finished", proc="launcher" if not ok else "coordinator", ok=ok)
        return sorted(self.events, key=lambda e: e["t"])


def manual_kill(exitcode: int) -> Callable[[], list[Event]]:
    def build() -> list[Event]:
        run = Run().train(5)
        run.wait(0.05).exit("w1", exitcode).peers_fail([1], reason="process_exit")
        return run.recover([1]).train(5).finish()

    return build


def start_failure() -> list[Event]:
    run = Run(spares=0)
    run.exit("w1", 1, reason="start_failure", log_tail="Traceback ...\nImportError: no module named foo")
    return run.finish(ok=False)


def start_timeout() -> list[Event]:
    run = Run(spares=1)
    run.wait(60.0).ev(
        "fault_detected", rank=1, reason="start_timeout", target="w1", role="worker", silent_s=60.0
    )
    run.exit("w1", -9).peers_fail([1], reason="process_exit")
    return run.recover([1]).train(3).finish()


def injected_hang() -> list[Event]:
    run = Run(faults=("hang:rank=1@step=5",)).train(5).inject(0, "hang", [1])
    run.wait(2.0).hang_detected("w1").peers_fail([1], reason="process_exit")
    return run.recover([1]).train(5).finish()


def injected_stuck() -> list[Event]:
    run = Run().train(5)
    run.wait(3.0).hang_detected("w1", reason="no_progress").peers_fail([1], reason="process_exit")
    return run.recover([1]).train(5).finish()


def injected_exception_in_place() -> list[Event]:
    run = Run(faults=("exception:rank=1@step=5",)).train(5).inject(0, "exception", [1])
    run.raised(1, "injected fault").peers_fail([1])
    return run.recover([]).train(5).finish()


def exception_never_recovered() -> list[Event]:
    run = Run().train(5).raised(1, "CUDA error: an illegal memory access").peers_fail([1])
    return run.wait(1.0).finish(ok=False)


def two_rank_kill_then_one() -> list[Event]:
    run = Run(workers=3, spares=3, faults=("kill:rank=0,2@step=3", "kill:rank=0@step=6")).train(3)
    run.inject(0, "kill", [0, 2]).wait(0.05).exit("w0", -9).exit("w2", -9).peers_fail([0, 2], "process_exit")
    run.recover([0, 2]).train(3)
    run.inject(1, "kill", [0]).wait(0.05).exit("s0", -9).peers_fail([0], "process_exit")
    return run.recover([0]).train(3).finish()


def two_workers_killed_together() -> list[Event]:
    run = Run(workers=3, spares=2).train(3)
    run.wait(0.05).exit("w2", -9).exit("w0", -9).peers_fail([0, 2], "process_exit")
    run.recover([0, 2]).train(2)
    run.exit("s1", -9).peers_fail([2], "process_exit")  # the next generation: another fault
    return run.recover([]).finish(ok=False)


def spare_died(with_detection: bool) -> Callable[[], list[Event]]:
    def build() -> list[Event]:
        run = Run(spares=2).train(3)
        run.ev("process_exited", target="s0", role="spare", exitcode=-9)
        if with_detection:  # the coordinator may also report it as a fault_detected
            run.ev("fault_detected", reason="process_exit", target="s0", role="spare", exitcode=-9)
        return run.train(3).finish()

    return build


def host_lost(injected: bool) -> Callable[[], list[Event]]:
    """Host 1 (ranks 2, 3) dies whole: its ranks fall silent, then the host is lost; the coordinator
    then sees both processes gone. One fault, the host's, whether injected or not."""

    def build() -> list[Event]:
        run = Run(workers=4, spares=2, faults=("kill:node=1@step=3",) if injected else ()).train(3)
        if injected:
            run.inject(0, "kill", [2, 3], target="node")
        run.wait(0.05).peers_fail([2, 3], "process_exit")
        run.ev("fault_detected", rank=2, reason="heartbeat_timeout", target="w2", silent_s=2.0)
        run.ev("host_lost", host="host1", node=1, silent_s=2.0, procs=["w2", "w3"], why="no answer")
        for proc in ("w2", "w3"):
            run.ev("fault_detected", rank=int(proc[1]), reason="process_exit", target=proc, role="worker")
        return run.recover([2, 3]).train(3).finish()

    return build


CASES: list[tuple[str, Callable[[], list[Event]], list[dict[str, Any]]]] = [
    (
        "a host lost whole (not injected): one fault of kind node",
        host_lost(False),
        [{"kind": "node", "cause": "host_lost", "injected": False, "ranks": [2, 3], "proc": "w2,w3",
          "replaced_by": "s0,s1"}],
    ),
    (
        "an injected kill:node: one fault, the host's cause",
        host_lost(True),
        [{"kind": "kill", "cause": "host_lost", "injected": True, "ranks": [2, 3], "replaced_by": "s0,s1"}],
    ),
    (
        "manual SIGKILL",
        manual_kill(-9),
        [{"kind": "crash", "cause": "process_exit", "injected": False, "spec": None, "exitcode": -9,
          "signal": "SIGKILL", "ranks": [1], "proc": "w1", "role": "worker", "step": 5, "target": "step",
          "detection_s": None, "replaced_by": "s0", "lost_steps": 0}],
    ),
    (
        "segfault",
        manual_kill(-11),
        [{"kind": "crash", "cause": "process_exit", "injected": False, "exitcode": -11, "signal": "SIGSEGV",
          "replaced_by": "s0"}],
    ),
    (
        "crash at start-up",
        start_failure,
        [{"kind": "start_failure", "cause": "start_failure", "injected": False, "exitcode": 1,
          "signal": None, "ranks": [1], "proc": "w1", "step": None, "replaced_by": None}],
    ),
    (
        "never joined: killed after the start timeout (one fault)",
        start_timeout,
        [{"kind": "start_failure", "cause": "start_timeout", "injected": False, "exitcode": None,
          "ranks": [1], "proc": "w1", "replaced_by": "s0"}],
    ),
    (
        "injected hang: one fault, not a hang and a crash",
        injected_hang,
        [{"kind": "hang", "cause": "heartbeat_timeout", "injected": True, "spec": "hang:rank=1@step=5",
          "ranks": [1], "step": 5, "proc": "w1", "exitcode": None, "signal": None, "replaced_by": "s0"}],
    ),
    (
        "stuck with a live heartbeat",
        injected_stuck,
        [{"kind": "stuck", "cause": "no_progress", "injected": False, "ranks": [1], "replaced_by": "s0"}],
    ),
    (
        "injected exception recovered in place",
        injected_exception_in_place,
        [{"kind": "exception", "cause": "exception", "injected": True, "spec": "exception:rank=1@step=5",
          "ranks": [1], "step": 5, "proc": "w1", "replaced_by": "in-place", "detection_s": 0.001}],
    ),
    (
        "exception that never recovered",
        exception_never_recovered,
        [{"kind": "exception", "cause": "exception", "injected": False, "ranks": [1], "step": 5,
          "replaced_by": None, "error": "CUDA error: an illegal memory access"}],
    ),
    (
        "two-rank kill, then a single kill",
        two_rank_kill_then_one,
        [{"kind": "kill", "injected": True, "spec": "kill:rank=0,2@step=3", "ranks": [0, 2], "step": 3,
          "proc": "w0,w2", "replaced_by": "s0,s1", "signal": "SIGKILL"},
         {"kind": "kill", "injected": True, "spec": "kill:rank=0@step=6", "ranks": [0], "step": 6,
          "proc": "s0", "replaced_by": "s2"}],
    ),
    (
        "two workers killed together (no injection), then another",
        two_workers_killed_together,
        [{"kind": "crash", "injected": False, "ranks": [0, 2], "proc": "w0,w2", "replaced_by": "s0,s1"},
         {"kind": "crash", "injected": False, "ranks": [2], "proc": "s1", "replaced_by": None}],
    ),
    (
        "a spare died in the pool",
        spare_died(False),
        [{"kind": "crash", "cause": "process_exit", "role": "spare", "ranks": [], "proc": "s0",
          "signal": "SIGKILL", "replaced_by": None, "stall_s": 0.0, "lost_steps": 0}],
    ),
    (
        "a spare died in the pool (with a fault_detected)",
        spare_died(True),
        [{"kind": "crash", "cause": "process_exit", "role": "spare", "ranks": [], "proc": "s0"}],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("build", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_faults_from_detections(build: Callable[[], list[Event]], expected: list[dict[str, Any]]) -> None:
    faults = build_report(build(), total_steps=10, digest=None)["faults"]
    assert len(faults) == len(expected), faults
    for got, want in zip(faults, expected, strict=True):
        for key, value in want.items():
            assert got[key] == (pytest.approx(value) if isinstance(value, float) else value), (key, got)
    assert [f["t"] for f in faults] == sorted(f["t"] for f in faults)


def test_injected_detection_time_is_injection_to_detection() -> None:
    (f,) = build_report(injected_hang(), total_steps=10, digest=None)["faults"]
    assert f["detection_s"] == pytest.approx(2.0, abs=0.01)


def test_real_fault_step_during_recovery_is_marked() -> None:
    run = Run(spares=2).train(3).exit("w1", -9).peers_fail([1], "process_exit")
    run.gen += 1
    run.members[1] = "s0"
    run.ev("generation_started", members=dict(run.members), resume_step=3)
    run.ev("spare_assigned", rank=1, target="s0", replaces="w1")
    run.exit("s0", -9)  # dies while receiving state: a second fault, replaced by the next spare
    run.gen += 1
    run.members[1] = "s1"
    run.ev("generation_started", members=dict(run.members), resume_step=3)
    run.ev("spare_assigned", rank=1, target="s1", replaces="s0")
    run.ev("recovery_done", step=3, seconds=0.5)
    faults = build_report(run.train(2).finish(), total_steps=5, digest=None)["faults"]
    assert [(f["proc"], f["target"], f["replaced_by"]) for f in faults] == [
        ("w1", "step", "s0"),
        ("s0", "recovery", "s1"),
    ]


def test_a_real_crash_whose_last_commits_were_lost_is_placed_by_its_peers_commits() -> None:
    """Rank 1 killed outright after committing steps 0-7, its heartbeat thread having shipped only
    0-4: its peers' commits in its generation place the fault at step 8, not 5."""
    run = Run(spares=1).train(8)
    run.events = [e for e in run.events if not (e["kind"] == "step_committed" and e["rank"] == 1
                                                 and e["step"] >= 5)]  # fmt: skip
    run.exit("w1", -9).peers_fail([1], "process_exit")
    (f,) = build_report(run.finish(), total_steps=8, digest=None)["faults"]
    assert (f["kind"], f["ranks"], f["step"]) == ("crash", [1], 8), f


# ---------------------------------------------------------------------------- one list for everyone


def _mixed_run() -> list[Event]:
    """A two-rank injected kill, an injected hang, a manual segfault, an exception, a dead spare."""
    run = Run(workers=3, spares=5, faults=("kill:rank=0,2@step=3", "hang:rank=1@step=5")).train(3)
    run.inject(0, "kill", [0, 2]).wait(0.05).exit("w0", -9).exit("w2", -9).peers_fail([0, 2], "process_exit")
    run.recover([0, 2]).train(2)
    run.inject(1, "hang", [1]).wait(2.0).hang_detected("w1").peers_fail([1], "process_exit")
    run.recover([1]).train(2)
    run.exit("s1", -11).peers_fail([2], "process_exit").recover([2]).train(1)
    run.raised(0).peers_fail([0]).recover([]).train(1)
    run.ev("process_exited", target="s4", role="spare", exitcode=-9)
    return run.train(2).finish()


def _fault_samples(m: JobMetrics) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for fam in m.registry.collect():
        for s in fam.samples:
            if s.name == "checkpointless_faults_total":
                out[(s.labels["kind"], s.labels["cause"])] = s.value
    return out


def test_console_report_and_metrics_agree() -> None:
    events = _mixed_run()
    faults = build_report(events, total_steps=10, digest=None)["faults"]
    assert [(f["kind"], f["cause"], f["injected"]) for f in faults] == [
        ("kill", "process_exit", True),
        ("hang", "heartbeat_timeout", True),
        ("crash", "process_exit", False),
        ("exception", "exception", False),
        ("crash", "process_exit", False),
    ]
    assert [f["replaced_by"] for f in faults] == ["s0,s1", "s2", "s3", "in-place", None]
    assert count_faults(events) == len(faults) == len(derive_faults(events))

    # the Prometheus feed, fed the events one by one as they arrive: a fault counts once detected,
    # by what was detected, and one hang counts once
    live: list[Event] = []
    metrics = JobMetrics(port=0)
    feed = MetricsFeed(metrics, live)
    for e in events:
        live.append(e)
        feed.add(e)
        feed.feed_events()
        detected = [f for f in derive_faults(live) if f.cause is not None]
        assert sum(_fault_samples(metrics).values()) == len(detected)
    counted = _fault_samples(metrics)
    assert sum(counted.values()) == len(faults)
    assert counted[("hang", "heartbeat_timeout")] == 1
    assert counted[("crash", "process_exit")] == 3  # the injected kill, the segfault, the dead spare
    assert ("crash", "heartbeat_timeout") not in counted


def test_live_view_counts_the_same_faults() -> None:
    """While a job runs the launcher holds only its and the coordinator's events: same count."""
    events = _mixed_run()
    live = [e for e in events if e["proc"] in ("launcher", "coordinator")]
    assert count_faults(live) == count_faults(events) == 5
    metrics = JobMetrics(port=0)
    feed = MetricsFeed(metrics, live)
    for e in live:
        feed.add(e)
    feed.feed_events()
    feed.feed_events()  # nothing new: nothing counted twice
    assert sum(_fault_samples(metrics).values()) == 5


def test_goodput_never_exceeds_one_when_the_median_step_is_longer_than_the_mean() -> None:
    """Fast first steps, then slower ones: steps x median step time can exceed the wall time."""
    times = [0.0, 0.01, 0.02, 0.03, 0.23, 0.43, 0.63]  # gaps 0.01 x3, then 0.2 x3: median 0.2 > mean
    events = [
        {"t": 1.0 + t, "kind": "step_committed", "rank": 0, "step": s, "gen": 0, "step_time_s": 0.01}
        for s, t in enumerate(times)
    ]
    report = build_report(events, total_steps=len(times), digest=None)
    assert 0 < report["goodput"] <= 1.0


def test_durable_summary_counts_a_snapshot_complete_only_when_every_shard_wrote_it() -> None:
    def ev(kind: str, step: int, shard: int, **f: Any) -> dict[str, Any]:
        return {
            "t": float(step),
            "kind": kind,
            "proc": f"w{shard}",
            "rank": shard,
            "step": step,
            "shard": shard,
            **f,
        }

    events = [
        ev("durable_saved", 4, 0), ev("durable_saved", 4, 1),
        ev("durable_written", 4, 0, seconds=0.2, bytes=10), ev("durable_written", 4, 1, seconds=0.4, bytes=10),
        ev("durable_saved", 9, 0), ev("durable_saved", 9, 1),
        ev("durable_written", 9, 0, seconds=0.3, bytes=10),  # shard 1's write of step 9 failed
        ev("durable_failed", 9, 1, error="OSError: [Errno 28] No space left on device"),
        ev("durable_skipped", 14, 0),
    ]  # fmt: skip
    tier = build_report(events, total_steps=20, digest=None)["durable"]
    assert tier == {
        "started": 4, "written": 3, "failed": 1, "skipped": 1, "newest_complete_step": 4,
        "write_s_median": 0.3, "last_error": "OSError: [Errno 28] No space left on device",
    }  # fmt: skip
    assert build_report([], total_steps=1, digest=None)["durable"] is None  # no tier, no section


# ---------------------------------------------------------------------------- the console's fault table


def _table_text(report: dict[str, Any], width: int = 400) -> str:
    out = io.StringIO()
    Console(file=out, width=width).print(summary_table(report))
    return out.getvalue()


def _kind_cells(report: dict[str, Any]) -> list[str]:
    """The first column of the fault table, one cell per fault."""
    rows = [ln for ln in _table_text(report).splitlines() if ln.startswith("│")]
    return [row.split("│")[1].strip() for row in rows]


def test_fault_table_says_whose_fault_it_was() -> None:
    """A worker's hang detected while a recovery was under way is not a spare's; spares, and the
    survivor killed as it sent state, are named."""
    run = Run(spares=4, faults=("kill:spare@join", "kill:source@recovery")).train(3)
    run.exit("w1", -11).peers_fail([1], "process_exit")  # a real crash of w1
    run.gen += 1
    run.members[1] = run.spares.pop(0)
    run.ev("generation_started", members=dict(run.members), resume_step=3, replaced={1: "w1"})
    run.ev("spare_assigned", rank=1, target="s0", replaces="w1")
    run.hang_detected("w0")  # ... and w0 hangs while s0 receives the state: a worker's hang
    run.peers_fail([0], "process_exit").recover([0]).train(2)
    run.inject(0, "kill", [1], target="join").exit("s0", -9).peers_fail([1], "process_exit")
    run.recover([1]).train(1)
    run.inject(1, "kill", [0], target="source").exit("s1", -9).peers_fail([0], "process_exit")
    run.ev("process_exited", target="s9", role="spare", exitcode=-9)  # a spare lost from the pool
    report = build_report(run.recover([0]).train(1).finish(), total_steps=8, digest=None)
    assert [(f["kind"], f["role"], f["target"]) for f in report["faults"]] == [
        ("crash", "worker", "step"),
        ("hang", "worker", "recovery"),
        ("kill", "worker", "join"),
        ("kill", "worker", "source"),
        ("crash", "spare", "step"),
    ]
    assert _kind_cells(report) == [
        "crash",
        "hang (in recovery)",
        "kill (spare)",
        "kill (source)",
        "crash (spare)",
    ]


def test_fault_table_is_not_cut_without_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Piped into a file or a CI log, the CLI's console used rich's 80 columns: ``dete…``, ``repla…``,
    specs cut. Without a terminal (and without COLUMNS) nothing is cut now."""
    monkeypatch.delenv("COLUMNS", raising=False)
    report = build_report(_mixed_run(), total_steps=10, digest=None)
    console = stderr_console()
    assert not console.is_terminal  # pytest's captured stderr
    console.print(summary_table(report))
    err = capsys.readouterr().err
    assert "…" not in err, err
    header = next(ln for ln in err.splitlines() if "kind" in ln)
    for name in ("detection s", "stall s", "lost steps", "replaced by"):
        assert name in header, header
    assert "kill:rank=0,2@step=3" in err and "process_exit (SIGSEGV)" in err, err
    # a terminal's width (or COLUMNS) is still the user's
    monkeypatch.setenv("COLUMNS", "100")
    assert stderr_console().width == 100


def test_unfired_faults_are_named() -> None:
    """A fault that never fired (the script ran fewer steps than --steps) is named, in schedule
    order; one naming two ranks fired only if it fired in both."""
    specs = ["kill:rank=1@step=3", "hang:rank=0,1@step=5", "kill:spare@recovery", "exception:rank=0@step=40"]
    run = Run(spares=2, faults=tuple(specs)).train(3).inject(0, "kill", [1])
    run.exit("w1", -9).peers_fail([1], "process_exit").recover([1]).train(2)
    run.inject(1, "hang", [0])  # rank 1 never got there
    events = run.finish()
    assert unfired(parse_faults(specs), events) == specs[1:]
    run = Run(spares=2, faults=tuple(specs)).train(3).inject(0, "kill", [1])
    run.inject(2, "kill", [1], target="recovery").inject(1, "hang", [0, 1]).inject(3, "exception", [0])
    assert unfired(parse_faults(specs), run.finish()) == []


def test_loss_and_replicas_by_step_weigh_each_rank_by_its_shares_in_the_generation_that_committed() -> None:
    """Step 1 failed in generation 0 (rank 1's commit of it is not the step's: generation 1 committed
    it again) and was committed by two replicas, one of which computed two shares; step 2's commits
    came packed from a host; step 3 logged no loss."""
    from checkpointless.observe.report import by_step

    def commit(step: int, rank: int, gen: int, **fields: Any) -> dict[str, Any]:
        return {"kind": "step_committed", "t": float(step), "step": step, "rank": rank, "gen": gen, **fields}

    events = [
        commit(0, 0, 0, loss=1.0), commit(0, 1, 0, loss=3.0), commit(0, 2, 0, loss=5.0),
        commit(1, 1, 0, loss=100.0),
        commit(1, 0, 1, loss=2.0, share_count=2), commit(1, 1, 1, loss=8.0),
        {"kind": "steps_committed", "t": 2.0, "step": 2, "gen": 1, "host": "h0",
         "ranks": [{"rank": 0, "dt": 0.0, "loss": 1.0, "share_count": 2}, {"rank": 1, "dt": 0.01, "loss": 4.0}]},
        commit(3, 0, 1), commit(3, 1, 1),
    ]  # fmt: skip
    losses, replicas = by_step(events)
    assert replicas == {"0": 3, "1": 2, "2": 2, "3": 2}
    assert losses == {"0": 3.0, "1": 4.0, "2": 2.0}


def test_a_spare_that_left_on_a_notice_is_no_fault_one_that_died_is() -> None:
    """A host drained: its spares exit with status 0 or by SIGTERM (no rank to hand over): not a
    fault. A spare killed is one."""
    base = [
        {
            "t": 0.0,
            "kind": "job_started",
            "proc": "launcher",
            "rank": None,
            "gen": 0,
            "workers": 2,
            "spares": 2,
        }
    ]
    left = {"t": 1.0, "kind": "process_exited", "proc": "coordinator", "rank": None, "gen": 0, "target": "s0",
            "role": "spare", "exitcode": 0, "joined": True}  # fmt: skip
    termed = {**left, "t": 1.5, "target": "s2", "exitcode": -15}
    died = {**left, "t": 2.0, "target": "s1", "exitcode": -9}
    faults = derive_faults([*base, left, termed, died])
    assert [(f.proc, f.exitcode) for f in faults] == [("s1", -9)]
