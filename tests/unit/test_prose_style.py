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
