"""Sphinx extension: the benchmark pages (``docs/benchmarks/``), rendered from
``bench/results/*.json`` by ``bench.docs_pages`` as the build starts, so they cannot drift from
the results. The folder is git-ignored: nothing in it is edited by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sphinx.application import Sphinx

REPO = Path(__file__).resolve().parents[2]


def _render(app: Sphinx) -> None:
    from bench import docs_pages  # the repository's root is on the path (docs/conf.py)

    docs_pages.write_pages(Path(app.srcdir) / "benchmarks", REPO / "bench" / "results", REPO / "docs")


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", _render)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
