"""Sphinx configuration of attnkit's manual: Markdown pages (MyST), the API reference from the
docstrings (autodoc + napoleon), the furo theme. ``make docs`` builds it with warnings as errors."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attnkit  # noqa: E402

project = "attnkit"
author = "attnkit contributors"
copyright = "attnkit contributors"
release = version = attnkit.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"attnkit {release}"
html_static_path = ["_static"]
html_css_files = ["attnkit.css"]

# The API reference: signatures with their annotations in the description, members in source order.
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": False}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Docstrings name torch types that Sphinx cannot link (torch has no inventory here): no nitpicking.
nitpicky = False
