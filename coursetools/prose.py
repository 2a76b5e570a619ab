"""How long the course's sentences are: ``python -m coursetools.prose`` (``make prose``).

The course writes one idea a sentence: a mean of 20 words or fewer, none over 40 (CONTRIBUTING.md, "How the
course writes"). This module is the one measurement (the style test, tests/unit/test_prose_style.py, and ``make
prose`` use it), so a chapter, a lab's markdown, the READMEs and CONTRIBUTING are all counted the same way:

* prose only: fenced code, indented code blocks, tables, headings, HTML comments and display maths are left out
  (a table's cells are not measured: keep sentences out of them);
* a MyST directive's text is prose (a ``{note}``, a ``{figure}``'s caption), its options are not, and a directive
  of code, maths or a table (``CODE_DIRECTIVES``) is left out like fenced code;
* inline code counts as one word (``torch.distributed.fsdp.fully_shard`` is one thing the reader reads); HTML tags
  are left out, their text is not;
* a link counts as its text, and a title's own ``.``, ``?`` or ``!`` inside it does not end the sentence around
  it (chapter 14's lines of reported issues); an image counts as its alt text;
* each list item and each block-quote paragraph is its own unit, so a list of short items is not one long sentence;
* a sentence ends at ``.``, ``!`` or ``?`` followed by a space, after any closing bracket, quote or emphasis
  (``*It does not shrink.*`` ends one). A decimal point never does, nor an ellipsis (``r, r + N, ... of``), nor
  the abbreviations of ``ABBREVIATIONS``; a quoted question followed by a lower-case word (every "does it fit?" in
  the course) is inside its sentence.

A word is what whitespace separates. ``python -m coursetools.prose`` prints the table for every chapter, lab and
README; ``--long`` lists each sentence over 40 words with its file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEAN_WORDS, MOST_WORDS = 20, 40
ABBREVIATIONS = ("e.g.", "i.e.", "vs.", "cf.", "etc.", "approx.", "Fig.", "Eq.", "No.", "et al.")
# Stand-ins for a full stop, question mark and exclamation mark that do not end a sentence (an abbreviation's dots,
# an ellipsis, the punctuation inside a link's text) while sentences are split; put back afterwards.
_PROTECT = {".": "\u2024", "?": "\ufe56", "!": "\ufe57"}
_RESTORE = str.maketrans({v: k for k, v in _PROTECT.items()})
# MyST directives whose body is code, maths or a table, not prose (the others, {note}, {figure}'s caption..., are read)
CODE_DIRECTIVES = ("code", "code-block", "code-cell", "sourcecode", "literalinclude", "math", "raw", "eval-rst",
                   "table", "list-table", "csv-table", "mermaid", "graphviz", "toctree", "bibliography")
CELL = "\ue000"                              # between two notebook cells (a private-use character)
_FENCE = re.compile(r"\s*(`{3,}|~{3,}|:{3,})\s*(?:\{([\w-]+)\})?")
_ITEM = re.compile(r"(?:[-*+]|\d+[.)])(?:\s+|$)")
_LINK = re.compile(r"!?\[((?:\\.|[^\]\\])*)\]\((?:[^()\s]|\([^()\s]*\))*(?:\s+\"[^\"]*\")?\)")


def _protect(text: str) -> str:
    return text.translate(str.maketrans(_PROTECT))


def _lines_read(markdown: str) -> list[str | None]:
    """The page's lines a reader reads as prose, in order; None where a block ends. Left out: fenced code (and MyST
    directives of code, maths or tables; a directive's options), indented code blocks, HTML comments, display maths,
    headings, tables and rules."""
    if CELL in markdown:                     # a notebook: each markdown cell is a page of its own
        return [line for part in markdown.split(CELL) for line in _lines_read(part) + [None]]
    text = re.sub(r"<!--.*?-->", "", markdown, flags=re.S)
    text = re.sub(r"<!--.*", "", text, flags=re.S)                     # a comment left open hides the rest
    text = re.sub(r"^\s*\$\$.*?\$\$\s*$", "", text, flags=re.S | re.M)
    out: list[str | None] = [None]
    fences: list[tuple[str, bool]] = []      # open fences, innermost last: (marker, whether its body is read)
    lists: list[int] = []                    # content indents of the open list items, innermost last
    in_code = False                          # inside an indented code block
    for line in text.expandtabs(4).splitlines():
        stripped = line.strip()
        fence = _FENCE.match(line)
        if fences:
            marker, read = fences[-1]
            if fence and fence.group(1)[0] == marker[0] and len(fence.group(1)) >= len(marker) and not fence.group(2) \
                    and stripped == fence.group(1):
                fences.pop()
                out.append(None)
                continue
            if fence and read:                                          # a fence nested in a directive that is read
                fences.append((fence.group(1), fence.group(1)[0] == ":" or bool(fence.group(2))
                               and fence.group(2) not in CODE_DIRECTIVES))
                out.append(None)
                continue
            if not read or re.match(r"\s*:[\w-]+:", line):              # code, or a directive's option
                continue
        elif fence:
            name = fence.group(2)
            fences.append((fence.group(1), (fence.group(1)[0] == ":" or bool(name)) and name not in CODE_DIRECTIVES))
            out.append(None)
            continue
        if not stripped:
            out.append(None)
            continue
        indent = len(line) - len(line.lstrip(" "))
        paragraph_open = out[-1] is not None
        if not paragraph_open:
            while lists and indent < lists[-1] and not _ITEM.match(stripped):
                lists.pop()                                             # a line left of the item: the list ended
        code_indent = (lists[-1] if lists else 0) + 4
        if (in_code or not paragraph_open) and indent >= code_indent:
            in_code = True                                              # an indented code block (never inside a paragraph)
            continue
        in_code = False
        while stripped.startswith(">"):                                # a quote reads as the prose it quotes
            stripped = stripped[1:].strip()
        if not stripped or stripped.startswith("|") or re.match(r"#{1,6}(\s|$)", stripped) \
                or re.fullmatch(r"[-=*_ ]{3,}", stripped):
            out.append(None)
            continue
        item = _ITEM.match(stripped)
        if item:                                                       # a list item starts a unit of its own
            while lists and indent < lists[-1]:
                lists.pop()
            lists.append(indent + item.end())
            out.append(None)
            stripped = stripped[item.end():]
        out.append(stripped)
    return out


def _flat(block: str) -> str:
    """One block flattened as it reads: inline code one word, a link its text, HTML tags and escapes out."""
    line = re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "CODE", block)
    line = re.sub(r"<(https?://[^\s<>]+)>", r"\1", line)                # an autolink reads as its address
    line = re.sub(r"</?[A-Za-z][A-Za-z0-9-]*(?:\s[^<>]*)?/?>", "", line)  # HTML tags, not their text
    # a link reads as its text, one unit: a title's own '.', '?' or '!' inside it ends no sentence
    # (an image's alt text, read aloud to who cannot see it, splits as prose does)
    line = _LINK.sub(lambda m: m.group(1) if m.group(0).startswith("!") else
                     re.sub(r"[.!?](?=.*\w)", lambda p: _protect(p.group(0)), m.group(1)), line)
    line = re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", line)                 # backslash escapes
    line = line.replace("**", "").replace("__", "")
    return " ".join(line.split())


def _blocks(markdown: str) -> list[str]:
    blocks, current = [], []
    for line in _lines_read(markdown) + [None]:
        if line is None:
            flat = _flat(" ".join(current))
            if re.search(r"\w", flat):
                blocks.append(flat)
            current = []
        else:
            current.append(line)
    return blocks


def prose(markdown: str) -> list[str]:
    """The page's prose as blocks (paragraphs, list items, quoted paragraphs), each flattened to one line."""
    return [block.translate(_RESTORE) for block in _blocks(markdown)]


def sentences(markdown: str) -> list[str]:
    """Every sentence of the page's prose, in order."""
    found = []
    for block in _blocks(markdown):
        for abbreviation in ABBREVIATIONS:
            block = block.replace(abbreviation, _protect(abbreviation))
        block = re.sub(r"\.{3,}", lambda m: _protect(m.group(0)), block)   # an ellipsis never ends a sentence
        start = 0
        for end in re.finditer(r"(?<=[.!?])([)\"'\u201d*_]*)\s+", block):
            closing, after = end.group(1), block[end.end():end.end() + 1]
            if block[end.start() - 1] in "?!" and closing and after.islower():
                continue                                # a quoted "does it fit?" inside a sentence
            found.append(block[start:end.start() + len(closing)])
            start = end.end()
        found.append(block[start:])
    return [s.translate(_RESTORE) for s in found if re.search(r"\w", s)]


def words(sentence: str) -> int:
    return len(sentence.split())


@dataclass(frozen=True)
class Measure:
    name: str
    sentences: int
    mean: float
    over_20: int
    over_40: list[str]

    @property
    def keeps_the_style(self) -> bool:
        return self.mean <= MEAN_WORDS and not self.over_40


def measure(name: str, markdown: str) -> Measure:
    found = sentences(markdown)
    lengths = [words(s) for s in found]
    mean = sum(lengths) / len(lengths) if lengths else 0.0
    return Measure(name, len(found), mean, sum(n > 20 for n in lengths), [s for s in found if words(s) > MOST_WORDS])


def notebook_markdown(path: Path) -> str:
    """A notebook's markdown cells, one after another, each its own page (``CELL`` between them: a fence or an HTML
    comment left open in one cell ends with it, as Jupyter renders it)."""
    cells = json.loads(path.read_text())["cells"]
    return f"\n\n{CELL}\n\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                                    for c in cells if c["cell_type"] == "markdown")


def course_texts(root: Path = ROOT) -> dict[str, str]:
    """Every text a learner reads: the chapters, the labs' markdown (the full copies: the learner's copies are
    generated from them), the README, the two cluster guides (PBS and Slurm) and CONTRIBUTING."""
    texts = {str(p.relative_to(root)): p.read_text() for p in sorted((root / "chapters").glob("[0-9][0-9]*.md"))}
    texts.update({str(p.relative_to(root)): notebook_markdown(p)
                  for p in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))})
    for name in ("README.md", "pbs/README.md", "slurm/README.md", "CONTRIBUTING.md"):
        texts[name] = (root / name).read_text()
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="list every sentence over 40 words")
    parser.add_argument("files", nargs="*", help="only these (paths as printed)")
    args = parser.parse_args(argv)
    texts = course_texts()
    if args.files:
        texts = {k: v for k, v in texts.items() if k in args.files}
    print(f"{'text':44} {'sentences':>9} {'mean':>5} {'>20':>5} {'>40':>4}")
    failing = 0
    for name, text in texts.items():
        m = measure(name, text)
        failing += not m.keeps_the_style
        print(f"{name:44} {m.sentences:9d} {m.mean:5.1f} {m.over_20:5d} {len(m.over_40):4d}"
              f"{'' if m.keeps_the_style else '  <- over'}")
        if args.long:
            for sentence in m.over_40:
                print(f"    [{words(sentence)}] {sentence}")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
