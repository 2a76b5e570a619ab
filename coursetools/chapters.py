"""A chapter's pages and the shape a chapter keeps: teach first, prove second (``python -m coursetools.chapters``).

A chapter is one page (``chapters/07_pipeline_parallel.md``) or, when its body is longer than a learner reads in
about ten minutes, numbered pages read in order: the first keeps the chapter's name (every link to it stays
right), the next ones are ``chapters/07.2_interleaving_and_zero_bubble.md``, ``chapters/07.3_...``.
:func:`pages` is the one place that knows this (the website's contents, the chapter links, the text tests).

The shape, measured by :func:`problems` (``tests/unit/test_teach_first.py`` holds every chapter to it):

* the last page ends with ``## Exercises`` and then ``## How we know``, the chapter's last section: the appendix
  with tolerances, source lines, tests, planted bugs and sources (the website shows it collapsed);
* the body (every page before "How we know") cites no ``file.ext:NNN``, names no ``tests/`` path and no
  ``test_*.py``: a learner reads the mechanism there, and the proof in the appendix;
* a page's body holds at most ``MOST_BODY_WORDS`` words, tables included (fenced code and comments left out);
* a table cell is prose and keeps a sentence's limit (``MOST_CELL_WORDS``);
* the Exercises section lists two or three exercises, each naming by its title an exercise heading of the
  chapter's lab, which grades it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from coursetools.prose import CODE_DIRECTIVES

ROOT = Path(__file__).resolve().parents[1]
HOW_WE_KNOW = "How we know"
EXERCISES = "Exercises"
MOST_BODY_WORDS = 2400
MOST_CELL_WORDS = 40
_FENCE = re.compile(r"^\s*(`{3,}|~{3,}|:{3,})\s*(?:\{([\w-]+)\})?(.*)$")
# a citation of a source line (`distributed.py:1203`, `ProcessGroupNCCL.cpp:812-830`), a path into tests/, a test file
CITATION = re.compile(r"\b[\w./-]+\.(?:py|cpp|cu|cuh|h|hpp|c|md|ipynb|pbs|sh|yaml|yml|toml|txt|json):\d+")
TEST_PATH = re.compile(r"(?<![\w/.-])tests/[\w./-]*|\btest_\w+\.py\b")


def numbers(root: Path = ROOT) -> list[str]:
    """The chapters' numbers, "01" to "14" (chapter 00, the conventions, is a reference page, not a chapter)."""
    return [p.name[:2] for p in sorted((root / "chapters").glob("[0-9][0-9]_*.md")) if p.name[:2] != "00"]


def pages(number: str, root: Path = ROOT) -> list[Path]:
    """A chapter's pages in reading order: ``NN_name.md``, then ``NN.2_*.md``, ``NN.3_*.md``..."""
    folder = root / "chapters"
    first = sorted(folder.glob(f"{number}_*.md"))
    if len(first) != 1:
        raise ValueError(f"chapter {number}: {len(first)} first pages ({[p.name for p in first]})")
    more = sorted(folder.glob(f"{number}.[0-9]*_*.md"), key=lambda p: int(p.name.split("_")[0].split(".")[1]))
    return first + more


def labs(number: str, root: Path = ROOT) -> list[Path]:
    """A chapter's lab notebooks in working order: the one named as the chapter (``notebooks/NN_name.ipynb``) first,
    then its sequels by name (chapter 14's lab is three notebooks, each under a minute)."""
    first = pages(number, root)[0].stem
    return sorted((root / "notebooks").glob(f"{number}_*.ipynb"), key=lambda lab: (lab.stem != first, lab.name))


def text(number: str, root: Path = ROOT) -> str:
    """A chapter's pages as one text (what a text test reads: a claim may move from one page to the next)."""
    return "\n\n".join(p.read_text() for p in pages(number, root))


def _outside_code(markdown: str) -> list[str]:
    """The lines of a page that are not code: fenced code (and directives of code or maths) and HTML comments left
    out; a prose directive's text kept (a ``{figure}``'s caption, a ``{note}``)."""
    markdown = re.sub(r"<!--.*?-->", "", markdown, flags=re.S)
    kept, fences = [], []          # the open fences: (marker, holds code)
    for line in markdown.splitlines():
        match = _FENCE.match(line)
        if match:
            marker, directive, rest = match.groups()
            opener = fences[-1][0] if fences else ""
            if (fences and marker[0] == opener[0] and len(marker) >= len(opener) and directive is None
                    and not rest.strip()):
                fences.pop()
                continue
            if not fences or not fences[-1][1]:
                fences.append((marker, directive is None or directive in CODE_DIRECTIVES))
                continue
        if fences and fences[-1][1]:
            continue
        kept.append(line)
    return kept


def headings(markdown: str, level: int = 2) -> list[str]:
    """The titles of a page's headings of one level, code left out."""
    mark = "#" * level + " "
    return [line[len(mark):].strip() for line in _outside_code(markdown) if line.startswith(mark)]


def split_appendix(markdown: str) -> tuple[str, str]:
    """A page's body and its "How we know" appendix (empty when the page has none)."""
    match = re.search(rf"^## {HOW_WE_KNOW}\s*$", markdown, flags=re.M)
    return (markdown, "") if match is None else (markdown[:match.start()], markdown[match.start():])


def body_words(markdown: str) -> int:
    """The words a learner reads in a body: prose, headings and tables; not fenced code, comments, link targets."""
    lines = _outside_code(markdown)
    flat = re.sub(r"\]\([^)\s]*\)", "]", "\n".join(lines))        # a link counts as its text
    flat = re.sub(r"^\s*:[\w-]+:.*$", "", flat, flags=re.M)        # a directive's options
    return len([w for w in re.split(r"\s+", flat) if re.search(r"\w", w)])


def long_cells(markdown: str) -> list[str]:
    """Table cells over a sentence's limit."""
    cells = []
    for line in _outside_code(markdown):
        if line.lstrip().startswith("|"):
            cells += [c.strip() for c in line.strip().strip("|").split("|")]
    return [c for c in cells if len(c.split()) > MOST_CELL_WORDS]


def citations(markdown: str) -> list[str]:
    """The source-line citations, ``tests/`` paths and test files a text names."""
    flat = "\n".join(_outside_code(markdown))
    return CITATION.findall(flat) + TEST_PATH.findall(flat)


def section(markdown: str, title: str) -> str:
    """The text under ``## title``, up to the next heading of level 2."""
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", markdown, flags=re.M | re.S)
    return match.group(1) if match else ""


def exercise_items(markdown: str) -> list[str]:
    """The exercises the Exercises section lists: its top-level numbered items."""
    items = re.split(r"^\d+\.\s+", section(markdown, EXERCISES), flags=re.M)[1:]
    return [" ".join(item.split()) for item in items]


def notebook_exercises(lab: Path) -> list[str]:
    """The titles of one notebook's exercise headings, in its order ("Exercise 2: predict the bytes of a step")."""
    found = []
    for cell in json.loads(lab.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            found += re.findall(r"^#+\s+(?:\d+\.\s+)?(Exercise[^\n]*?)\s*$", source, flags=re.M)
    return found


def lab_exercises(number: str, root: Path = ROOT) -> list[str]:
    """The titles of the exercise headings of a chapter's lab, its notebooks in working order."""
    return [title for lab in labs(number, root) for title in notebook_exercises(lab)]


def problems(number: str, root: Path = ROOT) -> list[str]:
    """Every way chapter ``number`` breaks the shape above (empty: it keeps it)."""
    found = []
    chapter = pages(number, root)
    for i, page in enumerate(chapter):
        markdown = page.read_text()
        body, appendix = split_appendix(markdown)
        last = i == len(chapter) - 1
        if appendix and not last:
            found.append(f"{page.name}: 'How we know' on a page that is not the chapter's last")
        words = body_words(body)
        if words > MOST_BODY_WORDS:
            found.append(f"{page.name}: a body of {words} words (at most {MOST_BODY_WORDS})")
        for cited in citations(body):
            found.append(f"{page.name}: cites {cited} before 'How we know'")
        for cell in long_cells(markdown):
            found.append(f"{page.name}: a table cell of {len(cell.split())} words: {cell[:60]}...")
        if last:
            titles = headings(markdown)
            if not titles or titles[-1] != HOW_WE_KNOW:
                found.append(f"{page.name}: the last section is not '## {HOW_WE_KNOW}'")
            if EXERCISES not in titles or (HOW_WE_KNOW in titles
                                           and titles.index(EXERCISES) > titles.index(HOW_WE_KNOW)):
                found.append(f"{page.name}: no '## {EXERCISES}' before '## {HOW_WE_KNOW}'")
            items = exercise_items(body)
            if not 2 <= len(items) <= 3:
                found.append(f"{page.name}: {len(items)} exercises listed (two or three)")
            graded = lab_exercises(number, root)
            for item in items:
                if not any(title in item for title in graded):
                    found.append(f"{page.name}: an exercise names no exercise of the lab by its title "
                                 f"({graded}): {item[:60]}...")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("numbers", nargs="*", help="chapters (default: all)")
    args = parser.parse_args(argv)
    failing = 0
    for number in args.numbers or numbers():
        words = [body_words(split_appendix(p.read_text())[0]) for p in pages(number)]
        found = problems(number)
        failing += bool(found)
        print(f"chapter {number}: {len(pages(number))} page(s), body words {words}: "
              + ("keeps the shape" if not found else f"{len(found)} problem(s)"))
        for problem in found:
            print(f"    {problem}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
