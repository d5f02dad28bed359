"""Sphinx configuration of the dist_checkpointing docs; `make docs` builds docs/_build/html."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

# Document the working tree even when the package is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

project = "dist_checkpointing"
author = "dist_checkpointing contributors"
project_copyright = "dist_checkpointing contributors"
try:
    release = metadata.version("dist_checkpointing")
except metadata.PackageNotFoundError:
    release = "unreleased"
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style "Args:" / "Returns:" sections, as Megatron-Core uses
    "sphinx.ext.viewcode",
]
exclude_patterns = ["_build"]

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = "dist_checkpointing"
html_static_path: list[str] = []
