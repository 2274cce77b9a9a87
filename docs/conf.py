"""Sphinx configuration for the Zephon documentation (Markdown pages through myst-parser).

Build with ``make docs``; the API pages import the installed package, so its compiled core must
be built first (``make build`` does it).
"""

from __future__ import annotations

import importlib.metadata
import re

project = "Zephon"
author = "Zephon developers"
copyright = "Zephon developers"
release = importlib.metadata.version("zephon-loader")
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "examples"]

# Markdown: `name <#anchor>` links to headings, and ::: fences for admonitions.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# The API reference is generated from docstrings. The compiled classes (SampleCursor, ...) carry
# their signatures because the extensions are built with ``binding=True, embedsignature=True``.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# torch is an optional extra: the torch integration's page must build without it.
autodoc_mock_imports = ["torch"]
autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
}

html_theme = "alabaster"
html_title = f"Zephon {release}"
html_theme_options = {
    "description": "Deterministic, checkpointable data pipelines for ML training",
    "fixed_sidebar": True,
}


# The docstrings pluralize literals the way the code reads (``SampleBatch``es). reStructuredText
# needs an escaped space between a literal and a word character that follows it; add it here.
_LITERAL = re.compile(r"``.+?``")


def _escape_suffix(match: re.Match[str]) -> str:
    rest = match.string[match.end() : match.end() + 1]
    return match.group(0) + ("\\ " if rest.isalnum() else "")


def _escape_literal_suffixes(app, what, name, obj, options, lines) -> None:
    for i, line in enumerate(lines):
        lines[i] = _LITERAL.sub(_escape_suffix, line)


# Cython's embedsignature puts the signature on the docstring's first line. autodoc strips it, but
# not when a page gives the signature explicitly (as api/types.md does for SampleMeta, whose
# embedded signature misplaces the keyword-only marker); drop it there too.
def _drop_embedded_signature(app, what, name, obj, options, lines) -> None:
    if what == "class" and lines and lines[0].startswith(name.rsplit(".", 1)[-1] + "("):
        del lines[: 2 if len(lines) > 1 and not lines[1].strip() else 1]


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _drop_embedded_signature)
    app.connect("autodoc-process-docstring", _escape_literal_suffixes)
