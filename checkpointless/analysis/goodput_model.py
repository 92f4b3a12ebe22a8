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
* The cost defaults are calibrated to published cluster figures
  (:mod:`checkpointless.analysis.cluster_params`: its :data:`REFERENCES`; each field of
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

import numpy as np

from checkpointless.analysis.cluster_params import ClusterParams

__all__ = [
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
