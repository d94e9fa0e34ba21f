"""Sphinx configuration for rpcnb's documentation (MyST pages, myst-nb tutorials).

Build it with ``make docs`` (or ``python scripts/build_docs.py``): the script executes the
tutorial notebooks, stages this folder with the executed copies under ``tutorials/``, and
runs ``sphinx-build -W`` on the staged tree. Sphinx never executes a notebook itself
(``nb_execution_mode = "off"``): the outputs shown are the ones the script recorded.
"""

from __future__ import annotations

import rpcnb

project = "rpcnb"
author = "the rpcnb developers"
copyright = "the rpcnb developers"
release = rpcnb.__version__
version = release

extensions = [
    "myst_nb",  # also registers myst_parser for the .md pages
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "**.ipynb_checkpoints"]
root_doc = "index"
# text as written: no curly quotes in dict literals and error messages, and "--flag" in
# prose (the magics' help, the quoted error sentences) stays two hyphens, not an en dash
smartquotes = False

# -- MyST ----------------------------------------------------------------------------------

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # "[...](channels.md#how-tensorpipe-chooses)" links resolve

# -- myst-nb: render the outputs the build script stored; never execute here --------------

nb_execution_mode = "off"
nb_merge_streams = True  # one block per stream, not one per 50 ms output batch
nb_output_stderr = "show"  # workers' warnings are part of what a reader sees

# -- autodoc -----------------------------------------------------------------------------

autodoc_default_options = {
    "members": True,
    "undoc-members": True,  # the public names without a docstring are still API
    "member-order": "bysource",
    "show-inheritance": True,
}
autodoc_typehints = "signature"
python_maximum_signature_line_length = 88  # longer signatures: one parameter a line
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autoclass_content = "both"  # a class's docstring and its __init__'s
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as a field list: a dataclass's fields are members too
nitpicky = False  # rpcnb's hints name torch and IPython types we do not link to

# -- HTML ----------------------------------------------------------------------------------

html_theme = "furo"
html_title = f"rpcnb {release}"
html_static_path = ["_static"]
html_show_sourcelink = False
