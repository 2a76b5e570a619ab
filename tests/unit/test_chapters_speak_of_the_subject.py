"""A chapter speaks of its subject, never of the course's own history: no "earlier version", no "the course's seed",
no "the issue asked" (what a reader cannot see and need not know). A random seed is the subject: it stays."""

import re
from pathlib import Path

import pytest

CHAPTERS = sorted((Path(__file__).resolve().parents[2] / "chapters").glob("[0-9][0-9]*.md"))
HISTORY = re.compile(r"earlier version|course's seed|the seed listed|the issue asked|an earlier session", re.I)


def history_notes(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if HISTORY.search(line)]


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_no_chapter_speaks_of_the_courses_history(chapter):
    assert history_notes(chapter.read_text()) == []


def test_the_rule_finds_history_and_leaves_a_random_seed_alone():
    assert history_notes("An earlier version of this chapter listed 12 cases.\nThe issue asked for more.") != []
    assert len(history_notes("The course's seed listed GPT-3.")) == 1
    assert history_notes("Sample i is a pure function of the seed and the epoch.") == []
