"""A Sphinx extension of the course's website: each chapter's "How we know" appendix opens collapsed.

The appendix (tolerances, source lines, tests, planted bugs, sources) is for the reader who checks; the learner
reads the chapter above it. Its heading stays in the page and in the contents; what follows the heading is wrapped
in an HTML ``<details>`` element, closed until the reader opens it. Other builders than HTML leave it as it is."""

from docutils import nodes

TITLE = "How we know"
OPEN = ('<details class="how-we-know"><summary>Open the appendix: the tolerances, the sources, the tests and '
        "the planted bugs behind this chapter</summary>")


def collapse(app, doctree) -> None:
    for section in doctree.findall(nodes.section):
        if section.children and isinstance(section[0], nodes.title) and section[0].astext() == TITLE:
            section.insert(1, nodes.raw("", OPEN, format="html"))
            section.append(nodes.raw("", "</details>", format="html"))


def setup(app):
    app.connect("doctree-read", collapse)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
