"""Sphinx configuration of distopt's documentation.

Build it with ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` from the
repository root (``pip install -e ".[docs]"`` first). The user guide is Markdown (MyST),
the API reference reStructuredText generated from the docstrings of every name in the
public modules' ``__all__`` (``_ext/public_api.py``, which also fails the build when one
of those names has no docstring).
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs", "_ext"))

project = "distopt"
author = "the distopt authors"
copyright = "the distopt authors"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_parser",
    "public_api",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
# Unresolved Python references warn (and fail the build) when they point into the public
# API; public_api lets references to torch and to private modules go.
nitpicky = True
root_doc = "index"

# The modules whose __all__ make the public surface: every name in them gets an entry in
# the API reference and must have a docstring. public_api warns about a package of
# distopt or functional that is not listed here.
public_api_modules = [
    "distopt",
    "distopt.parallel",
    "distopt.sparse",
    "distopt.schedule",
    "functional",
]
public_api_packages = ["distopt", "functional"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]

html_theme = "alabaster"
html_title = "distopt"
# _static/custom.css (which alabaster loads): a page as wide as the window up to 1240 px,
# and code that wraps rather than scrolling sideways; code set at 0.8em so that about 105
# characters fit a line at 1280 px. body_max_width "none" lifts the basic theme's 800 px.
html_static_path = ["_static"]
html_theme_options = {
    "description": "Distributed optimizers for PyTorch",
    "fixed_sidebar": True,
    "body_max_width": "none",
    "code_font_size": "0.8em",
}
