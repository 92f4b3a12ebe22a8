"""Monte-Carlo event simulation of both recovery schemes, to cross-check the closed forms.

:func:`simulate_mc` draws one Poisson failure history in wall-clock time and replays it through
checkpoint-restart (segments of compute plus a blocking checkpoint, restarts that a failure during them
starts over) or checkpointless recovery (FIFO hot spares replaced after a delay, overlapping down
periods merged). It makes none of the independence approximations of
:mod:`checkpointless.analysis.goodput_model`, whose assumptions and parameters
(:class:`~checkpointless.analysis.cluster_params.ClusterParams`) it shares.
"""

from __future__ import annotations

import math

import numpy as np

from checkpointless.analysis.cluster_params import ClusterParams
from checkpointless.analysis.goodput_model import checkpoint_restart_interval, require_positive

__all__ = ["SYSTEMS", "failure_times", "simulate_mc"]

#: Names accepted by :func:`simulate_mc` for ``system``.
SYSTEMS: tuple[str, ...] = ("checkpoint_restart", "checkpointless")

_MAX_MC_EVENTS = 20_000_000


def failure_times(p: ClusterParams, horizon_s: float, rng: np.random.Generator) -> np.ndarray:
    """One history of failures over ``[0, horizon_s)``, sorted, in seconds: a Poisson process of
    rate ``p.failure_rate_per_s`` drawn from ``rng`` (a Poisson count, then uniform times). A
    ValueError if more than 20 million failures are expected."""
    lam = p.failure_rate_per_s
    mean = lam * horizon_s
    if mean > _MAX_MC_EVENTS:
        raise ValueError(
            f"hours too large: about {mean:.3g} failures to simulate (limit {_MAX_MC_EVENTS:.0e})"
        )
    n = int(rng.poisson(mean))
    return np.sort(rng.uniform(0.0, horizon_s, size=n))


def _mc_checkpoint_restart(p: ClusterParams, t_fail: np.ndarray, horizon_s: float) -> float:
    """Useful seconds in ``[0, horizon]`` for checkpoint-restart given sorted failure times."""
    tau = checkpoint_restart_interval(p)
    seg = tau + p.checkpoint_cost_s
    restart = p.restart_cost_s
    work = 0.0
    up_from = 0.0  # time the job (re)started running from its last checkpoint
    for f in t_fail.tolist():
        if f > up_from:  # ran from up_from to f; completed segments are kept
            work += math.floor((f - up_from) / seg) * tau
        # a failure during a restart (f <= up_from) just starts the restart over
        up_from = f + restart
        if up_from >= horizon_s:
            return work
    span = horizon_s - up_from
    k = math.floor(span / seg)
    # completed segments, plus the compute done in the unfinished last segment
    return work + k * tau + min(span - k * seg, tau)


def _mc_checkpointless(p: ClusterParams, t_fail: np.ndarray, horizon_s: float) -> float:
    """Useful seconds in ``[0, horizon]`` for checkpointless given sorted failure times."""
    n = t_fail.size
    s = p.spare_pool_size
    # FIFO spares: the first S come from the initial pool, failure i then gets the replacement
    # ordered by failure i - S, which arrives spare_replace_s after it.
    avail = np.concatenate([np.zeros(min(s, n)), t_fail[: max(n - s, 0)] + p.spare_replace_s])
    ready = np.maximum(t_fail, avail)
    end = np.minimum(ready + p.recovery_cost_s, horizon_s)
    # length of the union of [t_i, end_i), intervals sorted by start
    if n:
        prev_max = np.concatenate([[0.0], np.maximum.accumulate(end)[:-1]])
        down = float(np.clip(end - np.maximum(t_fail, prev_max), 0.0, None).sum())
    else:
        down = 0.0
    return (horizon_s - down) * (1.0 - p.checkpointless_overhead)


def simulate_mc(p: ClusterParams, system: str, hours: float, seed: int) -> float:
    """Monte-Carlo goodput of ``system`` over ``hours`` of wall time.

    Failures are a Poisson process of rate ``N r`` in wall-clock time (also during downtime).

    * ``"checkpoint_restart"``: segments of ``tau`` compute (:func:`young_daly_interval`) plus a
      ``C`` checkpoint; a failure loses the running segment and costs a restart of ``R(N)``,
      itself restarted by a failure during it. Compute done in the unfinished last segment at the
      horizon is counted (an ``O(tau / hours)`` edge effect).
    * ``"checkpointless"``: failure ``i`` takes a spare FIFO from a pool of ``S``, replacements
      arriving ``D`` after each failure; the job is down over the union of
      ``[t_i, max(t_i, spare_i) + L(N))``; up time is useful at rate ``1 - o``. The pool starts
      full.

    Args:
        p: cluster parameters.
        system: one of :data:`SYSTEMS` (``-`` is accepted for ``_``).
        hours: simulated wall-clock hours (> 0).
        seed: seed for :func:`numpy.random.default_rng`.

    Returns:
        Useful time / wall time.

    Raises:
        ValueError: unknown ``system``, non-positive ``hours``, or too many events.
    """
    name = system.replace("-", "_") if isinstance(system, str) else system
    if name not in SYSTEMS:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {system!r}")
    horizon = require_positive("hours", hours) * 3600.0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    rng = np.random.default_rng(seed)
    t_fail = failure_times(p, horizon, rng)
    if name == "checkpoint_restart":
        useful = _mc_checkpoint_restart(p, t_fail, horizon)
    else:
        useful = _mc_checkpointless(p, t_fail, horizon)
    return useful / horizon
