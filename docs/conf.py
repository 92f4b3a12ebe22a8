"""Sphinx configuration of the checkpointless documentation (``make docs``).

Pages are Markdown (myst-parser). The benchmark pages and the command-line reference are written at
build time by the local extensions in ``docs/_ext/``: from ``bench/results/*.json`` and from the
commands' ``--help``. No intersphinx: the build reads nothing from the network.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(REPO))

project = "checkpointless"
author = "the checkpointless authors"
copyright = "2026, the checkpointless authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "bench_pages",
    "cli_reference",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "spikes", "Thumbs.db", ".DS_Store"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "checkpointless"
html_static_path: list[str] = []

# The reference covers checkpointless.__all__ and the integrations' public classes, as written.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}

# Docstrings are Google style (Args:, Returns:); an override without a docstring of its own shows
# none rather than the host library's (transformers' and Lightning's are not ours to render).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_inherit_docstrings = False
