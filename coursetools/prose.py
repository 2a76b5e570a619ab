"""How long the course's sentences are: ``python -m coursetools.prose`` (``make prose``).

The course writes one idea a sentence: a mean of 20 words or fewer, none over 40 (CONTRIBUTING.md, "How the
course writes"). This module is the one measurement every text test and the style test use, so a chapter, a lab's
markdown and the README are all counted the same way:

* prose only: fenced code, tables, headings, HTML comments and display maths are left out;
* inline code counts as one word (``torch.distributed.fsdp.fully_shard`` is one thing the reader reads);
* a link or a figure counts as its text;
* each list item and each block-quote paragraph is its own unit, so a list of short items is not one long sentence;
* a sentence ends at ``.``, ``!`` or ``?`` followed by a space (a decimal point never does; "e.g." and "i.e."
  never do).

A word is what whitespace separates. ``python -m coursetools.prose`` prints the table for every chapter, lab and the
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
_PROTECT = "\u2024"   # ONE DOT LEADER stands in for an abbreviation's dots while sentences are split


def prose(markdown: str) -> list[str]:
    """The page's prose as blocks (paragraphs, list items, quoted paragraphs), each flattened to one line."""
    text = re.sub(r"^\s*(```|~~~).*?^\s*\1[^\n]*$", "", markdown, flags=re.S | re.M)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"^\s*\$\$.*?\$\$\s*$", "", text, flags=re.S | re.M)
    text = re.sub(r"<[^>\n]+>", "", text)                              # inline HTML tags, not their text
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        stripped = line.strip()
        while stripped.startswith(">"):                                # a quote reads as the prose it quotes
            stripped = stripped[1:].strip()
        if not stripped or stripped.startswith(("|", "#")) or re.fullmatch(r"[-=*_ ]{3,}", stripped):
            blocks.append([])
            continue
        item = re.match(r"(?:[-*+]|\d+[.)])\s+", stripped)
        if item:                                                       # a list item starts a unit of its own
            blocks.append([stripped[item.end():]])
        else:
            blocks[-1].append(stripped)
    flat = []
    for block in blocks:
        line = " ".join(block)
        line = re.sub(r"`[^`]*`", "CODE", line)
        line = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", line)
        line = line.replace("**", "").replace("__", "")
        line = " ".join(line.split())
        if re.search(r"\w", line):
            flat.append(line)
    return flat


def sentences(markdown: str) -> list[str]:
    """Every sentence of the page's prose, in order."""
    found = []
    for block in prose(markdown):
        for abbreviation in ABBREVIATIONS:
            block = block.replace(abbreviation, abbreviation.replace(".", _PROTECT))
        for sentence in re.split(r"(?<=[.!?])[)\"'\u201d]*\s+", block):
            if re.search(r"\w", sentence):
                found.append(sentence.replace(_PROTECT, "."))
    return found


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
    """A notebook's markdown cells, one after another (each cell its own paragraph)."""
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                       for c in cells if c["cell_type"] == "markdown")


def course_texts(root: Path = ROOT) -> dict[str, str]:
    """Every text a learner reads: the chapters, the labs' markdown (the full copies: the learner's copies are
    generated from them), the README and CONTRIBUTING."""
    texts = {str(p.relative_to(root)): p.read_text() for p in sorted((root / "chapters").glob("[0-9][0-9]_*.md"))}
    texts.update({str(p.relative_to(root)): notebook_markdown(p)
                  for p in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))})
    for name in ("README.md", "CONTRIBUTING.md"):
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
