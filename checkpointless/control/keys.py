"""Wire format of the control store (a c10d ``TCPStore`` hosted by the launcher).

Every key the coordinator and the workers exchange is built here, so the
protocol can be read in one place::

    gen/latest                  newest generation number (decimal)
    gen/<n>/plan                JSON ``Plan`` of generation n
    gen/<n>/pg/...              rendezvous of generation n's process group
    gen/<n>/fail/count          counter: members that reported a failure in gen n
    gen/<n>/fail/<rank>         JSON {committed, reason, proc}
    gen/<n>/abort               set by the coordinator once generation n has failed
    hb/<proc>                   JSON heartbeat of a process (worker or spare)
    assign/<proc>               generation a spare joins (decimal)
    events/<proc>               appended JSON lines, the process's event log
    done/<rank>                 JSON {digest, step} when a rank finished training
    fault/<i>/fired             counter: 1 for the process that fires fault i
    job/stop                    set when the job ends; spares exit
"""

from __future__ import annotations

LATEST_GEN = "gen/latest"
JOB_STOP = "job/stop"


def plan(gen: int) -> str:
    return f"gen/{gen}/plan"


def pg_prefix(gen: int) -> str:
    return f"gen/{gen}/pg/"


def fail_count(gen: int) -> str:
    return f"gen/{gen}/fail/count"


def fail(gen: int, rank: int) -> str:
    return f"gen/{gen}/fail/{rank}"


def heartbeat(proc: str) -> str:
    return f"hb/{proc}"


def assign(proc: str) -> str:
    return f"assign/{proc}"


def events(proc: str) -> str:
    return f"events/{proc}"


def done(rank: int) -> str:
    return f"done/{rank}"


def abort(gen: int) -> str:
    """Set by the coordinator when generation ``gen`` failed: idle members must report."""
    return f"gen/{gen}/abort"
