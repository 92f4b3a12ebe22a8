"""Sphinx extension: the command-line reference (``docs/reference/cli.md``, git-ignored), written as
the build starts from the commands' own argparse definitions: the table of commands
``checkpointless.cli.COMMANDS`` (what ``checkpointless --help`` prints) and each command's
``build_parser().format_help()`` at a fixed width. Nothing here is typed by hand."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx

WIDTH = "100"  # argparse wraps at $COLUMNS: a fixed width keeps the page the same on every machine


def page() -> str:
    from checkpointless import cli

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parts = [
            "# Command line",
            "",
            "Generated from the commands' own argparse definitions when the documentation is built.",
            "",
            "```text",
            cli.usage(),
            "```",
            "",
        ]
        for name, command in cli.COMMANDS.items():
            parts += [f"## `checkpointless {name}`", "", command.summary, "", "```text",
                      command.build_parser().format_help().rstrip(), "```", ""]  # fmt: skip
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
