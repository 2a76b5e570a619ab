"""Sphinx's settings for the course's website (``make site``; the source folder is laid out by coursetools.site).

MyST-NB reads the chapters (Markdown) and runs the labs (notebooks) on the CPU while it builds, with a cache: an
unchanged lab is not run again, and a cell that raises fails the build. The theme is sphinx-book-theme; search is
Sphinx's own (an index shipped with the pages: it works offline). Nothing is fetched from the network: no MathJax,
no widget scripts from a CDN.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # the course's own extension: how_we_know.py

project = "Distributed training, from one GPU to thousands"
author = "the course's authors"
copyright = "the course's authors"

extensions = ["myst_nb", "how_we_know"]   # how_we_know: each chapter's appendix opens collapsed
root_doc = "index"
exclude_patterns = ["**/.ipynb_checkpoints", "**/*.py", "**/*.pbs", "**/*.sh"]
# a shell block with a placeholder (`<this repository's URL>`) cannot be highlighted: it is shown plain
suppress_warnings = ["misc.highlighting_failure"]

# MyST: heading anchors so that chapter links like README.md#section resolve
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# The labs: run on the CPU, cached; DISTLAB_SITE_EXECUTE=off renders them unexecuted (the link and image test)
nb_execution_mode = os.environ.get("DISTLAB_SITE_EXECUTE", "cache")
REPO = Path(__file__).resolve().parent.parent     # Sphinx reads this file from book/: paths from the repository
nb_execution_cache_path = str(REPO / os.environ.get("DISTLAB_SITE_OUT", "build/site") / ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
# widgets would need their JavaScript from a CDN: the course's widgets show a static first view on the website
# (labkit.widgets.static_pages, the Makefile sets DISTLAB_STATIC_WIDGETS=1), and no widget script is loaded
nb_ipywidgets_js = {}

html_theme = "sphinx_book_theme"
html_title = "Distributed training, from one GPU to thousands"
html_theme_options = {
    "use_download_button": True,
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "show_toc_level": 2,
    "navigation_with_keys": False,
}
html_static_path = []
html_favicon = "favicon.png"       # a 2 x 2 grid of ranks; without one every page asks for /favicon.ico (a 404)
# the theme's light/dark switch starts from this mode (left empty, its script logs an error on every page)
html_context = {"default_mode": "light"}
html_copy_source = True
html_show_sourcelink = False
