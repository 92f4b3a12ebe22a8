"""The table of ``checkpointless`` commands (:data:`COMMANDS`: each one's line in
``checkpointless --help``, its ``build_parser()``, its ``run(argv)``) and :func:`main`, which
dispatches on it. User mistakes end with one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from checkpointless.cli import (
    agent,
    cluster,
    coordinator,
    demo,
    drain,
    dryrun,
    launch,
    report,
    run,
    scale,
    simulate,
)
from checkpointless.errors import UsageError, UserInputError


@dataclass(frozen=True)
class Command:
    """One command of ``checkpointless``."""

    summary: str
    """Its line in ``checkpointless --help``."""
    build_parser: Callable[[], argparse.ArgumentParser]
    """Its options (what ``checkpointless COMMAND --help`` prints)."""
    run: Callable[[list[str]], int]
    """Runs it on the arguments after its name; returns the exit status."""


COMMANDS: dict[str, Command] = {
    "demo": Command(
        "train a small GPT through real faults, on this machine (optionally --verify bitwise)",
        demo.build_parser, demo.run,
    ),
    "launch": Command(
        "run your own script that uses checkpointless.Session: checkpointless launch [options] -- python train.py",
        launch.build_parser, launch.run,
    ),
    "run": Command(
        "train what a YAML recipe says (Llama, GPT-OSS), fault tolerant", run.build_parser, run.run
    ),
    "cluster": Command(
        "try many hosts on this machine (network namespaces, root): cluster --nodes N [demo|launch|run] ...",
        cluster.build_parser, cluster.run,
    ),
    "coordinator": Command(
        "the control plane of a job on several machines: coordinator --nodes N --nproc-per-node P --secret-file F",
        coordinator.build_parser, coordinator.run,
    ),
    "agent": Command(
        "one host of a job on several machines: agent --coordinator HOST:PORT --secret-file F -- CMD",
        agent.build_parser, agent.run,
    ),
    "report": Command(
        "a finished run's timeline plot and summary, from its --out directory", report.build_parser, report.run
    ),
    "scale": Command(
        "ask a running job to train with N workers (an elastic job: --min-workers / --max-workers)",
        scale.build_parser, scale.run,
    ),
    "drain": Command(
        "ask a running job on several hosts to drain host N (its ranks handed over, no lost step)",
        drain.build_parser, drain.run,
    ),
    "simulate": Command(
        "goodput of checkpoint-restart against checkpointless at cluster scale",
        simulate.build_parser, simulate.run,
    ),
    "dryrun": Command(
        "size recipes without training: parameters, memory per rank, recovery traffic",
        dryrun.build_parser, dryrun.run,
    ),
}  # fmt: skip


def usage() -> str:
    """What ``checkpointless --help`` prints: the commands, one line each."""
    lines = [f"  {name:<8}  {command.summary}" for name, command in COMMANDS.items()]
    return "usage: checkpointless COMMAND [options]   (checkpointless COMMAND --help for its options)\n\n" \
        "commands:\n" + "\n".join(lines)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``checkpointless COMMAND [options]``: the exit status (a user mistake: one line, 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(usage(), file=sys.stdout if argv else sys.stderr)
            return 0 if argv else 2
        cmd, rest = argv[0], argv[1:]
        if cmd not in COMMANDS:
            raise UsageError(f"unknown command {cmd!r} (expected one of {', '.join(COMMANDS)})")
        return COMMANDS[cmd].run(rest)
    except UserInputError as e:  # UsageError, LaunchError, RecipeError: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
