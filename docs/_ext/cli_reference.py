"""Sphinx extension: the command-line reference (``docs/reference/cli.md``, git-ignored), written as
the build starts from each command's own ``--help``: ``checkpointless.launch.cli.main([CMD,
"--help"])`` with its standard output captured. The commands are read from the CLI's own list of
commands (the table its ``checkpointless --help`` prints), not typed here."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx

WIDTH = "100"  # argparse wraps at $COLUMNS: a fixed width keeps the page the same on every machine


def _capture(argv: list[str]) -> str:
    from checkpointless.launch import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(argv)
        except SystemExit:  # argparse exits after --help
            pass
    return out.getvalue().rstrip() or err.getvalue().rstrip()


def commands() -> list[tuple[str, str]]:
    """``(name, one line)`` for every command, in the order ``checkpointless --help`` lists them."""
    from checkpointless.launch import cli

    table = getattr(cli, "COMMANDS", None)
    if isinstance(table, dict) and table:
        return [(name, str(getattr(v, "help", "") or "")) for name, v in table.items()]
    text = _capture(["--help"])
    _, _, listing = text.partition("commands:")
    found = re.findall(r"(?m)^  ([a-z][a-z-]*)\s+(.*)$", listing)
    if not found:
        raise RuntimeError("cli_reference: no command table in `checkpointless --help`")
    return found


def page() -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parts = [
            "# Command line",
            "",
            "Generated from the commands' own `--help` when the documentation is built.",
            "",
            "```text",
            _capture(["--help"]),
            "```",
            "",
        ]
        for name, line in commands():
            parts += [f"## `checkpointless {name}`", "", line.strip(), "", "```text",
                      _capture([name, "--help"]), "```", ""]  # fmt: skip
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts)


def _write(app: Sphinx) -> None:
    path = Path(app.srcdir) / "reference" / "cli.md"
    text = page()
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", _write)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
