"""Failure detection rules: functions of the process views, the clock and the job's settings that
return verdicts; the coordinator acts on them (``coordinator.py``). Who sees what:

- process exit: the backend's handle reports the process dead (``ProcessWatch._on_exit``);
- hang: a process whose heartbeat has not changed for ``hang_timeout_s`` is
  killed (a stopped process cannot release its peers' collectives, DESIGN.md),
  unless it used CPU all along (a pause holding the GIL, see ``hung``, whose verdict carries the
  CPU samples the coordinator keeps in the process's view);
- collective error / exception: a worker reports the failure of its generation
  (read by the coordinator's ``_check_reports``);
- no progress: a member computing a step for ``progress_timeout_s`` while a
  peer waits in that step's reduction (``stuck``), or a live member that neither
  dies nor reports within that time once its generation failed, is killed and
  replaced (a member that is still starting is not: it reports when it gets there);
- start failure: a process that exits on its own before joining ends the job
  with its exit code and the last line of its log (a bad command or script,
  not a machine fault; one whose script started a process group of its own is told so,
  ``own_group``); one that never joins within ``start_timeout_s`` is
  killed. Spares that die at start-up are restarted with backoff, up to a cap;
- fatal: a worker that found a mistake no recovery can fix (``FatalError``)
  ends the job with its message; so do loops of different lengths (``early_finish``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from checkpointless.config import RecoveryConfig
from checkpointless.control.processes import ProcessView
from checkpointless.protocol.vocab import Phase

#: a silent process that used at least this share of one core in a sampling window (and at least
#: one 10 ms tick of /proc's) is busy, not hung: a stopped process uses none, a blocked one next to
#: none (a runtime's watchdog thread), one collecting garbage on a loaded host still gets its share
_BUSY_SHARE = 0.1


def own_group(tail: str) -> str:
    """What a script that starts a ``torch.distributed`` process group of its own did, for a process
    whose last log line is ``tail`` ("" when that line is not the sign of it). Such a script
    (``init_process_group()``, or accelerate's ``Accelerator`` seeing ``LOCAL_RANK``) asks for an
    ``env://`` rendezvous, whose variables (``MASTER_ADDR``, ``RANK``, ...) the launcher does not
    set: under it the session forms the groups."""
    if "env:// rendezvous" not in tail:
        return ""
    return ("started a torch.distributed process group of its own (init_process_group, or accelerate's "
            "Accelerator): under checkpointless launch the Session forms the groups: port the loop "
            "(docs/guide/porting.md) or use an integration (checkpointless.integrations.transformers / "
            ".lightning)")  # fmt: skip


def hint(tail: str) -> str:
    """What a script's last error line usually means under the launcher ("" when nothing is known)."""
    if "process group has not been initialized" in tail or "init_process_group" in tail:
        return (" (a torch.distributed call that needs the default process group, such as DistributedSampler(dataset) "
                "or dist.get_rank(), made before checkpointless.Session() returned: the session forms the group "
                "once the rank is known; make the call after it, or read the data with session.loader(...))")  # fmt: skip
    if any(m in tail for m in ("Connection closed by peer", "Connection reset by peer", "gloo/transport")):
        return (" (a collective outside the step failed, most likely because a peer failed: run the script's "
                "collectives between steps in `with session.between_steps():`, or inside the step)")  # fmt: skip
    return ""


@dataclass(frozen=True)
class Silence:
    """The hang rule's verdict on a joined process (``hung``), and the CPU samples its view keeps
    from now on (the coordinator applies them: ``ProcessView.sampled``)."""

    hung: bool
    cpu_mark: tuple[float, float] | None
    """(when, CPU seconds) sampled while it is silent."""
    busy: bool | None
    """It used CPU in the last sampled window (None: not sampled)."""


def hung(p: ProcessView, now: float, rc: RecoveryConfig) -> Silence:
    """Whether a joined process's heartbeat has been silent too long (``Silence.hung``).

    Silent for ``hang_timeout_s``: hung, unless it used CPU in the last window sampled (windows of
    half the timeout, from half the timeout of silence on; the samples are kept in the view): a
    full garbage collection, or native code holding the GIL, stops a Python heartbeat thread but
    not the process, and such a pause must not cost a recovery. A stopped process (SIGSTOP, a
    frozen host) or one blocked for good uses no CPU. A process silent but busy is declared hung
    after ``progress_timeout_s``."""
    hang, silent = rc.hang_timeout_s, now - p.last_change
    mark, busy = p.cpu_mark, p.busy
    if silent <= hang / 2:
        return Silence(False, mark, busy)
    cpu = p.handle.cpu_seconds()
    if cpu is None:
        return Silence(silent > hang, mark, busy)
    # when that figure was read: now here, at its agent's last status for another host's
    # process (a window between two reads of one figure would see an idle process)
    at = now - p.handle.cpu_age()
    if mark is None:
        return Silence(False, (at, cpu), busy)
    window = at - mark[0]
    if window >= hang / 2 or (silent > hang and window >= hang / 4):
        busy = cpu - mark[1] >= max(0.01, _BUSY_SHARE * window)
        mark = (at, cpu)
    if silent > max(rc.progress_timeout_s, hang):
        return Silence(True, mark, busy)
    return Silence(silent > hang and busy is False, mark, busy)


def stuck(members: list[ProcessView], now: float, rc: RecoveryConfig, limit: float) -> list[ProcessView]:
    """The members (of the current generation) stuck computing a step for ``limit`` seconds while a
    peer already waits in that step's reduction: hangs that keep the heartbeat thread alive (a
    deadlock or an endless loop in the step). A silent one is the heartbeat rule's case."""
    waiting = {p.hb.get("step") for p in members if p.hb.get("phase") == Phase.REDUCE}
    out = []
    for p in members:
        hb = p.hb
        if p.killed or hb.get("phase") != Phase.COMPUTE or hb.get("step") not in waiting:
            continue
        if now - p.last_change > 3 * rc.heartbeat_interval_s:
            continue  # a silent process is the heartbeat detector's case (a stopped process)
        if now - p.phase_since > limit:
            out.append(p)
    return out


def early_finish(live: dict[int, dict[str, Any]], names: dict[int, str]) -> tuple[int, str] | None:
    """A rank (of ``live``: rank -> heartbeat, this generation's) that finished its loop while a
    peer still attempts (or finished after) a later step: the peer would wait in that step's
    reduction for a rank that never comes (each collective timeout a new generation, forever).
    The loops disagree on their length, a mistake no recovery can fix: (that rank, the error
    naming both), or None."""

    def reach(hb: dict[str, Any]) -> tuple[int, str]:
        if hb.get("phase") in (Phase.COMPUTE, Phase.REDUCE) and hb.get("step") is not None:
            return int(hb["step"]), f"attempts step {hb['step']}"
        committed = int(hb.get("committed", -1))
        verb = "finished after" if hb.get("phase") == Phase.DONE else "committed"
        return committed, f"{verb} step {committed}"

    for r, hb in sorted(live.items()):
        if hb.get("phase") != Phase.DONE:
            continue
        mine = int(hb.get("committed", -1))
        for peer, other in sorted(live.items()):
            step, what = reach(other)
            if peer == r or step <= mine:
                continue
            return r, (
                f"rank {r} ({names[r]}) finished its loop after step {mine} while rank {peer} "
                f"({names[peer]}) {what}: every rank must run the same number of steps "
                "(the same session.steps(n) everywhere, a replacement included)"
            )
    return None


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
