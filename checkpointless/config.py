"""Configuration dataclasses of the core, validated with errors that name the field."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from checkpointless.fault_grammar import FaultSpec

LEASE_FRACTION = 0.5
"""The default ``heartbeat_lease_s``, as a fraction of ``hang_timeout_s``."""
LEASE_MARGIN = 0.75
"""``heartbeat_lease_s + heartbeat_interval_s`` may be at most this fraction of ``hang_timeout_s``."""


@dataclass(kw_only=True, slots=True)
class RecoveryConfig:
    """How failures are detected and how long recovery may wait."""

    hang_timeout_s: float = 0.5
    """A process with no heartbeat for this long is declared hung, killed and replaced: a stopped
    process, a frozen host. Where the launcher can read the process's CPU time (its own host), a
    process silent but using CPU (a full garbage collection, native code holding the GIL: they stop
    the heartbeat thread, not the process) is not hung until ``progress_timeout_s``. The default
    must make no false kill on a loaded machine: ``bench/hang_compare.py``'s fault-free jobs and
    ``tests/integration/test_lease_under_load.py`` (16 workers and 2 spares on 2 cores with two busy
    loops beside them) check it."""
    progress_timeout_s: float = 60.0
    """A process computing a step this long (or five normal steps, if longer) while a peer
    already waits in that step's reduction is declared hung, killed and replaced. Its
    heartbeat is alive, so it is not stopped: a slow read or a GC pause must not be
    mistaken for a hang, hence the long default (a false kill costs more than a late catch)."""
    start_timeout_s: float = 300.0
    """A process that has not joined the job (no heartbeat) this long after it was started
    is killed; members still starting are never held to a recovery deadline."""
    spare_restart_limit: int = 3
    """Spares that die before they are ready are restarted with exponential backoff
    (0.5 s, 1 s, 2 s, ...); after this many such deaths in a row the pool is not refilled."""
    spare_start_nice: int = 0
    """Spares start at this nice value (0-19) and restore normal priority before they report ready
    (they share the launcher's scheduling autogroup with the workers, so the nice value counts). On a host where the workers leave
    CPU idle (GPU training), this keeps a refilled spare's start-up (importing torch, building the
    model) from preempting a worker, whom every rank waits for. Off by default: on a host whose
    cores the workers keep busy it cannot hide that CPU time and only delays the refill (measured:
    ``bench/kill_cost.py``). Applied only where the spare can undo it (root, or RLIMIT_NICE)."""
    heartbeat_interval_s: float = 0.1
    """How often each process reports to the coordinator."""
    heartbeat_lease_s: float | None = None
    """A process whose control store has not answered a round trip for this long exits on its own
    (code 3): the store (the launcher) is gone, or the network to it is. Errors shorter than this
    (a timeout on a loaded machine, a reset connection) are retried, reconnecting. The lease must
    run out before the coordinator declares the silent process dead, with a margin:
    ``2 * heartbeat_interval_s <= heartbeat_lease_s`` and
    ``heartbeat_lease_s + heartbeat_interval_s <= 0.75 * hang_timeout_s``.
    None (the default): ``LEASE_FRACTION`` (0.5) of ``hang_timeout_s``, see ``lease_s``. A store
    that is only late (its launcher not scheduled: it still accepts a new connection) is waited
    for, up to 40 leases (``SLOW_STORE_CAP``; ``LeaseWatchdog``, ``control/lease.py``)."""
    collective_timeout_s: float = 60.0
    """Backstop for any single collective or group formation (normally never reached)."""
    plan_timeout_s: float = 120.0
    """How long a survivor waits for the coordinator's recovery plan."""
    exit_timeout_s: float = 900.0
    """Once the job has finished (every rank called ``session.finish()``), how long the launcher
    waits for the ranks' processes to exit by themselves: what a script does after training (rank 0
    saving the model, an evaluation, an upload) runs meanwhile. A process still alive then is killed,
    with a warning naming it."""
    max_retries_per_step: int = 5
    """Recoveries that may resume at the same step before the job is failed."""
    consistency_every: int = 100
    """Replicas compare a digest of their state (BLAKE3 of every tensor, one 32-byte all-gather)
    after the first step and then after every this many committed steps (0: after the first step
    only). A replica that differs from a majority is re-synced from a healthy one; with no majority
    (two replicas) the job stops, naming the state entry that differs."""
    durable_every: int = 0
    """The last-resort durable tier: every this many committed steps, rank 0 of each shard writes an
    asynchronous ``torch.distributed.checkpoint`` snapshot under ``durable_dir``, used only when no
    live replica holds some shard. 0 (the default): off."""
    durable_dir: str | None = None
    """Where the durable tier writes (required with ``durable_every``; a directory every host sees)."""
    min_workers: int = 0
    """The fewest replicas an elastic job trains with: ranks lost with no spare ready leave the
    job, the survivors computing their shares (``share_loop``), while at least this many live.
    0 (the default): the job's size, no shrink (a lost rank needs a spare)."""
    max_workers: int = 0
    """The most replicas an elastic job trains with: capacity beyond the spares' reserve (a spare
    that became ready, a process started in a lost one's place) grows the job up to this many, and
    ``checkpointless scale`` may ask for up to this many. At most ``shares``. 0 (the default): the
    starting size."""
    resize_interval_s: float = 10.0
    """The least time between two changes of size that nothing forced (a grow, a requested
    shrink): each one stops the job for a transfer."""
    exact_resize: bool = False
    """Sum each step's gradient over the shares in share order (``exact_sum``): the result is then
    the same bit for bit whatever the number of replicas, so a job that changes size stays bitwise
    the run it would have been. Off (the default): an all-reduce, whose rounding depends on the
    number of replicas (the losses then match to rounding across a resize). Sharded: the
    replicas' stage of FSDP2's reduction (``sharded_exact``)."""
    never_wait: bool = False
    """A lost replica's shares go to the survivors at once (a shrink: no transfer to wait for), and a
    ready spare receives the state in the background (``catch_up``): a copy taken at a step
    boundary, then what the optimizer was given at every step since. The spare takes shares back at
    the first step boundary after it caught up. Needs ``min_workers`` below ``workers``."""
    shares: int = 0
    """The data-parallel shares the global batch is cut into, for the whole job (``share_loop``):
    a replica holding k shares computes k share passes per step (``for share in session.shares():``),
    the gradient is the sum over the shares divided by their number, and a step's samples depend
    on the share, not on the number of replicas. 0 (the default): the starting number of replicas,
    one share each. With shards (HSDP): 0 only, for now."""

    @property
    def lease_s(self) -> float:
        """The effective ``heartbeat_lease_s``."""
        if self.heartbeat_lease_s is not None:
            return self.heartbeat_lease_s
        return LEASE_FRACTION * self.hang_timeout_s

    def __post_init__(self) -> None:
        for name in ("hang_timeout_s", "progress_timeout_s", "heartbeat_interval_s", "collective_timeout_s",
                     "plan_timeout_s", "start_timeout_s", "exit_timeout_s", "resize_interval_s"):  # fmt: skip
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite number of seconds, got {value}")
        if self.spare_restart_limit < 0:
            raise ValueError(f"spare_restart_limit must be >= 0, got {self.spare_restart_limit}")
        if not 0 < self.heartbeat_interval_s < self.hang_timeout_s:
            raise ValueError(
                f"heartbeat_interval_s must be in (0, hang_timeout_s={self.hang_timeout_s}), "
                f"got {self.heartbeat_interval_s}"
            )
        own = self.heartbeat_lease_s
        if own is not None and (not math.isfinite(own) or own <= 0):
            raise ValueError(f"heartbeat_lease_s must be a positive finite number of seconds, got {own}")
        lease, slack = self.lease_s, 1 + 1e-9  # the slack: hang_timeout_s / 4 intervals pass exactly
        if lease * slack < 2 * self.heartbeat_interval_s or (
            lease + self.heartbeat_interval_s > LEASE_MARGIN * self.hang_timeout_s * slack
        ):
            which = (
                "heartbeat_lease_s"
                if own is not None
                else f"heartbeat_lease_s ({LEASE_FRACTION:g} x hang_timeout_s)"
            )
            raise ValueError(
                f"{which} = {lease:g} must be at least 2 x heartbeat_interval_s ({self.heartbeat_interval_s:g}), "
                f"and heartbeat_lease_s + heartbeat_interval_s at most {LEASE_MARGIN:g} x hang_timeout_s "
                f"({self.hang_timeout_s:g}): a process cut off from the control store must give up before "
                "the coordinator declares it dead"
            )
        if not 0 <= self.spare_start_nice <= 19:
            raise ValueError(f"spare_start_nice must be in 0..19, got {self.spare_start_nice}")
        if self.durable_every < 0:
            raise ValueError(f"durable_every must be >= 0 steps, got {self.durable_every}")
        if self.durable_every and not self.durable_dir:
            raise ValueError("durable_dir must name a directory when durable_every is set")
        if self.consistency_every < 0:
            raise ValueError(f"consistency_every must be >= 0 steps, got {self.consistency_every}")
        if self.max_retries_per_step < 1:
            raise ValueError(f"max_retries_per_step must be >= 1, got {self.max_retries_per_step}")
        if self.min_workers < 0:
            raise ValueError(f"min_workers must be >= 0 (0: no shrink), got {self.min_workers}")
        if self.max_workers < 0:
            raise ValueError(f"max_workers must be >= 0 (0: the starting size), got {self.max_workers}")
        if self.shares < 0:
            raise ValueError(f"shares must be >= 0 (0: one per starting replica), got {self.shares}")


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """Shape of a job as the launcher runs it; passed to every process."""

    workers: int
    spares: int = 1
    shards: int = 1
    backend: str = "gloo"
    """The data plane: ``gloo`` (CPU, or CUDA tensors staged where gloo needs them) or ``nccl``."""
    device: str | None = None
    """Where the ranks train: ``cpu`` or ``cuda`` (each process on ``cuda:<its slot on the host>``,
    see ``checkpointless.devices``); None: ``cuda`` with ``nccl``, else ``cpu``."""
    seed: int = 0
    faults: list[FaultSpec] = field(default_factory=list)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.spares < 0:
            raise ValueError(f"spares must be >= 0, got {self.spares}")
        if self.shards < 1 or self.workers % self.shards:
            raise ValueError(f"shards={self.shards} must divide workers={self.workers}")
        shares = self.recovery.shares
        if shares and shares % self.shards:
            raise ValueError(f"shares={shares} must be a multiple of shards={self.shards}: each rank of a "
                             "replica reads its own part of the replica's share")  # fmt: skip
        low = self.recovery.min_workers
        if low and not 1 <= low <= self.workers:
            raise ValueError(f"min_workers={low} must be between 1 and workers={self.workers}")
        for name, n in (("min_workers", low), ("max_workers", self.recovery.max_workers)):
            if n and n % self.shards:
                raise ValueError(f"{name}={n} must be a multiple of shards={self.shards}: a sharded job "
                                 "changes size by whole replicas")  # fmt: skip
        if self.recovery.never_wait and self.shards > 1:
            raise ValueError(f"never_wait with shards={self.shards}: a sharded job's spares receive the state "
                             "in the recovery (leave never_wait off)")  # fmt: skip
        if shares and shares < self.workers:
            raise ValueError(f"shares={shares} must be at least workers={self.workers}: each replica holds "
                             "one share or more")  # fmt: skip
        if self.recovery.never_wait and not (low and low < self.workers):
            raise ValueError("never_wait needs min_workers below workers: the survivors take a lost replica's "
                             "shares while a spare catches up")  # fmt: skip
        high = self.recovery.max_workers
        if high and high < self.workers:
            raise ValueError(f"max_workers={high} must be at least workers={self.workers}")
        if high and high > self.share_count:
            raise ValueError(f"max_workers={high} must be at most the shares ({self.share_count}): each replica "
                             "holds one share or more (raise --shares)")  # fmt: skip
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend nccl needs device cuda (NCCL carries CUDA tensors only)")

    @property
    def min_size(self) -> int:
        """The fewest replicas the job trains with (``min_workers``, else the starting size)."""
        return self.recovery.min_workers or self.workers

    @property
    def max_size(self) -> int:
        """The most replicas the job trains with (``max_workers``, else the starting size)."""
        return self.recovery.max_workers or self.workers

    @property
    def elastic(self) -> bool:
        """Whether the job may train with another number of replicas than it started with."""
        return self.min_size < self.workers or self.max_size > self.workers

    @property
    def share_count(self) -> int:
        """S, the job's data-parallel shares (``recovery.shares``, else one per rank)."""
        return self.recovery.shares or self.workers

    @property
    def device_type(self) -> str:
        """``cpu`` or ``cuda``: the ``device`` asked for, or the backend's."""
        return self.device or ("cuda" if self.backend == "nccl" else "cpu")

    def to_json(self) -> str:
        d = asdict(self)
        d["faults"] = [f.to_json() for f in self.faults]
        return json.dumps(d)

    @staticmethod
    def from_json(text: str) -> JobConfig:
        d = json.loads(text)
        d["faults"] = [FaultSpec.from_json(f) for f in d["faults"]]
        d["recovery"] = RecoveryConfig(**d["recovery"])
        return JobConfig(**d)
