"""``make site``: the course as a website, built by Sphinx with MyST-NB (``book/conf.py``).

The repository is written for readers of files (a chapter names ``scripts/05_fully_sharded/train_fsdp.py`` in
backticks, a notebook sits in ``notebooks/``). :func:`assemble` lays out a Sphinx source folder that mirrors it,
adding only what a website needs, and never edits the course's files:

* ``index.md``: the README, then the table of contents (the conventions, each chapter with its lab, the scripts,
  the PBS jobs, the benchmarks);
* ``chapters/NN_*.md`` (and a long chapter's further pages, ``chapters/NN.K_*.md``: ``coursetools.chapters.pages``):
  each page with a line of links at the top (its lab, its scripts, its PBS job), and each
  path of a script, lab or job in its text turned into a link to that page; ``chapters/figures/`` as is;
* ``notebooks/NN_*.ipynb``: each lab with a first cell that says how to run it (``make lab``), offers the notebook
  for download and links back to the chapter and the scripts. MyST-NB runs the labs while it builds, with a
  cache (``build/site/.jupyter_cache``): an unchanged lab is not run again; a cell that fails fails the build;
* ``scripts/NN_*/NAME.md`` and ``pbs/NAME.md``: each script and job as highlighted source, with links back.

:func:`chapter_links` is the map of the four faces of every chapter, found from the files (chapter NN, lab NN,
``scripts/NN_*/``, ``pbs/NN_*.pbs``).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from coursetools.chapters import labs as chapter_labs
from coursetools.chapters import pages as chapter_pages
from coursetools.chapters import text as chapter_text

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "build" / "site"


@dataclass
class Chapter:
    number: str                  # "05"
    stem: str                    # "05_fully_sharded"
    title: str
    labs: list[str]              # ["notebooks/05_fully_sharded.ipynb"]; chapter 14's lab is three
    scripts: list[str] = field(default_factory=list)   # "scripts/05_fully_sharded/train_fsdp.py", ...
    job: str | None = None       # "pbs/05_fully_sharded.pbs"


def _title(markdown: str, fallback: str) -> str:
    match = re.search(r"^# (.+)$", markdown, re.M)
    return match.group(1).strip() if match else fallback


def chapter_links(repo: Path = REPO) -> list[Chapter]:
    """Every chapter and its lab, scripts and PBS job, as the files lay them out."""
    chapters = []
    for path in sorted((repo / "chapters").glob("[0-9][0-9]_*.md")):
        number = path.stem[:2]
        if number == "00":    # the conventions: a page of their own
            continue
        labs = [f"notebooks/{p.name}" for p in chapter_labs(number, repo)]   # the lab named as its chapter first
        folder = next(iter(sorted((repo / "scripts").glob(f"{number}_*"))), None)
        scripts = ([f"scripts/{folder.name}/{p.name}" for p in sorted(folder.glob("*.py"))
                    if not p.name.startswith("common_")] if folder else
                   _scripts_named(chapter_text(number, repo), repo))   # chapter 14 breaks the other chapters' scripts
        job = next((f"pbs/{p.name}" for p in sorted((repo / "pbs").glob(f"{number}_*.pbs"))), None)
        chapters.append(Chapter(number, path.stem, _title(path.read_text(), path.stem), labs, scripts, job))
    return chapters


def _scripts_named(markdown: str, repo: Path) -> list[str]:
    """The scripts a chapter without a folder of its own names in backticks (``scripts/NN_*/NAME.py``), in order."""
    named = re.findall(r"`(scripts/[0-9][0-9]_[^`/\s]+/[^`/\s]+\.py)`", markdown)
    return [p for p in dict.fromkeys(named) if (repo / p).is_file()]


def page_of(path: str) -> str:
    """The site page of a repository file: a script or job becomes a page of its own (``.md``)."""
    return path + ".md" if path.endswith((".py", ".pbs", ".sh")) else path


def _relative(target: str, page: str) -> str:
    """A link from the page at ``page`` (a path in the source folder) to ``target``."""
    depth = page.count("/")
    return "../" * depth + target


def _link_paths(text: str, page: str, known: set[str]) -> str:
    """Each `scripts/...`, `notebooks/...`, `pbs/...` or `chapters/...` path in backticks that names a file of the
    course becomes a link to its page (the backticks kept)."""

    def replace(match):
        path = match.group(1)
        if path not in known:
            return match.group(0)
        return f"[`{path}`]({_relative(page_of(path), page)})"

    return re.sub(r"(?<!\[)`((?:scripts|notebooks|pbs|chapters)/[^`\s]+)`(?!\])", replace, text)


def _faces_line(chapter: Chapter, page: str, *, skip: str = "") -> str:
    parts = []
    if skip != "chapter":
        parts.append(f"[chapter {chapter.number}]({_relative(f'chapters/{chapter.stem}.md', page)})")
    labs = [lab for lab in chapter.labs if lab != skip]
    if len(labs) == 1 and len(chapter.labs) == 1:
        parts.append(f"[the lab]({_relative(labs[0], page)})")
    elif labs:   # a lab of several notebooks: each, in order; a notebook's own page links the others
        word = "the lab" if len(labs) == len(chapter.labs) else "the lab's other part" + "s" * (len(labs) > 1)
        parts.append(f"{word}: " + ", ".join(f"[part {chapter.labs.index(lab) + 1}]({_relative(lab, page)})"
                                             for lab in labs))
    if chapter.scripts:
        parts.append("scripts: " + ", ".join(f"[`{Path(s).name}`]({_relative(page_of(s), page)})"
                                             for s in chapter.scripts if s != skip))
    if chapter.job and skip != chapter.job:
        parts.append(f"PBS job: [`{Path(chapter.job).name}`]({_relative(page_of(chapter.job), page)})")
    return " · ".join(parts)


def _source_page(path: str, chapter: Chapter | None, language: str) -> str:
    name = Path(path).name
    lines = [f"# `{path}`", ""]
    if chapter:
        lines += [f"Part of {_faces_line(chapter, page_of(path), skip=path)}.", ""]
    if path.endswith(".py"):
        lines += ["Run it from the repository's root, on a laptop's CPU or on GPUs, as its docstring says "
                  "(`torchrun --standalone --nproc_per_node=4 " + path + "`).", ""]
    elif path.endswith(".pbs"):
        lines += [f"Submit it from the repository's root: `qsub -A $PBS_ACCOUNT {path}` "
                  "(see the [PBS guide](README.md)).", ""]
    lines += [f"```{{literalinclude}} {name}", f":language: {language}", "```", ""]
    return "\n".join(lines)


def _lab_cell(chapter: Chapter, lab: str) -> dict:
    name = Path(lab).name
    text = (f"**Run this lab yourself:** `make lab` opens the course in JupyterLab; open `notebooks/student/{name}` "
            f"there, your copy with the exercises left to do. The page below is `{lab}`, the lab with its "
            f"answers, as the course ran it on a CPU while the website was built: try the exercises before you read "
            f"it. {{download}}`Download the answers <{name}>`.\n\n{_faces_line(chapter, lab, skip=lab)}")
    return {"cell_type": "markdown", "id": "distlab-run-this-lab", "metadata": {}, "source": text}


def assemble(out: Path = OUT, repo: Path = REPO) -> Path:
    """Lay out the Sphinx source folder ``out / "source"`` (the build's own folder: files the course no longer has
    are removed from it)."""
    source = out / "source"
    staging = out / "source.new"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    _lay_out(staging, repo)
    _sync(staging, source)
    shutil.rmtree(staging)
    return source


def _sync(new: Path, old: Path) -> None:
    """Make ``old`` equal to ``new``, touching only the files that differ (Sphinx then re-reads only those: a
    rebuild with nothing changed takes seconds)."""
    old.mkdir(parents=True, exist_ok=True)
    wanted = {p.relative_to(new) for p in new.rglob("*") if p.is_file()}
    for path in old.rglob("*"):
        if path.is_file() and path.relative_to(old) not in wanted:
            path.unlink()
    for relative in wanted:
        target = old / relative
        if not target.exists() or target.read_bytes() != (new / relative).read_bytes():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(new / relative, target)


def _lay_out(source: Path, repo: Path) -> None:
    chapters = chapter_links(repo)
    known = {p.relative_to(repo).as_posix() for folder in ("scripts", "notebooks", "pbs", "chapters")
             for p in (repo / folder).rglob("*") if p.is_file() and "student" not in p.parts
             and p.suffix in (".py", ".ipynb", ".pbs", ".sh", ".md")}
    by_script = {}   # a script's page links back to the chapter that wrote it (the first to list it)
    for chapter in chapters:
        for path in chapter.scripts + ([chapter.job] if chapter.job else []):
            by_script.setdefault(path, chapter)

    # chapters, with their figures
    (source / "chapters").mkdir()
    shutil.copytree(repo / "chapters" / "figures", source / "chapters" / "figures",
                    ignore=shutil.ignore_patterns("data"))
    conventions = repo / "chapters" / "00_conventions.md"
    (source / "chapters" / conventions.name).write_text(_link_paths(conventions.read_text(),
                                                                    "chapters/00_conventions.md", known))
    for chapter in chapters:
        for path in chapter_pages(chapter.number, repo):
            page = path.relative_to(repo).as_posix()
            text = _link_paths(path.read_text(), page, known)
            title, _, rest = text.partition("\n")
            (source / page).write_text(f"{title}\n\n{_faces_line(chapter, page, skip='chapter')}\n{rest}")

    # labs, each with its first cell
    (source / "notebooks").mkdir()
    for chapter in chapters:
        for lab in chapter.labs:
            notebook = json.loads((repo / lab).read_text())
            for cell in notebook["cells"]:
                if cell["cell_type"] == "markdown":
                    text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                    cell["source"] = _link_paths(text, lab, known)
            notebook["cells"].insert(1, _lab_cell(chapter, lab))   # under the lab's title
            (source / lab).write_text(json.dumps(notebook, indent=1))

    # scripts and jobs as pages
    scripts = sorted(p.relative_to(repo).as_posix() for p in (repo / "scripts").rglob("*.py"))
    jobs = sorted(p.relative_to(repo).as_posix() for p in (repo / "pbs").iterdir()
                  if p.suffix in (".pbs", ".sh"))
    for path in scripts + jobs:
        target = source / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / path, target)
        language = "python" if path.endswith(".py") else "bash"
        (source / page_of(path)).write_text(_source_page(path, by_script.get(path), language))
    for guide in ("pbs/README.md", "slurm/README.md"):   # the two schedulers' guides: a workshop reads one of them
        (source / guide).parent.mkdir(parents=True, exist_ok=True)
        (source / guide).write_text(_link_paths((repo / guide).read_text(), guide, known))
    listing = ["# The scripts and jobs", "", "Every chapter's standalone scripts (`torchrun`, 4 CPU ranks or the GPUs "
               "of a node) and its PBS job, as source.", ""]
    for chapter in chapters:
        if chapter.scripts or chapter.job:
            listing.append(f"- [{chapter.title}](chapters/{chapter.stem}.md): "
                           + _faces_line(chapter, "scripts.md", skip="chapter"))
    others = [p for p in scripts + jobs if p not in by_script]
    listing += ["", "Shared by several chapters: " + ", ".join(f"[`{p}`]({page_of(p)})" for p in others), ""]
    (source / "scripts.md").write_text("\n".join(listing))

    # the landing page: the README, then the contents
    readme = _link_paths((repo / "README.md").read_text(), "index.md", known)
    toc = ["chapters/00_conventions.md"]
    for chapter in chapters:   # a chapter of several pages: each page in the contents, in reading order
        toc += [path.relative_to(repo).as_posix() for path in chapter_pages(chapter.number, repo)]
        for part, lab in enumerate(chapter.labs, 1):   # named apart from its chapter in the contents (some labs
            # share the chapter's title); a lab of several notebooks, part by part
            toc.append(f"{chapter.number} · the lab" + (f", part {part}" if len(chapter.labs) > 1 else "") + f" <{lab}>")
    hidden = [page_of(p) for p in scripts + jobs]
    (source / "BENCHMARKS.md").write_text((repo / "BENCHMARKS.md").read_text())
    index = [readme, "", "```{toctree}", ":caption: The course", ":maxdepth: 1", "", *toc, "```", "",
             "```{toctree}", ":caption: Reference", ":maxdepth: 1", "", "scripts.md", "pbs/README.md",
             "slurm/README.md", "BENCHMARKS.md", "```", "", "```{toctree}", ":hidden:", "", *hidden, "```", ""]
    (source / "index.md").write_text("\n".join(index))


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Lay out the website's Sphinx source folder (make site runs Sphinx).")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    source = assemble(args.out)
    print(f"site source: {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
