"""Sphinx configuration of the zerojax documentation site.

Build it with ``python -m sphinx -W --keep-going -b html docs docs/_build`` after
``pip install -e ".[docs]"``. The pages are the Markdown files of this folder (MyST);
the API reference (api.md) is generated from the docstrings.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
sys.path.insert(0, os.path.abspath("ext"))

import zerojax

project = "zerojax"
author = "zerojax contributors"
copyright = "2026, zerojax contributors"
version = release = zerojax.__version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.intersphinx",
  "sphinx.ext.napoleon",
  "coverage_check",
  "internal_links",
  "private_aliases",
  "constant_docs",
]

root_doc = "index"
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "README.md"]

# -- MyST: the pages are the repository's own Markdown, read as they are on GitHub.
myst_heading_anchors = 4  # `[...](guide.md#the-drop-in-path)` links resolve to headings.

# -- API reference: autodoc + napoleon on the Google-style docstrings.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# Attribute types would be printed with private module paths (jax._src.mesh.Mesh); the
# descriptions say what each attribute is.
napoleon_attr_annotations = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"exclude-members": "__new__, __init__, _asdict, _make, _replace"}
autosummary_generate = False

# A reference to a zerojax name that does not resolve is a broken link, and -W makes it fail.
# Names of the libraries zerojax builds on resolve through intersphinx when it is on, and stay
# plain code (not an error) when it is off.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r"(jax|optax|flax|orbax|numpy|np|collections|os)(\..*)?")]

# -- Intersphinx: links to jax, optax, flax and orbax. Their inventories live on the web, and the
# build must not need the network (CI has none), so they are read only on Read the Docs or when
# ZEROJAX_DOCS_INTERSPHINX=1; otherwise those names render as code without a link and without
# a warning (see nitpick_ignore_regex above).
_INTERSPHINX = {
  "python": "https://docs.python.org/3/",
  "numpy": "https://numpy.org/doc/stable/",
  "jax": "https://docs.jax.dev/en/latest/",
  "optax": "https://optax.readthedocs.io/en/latest/",
  "flax": "https://flax.readthedocs.io/en/latest/",
  "orbax": "https://orbax.readthedocs.io/en/latest/",
}
if os.environ.get("READTHEDOCS") == "True" or os.environ.get("ZEROJAX_DOCS_INTERSPHINX") == "1":
  intersphinx_mapping = {name: (url, None) for name, url in _INTERSPHINX.items()}
intersphinx_timeout = 10

# -- The coverage check (ext/coverage_check.py): every name in the __all__ of zerojax and of its
# public submodules (zerojax.flax.nnx, zerojax.launch, ...; new ones are found by themselves) must
# have an entry in the site, with an example.
coverage_check_packages = ["zerojax"]

# -- HTML: the book theme, as optax, flax and orbax use.
html_theme = "sphinx_book_theme"
html_title = "zerojax"
html_theme_options = {"show_toc_level": 2, "navigation_with_keys": False}
