"""``checkpointless report RUN_DIR``: a finished run's ``timeline.png`` and ``summary.txt``
(:func:`checkpointless.observe.plot.write_report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="checkpointless report",
        description="Render RUN_DIR/events.jsonl and report.json into timeline.png and summary.txt.",
    )
    parser.add_argument("run_dir", type=Path, help="run directory written by a training job")
    return parser


def run(argv: list[str]) -> int:
    """The exit status: a missing directory or file, or a malformed report, prints one line to
    stderr and returns 2; argparse's own usage errors return its code."""
    from checkpointless.observe.plot import PNG_FILE, SUMMARY_FILE, write_report

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed usage
        return exc.code if isinstance(exc.code, int) else 2
    try:
        summary = write_report(args.run_dir)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        print(f"checkpointless report: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(
            f"checkpointless report: error: matplotlib is needed for the plot "
            f"(pip install 'checkpointless[report]'): {exc}",
            file=sys.stderr,
        )
        return 1
    except OSError as exc:
        print(f"checkpointless report: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(summary)
    print(f"wrote {args.run_dir / PNG_FILE} and {args.run_dir / SUMMARY_FILE}")
    return 0
