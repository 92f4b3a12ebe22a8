"""The ``checkpointless`` command line: one module per command, each with a ``build_parser()``
(the reference pages are generated from it) and a ``run(argv)`` returning the exit status;
:data:`~checkpointless.cli.commands.COMMANDS` lists them, :func:`main` dispatches on it.

The shared job options are in :mod:`checkpointless.cli.job_flags`, a job's run and its printed
result in :mod:`checkpointless.cli.job_run`. The command line imports ``launch/``; nothing there
imports it.
"""

from checkpointless.cli.commands import COMMANDS, Command, main, usage

__all__ = ["COMMANDS", "Command", "main", "usage"]
