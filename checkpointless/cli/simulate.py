"""``checkpointless simulate``: goodput of checkpoint-restart against checkpointless recovery at
cluster scale (:mod:`checkpointless.analysis.simulate`), swept over cluster sizes, printed as a
table; ``--out DIR`` also writes ``simulate.json`` (parameters and rows) and ``goodput.png``.

Bad input prints one line, ``checkpointless simulate: error: ...``, and returns 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any, NoReturn

JSON_FILE = "simulate.json"
PNG_FILE = "goodput.png"

_DESCRIPTION = """\
Goodput of checkpoint-restart vs checkpointless recovery vs cluster size.

The defaults are calibrated to published cluster figures: the failure rate, step time and
per-GPU state come from the Llama 3 report (16,384 H100 GPUs); the checkpoint and restart costs
are assumptions chosen inside the ranges the sources allow, stated as such below. With them
checkpoint-restart keeps ~0.91 of wall time at 16,384 GPUs, within the >90% effective training
time Llama 3 reports. `--params bench/results/scale.json` uses instead the parameters `make bench`
measured on a 2-core machine (fixed software costs of a tiny model; not cluster figures)."""


class _BadInput(Exception):
    """Raised instead of argparse's print-usage-and-exit."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _BadInput(message)


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


def build_parser() -> argparse.ArgumentParser:
    from checkpointless.analysis.simulate import (
        DEFAULT_SWEEP_SIZES,
        INTEGER_PARAMS,
        REFERENCES,
        ClusterParams,
    )

    refs = (textwrap.fill(ref, 100, initial_indent="  ", subsequent_indent="    ") for ref in REFERENCES)
    parser = _Parser(
        prog="checkpointless simulate",
        description=_DESCRIPTION,
        epilog="sources of the defaults:\n" + "\n".join(refs),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes",
        type=_parse_sizes,
        default=list(DEFAULT_SWEEP_SIZES),
        help="comma-separated cluster sizes (default: %(default)s)",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"write {JSON_FILE} and {PNG_FILE} here")
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
        conv = int if f.name in INTEGER_PARAMS else float
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=conv,
            default=None,
            help=f"{f.metadata.get('help', '')} (default: {f.default:g}; {f.metadata.get('source', '')})".replace(
                "%", "%%"
            ),
        )
    return parser


def _provenance(from_file: set[str], from_flags: set[str], path: Path | None) -> str:
    """One line saying where the parameters came from: printed on every run."""
    from checkpointless.analysis.simulate import ClusterParams

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


def run(argv: list[str]) -> int:
    """Sweep cluster sizes, print a table, optionally write files; the exit status (bad input:
    one line on stderr, 2)."""
    from checkpointless.analysis.simulate import ClusterParams, plot_sweep, read_params_file, sweep

    parser = build_parser()
    prog = parser.prog
    try:
        args = parser.parse_args(argv)
    except _BadInput as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    try:
        from_file = read_params_file(args.params) if args.params is not None else {}
        flags = {
            f.name: getattr(args, f.name)
            for f in fields(ClusterParams)
            if f.name != "n_accelerators" and getattr(args, f.name) is not None
        }
        base = ClusterParams(n_accelerators=args.sizes[0], **(from_file | flags))
        for n in args.sizes:
            replace(base, n_accelerators=n)  # validate every size
        if args.mc_hours is not None and not (math.isfinite(args.mc_hours) and args.mc_hours > 0):
            raise ValueError(f"--mc-hours must be a finite number > 0, got {args.mc_hours!r}")
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
            (args.out / JSON_FILE).write_text(json.dumps(payload, indent=2) + "\n")
            plot_sweep(rows, args.out / PNG_FILE)
        except ImportError:
            print(f"{prog}: error: matplotlib is needed for {PNG_FILE}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"{prog}: error: cannot write to {args.out}: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {args.out / JSON_FILE} and {args.out / PNG_FILE}")
    return 0
