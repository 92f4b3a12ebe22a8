"""Goodput simulator: checkpoint-restart vs checkpointless recovery, swept over cluster size.

What the ``checkpointless simulate`` command (``checkpointless/cli/simulate.py``) runs:
:func:`sweep` evaluates both systems for each cluster size with the closed forms of
:mod:`checkpointless.analysis.goodput_model` (model and assumptions are documented there, the
parameters in :mod:`checkpointless.analysis.cluster_params`) and optionally the Monte-Carlo of :mod:`checkpointless.analysis.montecarlo`;
:func:`plot_sweep` draws the result; :func:`read_params_file` reads parameters from a JSON file.

The model and Monte-Carlo names are re-exported here, so ``checkpointless.analysis.simulate`` remains
the one import for the whole simulator.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from checkpointless.analysis.cluster_params import (
    INTEGER_FIELDS,
    LLAMA3_EFFECTIVE_TRAINING_TIME,
    LLAMA3_FAILURES_PER_GPU_HOUR,
    REFERENCES,
    ClusterParams,
)
from checkpointless.analysis.goodput_model import (
    checkpoint_restart_interval,
    checkpoint_restart_waste_first_order,
    goodput_checkpoint_restart,
    goodput_checkpointless,
    optimal_interval_exact,
    spare_pool_stats,
    young_daly_interval,
    young_interval,
)
from checkpointless.analysis.montecarlo import SYSTEMS, simulate_mc

__all__ = [
    "DEFAULT_SWEEP_SIZES",
    "INTEGER_PARAMS",
    "LLAMA3_EFFECTIVE_TRAINING_TIME",
    "LLAMA3_FAILURES_PER_GPU_HOUR",
    "REFERENCES",
    "SYSTEMS",
    "ClusterParams",
    "checkpoint_restart_interval",
    "checkpoint_restart_waste_first_order",
    "goodput_checkpoint_restart",
    "goodput_checkpointless",
    "optimal_interval_exact",
    "plot_sweep",
    "read_params_file",
    "simulate_mc",
    "spare_pool_stats",
    "sweep",
    "young_daly_interval",
    "young_interval",
]

#: Cluster sizes swept by default (1,000 .. 100,000 accelerators, roughly log-spaced).
DEFAULT_SWEEP_SIZES: tuple[int, ...] = (1000, 2000, 4000, 8000, 16384, 32768, 65536, 100000)


# ------------------------------------------------------------------------------ sweep, plot


def sweep(
    sizes: Sequence[int],
    base: ClusterParams,
    *,
    mc_hours: float | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Evaluate both systems for each cluster size (e.g. 1,000 .. 100,000 accelerators).

    Args:
        sizes: cluster sizes; each replaces ``base.n_accelerators``.
        base: all other parameters.
        mc_hours: if given, also run :func:`simulate_mc` for that many hours per size and system
            (keys ``mc_checkpoint_restart`` and ``mc_checkpointless``).
        seed: Monte-Carlo seed (the same for every size).

    Returns:
        One dict per size, in order: ``n_accelerators``, ``mtbf_h``, ``restart_cost_s``,
        ``recovery_cost_s``, ``checkpoint_interval_s``, ``goodput_checkpoint_restart``,
        ``goodput_checkpointless``, ``p_pool_empty``, ``mean_spare_wait_s`` (+ MC keys).

    Raises:
        ValueError: an empty ``sizes`` or a size < 1.
    """
    if not sizes:
        raise ValueError("sizes must not be empty")
    rows: list[dict[str, Any]] = []
    for n in sizes:
        p = replace(base, n_accelerators=n)
        spares = spare_pool_stats(p)
        row: dict[str, Any] = {
            "n_accelerators": n,
            "mtbf_h": p.mtbf_s / 3600.0,
            "restart_cost_s": p.restart_cost_s,
            "recovery_cost_s": p.recovery_cost_s,
            "checkpoint_interval_s": checkpoint_restart_interval(p),
            "goodput_checkpoint_restart": goodput_checkpoint_restart(p),
            "goodput_checkpointless": goodput_checkpointless(p),
            "p_pool_empty": spares["p_pool_empty"],
            "mean_spare_wait_s": spares["mean_wait_s"],
        }
        if mc_hours is not None:
            for system in SYSTEMS:
                row[f"mc_{system}"] = simulate_mc(p, system, mc_hours, seed)
        rows.append(row)
    return rows


def plot_sweep(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    alternative: Sequence[dict[str, Any]] | None = None,
    alternative_label: str = "alternative model",
) -> Path:
    """Draw goodput vs cluster size (log x) for both systems to ``path`` (PNG) and return it.

    Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch); matplotlib is
    imported here so the rest of the module does not need it. Monte-Carlo points are drawn as
    markers when the rows carry them; ``alternative`` rows (the same keys, another model of some
    cost, e.g. a power-law fit of group formation) are drawn dashed, labelled ``alternative_label``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not rows:
        raise ValueError("rows must not be empty")
    xs = [r["n_accelerators"] for r in rows]
    fig = Figure(figsize=(7.0, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    series = (
        ("goodput_checkpoint_restart", "mc_checkpoint_restart", "checkpoint-restart (Daly interval)", "C1"),
        ("goodput_checkpointless", "mc_checkpointless", "checkpointless", "C0"),
    )
    for key, mc_key, label, color in series:
        ax.plot(xs, [r[key] for r in rows], "-o", color=color, label=label, markersize=4)
        if all(mc_key in r for r in rows):
            ax.plot(xs, [r[mc_key] for r in rows], "x", color=color, label=f"{label}, Monte-Carlo")
    if alternative:
        axs = [r["n_accelerators"] for r in alternative]
        for key, _, label, color in series:
            ax.plot(axs, [r[key] for r in alternative], "--", color=color, alpha=0.7,
                    label=f"{label}, {alternative_label}")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("accelerators")
    ax.set_ylabel("goodput (useful time / wall time)")
    ax.set_ylim(0.0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("Expected goodput vs cluster size")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    return out


# ------------------------------------------------------------------------------ parameters

#: The :class:`ClusterParams` fields that are integers (the others are floats).
INTEGER_PARAMS: frozenset[str] = frozenset(INTEGER_FIELDS)


def read_params_file(path: Path) -> dict[str, Any]:
    """The :class:`ClusterParams` fields a JSON file sets (``simulate --params``): an object of
    parameters, a ``simulate.json`` (its ``params``) or ``bench/results/scale.json`` (its
    ``cluster_params``); ``n_accelerators`` is left out (the sizes are swept). A ValueError names
    the file and the key."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"--params {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--params {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, dict):  # a simulate.json ("params") or bench/results/scale.json ("cluster_params")
        data = next((data[k] for k in ("params", "cluster_params") if isinstance(data.get(k), dict)), data)
    if not isinstance(data, dict):
        raise ValueError(f"--params {path}: expected a JSON object of parameters")
    known = {f.name for f in fields(ClusterParams)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "n_accelerators":
            continue  # the sizes come from --sizes
        if key not in known:
            raise ValueError(f"--params {path}: unknown parameter {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"--params {path}: {key} must be a number, got {value!r}")
        out[key] = int(value) if key in INTEGER_PARAMS else float(value)
    return out
