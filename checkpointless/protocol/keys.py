"""Wire format of the control store (a c10d ``TCPStore`` hosted by the launcher).

Every key the coordinator and the workers exchange is built here, so the
protocol can be read in one place. Values are sealed with the job's secret
(``control/auth.py``) except counters, which are only hints::

    gen/latest                  newest generation number (decimal)
    gen/<n>/plan                JSON ``Plan`` of generation n
    gen/<n>/pg/<token>/...      rendezvous of generation n's process group (token from the secret)
    gen/<n>/fail/count          counter: members that reported a failure in gen n
    gen/<n>/fail/ranks          ``r,`` appended by each member that reported (a hint: which reports to read)
    gen/<n>/fail/<rank>         JSON {committed, reason, proc, has_state}
    gen/<n>/abort               set by the coordinator once generation n has failed
    gen/<n>/layout/<rank>       JSON list of (name, shape, dtype) of a rank's parameters
    gen/<n>/trainable/<s>/<r>   JSON list of rank r's trainable parameters, when they changed at step s
    hb/<proc>                   JSON heartbeat of a process (worker or spare)
    assign/<proc>               generation a spare joins (decimal), or ``stop`` at job end
    events/<proc>/<i>           chunk i of a process's events (JSON lines, i from 0, written in order with
                                no reply awaited); the launcher reads them in order, deletes each once read
    done/<rank>                 JSON {digest, step, proc} when a rank finished training
    report/bell                 set after a failure report; the launcher's bell thread waits on it
                                and deletes it (a hint: wakes the coordinator, control/bell.py)
    fatal/count                 counter: fatal reports (hint)
    fatal/<proc>                JSON {rank, error}: a mistake no recovery can fix; ends the job
    fault/<i>/rank/<r>/fired    counter: 1 for the process that fires fault i on rank r
    job/stop                    set when the job ends; spares exit
    job/config                  JSON {job, job_id}: what a host's agent reads first (multi-host jobs)
    agents/count                counter: tickets of the agents that said hello (hint)
    agents/<i>                  JSON hello of agent i {host, addr, nproc, spare, pid, node_rank}
    node/<host>/<pid>/accept    JSON {node} (its index) or {error}: the coordinator's answer to an agent
    node/<host>/order/<i>       JSON order i to the host's agent {op: spawn|kill|stop, ...}, i from 0
    node/<host>/status          JSON {seq, procs: {name: {alive, exit, tail, cpu, pid, slot}}, stopped}
    node/<host>/relay           JSON {seq, t, chunks, procs: {name: heartbeat}}: the host's processes'
                                heartbeats, forwarded by its agent every heartbeat interval (multi-host
                                jobs: launch/relay.py; the processes write ``hb/`` and ``events/`` keys
                                into the agent's own store, never into this one)
    node/<host>/events/<i>      chunk i of the host's processes' events (JSON lines, each naming its
                                process), written in order before the relay value that counts it

``CLUSTER_HELLO`` is the one key outside the job's namespace an agent reads: sealed with the job's
secret, it tells an agent with another secret that it has the wrong one (launch/remote.py).
"""

from __future__ import annotations

LATEST_GEN = "gen/latest"
JOB_STOP = "job/stop"
STOP = "stop"  # the assignment that wakes a waiting spare at job end
FATAL_COUNT = "fatal/count"
JOB_CONFIG = "job/config"
AGENTS_COUNT = "agents/count"
CLUSTER_HELLO = "checkpointless/cluster-hello"
REPORT_BELL = "report/bell"  # set after a failure report: wakes the coordinator (control/bell.py)


def plan(gen: int) -> str:
    return f"gen/{gen}/plan"


def pg_prefix(gen: int, token: str) -> str:
    return f"gen/{gen}/pg/{token}/"


def fail_count(gen: int) -> str:
    return f"gen/{gen}/fail/count"


def fail_ranks(gen: int) -> str:
    """Appended to (``rank,``) by each member after its failure report: which reports to read (a hint)."""
    return f"gen/{gen}/fail/ranks"


def fail(gen: int, rank: int) -> str:
    return f"gen/{gen}/fail/{rank}"


def layout(gen: int, rank: int) -> str:
    return f"gen/{gen}/layout/{rank}"


def state_digests(gen: int, step: int, rank: int) -> str:
    """A rank's per-entry state digests, published when replicas disagree at ``step``."""
    return f"consistency/{gen}/{step}/{rank}"


def trainable(gen: int, step: int, rank: int) -> str:
    """JSON list of a rank's trainable parameter names, published when the set changes at ``step``."""
    return f"gen/{gen}/trainable/{step}/{rank}"


def heartbeat(proc: str) -> str:
    return f"hb/{proc}"


def catch_up_prefix(gen: int, token: str, proc: str) -> str:
    """The rendezvous of the pair group over which ``proc`` catches up, named in generation ``gen``."""
    return f"gen/{gen}/catchup/{token}/{proc}/"


def assign(proc: str) -> str:
    return f"assign/{proc}"


def events(proc: str, chunk: int) -> str:
    return f"events/{proc}/{chunk}"


def done(rank: int) -> str:
    return f"done/{rank}"


def fatal(proc: str) -> str:
    return f"fatal/{proc}"


def fault_fired(index: int, rank: int) -> str:
    return f"fault/{index}/rank/{rank}/fired"


def planned(gen: int) -> str:
    """Set before ``abort(gen)`` when the change is one nothing forced (a resize, a handoff): the
    members finish the step in flight and leave at its commit instead of dropping it."""
    return f"gen/{gen}/planned"


def abort(gen: int) -> str:
    """Set by the coordinator when generation ``gen`` failed: idle members must report."""
    return f"gen/{gen}/abort"


def agent_hello(ticket: int) -> str:
    return f"agents/{ticket}"


def node_accept(host: str, pid: int) -> str:
    return f"node/{host}/{pid}/accept"


def node_order(host: str, index: int) -> str:
    return f"node/{host}/order/{index}"


def node_status(host: str) -> str:
    return f"node/{host}/status"


def node_relay(host: str) -> str:
    return f"node/{host}/relay"


def node_events(host: str, chunk: int) -> str:
    return f"node/{host}/events/{chunk}"


def node_read(host: str) -> str:
    """How many of ``host``'s relayed event chunks the coordinator has read: its relay deletes those
    (the coordinator deletes none: one ``multi_set`` of every host's count per pass, where a delete
    per chunk cost it a round trip each)."""
    return f"node/{host}/read"


def relayed(proc: str) -> str:
    """In a host agent's relay store: how many of ``proc``'s event chunks reached the coordinator."""
    return f"relayed/{proc}"


HOST_LEASE = "host/lease"
"""In a host agent's relay store: JSON {acked, aborted, stopped}: when (``time.monotonic()``, one clock on a
host) the relay's last round trip with the control store that got an answer was sent, the
generations it saw aborted, whether the job was stopped. A relayed process's lease is the relay's: its
heartbeat thread's round trip reads this value (``RelayedTransport.lease``, ``control/transport.py``)."""
