"""Goodput model: checkpoint-restart vs checkpointless recovery at cluster scale, in closed form.

*Goodput* is useful training time divided by wall-clock time. This module compares, for a cluster
of ``N`` accelerators, two ways of surviving hardware failures:

* **checkpoint-restart** (C/R): the job writes a blocking checkpoint every ``tau`` seconds of
  compute; on a failure the whole job is torn down, re-scheduled, re-rendezvoused and reloads the
  last checkpoint, losing the work done since that checkpoint;
* **checkpointless**: survivors stay up, a hot spare takes the failed rank's place, the process
  group is re-formed in-process and the failed rank's state is copied from a peer replica; no
  work is lost beyond the interrupted step, which is re-executed.

Both systems are evaluated analytically (the closed forms in this module) and by a Monte-Carlo
event simulation (:func:`checkpointless.analysis.montecarlo.simulate_mc`) so that each can check the
other; :mod:`checkpointless.analysis.simulate` sweeps cluster sizes over both.

Model assumptions (shared)
--------------------------
* Failures of individual accelerators are independent with a constant rate ``r`` per
  accelerator-hour, so job-level failures form a Poisson process in *wall-clock* time with rate
  ``lam = N * r`` and mean time between failures ``M = 1 / lam``. Failures keep arriving while the
  job is down (hardware does not stop failing while the job restarts).
* The default ``r`` comes from the Llama 3 report (Dubey et al. 2024, section 3.3.4): 419
  unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs (466 in all, 47
  of them planned maintenance, which is not modelled; 78% of the unexpected ones hardware-related),
  i.e. ``r = 419 / (54 * 24 * 16384)`` per GPU-hour (about 1.97e-5; an accelerator MTBF of about
  5.8 years; a 16k-GPU job MTBF of about 3.1 hours). Every unexpected interruption is a failure
  here: checkpoint-restart restarts the job for any of them.
* The cost defaults are calibrated to published cluster figures (:data:`REFERENCES`; each field of
  :class:`ClusterParams` says whether its default is published, derived from published figures or
  an assumption): with them checkpoint-restart keeps about 0.91 of wall time at 16,384 GPUs,
  within the ">90% effective training time" the same report gives
  (:data:`LLAMA3_EFFECTIVE_TRAINING_TIME`). The assumed costs (checkpoint write and load, restart)
  are chosen inside the ranges the sources allow, not measured; the module is a calculator for
  "what if" questions. The costs ``make bench`` measured on a 2-core machine are kept in
  ``bench/results/scale.json`` (``checkpointless simulate --params bench/results/scale.json``).

Checkpoint-restart (Daly's exact model)
---------------------------------------
The run is a sequence of segments of ``tau`` seconds of compute followed by a ``C``-second
blocking checkpoint. A failure anywhere in a segment (compute or checkpoint) loses the segment;
the job then needs ``R(N)`` seconds to restart (re-queue + rendezvous + checkpoint load), and a
failure during the restart starts the restart over. The expected wall time of one segment is
exactly (Daly 2006, "A higher order estimate of the optimum checkpoint interval")::

    T_seg = M * exp(R / M) * (exp((tau + C) / M) - 1)

so goodput is ``tau / T_seg``. To first order in ``1/M`` the waste fraction is Young's
``C / tau + (tau / 2 + R) / M``: a checkpoint overhead ``C / tau`` while running, plus per
failure the restart cost and on average half an interval of lost work. Its minimiser is Young's
``tau = sqrt(2 C M)``; :func:`young_daly_interval` returns Daly's higher-order estimate and
:func:`optimal_interval_exact` the exact minimiser of ``T_seg / tau``.

Checkpointless
--------------
Each failure costs a recovery ``L(N) = detection(N) + re-formation(N) + transfer + step``: failure
detection and process-group re-formation grow with ``N`` (``a + b * log2 N + c * N``), the state
transfer is one shard over one peer link and does *not* grow with ``N``, and one step time is
added for the re-executed step. The job is down from the failure until the spare is in place and
the recovery has run; overlapping down periods merge (a failure during a recovery restarts it).

Spares: the pool holds ``S`` spares. Each failure takes one spare at once and triggers a
replacement that arrives ``D = spare_replace_s`` later (an ``(S-1, S)`` base-stock inventory,
first-come first-served). By Palm's theorem the number ``K`` of replacements outstanding at a
random time is Poisson with mean ``a = lam * D`` (true for any replacement-time distribution: it
is the occupancy of an M/G/inf queue). Hence:

* probability a failure finds the pool empty (PASTA): ``P(K >= S)``;
* fraction of time the job stalls waiting for a spare: ``P(K >= S + 1)``;
* mean wait per failure (Little's law on back-orders): ``E[(K - S)^+] / lam``.

Treating "no spare back-order" and "no recovery in progress" as independent, and using that the
down periods are the union of Poisson-started intervals (an M/G/inf busy probability), gives::

    goodput_checkpointless = (1 - o) * P(K <= S) * exp(-lam * L(N))

where ``o`` is the steady-state overhead of the fault-tolerance machinery (heartbeats, peer
replicas). To first order this is ``(1 - o) * (1 - lam * (L + E[wait]))``. The independence
step slightly underestimates the downtime when the pool is often empty (by about
``lam * L * P(K > S)``); the Monte-Carlo has no such approximation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

__all__ = [
    "INTEGER_FIELDS",
    "LLAMA3_EFFECTIVE_TRAINING_TIME",
    "LLAMA3_FAILURES_PER_GPU_HOUR",
    "REFERENCES",
    "ClusterParams",
    "checkpoint_restart_interval",
    "checkpoint_restart_waste_first_order",
    "goodput_checkpoint_restart",
    "goodput_checkpointless",
    "optimal_interval_exact",
    "require_positive",
    "spare_pool_stats",
    "young_daly_interval",
    "young_interval",
]

#: Llama 3 report (section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3_FAILURES_PER_GPU_HOUR: float = 419.0 / (54.0 * 24.0 * 16384.0)
#: Llama 3 report (section 3.3.4): "higher than 90% effective training time" (useful training time
#: over elapsed time) on 16,384 GPUs, with checkpoint-restart; the calibration target of the defaults.
LLAMA3_EFFECTIVE_TRAINING_TIME: float = 0.90

#: The published sources of the defaults, cited by ``checkpointless simulate --help`` and the
#: benchmarks page.
REFERENCES: tuple[str, ...] = (
    '[Llama 3] A. Dubey et al. (Meta), "The Llama 3 Herd of Models", arXiv:2407.21783, 2024: '
    "section 3.3.4 (466 job interruptions in a 54-day snapshot on 16,384 H100 GPUs, 47 planned, "
    "419 unexpected, 78% of those hardware-related; >90% effective training time), section 3.3.1 "
    "(Tectonic storage: 2 TB/s sustained, 7 TB/s peak; checkpoints of 1 MB to 4 GB model state per "
    "GPU; 400 Gb/s interconnect per GPU), Table 4 (16,384 GPUs: 16M tokens per batch, ~400 TFLOP/s "
    "per GPU)",
    "[NCCL #1156] a PyTorch distributed maintainer in https://github.com/NVIDIA/nccl/issues/1156 "
    "(2024): ~2.5 min of NCCL initialisation on the default path above a few thousand GPUs, at launch "
    "and again at every restart after a GPU failure",
    '[Daly 2006] J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart '
    'dumps", Future Generation Computer Systems 22(3), 2006 (the checkpoint-restart model)',
)

_PUB, _DER, _ASM = "published", "derived from published figures", "assumption"

# Fields that must be > 0 (all other float fields must be >= 0).
_POSITIVE_FIELDS = frozenset(
    {"failures_per_accel_hour", "step_time_s", "checkpoint_cost_s", "peer_bandwidth_gb_s"}
)
#: The :class:`ClusterParams` fields that are integers, each with its minimum (``__post_init__``
#: refuses a bool, a float or a smaller value); every other field is a float.
INTEGER_FIELDS: dict[str, int] = {"n_accelerators": 1, "spare_pool_size": 0}


@dataclass(kw_only=True)
class ClusterParams:
    """Cluster, failure and cost parameters; defaults calibrated to published figures.

    Each field's metadata carries ``help`` and ``source`` (``published``, ``derived from published
    figures`` or ``assumption``, with the figure or reasoning); ``checkpointless simulate --help`` and
    the benchmarks page print them. Sources in :data:`REFERENCES`. With these defaults
    checkpoint-restart keeps ~0.91 of wall time at 16,384 GPUs (Llama 3: >90%).

    Attributes:
        n_accelerators: accelerators (= ranks) in the job. Default 16,384, the Llama 3 405B
            pre-training cluster that the failure rate comes from.
        failures_per_accel_hour: failure rate per accelerator-hour (Llama 3: 419 / (54 d * 24 h *
            16,384 GPUs) ~= 1.97e-5).
        step_time_s: seconds per optimizer step (6 s: Llama 3 405B, 6 * 405e9 * 16M tokens at
            ~400 TFLOP/s on each of 16,384 GPUs).
        checkpoint_cost_s: time training is blocked per checkpoint write (``C``). 20 s (assumption,
            >= 3.3 s for ~6.5 TB at Llama 3's 2 TB/s sustained storage throughput).
        checkpoint_load_s: time to read the checkpoint back on restart. 60 s (assumption).
        restart_base_s: fixed part of a job restart: detect the failure, tear down, re-schedule on
            a standby node, start containers, import, initialise CUDA. 120 s (assumption).
        restart_per_log2_rank_s: restart time per doubling of ranks (tree-structured bootstrap,
            NCCL communicator init). 8 s (112 s at 16k; assumption).
        restart_per_rank_s: restart time linear in ranks (a central rendezvous store every rank
            connects to, address all-gather). 2 ms (33 s at 16k, 200 s at 100k; assumption). With
            the log term, ~145 s at 16k, near the ~2.5 min NCCL initialisation at restart reported
            above a few thousand GPUs (NCCL #1156).
        detect_base_s: checkpointless failure detection, fixed part (heartbeat timeout). 10 s.
        detect_per_log2_rank_s: detection per doubling of ranks (propagating the failure notice
            down a tree). 0.5 s.
        reform_base_s: in-process process-group re-formation, fixed part (abort the old
            communicator, agree on the new membership). 5 s.
        reform_per_log2_rank_s: re-formation per doubling of ranks (communicator bootstrap). 1 s.
        reform_per_rank_s: re-formation linear in ranks (membership broadcast through a store that
            is already up, so much cheaper than a cold rendezvous). 0.5 ms.
        shard_state_gb: per-rank state copied to the replacement, in GB; does not grow with ``N``.
            4 GB: the largest per-GPU model state Llama 3 checkpoints (1 MB to 4 GB per GPU).
        peer_bandwidth_gb_s: peer-to-peer bandwidth for that transfer, GB/s. 25 GB/s: half of the
            400 Gb/s per-GPU interconnect of the Llama 3 cluster.
        spare_pool_size: hot spares standing by (``S``). 16 (assumption).
        spare_replace_s: time until a consumed spare is replaced in the pool (``D``): drain,
            swap or repair, re-image, health-check. 4 h (assumption).
        checkpointless_overhead: steady-state fraction of step time lost to the fault-tolerance
            machinery (heartbeats, keeping peer replicas current). 0.01 (assumption).
    """

    n_accelerators: int = field(
        default=16_384,
        metadata={"help": "accelerators (ranks) in the job", "source": f"{_PUB}: Llama 3 cluster size"},
    )
    failures_per_accel_hour: float = field(
        default=LLAMA3_FAILURES_PER_GPU_HOUR,
        metadata={
            "help": "failures per accelerator-hour",
            "source": f"{_PUB}: Llama 3 section 3.3.4, 419 unexpected interruptions / "
            "(54 days * 24 h * 16,384 GPUs)",
        },
    )
    step_time_s: float = field(
        default=6.0,
        metadata={
            "help": "seconds per training step",
            "source": f"{_DER}: Llama 3 Table 4, 6 * 405e9 params * 16M tokens / (16,384 GPUs * "
            "400 TFLOP/s) = 5.9 s",
        },
    )
    checkpoint_cost_s: float = field(
        default=20.0,
        metadata={
            "help": "blocking checkpoint write, s",
            "source": f"{_ASM}: ~6.5 TB of state (405e9 params * 16 B) at the 2 TB/s sustained storage "
            "throughput of Llama 3 section 3.3.1 is >= 3.3 s; 20 s allows for the bursty checkpoint "
            "writes saturating the storage fabric that it reports, and the synchronisation around them",
        },
    )
    checkpoint_load_s: float = field(
        default=60.0,
        metadata={
            "help": "checkpoint load on restart, s",
            "source": f"{_ASM}: >= 3.3 s for 6.5 TB at 2 TB/s (Llama 3 section 3.3.1); 60 s for every "
            "rank reading at once, metadata and placement",
        },
    )
    restart_base_s: float = field(
        default=120.0,
        metadata={
            "help": "fixed job-restart cost, s",
            "source": f"{_ASM}: detect, tear down, re-schedule on a standby node, start containers, "
            "import, initialise CUDA (Llama 3 reports having reduced job start-up time, without a figure)",
        },
    )
    restart_per_log2_rank_s: float = field(
        default=8.0,
        metadata={
            "help": "job-restart cost per log2(ranks), s",
            "source": f"{_ASM}: with the per-rank term ~145 s of bootstrap and communicator init at "
            "16,384 ranks, near the ~2.5 min NCCL init at restart reported above a few thousand GPUs "
            "(NCCL #1156)",
        },
    )
    restart_per_rank_s: float = field(
        default=0.002,
        metadata={
            "help": "job-restart cost per rank, s",
            "source": f"{_ASM}: a central rendezvous every rank connects to, 2 ms each (33 s at 16,384)",
        },
    )
    detect_base_s: float = field(
        default=10.0,
        metadata={"help": "checkpointless detection, fixed, s", "source": f"{_ASM}: heartbeat timeout"},
    )
    detect_per_log2_rank_s: float = field(
        default=0.5,
        metadata={
            "help": "checkpointless detection per log2(ranks), s",
            "source": f"{_ASM}: failure notice down a tree",
        },
    )
    reform_base_s: float = field(
        default=5.0,
        metadata={
            "help": "process-group re-formation, fixed, s",
            "source": f"{_ASM}: abort the old communicator, agree on the membership",
        },
    )
    reform_per_log2_rank_s: float = field(
        default=1.0,
        metadata={
            "help": "process-group re-formation per log2(ranks), s",
            "source": f"{_ASM}: communicator bootstrap",
        },
    )
    reform_per_rank_s: float = field(
        default=0.0005,
        metadata={
            "help": "process-group re-formation per rank, s",
            "source": f"{_ASM}: membership through a store that is already up",
        },
    )
    shard_state_gb: float = field(
        default=4.0,
        metadata={
            "help": "per-rank state to transfer, GB",
            "source": f"{_PUB}: the largest per-GPU model state Llama 3 checkpoints (1 MB to 4 GB, "
            "section 3.3.1); a peer holding a replica of it is the checkpointless premise",
        },
    )
    peer_bandwidth_gb_s: float = field(
        default=25.0,
        metadata={
            "help": "peer transfer bandwidth, GB/s",
            "source": f"{_ASM}: half of the 400 Gb/s per-GPU interconnect of Llama 3 section 3.3.1",
        },
    )
    spare_pool_size: int = field(
        default=16, metadata={"help": "hot spares in the pool", "source": f"{_ASM}: two 8-GPU nodes"}
    )
    spare_replace_s: float = field(
        default=4 * 3600.0,
        metadata={
            "help": "time to replace a consumed spare, s",
            "source": f"{_ASM}: drain, swap or repair, re-image, health-check",
        },
    )
    checkpointless_overhead: float = field(
        default=0.01,
        metadata={
            "help": "steady-state overhead fraction of checkpointless, [0, 1)",
            "source": f"{_ASM}: heartbeats and keeping peer replicas current",
        },
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            name = f.name
            value = getattr(self, name)
            if name in INTEGER_FIELDS:
                lo = INTEGER_FIELDS[name]
                if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                    raise ValueError(f"ClusterParams.{name} must be an integer >= {lo}, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"ClusterParams.{name} must be a finite number, got {value!r}")
            if name in _POSITIVE_FIELDS and value <= 0:
                raise ValueError(f"ClusterParams.{name} must be > 0, got {value!r}")
            if value < 0:
                raise ValueError(f"ClusterParams.{name} must be >= 0, got {value!r}")
        if self.checkpointless_overhead >= 1:
            raise ValueError(
                f"ClusterParams.checkpointless_overhead must be < 1, got {self.checkpointless_overhead!r}"
            )

    # ------------------------------------------------------------------ derived quantities

    @property
    def failure_rate_per_s(self) -> float:
        """Job-level failure rate ``lam = N * r`` in failures per second."""
        return self.n_accelerators * self.failures_per_accel_hour / 3600.0

    @property
    def mtbf_s(self) -> float:
        """Job mean time between failures ``M = 1 / lam`` in seconds."""
        return 1.0 / self.failure_rate_per_s

    @property
    def restart_cost_s(self) -> float:
        """Checkpoint-restart cost ``R(N)``: restart + rendezvous (log and linear in N) + load."""
        n = self.n_accelerators
        return (
            self.restart_base_s
            + self.restart_per_log2_rank_s * math.log2(n)
            + self.restart_per_rank_s * n
            + self.checkpoint_load_s
        )

    @property
    def state_transfer_s(self) -> float:
        """Per-shard peer state transfer time; independent of ``N``."""
        return self.shard_state_gb / self.peer_bandwidth_gb_s

    @property
    def recovery_cost_s(self) -> float:
        """Checkpointless loss per failure ``L(N)`` excluding spare waits.

        Detection + re-formation (growing with N) + state transfer (constant) + one re-executed
        step.
        """
        n = self.n_accelerators
        lg = math.log2(n)
        detect = self.detect_base_s + self.detect_per_log2_rank_s * lg
        reform = self.reform_base_s + self.reform_per_log2_rank_s * lg + self.reform_per_rank_s * n
        return detect + reform + self.state_transfer_s + self.step_time_s


# ---------------------------------------------------------------------- checkpoint-restart


def require_positive(name: str, value: float) -> float:
    """``value`` as a float if it is a finite number > 0 (an int or a float, not a bool); else a
    ValueError that names the argument ``name`` and the value given."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def young_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimum checkpoint interval ``sqrt(2 C M)`` (compute seconds)."""
    c = require_positive("checkpoint_cost_s", checkpoint_cost_s)
    m = require_positive("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * c * m)


def young_daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Optimum compute time between checkpoints, Daly's higher-order estimate (Daly 2006).

    For ``C < 2M``: ``tau = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C``, which tends
    to Young's ``sqrt(2 C M)`` when ``C << M``; for ``C >= 2M`` Daly recommends ``tau = M``.
    The restart cost does not enter (it only scales Daly's expected wall time by ``exp(R/M)``).

    Raises:
        ValueError: a non-positive or non-finite argument.
    """
    c = require_positive("checkpoint_cost_s", checkpoint_cost_s)
    m = require_positive("mtbf_s", mtbf_s)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def optimal_interval_exact(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Exact minimiser of Daly's expected wall time per unit of work, ``(exp((tau+C)/M) - 1)/tau``.

    Setting the derivative to zero gives ``(1 - u) exp(u) = exp(-C/M)`` with ``u = tau / M``
    (equivalently ``tau = M (1 + W0(-exp(-1 - C/M)))`` with Lambert's W); it has one root in
    ``(0, 1)``, found here by bisection on ``log1p(-u) + u + C/M``.
    """
    c = require_positive("checkpoint_cost_s", checkpoint_cost_s)
    m = require_positive("mtbf_s", mtbf_s)
    ratio = c / m
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if math.log1p(-mid) + mid + ratio > 0.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi) * m


def _daly_goodput(tau: float, c: float, r: float, m: float) -> float:
    """``tau / (M exp(R/M) (exp((tau+C)/M) - 1))``, 0 when the exponent overflows."""
    x = (tau + c) / m
    if x + r / m > 700.0:
        return 0.0
    return tau / (m * math.exp(r / m) * math.expm1(x))


def checkpoint_restart_interval(p: ClusterParams) -> float:
    """Checkpoint interval used for ``p``: Daly's estimate, at least one step."""
    return max(young_daly_interval(p.checkpoint_cost_s, p.mtbf_s), p.step_time_s)


def goodput_checkpoint_restart(p: ClusterParams, interval_s: float | None = None) -> float:
    """Expected goodput of checkpoint-restart (Daly's exact model; see the module docstring).

    Args:
        p: cluster parameters; uses ``checkpoint_cost_s``, ``restart_cost_s`` and ``mtbf_s``.
        interval_s: compute seconds between checkpoints; ``None`` uses
            :func:`young_daly_interval` (at least one step time).

    Returns:
        ``tau / (M exp(R/M) (exp((tau + C)/M) - 1))`` in ``[0, 1)``.
    """
    tau = checkpoint_restart_interval(p) if interval_s is None else require_positive("interval_s", interval_s)
    return _daly_goodput(tau, p.checkpoint_cost_s, p.restart_cost_s, p.mtbf_s)


def checkpoint_restart_waste_first_order(p: ClusterParams, interval_s: float) -> float:
    """Young's first-order waste fraction ``C/tau + (tau/2 + R)/M`` (for reference and tests)."""
    tau = require_positive("interval_s", interval_s)
    return p.checkpoint_cost_s / tau + (tau / 2.0 + p.restart_cost_s) / p.mtbf_s


# ---------------------------------------------------------------------------- checkpointless


def _poisson_logpmf(k: np.ndarray, a: float) -> np.ndarray:
    lgam = np.array([math.lgamma(float(x) + 1.0) for x in k])
    return -a + k * math.log(a) - lgam


def _poisson_sf(s: int, a: float) -> float:
    """``P(K >= s)`` for ``K ~ Poisson(a)``, summing whichever side is smaller in log space."""
    if s <= 0:
        return 1.0
    if a <= 0.0:
        return 0.0
    if s > a:  # upper tail, truncated far past the mode
        top = int(s + a + 40.0 * math.sqrt(a) + 50.0)
        lp = _poisson_logpmf(np.arange(s, top + 1, dtype=float), a)
        mx = float(lp.max())
        return float(min(1.0, math.exp(mx) * float(np.exp(lp - mx).sum())))
    lp = _poisson_logpmf(np.arange(0, s, dtype=float), a)
    mx = float(lp.max())
    return float(max(0.0, 1.0 - math.exp(mx) * float(np.exp(lp - mx).sum())))


def spare_pool_stats(p: ClusterParams) -> dict[str, float]:
    """Spare-pool statistics under the base-stock / Palm's-theorem model (module docstring).

    Returns:
        ``offered_load`` ``a = lam D`` (mean replacements outstanding), ``p_pool_empty``
        ``P(K >= S)`` (probability a failure finds no spare), ``p_waiting`` ``P(K >= S+1)``
        (fraction of time the job stalls for a spare) and ``mean_wait_s`` ``E[(K-S)^+] / lam``
        (mean wait per failure).
    """
    lam = p.failure_rate_per_s
    a = lam * p.spare_replace_s
    s = p.spare_pool_size
    p_empty = _poisson_sf(s, a)
    p_wait = _poisson_sf(s + 1, a)
    backorders = max(0.0, a * p_empty - s * p_wait)  # E[(K - S)^+]
    return {
        "offered_load": a,
        "p_pool_empty": p_empty,
        "p_waiting": p_wait,
        "mean_wait_s": backorders / lam,
    }


def goodput_checkpointless(p: ClusterParams) -> float:
    """Expected goodput of checkpointless recovery.

    ``(1 - o) * P(K <= S) * exp(-lam * L(N))`` with ``L(N)`` = :attr:`ClusterParams.recovery_cost_s`
    (detection + re-formation + state transfer + one re-executed step), ``K ~ Poisson(lam D)`` the
    replacements outstanding and ``o`` the steady-state overhead. Assumptions in the module
    docstring.
    """
    lam = p.failure_rate_per_s
    p_no_backorder = 1.0 - _poisson_sf(p.spare_pool_size + 1, lam * p.spare_replace_s)
    return (1.0 - p.checkpointless_overhead) * p_no_backorder * math.exp(-lam * p.recovery_cost_s)
