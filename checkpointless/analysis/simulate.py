"""Goodput simulator: checkpoint-restart vs checkpointless recovery, swept over cluster size.

The ``checkpointless simulate`` command: :func:`sweep` evaluates both systems for each cluster size
with the closed forms of :mod:`checkpointless.analysis.goodput_model` (model, assumptions and
parameters are documented there) and optionally the Monte-Carlo of
:mod:`checkpointless.analysis.montecarlo`; :func:`plot_sweep` draws the result and :func:`main`
prints it as a table and writes ``simulate.json`` and ``goodput.png``.

The model and Monte-Carlo names are re-exported here, so ``checkpointless.analysis.simulate`` remains
the one import for the whole simulator.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from checkpointless.analysis.goodput_model import (
    _INT_FIELDS,
    LLAMA3_EFFECTIVE_TRAINING_TIME,
    LLAMA3_FAILURES_PER_GPU_HOUR,
    REFERENCES,
    ClusterParams,
    _check_positive,
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
from checkpointless.analysis.montecarlo import _failure_times as _failure_times  # for the tests

__all__ = [
    "DEFAULT_SWEEP_SIZES",
    "LLAMA3_EFFECTIVE_TRAINING_TIME",
    "LLAMA3_FAILURES_PER_GPU_HOUR",
    "REFERENCES",
    "SYSTEMS",
    "ClusterParams",
    "checkpoint_restart_interval",
    "checkpoint_restart_waste_first_order",
    "goodput_checkpoint_restart",
    "goodput_checkpointless",
    "main",
    "optimal_interval_exact",
    "plot_sweep",
    "simulate_mc",
    "spare_pool_stats",
    "sweep",
    "young_daly_interval",
    "young_interval",
]

#: Cluster sizes swept by default (1,000 .. 100,000 accelerators, roughly log-spaced).
DEFAULT_SWEEP_SIZES: tuple[int, ...] = (1000, 2000, 4000, 8000, 16384, 32768, 65536, 100000)

_JSON_FILE = "simulate.json"
_PNG_FILE = "goodput.png"


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


# ------------------------------------------------------------------------------------- CLI


class _UsageError(Exception):
    """Raised instead of argparse's print-usage-and-exit."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise _UsageError(message)


def _parse_sizes(text: str) -> list[int]:
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        try:
            n = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {part!r}") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {n}")
        sizes.append(n)
    return sizes


_DESCRIPTION = """\
Goodput of checkpoint-restart vs checkpointless recovery vs cluster size.

The defaults are calibrated to published cluster figures: the failure rate, step time and
per-GPU state come from the Llama 3 report (16,384 H100 GPUs); the checkpoint and restart costs
are assumptions chosen inside the ranges the sources allow, stated as such below. With them
checkpoint-restart keeps ~0.91 of wall time at 16,384 GPUs, within the >90% effective training
time Llama 3 reports. `--params bench/results/scale.json` uses instead the parameters `make bench`
measured on a 2-core machine (fixed software costs of a tiny model; not cluster figures)."""


def _epilog() -> str:
    refs = (textwrap.fill(ref, 100, initial_indent="  ", subsequent_indent="    ") for ref in REFERENCES)
    return "sources of the defaults:\n" + "\n".join(refs)


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="checkpointless simulate",
        description=_DESCRIPTION,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes",
        type=_parse_sizes,
        default=list(DEFAULT_SWEEP_SIZES),
        help="comma-separated cluster sizes (default: %(default)s)",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"write {_JSON_FILE} and {_PNG_FILE} here")
    parser.add_argument(
        "--mc-hours", type=float, default=None, help="also run a Monte-Carlo of this many hours per point"
    )
    parser.add_argument("--seed", type=int, default=0, help="Monte-Carlo seed (default: %(default)s)")
    parser.add_argument(
        "--params",
        type=Path,
        default=None,
        help="JSON file of parameters (field: value, a simulate.json, or bench/results/scale.json for "
        "the ones measured by make bench); flags given on the command line override it",
    )
    for f in fields(ClusterParams):
        if f.name == "n_accelerators":  # set by --sizes
            continue
        conv = int if f.name in _INT_FIELDS else float
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=conv,
            default=None,
            help=f"{f.metadata.get('help', '')} (default: {f.default:g}; {f.metadata.get('source', '')})".replace(
                "%", "%%"
            ),
        )
    return parser


def _params_file(path: Path) -> dict[str, Any]:
    """The ClusterParams fields a ``--params`` file sets (ValueError naming the file and key)."""
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
        out[key] = int(value) if key in _INT_FIELDS else float(value)
    return out


def _provenance(from_file: set[str], from_flags: set[str], path: Path | None) -> str:
    """One line saying where the parameters came from: printed on every run."""
    names = [f.name for f in fields(ClusterParams) if f.name != "n_accelerators"]
    defaults = [n for n in names if n not in from_file and n not in from_flags]
    parts = []
    if from_file:
        parts.append(f"{len(from_file)} from {path}")
    if from_flags:
        parts.append(f"{len(from_flags)} from flags")
    if defaults:
        by_name = {f.name: f for f in fields(ClusterParams)}
        assumed = [n for n in defaults if str(by_name[n].metadata.get("source", "")).startswith("assumption")]
        parts.append(
            f"{len(defaults)} defaults calibrated to published figures (Llama 3, 16,384 GPUs), "
            f"{len(assumed)} of them assumptions ({', '.join(assumed) or 'none'}; see --help); "
            "--params bench/results/scale.json uses the ones make bench measured on a 2-core machine"
        )
    return "parameters: " + "; ".join(parts)


def _format_table(rows: Sequence[dict[str, Any]]) -> str:
    has_mc = all("mc_checkpointless" in r for r in rows)
    head = f"{'N':>8} {'MTBF h':>8} {'restart s':>9} {'recov s':>8} {'ckpt tau s':>10} {'C/R':>7} {'ckptless':>8} {'P(empty)':>9}"
    if has_mc:
        head += f" {'C/R mc':>7} {'CL mc':>7}"
    lines = [head]
    for r in rows:
        line = (
            f"{r['n_accelerators']:>8d} {r['mtbf_h']:>8.2f} {r['restart_cost_s']:>9.0f} "
            f"{r['recovery_cost_s']:>8.1f} {r['checkpoint_interval_s']:>10.0f} "
            f"{r['goodput_checkpoint_restart']:>7.4f} {r['goodput_checkpointless']:>8.4f} "
            f"{r['p_pool_empty']:>9.2e}"
        )
        if has_mc:
            line += f" {r['mc_checkpoint_restart']:>7.4f} {r['mc_checkpointless']:>7.4f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI ``checkpointless simulate``: sweep cluster sizes, print a table, optionally write files.

    ``--out DIR`` writes ``simulate.json`` (parameters + rows) and ``goodput.png``. Bad input
    prints one line to stderr and returns 2.
    """
    parser = _build_parser()
    prog = parser.prog
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    try:
        from_file = _params_file(args.params) if args.params is not None else {}
        flags = {
            f.name: getattr(args, f.name)
            for f in fields(ClusterParams)
            if f.name != "n_accelerators" and getattr(args, f.name) is not None
        }
        base = ClusterParams(n_accelerators=args.sizes[0], **(from_file | flags))
        for n in args.sizes:
            replace(base, n_accelerators=n)  # validate every size
        if args.mc_hours is not None:
            _check_positive("--mc-hours", args.mc_hours)
        rows = sweep(args.sizes, base, mc_hours=args.mc_hours, seed=args.seed)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    print(_provenance(set(from_file) - set(flags), set(flags), args.params))
    print(_format_table(rows))
    if args.out is not None:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            payload = {"params": asdict(base) | {"n_accelerators": None}, "sizes": args.sizes, "rows": rows}
            (args.out / _JSON_FILE).write_text(json.dumps(payload, indent=2) + "\n")
            plot_sweep(rows, args.out / _PNG_FILE)
        except ImportError:
            print(f"{prog}: error: matplotlib is needed for {_PNG_FILE}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"{prog}: error: cannot write to {args.out}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.out / _JSON_FILE} and {args.out / _PNG_FILE}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
