"""Issue 33's style over every text a learner reads (the chapters, the labs' markdown, the README, CONTRIBUTING): one
idea a sentence, a mean of 20 words or fewer, none over 40, measured by ``coursetools.prose`` (the one measurement:
``make prose`` prints it). The first tests hold the measurement itself to what a reader reads."""

from __future__ import annotations

import pytest

from coursetools import prose

TEXTS = prose.course_texts()


def test_the_measure_counts_what_a_reader_reads():
    page = ("# A heading of many words that is not a sentence at all\n\nOne short sentence. Another one, with "
            "`labkit.broken_runs.run_case(name)` in it.\n\n```\ncode. is. not. prose.\n```\n\n| a | table. |\n\n"
            "- a list item of 2.5 words\n- a [linked](https://x.org/a.b) item, e.g. this one\n\n"
            "<!-- a comment. -->\n> A quoted line.\n")
    assert prose.sentences(page) == ["One short sentence.", "Another one, with CODE in it.",
                                     "a list item of 2.5 words", "a linked item, e.g. this one", "A quoted line."]


def test_a_sentence_over_40_words_or_a_long_mean_is_caught():
    long_one = " ".join(["word"] * 41) + "."
    assert prose.measure("planted", f"Short one. {long_one}").over_40 == [long_one]
    assert not prose.measure("planted", f"Short one. {long_one}").keeps_the_style
    wordy = " ".join(" ".join(["word"] * 21) + "." for _ in range(5))       # every sentence 21 words, none over 40
    assert prose.measure("planted", wordy).mean == 21 and not prose.measure("planted", wordy).keeps_the_style
    assert prose.measure("planted", "Three words here. And four words here.").keeps_the_style


def test_every_text_is_measured():
    names = set(TEXTS)
    assert {f"chapters/{n:02d}" for n in range(15)} <= {name[:11] for name in names}
    assert sum(name.startswith("notebooks/") for name in names) == 14
    assert {"README.md", "CONTRIBUTING.md"} <= names


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_one_idea_a_sentence(name):
    measured = prose.measure(name, TEXTS[name])
    too_long = "\n".join(f"  [{prose.words(s)}] {s}" for s in measured.over_40)
    assert not measured.over_40, f"{name}: sentences over {prose.MOST_WORDS} words:\n{too_long}"
    assert measured.mean <= prose.MEAN_WORDS, (
        f"{name}: a mean of {measured.mean:.1f} words a sentence (at most {prose.MEAN_WORDS})")


def test_contributing_example_is_true():
    """CONTRIBUTING's before-and-after example: the "before" (chapter 11's opening as it was) has a sentence as long as
    the note says, over the limit; each piece of the "after" is in chapter 11 now (so the example drifts with the chapter)."""
    import re
    from pathlib import Path
    note = TEXTS["CONTRIBUTING.md"]
    before = re.search(r"Before:.*?already runs (\d+) words.*?```text\n(.*?)```", note, flags=re.S)
    longest = max(prose.words(s) for s in prose.sentences(before.group(2).replace("[...]", "")))
    assert longest == int(before.group(1)) > prose.MOST_WORDS, (longest, before.group(1))
    after = note[note.index("After:"):note.index("## A script")]
    quoted = " ".join(line[1:].strip() for line in after.splitlines() if line.startswith(">"))
    chapter = " ".join((Path(prose.ROOT) / "chapters" / "11_choosing_a_strategy.md").read_text().split())
    pieces = [p.strip(" -") for p in re.split(r"\[\.\.\.\]|\*\(.*?\)\*|- ", quoted) if len(p.strip(" -")) > 20]
    assert len(pieces) >= 3 and all(piece in chapter for piece in pieces), [p for p in pieces if p not in chapter]
