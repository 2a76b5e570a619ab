"""The course as a website (coursetools.site, book/conf.py): its source folder, and builds that fail as they should.

`make site` runs every lab (CI does it: .ci/run); here the site is built with the labs left unexecuted (nbval runs
them in `make test`), which checks every link and image of every page in seconds, and three planted faults (a broken
link, a missing image, a cell that raises while the lab runs) show that the build fails on each. The first two are
planted together in the built site's source and rebuilt once, incrementally (Sphinx re-reads only the changed pages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import widgets
from coursetools import site

REPO = Path(__file__).resolve().parents[2]


def sphinx(source: Path, out: Path, execute: str = "off") -> subprocess.CompletedProcess:
    env = {**os.environ, "DISTLAB_SITE_EXECUTE": execute, "DISTLAB_SITE_OUT": str(out),
           widgets.STATIC_ENV: "1"}
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-c",
                           str(REPO / "book"), str(source), str(out / "html"), "-d", str(out / "doctrees")],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    source = site.assemble(out)
    result = sphinx(source, out)
    return out, source, result


def test_every_chapter_has_its_four_faces():
    chapters = site.chapter_links()
    assert [c.number for c in chapters] == [f"{n:02d}" for n in range(1, 15)]
    for chapter in chapters:
        assert chapter.labs[0] == f"notebooks/{chapter.stem}.ipynb", chapter   # the lab named as its chapter first
        assert chapter.labs == [f"notebooks/{chapter.stem}.ipynb"] + (
            ["notebooks/14_against_one_device.ipynb", "notebooks/14_more_failures.ipynb"] if chapter.number == "14"
            else []), chapter   # chapter 14's lab is three notebooks, in working order
        assert chapter.scripts and all((REPO / s).exists() for s in chapter.scripts), chapter
        assert chapter.job == f"pbs/{chapter.stem}.pbs"


def test_a_lab_of_several_notebooks_is_linked_part_by_part():
    """Chapter 14's lab is three notebooks: the chapter's pages link each part in order, and each part's page links
    the other parts (a lab of one notebook keeps its one link, and its own page none)."""
    several = site.Chapter("14", "14_x", "x", ["notebooks/14_x.ipynb", "notebooks/14_b.ipynb", "notebooks/14_c.ipynb"])
    line = site._faces_line(several, "chapters/14_x.md", skip="chapter")
    assert line == ("the lab: [part 1](../notebooks/14_x.ipynb), [part 2](../notebooks/14_b.ipynb), "
                    "[part 3](../notebooks/14_c.ipynb)")
    own = site._faces_line(several, "notebooks/14_b.ipynb", skip="notebooks/14_b.ipynb")
    assert "the lab's other parts: [part 1](../notebooks/14_x.ipynb), [part 3](../notebooks/14_c.ipynb)" in own
    one = site.Chapter("05", "05_y", "y", ["notebooks/05_y.ipynb"])
    assert "[the lab](../notebooks/05_y.ipynb)" in site._faces_line(one, "chapters/05_y.md", skip="chapter")
    assert "lab" not in site._faces_line(one, "notebooks/05_y.ipynb", skip="notebooks/05_y.ipynb")


def test_paths_in_backticks_become_links_and_others_stay_text():
    known = {"scripts/05_fully_sharded/train_fsdp.py", "notebooks/05_fully_sharded.ipynb"}
    text = "run `scripts/05_fully_sharded/train_fsdp.py` or `scripts/nope.py`, see `notebooks/05_fully_sharded.ipynb`"
    linked = site._link_paths(text, "chapters/05_fully_sharded.md", known)
    assert "[`scripts/05_fully_sharded/train_fsdp.py`](../scripts/05_fully_sharded/train_fsdp.py.md)" in linked
    assert "[`notebooks/05_fully_sharded.ipynb`](../notebooks/05_fully_sharded.ipynb)" in linked
    assert "`scripts/nope.py`," in linked and "[`scripts/nope.py`]" not in linked


def test_the_site_builds_without_a_warning(built):
    out, _, result = built
    assert result.returncode == 0, result.stderr[-3000:]
    html = out / "html"
    for chapter in site.chapter_links():
        for page in site.chapter_pages(chapter.number):    # every page of a chapter of several
            assert (html / "chapters" / page.with_suffix(".html").name).exists(), page
        for lab in chapter.labs:
            assert (html / lab.replace(".ipynb", ".html")).exists(), lab
    assert (html / "searchindex.js").exists() and (html / "search.html").exists()


def test_links_go_both_ways(built):
    out, _, _ = built
    html = out / "html"
    chapter = (html / "chapters" / "05_fully_sharded.html").read_text()
    lab = (html / "notebooks" / "05_fully_sharded.html").read_text()
    script = (html / "scripts" / "05_fully_sharded" / "train_fsdp.py.html").read_text()
    job = (html / "pbs" / "05_fully_sharded.pbs.html").read_text()
    assert "../notebooks/05_fully_sharded.html" in chapter and "../scripts/05_fully_sharded/train_fsdp.py.html" in chapter
    assert "../pbs/05_fully_sharded.pbs.html" in chapter
    assert "../chapters/05_fully_sharded.html" in lab and "Run this lab yourself" in lab
    assert '<span class="pre">make</span> <span class="pre">lab</span>' in lab and "05_fully_sharded.ipynb" in lab
    assert "../../chapters/05_fully_sharded.html" in script and "../../notebooks/05_fully_sharded.html" in script
    assert '<span class="nf">main</span>' in script and "../chapters/05_fully_sharded.html" in job   # the source, highlighted
    # the notebook is offered for download
    assert list((html / "_downloads").rglob("05_fully_sharded.ipynb"))


def test_every_figure_the_chapters_show_is_on_the_site(built):
    out, _, _ = built
    for page in (out / "html" / "chapters").glob("*.html"):
        for name in __import__("re").findall(r'src="\.\./_images/([^"]+)"', page.read_text()):
            assert (out / "html" / "_images" / name).exists(), name


def test_nothing_is_fetched_from_the_network(built):
    out, _, _ = built
    for page in [out / "html" / "index.html", *(out / "html" / "notebooks").glob("*.html")]:
        text = page.read_text()
        assert "https://cdn" not in text and "unpkg.com" not in text and "mathjax" not in text.lower(), page


def _planted(built, changes: dict) -> subprocess.CompletedProcess:
    """Plant faults in the built site's own source (``changes``: a path and what to do to it) and rebuild it
    incrementally: Sphinx re-reads only the pages whose file or dependencies changed (seconds, where a copy of the
    source is a new source folder and a full build), then put the files back. Every fault's warning must fail the
    build: -W --keep-going reports them all, each naming its file, so one rebuild checks each."""
    out, source, _ = built
    saved = {path: (source / path).read_bytes() for path in changes}
    try:
        for path, change in changes.items():
            change(source / path)
        return sphinx(source, out)
    finally:
        for path, content in saved.items():
            (source / path).write_bytes(content)   # newer than the failed build's read: the next build reads it again


@pytest.fixture(scope="module")
def with_two_faults(built):
    """A broken link and a missing image, planted in one rebuild."""
    def break_link(page):
        page.write_text(page.read_text() + "\n\nSee [the missing page](06_no_such_chapter.md).\n")

    return _planted(built, {"chapters/05_fully_sharded.md": break_link,
                            "chapters/figures/05_zero_stages.png": lambda image: image.unlink()})


def test_a_broken_link_fails_the_build(with_two_faults):
    assert with_two_faults.returncode != 0 and "06_no_such_chapter" in with_two_faults.stderr


def test_a_missing_image_fails_the_build(with_two_faults):
    assert with_two_faults.returncode != 0 and "05_zero_stages.png" in with_two_faults.stderr


def test_the_appendix_opens_collapsed(built):
    """A chapter's "How we know" section: its heading shown, what follows it inside a closed <details> (book/
    how_we_know.py); a section of another name is left open. Planted on a built page, then put back."""
    out, source, _ = built
    target = source / "chapters" / "05_fully_sharded.md"
    saved = target.read_bytes()
    try:
        target.write_text(target.read_text() + "\n\n## Planted open section\n\nShown.\n\n## How we know\n\n"
                          "### Tolerances\n\nThe planted appendix.\n")
        result = sphinx(source, out)
        page = (out / "html" / "chapters" / "05_fully_sharded.html").read_text()
    finally:
        target.write_bytes(saved)
    assert result.returncode == 0, result.stderr[-2000:]
    appendix = page[page.index('id="how-we-know"'):]
    assert appendix.index("<details") < appendix.index("The planted appendix.") < appendix.index("</details>")
    opened = page[page.index('id="planted-open-section"'):page.index('id="how-we-know"')]
    assert "Shown." in opened and "<details" not in opened


def test_a_cell_that_raises_fails_the_build(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "index.md").write_text("# A lab\n\n```{toctree}\nlab.ipynb\n```\n")
    cell = {"cell_type": "code", "id": "boom", "metadata": {}, "outputs": [], "execution_count": None,
            "source": "raise RuntimeError('a lab that fails')"}
    (source / "lab.ipynb").write_text(json.dumps({"cells": [{"cell_type": "markdown", "id": "t", "metadata": {},
                                                             "source": "# The lab"}, cell],
                                                  "metadata": {"kernelspec": {"name": "python3", "language": "python",
                                                                              "display_name": "Python 3"}},
                                                  "nbformat": 4, "nbformat_minor": 5}))
    result = sphinx(source, tmp_path, execute="force")
    # Sphinx stops on MyST-NB's ExecutionError, naming the lab (the traceback goes to its error log)
    assert result.returncode != 0 and "ExecutionError" in result.stderr and "lab.ipynb" in result.stderr


def test_widgets_show_their_first_view_on_the_website(monkeypatch):
    from labkit import mesh_view

    monkeypatch.setenv(widgets.STATIC_ENV, "1")
    fit = widgets.does_it_fit_explorer(num_params=13e9, gpus=8).data
    assert widgets.STATIC_NOTE in fit and "13" in fit
    assert widgets.STATIC_NOTE in widgets.pipeline_explorer("gpipe", ranks=4, microbatches=8).data
    assert widgets.STATIC_NOTE in mesh_view.mesh_explorer(pp=2, dp=2, tp=4).data
    monkeypatch.delenv(widgets.STATIC_ENV)
    assert not isinstance(widgets.pipeline_explorer(), type(widgets.static_view("")))   # JupyterLab: the widget
