"""``--never-wait``: a lost worker's shares go to the survivors at once (no transfer to wait for), a
ready spare catches up in the background (a copy of the state, then what the optimizer was given at
every step since) and takes shares back once it has: the run stays the fault-free run, bit for bit
with the exact sum."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from checkpointless.launch.launcher import Launcher
from tests.integration.test_exact_resize import STEPS, _bitwise, _command
from tests.integration.test_shares import SCRIPT
from tests.jobs import kill_while_starting, logs_of, run_job

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``reference(workers, steps)``: the fault-free run of that size, made once."""
    made: dict[tuple[int, int, tuple[str, ...]], Path] = {}

    def get(workers: int, steps: int, *extra: str) -> Path:
        if (workers, steps, extra) not in made:
            out = tmp_path_factory.mktemp(f"ref{workers}x{steps}")
            result = run_job(workers=workers, spares=0, steps=steps, exact_resize=True,
                             command=[sys.executable, SCRIPT, str(steps), str(out), *extra])  # fmt: skip
            assert result.ok, f"{result.error}\n{logs_of(result)}"
            made[workers, steps, extra] = out
        return made[workers, steps, extra]

    return get


def _kinds(result: Any, *kinds: str) -> list[dict[str, Any]]:
    return [e for e in result.events if e["kind"] in kinds]


def test_a_kill_shrinks_at_once_and_the_spare_catches_up_then_joins(tmp_path: Path, reference: Any) -> None:
    result = run_job(workers=4, spares=1, min_workers=2, steps=STEPS, exact_resize=True, never_wait=True,
                     faults=["kill:rank=1@step=3"], command=_command(tmp_path / "e", "--pause", "0.3"))  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _bitwise(reference(4, STEPS), tmp_path / "e")
    sizes = [(e["before"], e["replicas"], e["why"]) for e in _kinds(result, "resized")]
    assert sizes == [(4, 3, "lost"), (3, 4, "catch_up")], sizes
    started = _kinds(result, "catch_up_started")
    assert len(started) == 1, started
    sent = _kinds(result, "catch_up_sent")
    assert len(sent) == 1 and sent[0]["bytes"] > 0, sent
    ended = _kinds(result, "catch_up_ended")
    assert [e["ok"] for e in ended] == [True], ended  # the light join: the digests matched
    (summary,) = result.report["catch_ups"]
    assert summary["ok"] is True and summary["target"] == started[0]["target"] and summary["bytes"] > 0, (
        summary
    )
    assert summary["from_step"] == 2 and summary["seconds"] > 0, summary
    # the recovery of the kill moved no state: nobody received anything in it
    first = next(e for e in _kinds(result, "generation_started") if e["gen"] == 1)
    assert first["sources"] == {} and first["replaced"] == {}, first
    assert result.report["steps_completed"] == STEPS
    assert all(f["lost_steps"] == 0 for f in result.report["faults"])


def test_a_script_that_changes_its_parameters_outside_the_optimizer_gets_the_whole_state_at_the_join(
    tmp_path: Path, reference: Any
) -> None:
    """The catch-up replays the optimizer's steps only: a script that scales a weight after each
    step leaves the spare with other parameters than its source. The join's digests differ, the
    spare receives the whole state instead, and the run stays the fault-free run, bit for bit."""
    result = run_job(workers=2, spares=1, min_workers=1, steps=STEPS, exact_resize=True, never_wait=True,
                     faults=["kill:rank=1@step=3"],
                     command=_command(tmp_path / "e", "--pause", "0.3", "--decay-outside"))  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _bitwise(reference(2, STEPS, "--decay-outside"), tmp_path / "e")
    assert [e["ok"] for e in _kinds(result, "catch_up_ended")] == [False]
    (full,) = _kinds(result, "transfer_ended")  # the whole state, to the spare that caught up
    assert full["bytes"] > 0 and full["step"] > 3, full
    assert result.report["steps_completed"] == STEPS


def test_a_worker_killed_at_start_up_under_never_wait_shrinks_then_the_spare_catches_up(
    tmp_path: Path, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILLed while it starts, once generation 0 names it: the survivor goes on alone from the
    start; the spare, once ready, catches up (from the state before the first step, or a later
    one) and joins; the run is the fault-free run bit for bit."""
    monkeypatch.setenv("CHECKPOINTLESS_FORK_SERVER", "0")  # started the slow way: it is seen starting
    launcher: list[Launcher] = []
    killed: list[str] = []
    result = run_job(workers=2, spares=1, min_workers=1, steps=STEPS, exact_resize=True, never_wait=True,
                     command=_command(tmp_path / "e", "--pause", "0.3"), on_tick=kill_while_starting("w1", launcher, killed),
                     launcher=launcher, resize_interval_s=1.0)  # fmt: skip
    assert killed == ["w1"]
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _bitwise(reference(2, STEPS), tmp_path / "e")
    (fault,) = result.report["faults"]
    assert (fault["proc"], fault["signal"], fault["lost_steps"]) == ("w1", "SIGKILL", 0), fault
    sizes = [(e["before"], e["replicas"], e["why"]) for e in _kinds(result, "resized")]
    # the grow needs the spare ready and caught up before the job's end: most runs, not all (a
    # catch-up the end cuts short ends not ok)
    assert sizes[0] == (2, 1, "lost") and sizes[1:] in ([], [(1, 2, "catch_up")]), sizes
    assert any(e["ok"] for e in _kinds(result, "catch_up_ended")) == (len(sizes) == 2)


def test_a_notice_under_never_wait_leaves_at_the_step_boundary_and_the_spare_catches_up(
    tmp_path: Path, reference: Any
) -> None:
    """``preempt:rank=1@step=3``: the rank with notice leaves at the next step boundary and the
    others take its shares at once (no transfer to wait for, whatever the notice), while the ready
    spare catches up from one of them in the background and joins: the same run, bit for bit, no
    lost step. (Without ``--never-wait`` the spare takes the rank, receiving the whole state first.)"""
    result = run_job(workers=4, spares=1, min_workers=2, steps=STEPS, exact_resize=True, never_wait=True,
                     faults=["preempt:rank=1@step=3,notice=30"],
                     command=_command(tmp_path / "e", "--pause", "0.3"))  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _bitwise(reference(4, STEPS), tmp_path / "e")
    sizes = [(e["before"], e["replicas"], e["why"]) for e in _kinds(result, "resized")]
    assert sizes == [(4, 3, "handoff"), (3, 4, "catch_up")], sizes
    handed = next(e for e in _kinds(result, "generation_started") if e["gen"] == 1)
    assert handed["sources"] == {} and handed["replaced"] == {}, handed  # no state moved
    assert [e["ok"] for e in _kinds(result, "catch_up_ended")] == [True]
    assert result.report["steps_completed"] == STEPS
    assert all(f["lost_steps"] == 0 for f in result.report["faults"])


def _killer(who: str, once: list[str]) -> Any:
    """An ``on_tick`` that SIGKILLs the follower (``who="follower"``) or its source (``"source"``)
    once the follower has applied a step of the catch-up (its heartbeat says so)."""

    def tick(coord: Any) -> None:
        plan = coord.plan
        if once or plan is None:
            return
        for follower, src in plan.followers.items():
            view = coord.table.procs.get(follower)
            if view is None or int(view.hb.get("applied", -1)) < plan.resume_step:
                continue
            target = follower if who == "follower" else plan.members[src]
            os.kill(coord.table[target].handle.pid, signal.SIGKILL)
            once.append(target)
            return

    return tick


@pytest.mark.parametrize("who", ["follower", "source"])
def test_a_kill_during_the_catch_up_is_one_more_fault(tmp_path: Path, reference: Any, who: str) -> None:
    """The spare that catches up dies (the pool starts another, which follows in turn), or its
    source does (one more shrink; the spare, given up, follows again): the job ends at full size,
    the same run bit for bit."""
    killed: list[str] = []
    result = run_job(workers=4, spares=1, min_workers=2, steps=20, exact_resize=True, never_wait=True,
                     resize_interval_s=0.5, faults=["kill:rank=1@step=3"], on_tick=_killer(who, killed),
                     command=[sys.executable, SCRIPT, "20", str(tmp_path / "e"), "--pause", "0.3"])  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert len(killed) == 1, killed
    _bitwise(reference(4, 20), tmp_path / "e")
    assert result.report["steps_completed"] == 20
    assert all(f["lost_steps"] == 0 for f in result.report["faults"]), result.report["faults"]
    ended = _kinds(result, "catch_up_ended")
    assert any(e["ok"] is False for e in ended) and ended[-1]["ok"] is True, ended
    sizes = [(e["before"], e["replicas"], e["why"]) for e in _kinds(result, "resized")]
    assert sizes[0] == (4, 3, "lost") and sizes[-1][1] == 4 and sizes[-1][2] == "catch_up", sizes


@pytest.mark.parametrize(
    ("workers", "faults"),
    [
        (2, ["kill:rank=1@step=3"]),
        (8, ["kill:rank=5@step=3"]),
        (4, ["hang:rank=2@step=3"]),
        (4, ["kill:rank=1@step=3", "exception:rank=0@step=5"]),  # a recovery during the catch-up
        (4, ["kill:rank=1@step=3", "kill:spare@recovery"]),  # the newcomer dies as it joins
        (4, ["kill:rank=1@step=3", "kill:source@recovery"]),  # its source dies as it joins
    ],
    ids=["kill-2", "kill-8", "hang-4", "exception-during", "newcomer-killed", "source-killed"],
)
def test_never_wait_through_faults_is_the_fault_free_run(
    tmp_path: Path, reference: Any, workers: int, faults: list[str]
) -> None:
    steps = 20
    result = run_job(workers=workers, spares=1, min_workers=max(1, workers // 2), steps=steps, exact_resize=True,
                     never_wait=True, resize_interval_s=0.5, faults=faults, hang_timeout_s=4.0, timeout_s=240,
                     command=[sys.executable, SCRIPT, str(steps), str(tmp_path / "e"), "--pause", "0.3"])  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _bitwise(reference(workers, steps), tmp_path / "e")
    report = result.report
    assert report["steps_completed"] == steps
    assert all(f["lost_steps"] == 0 for f in report["faults"]), report["faults"]
    sizes = [(e["before"], e["replicas"], e["why"]) for e in _kinds(result, "resized")]
    assert sizes[0] == (workers, workers - 1, "lost"), sizes
    assert sizes[-1] == (workers - 1, workers, "catch_up"), sizes  # back to full size by catching up
    assert _kinds(result, "catch_up_ended")[-1]["ok"] is True


@pytest.mark.timeout(120)
def test_ctrl_c_during_a_catch_up_stops_the_job_reports_it_and_leaves_nothing(tmp_path: Path) -> None:
    from tests.integration.test_adversarial import _cli, _interrupt, _launcher_tree, _poll, _text

    out = tmp_path / "run"
    # a kill, then long steps: Ctrl-C lands as the spare has its copy (before it joins, or as it does)
    proc = _cli("launch", "--workers", "4", "--spares", "1", "--min-workers", "2", "--never-wait", "--quiet",
                "--fault", "kill:rank=1@step=3", "--out", str(out),
                "--", sys.executable, SCRIPT, "400", str(tmp_path / "e"), "--pause", "1.5")  # fmt: skip
    with _launcher_tree(proc) as seen:
        _poll(lambda: '"catch_up_sent"' in _text(out / "events.jsonl"), 90, "the catch-up", proc, seen)
        _interrupt(proc, seen, out)


@pytest.mark.timeout(180)
def test_a_stranger_forging_every_key_does_not_steer_a_catch_up(tmp_path: Path, reference: Any) -> None:
    """A stranger on the store's port forges every key of the protocol (plans, aborts, assignments,
    heartbeats of the spares, the stop) through a never-wait recovery: the catch-up and the join
    happen as without it, and the run is the fault-free run bit for bit."""
    from checkpointless.config import JobConfig, RecoveryConfig
    from checkpointless.fault_grammar import parse_faults
    from checkpointless.launch.launcher import Launcher
    from tests.integration.test_adversarial import _free_port, _stranger

    port = _free_port()
    job = JobConfig(workers=4, spares=1, faults=parse_faults(["kill:rank=1@step=3"]),
                    recovery=RecoveryConfig(collective_timeout_s=30.0, plan_timeout_s=60.0, min_workers=2,
                                            exact_resize=True, never_wait=True, resize_interval_s=0.5))  # fmt: skip
    command = [sys.executable, SCRIPT, "20", str(tmp_path / "e"), "--pause", "0.3"]
    with _stranger(port, tmp_path / "stranger.json") as stranger:
        result = Launcher(job, command, total_steps=20, port=port, timeout_s=120).run()
        attack = stranger()
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    assert attack["rounds"] >= 1, attack
    _bitwise(reference(4, 20), tmp_path / "e")
    sizes = [(e["before"], e["replicas"], e["why"]) for e in _kinds(result, "resized")]
    assert sizes == [(4, 3, "lost"), (3, 4, "catch_up")], sizes
    assert result.report["rejected_messages"]["count"] > 0


@pytest.mark.parametrize(
    ("workers", "fault", "taken", "again"),
    [
        (2, "kill:rank=1@step=3", {"w0": [1]}, set()),
        (4, "kill:rank=3@step=3", {"w0": [], "w1": [], "w2": [3]}, set()),
        (4, "kill:rank=1@step=3", {"w0": []}, {"w2", "w3"}),  # shares move: those two compute again
        (4, "exception:rank=2@step=3", {"w0": [], "w1": [], "w3": []}, {"w2"}),
        (8, "hang:rank=7@step=3", {**{f"w{r}": [] for r in range(6)}, "w6": [7]}, set()),
    ],
    ids=["kill-2", "kill-last-4", "kill-middle-4", "exception-4", "hang-last-8"],
)
def test_survivors_keep_their_passes_and_take_the_lost_shares_in_the_same_step(
    tmp_path: Path, reference: Any, workers: int, fault: str, taken: dict[str, list[int]], again: set[str]
) -> None:
    """A peer lost at the end of its shares: each survivor whose new shares begin with those it
    computed goes on with its attempt in the next generation and computes only the shares it lacks
    (``shares_taken_over``); the others (their shares moved) and a peer that raised execute the
    step again. The same run, bit for bit, with no lost step."""
    steps = 8
    result = run_job(workers=workers, spares=0, min_workers=max(1, workers // 2), steps=steps, exact_resize=True,
                     never_wait=True, faults=[fault], hang_timeout_s=3.0, timeout_s=240,
                     command=[sys.executable, SCRIPT, str(steps), str(tmp_path / "e"), "--pause", "0.2"])  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _bitwise(reference(workers, steps), tmp_path / "e")
    over = {e["proc"]: e for e in _kinds(result, "shares_taken_over")}
    assert {p: e["shares"] for p, e in over.items()} == taken, over
    assert all(e["step"] == 3 for e in over.values()), over
    redone = {e["proc"] for e in _kinds(result, "step_reexecuted") if e["step"] == 3}
    assert redone == again, redone
    assert result.report["steps_completed"] == steps
    assert all(f["lost_steps"] == 0 for f in result.report["faults"]), result.report["faults"]


def test_a_survivor_killed_as_it_takes_shares_over_is_one_more_fault(tmp_path: Path, reference: Any) -> None:
    """Rank 3 is lost at the end of step 3; rank 2 takes its share over and is killed in the new
    generation before it computes it (``kill:survivor@takeover``), while ranks 0 and 1 wait at the
    check there. That check fails too: rank 0 takes shares 0 and 1 and goes on again, rank 1 (its
    shares moved) executes the step again. The same run, bit for bit, no lost step."""
    steps = 8
    result = run_job(workers=4, spares=0, min_workers=2, steps=steps, exact_resize=True, never_wait=True,
                     faults=["kill:rank=3@step=3", "kill:survivor@takeover"], timeout_s=240,
                     command=[sys.executable, SCRIPT, str(steps), str(tmp_path / "e"), "--pause", "0.2"])  # fmt: skip
    assert result.ok, f"{result.error}\n{logs_of(result)}"
    _bitwise(reference(4, steps), tmp_path / "e")
    over = sorted((e["gen"], e["proc"], e["shares"]) for e in _kinds(result, "shares_taken_over"))
    assert over == [(1, "w0", []), (1, "w1", []), (1, "w2", [3]), (2, "w0", [1])], over
    redone = {e["proc"] for e in _kinds(result, "step_reexecuted") if e["step"] == 3}
    assert redone == {"w1"}, redone
    sizes = [(e["before"], e["replicas"]) for e in _kinds(result, "resized")]
    assert sizes == [(4, 3), (3, 2)], sizes
    assert result.report["steps_completed"] == steps
    assert all(f["lost_steps"] == 0 for f in result.report["faults"]), result.report["faults"]
