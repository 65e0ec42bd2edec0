"""Sphinx configuration of mixhook's documentation site (``python docs/build.py`` builds it, warnings as
errors).

Sphinx with MyST (Markdown pages, as the README is) and the Furo theme: Sphinx is released steadily and its
autodoc imports the real package, so an API page that names something mixhook does not have fails the build;
MkDocs 1.6.1 (August 2024) has had no release since, and Material for MkDocs is in maintenance mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]

project = "mixhook"
author = "the mixhook developers"
copyright = "2026, the mixhook developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "generated",  # docs/_ext/generated.py: the Performance page's tables, from benchmarks/results/
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = [
    "_build",
    *(
        f"_generated/{n}.md"
        for n in (
            "goals",
            "runs",
            "costs",
            "methods-table",
            "methods",
            "api-methods",
            "hooks-table",
            "api-hooks",
        )
    ),
]  # included
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4  # [text](page.md#a-heading) links, checked by the build

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "mixhook"
html_static_path = ["_static"]
html_css_files = ["mixhook.css"]  # every table fits the content column or scrolls inside it
