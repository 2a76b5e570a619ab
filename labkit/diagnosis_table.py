"""Chapter 14's diagnosis table and its list of sources, written from the registry of broken runs.

The chapter shows them as this module renders them, and tests/unit/test_chapter_text_14.py keeps the two equal: a
case added to ``labkit.broken_runs.BROKEN_RUNS``, or a symptom reworded there, changes the chapter's table.
``python -m labkit.diagnosis_table --write`` writes the generated parts of the chapter again (the table, each
section's wrong fixes and reports); the prose around them stays as it is.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from labkit import diagnosis_sources

HEADER = ("what you see", "what it usually is", "the one check that tells them apart")


def _cell(text: str) -> str:
    """One table cell: a single line, with the pipe that would end the cell escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _link_text(text: str) -> str:
    """A title as a link's text: brackets escaped, or markdown would end the link there."""
    return _cell(text).replace("[", "\\[").replace("]", "\\]")


def _registry(cases):
    if cases is not None:
        return tuple(cases)
    from labkit import broken_runs

    return broken_runs.BROKEN_RUNS


def diagnosis_rows(cases=None) -> list[tuple[str, str, str]]:
    """(what you see, what it usually is, the one check that tells them apart) for each broken run, in the
    registry's order (the chapter's)."""
    return [(case.symptom, case.cause, case.tell_apart) for case in _registry(cases)]


def diagnosis_markdown(cases=None) -> str:
    """The diagnosis table as the chapter prints it: one row a broken run, grouped by family as the registry
    orders them, the family named in the first column."""
    lines = ["| family | " + " | ".join(HEADER) + " |", "|---|---|---|---|"]
    previous = None
    for case in _registry(cases):
        family = case.family if case.family != previous else ""
        previous = case.family
        lines.append("| " + " | ".join(_cell(c) for c in (family, case.symptom, case.cause, case.tell_apart)) + " |")
    return "\n".join(lines)


# Evidence the lab hides (it names the cause), in the chapter's words.
DIAGNOSIS_WORDS = {"extra.cause": "the diagnosis read from the journals", "extra.verdict": "the diagnosis read from the journals"}
EVIDENCE_HEADER = ("case", "what any user's tools show", "what only the course's instrumentation shows")


def evidence_markdown(cases=None) -> str:
    """Each case's evidence (the registry's ``evidence`` keys, in the lab's words), split by who can see it
    (``broken_runs.SEEN_BY``): a user's own tools, or only the course's instrumentation."""
    from labkit import broken_runs
    from labkit.exercises.ch14 import EVIDENCE_WORDS

    lines = ["| " + " | ".join(EVIDENCE_HEADER) + " |", "|---|---|---|"]
    for case in _registry(cases):
        seen = {"user": [], "course": []}
        for key in case.evidence:
            seen[broken_runs.SEEN_BY[key]].append(EVIDENCE_WORDS.get(key) or DIAGNOSIS_WORDS[key])
        cells = [f"`{case.name}`"] + ["; ".join(dict.fromkeys(seen[who])) or "nothing" for who in ("user", "course")]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


NCCL_LINE = "**On a GPU (NCCL).**"


def nccl_line(case) -> list[str]:
    """The line of a case's section that says what the same mistake shows on GPUs (the registry's ``on_nccl``)."""
    return [f"{NCCL_LINE} {_cell(case.on_nccl)}"] if case.on_nccl else []


def scripts_markdown(cases=None) -> str:
    """The scripts the broken runs live in, in the registry's order, each once: "`a.py`, `b.py` and `c.py`"."""
    scripts = [f"`{path}`" for path in dict.fromkeys(case.script for case in _registry(cases))]
    return ", ".join(scripts[:-1]) + f" and {scripts[-1]}" if len(scripts) > 1 else "".join(scripts)


def _flags(args) -> dict[str, tuple[str, ...]]:
    """Command-line arguments as {flag: its values}: ("--a", "1", "--b") -> {"--a": ("1",), "--b": ()}."""
    flags: dict[str, tuple[str, ...]] = {}
    flag = None
    for arg in args:
        if arg.startswith("--"):
            flag = arg
            flags[flag] = ()
        elif flag is not None:
            flags[flag] += (arg,)
    return flags


def wrong_fix_lines(case) -> list[str]:
    """The lines of a case's section for its plausible wrong fixes (the registry's ``wrong_fixes``): the flags the
    wrong fix changes in the broken run, and why the symptom stays."""
    broken = _flags(case.args)
    lines = []
    for args, why in case.wrong_fixes:
        changed = [" ".join((flag, *values)) for flag, values in _flags(args).items() if broken.get(flag) != values]
        lines.append(f"**Not a fix.** `{' '.join(changed)}`: {_cell(why)}.")
    return lines


def sources_line(name: str) -> str:
    """The line of a case's section that names the public reports it comes from, as links (their quotes are in
    labkit/diagnosis_sources.py)."""
    found = diagnosis_sources.sources_for(name)
    links = "; ".join(f"[{_link_text(s['title'])}]({s['url']})" for s in found)
    return f"**Reported.** {links or 'none found'}."


ROOT = Path(__file__).resolve().parent.parent
CHAPTER = ROOT / "chapters" / "14_when_it_goes_wrong.md"   # the chapter's first page; main() writes every page


def update_chapter(text: str, cases=None) -> str:
    """Chapter 14's text (one page of it, or all) with its generated parts written again from the registry and the
    sources: the diagnosis table and the evidence table where the text holds them, and in each case's section its
    '**Not a fix.**', '**On a GPU (NCCL).**' and '**Reported.**' lines (after its '**The fix.**' paragraph). The prose around them is left as it is."""
    cases = _registry(cases)
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("| family | ")), None)
    if start is not None:
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
        lines[start:end] = diagnosis_markdown(cases).split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(f"| {EVIDENCE_HEADER[0]} | ")), None)
    if start is not None:
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
        lines[start:end] = evidence_markdown(cases).split("\n")
    text = "\n".join(lines)
    sections = re.split(r"(?m)^(?=##+ )", text)
    for i, section in enumerate(sections):
        heading = section.split("\n", 1)[0]
        case = next((c for c in cases if heading.endswith(f"(`{c.name}`)")), None)
        names = [case.name] if case else [n for n in diagnosis_sources.LEFT_OUT if heading.startswith("### Left out")]
        if not names:
            continue
        body = section.rstrip("\n")
        kept = [p for p in body.split("\n\n")
                if p.strip() and not p.startswith(("**Not a fix.**", "**Reported.**", NCCL_LINE))]
        fix = next((j for j, p in enumerate(kept) if p.startswith("**The fix.**")), len(kept) - 1)
        kept[fix + 1:fix + 1] = ((wrong_fix_lines(case) + nccl_line(case)) if case else []) + [sources_line(names[0])]
        sections[i] = "\n\n".join(kept) + ("\n\n" if i + 1 < len(sections) else "\n")   # one blank line
    return "".join(sections)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labkit.diagnosis_table", description=update_chapter.__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the chapter's pages in place (else: print them)")
    options = parser.parse_args(argv)
    # the chapter's pages (coursetools.chapters names them; labkit does not import the course's build tools)
    for page in [CHAPTER, *sorted(CHAPTER.parent.glob("14.[0-9]*_*.md"))]:
        text = update_chapter(page.read_text())
        if options.write:
            page.write_text(text)
            print(f"wrote {page}")
        else:
            print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
