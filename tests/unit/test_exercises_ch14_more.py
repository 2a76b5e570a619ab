"""Lab 14's graded prompts under their "### Exercise N: ..." headings, which chapter 14's Exercises name: each
heading leads to the check cells that grade it, in the lab and in the learner's copy alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from coursetools import chapters
from helpers import lab_cells
from labkit.exercises import ch14

ROOT = Path(__file__).resolve().parents[2]
LABS = ["lab", "student"]   # the lab's notebooks with their answers, and the learner's copies
# heading -> the checks it grades: each diagnosis part by its name, then every fix
GRADED = {
    "Exercise 1: name the cause of a run that is stuck or slow": ['check_diagnoses(diagnoses_part1, "stuck or slow")'],
    "Exercise 2: name the cause of a run that stops or prints nonsense":
        ['check_diagnoses(diagnoses_part2, "stops or prints nonsense")'],
    "Exercise 3: name the cause of ranks that disagree": ['check_diagnoses(diagnoses_part3, "ranks that disagree")'],
    "Exercise 4: fix each run": ["check_fix_"],
    "Exercise 5: name the cause of a run that is wrong against one device":
        ['check_diagnoses(diagnoses_part4, "wrong against one device")'],
    "Exercise 6: fix the runs that are wrong against one device": ["check_fix_"],
    "Exercise 7: name the cause of two more jobs that stop":
        ['check_diagnoses(diagnoses_part5, "two more jobs that stop")'],
    "Exercise 8: fix the two jobs that stop": ["check_fix_"],
    "Exercise 9: name the cause of four more runs":
        ['check_diagnoses(diagnoses_part6, "four more runs")'],
    "Exercise 10: fix four more runs": ["check_fix_"],
    "Exercise 11: name the cause of three more wrong numbers":
        ['check_diagnoses(diagnoses_part7, "three more wrong numbers")'],
    "Exercise 12: fix three more wrong numbers": ["check_fix_"],
}


def graded_under_each_heading(lab: str) -> dict[str, list[str]]:
    """The source of every check cell (tagged ``check``), under the exercise heading above it, through both
    notebooks in working order."""
    under: dict[str, list[str]] = {}
    heading = None
    for cell in lab_cells("14", student=lab == "student"):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            found = re.findall(r"^###\s+(Exercise[^\n]*?)\s*$", source, flags=re.M)
            heading = found[-1] if found else heading
        elif "check" in cell.get("metadata", {}).get("tags", []):
            under.setdefault(heading, []).append(source)
    return under


@pytest.mark.parametrize("lab", LABS)
def test_each_exercise_heading_leads_to_the_checks_it_grades(lab):
    under = graded_under_each_heading(lab)
    assert None not in under, f"a check before any exercise heading: {under.get(None)}"
    assert list(under) == list(GRADED)
    for heading, checks in GRADED.items():
        assert all(any(check in source for check in checks) for source in under[heading]), heading
    assert len(under["Exercise 8: fix the two jobs that stop"]) == 2
    assert len(under["Exercise 10: fix four more runs"]) == len(ch14.PARTS["four more runs"])
    assert len(under["Exercise 6: fix the runs that are wrong against one device"]) == len(
        ch14.PARTS["wrong against one device"])
    # runs 22 and 23's functions in one check (one launch), run 24's in another
    assert [("check_fix_batch_and_tokens(" in s, "check_fix_stage_clip(" in s)
            for s in under["Exercise 12: fix three more wrong numbers"]] == [(True, False), (False, True)]
    fixes = under["Exercise 4: fix each run"]   # parts 1 to 3's fixes: runs 7, 8 and 9's in one check (one launch)
    assert len(fixes) == 8 and sum("check_fix_ranks_that_disagree(" in source for source in fixes) == 1


def test_the_chapter_names_the_labs_exercises_by_their_titles():
    assert chapters.lab_exercises("14") == list(GRADED)
    items = chapters.exercise_items(chapters.pages("14")[-1].read_text())
    assert 2 <= len(items) <= 3 and all(any(f'"{title}"' in item for title in GRADED) for item in items)


def test_the_labs_counts_of_runs_are_its_labels():
    """Each notebook's opening names its runs (how many, and their labels as ranges), its prefetch and its take-away
    count them: one per label of its parts' checks (ch14.NOTEBOOKS); the notebooks share the labels out, in the
    order of the parts, and the last take-away counts them all."""
    words = {6: "six", 9: "nine", 10: "ten", 25: "twenty-five"}
    assert [part for parts in ch14.NOTEBOOKS.values() for part in parts] == list(ch14.PARTS)
    assert [lab.stem for lab in chapters.labs("14")] == list(ch14.NOTEBOOKS)
    for lab, parts in ch14.NOTEBOOKS.items():
        cells = json.loads((ROOT / "notebooks" / f"{lab}.ipynb").read_text())["cells"]
        text = " ".join(" ".join("".join(cell["source"]) for cell in cells).split())
        opening, take_away = (" ".join("".join(cells[i]["source"]).split()) for i in (0, -1))
        labels = sorted((int(label.split()[1]) for part in parts for label in ch14.PARTS[part]))
        count = words[len(labels)]
        assert f"{count.capitalize()} " in opening[:200], lab
        firsts = [n for n in labels if n - 1 not in labels]   # each run of consecutive labels, as the opening says it
        lasts = [n for n in labels if n + 1 not in labels]
        ranges = [f"`run {a}` to `run {b}`" if a != b else f"`run {a}`" for a, b in zip(firsts, lasts)]
        assert all(range_ in opening for range_ in ranges), (lab, ranges)
        assert f'exercises.prefetch(notebook="{lab}") # this notebook\'s {count} runs start in the background' in text
        assert all(f'exercises.PARTS["{part}"]' in text for part in parts), lab
        total = words[len(ch14.LABELS)] if lab == list(ch14.NOTEBOOKS)[-1] else count
        assert f"You named {total} causes" in take_away, lab
def _cell_printing(part: str) -> str:
    return next("".join(c["source"]) for c in lab_cells("14") if f'exercises.PARTS["{part}"]' in "".join(c["source"]))


def test_parts_6_and_7_print_what_their_exercises_ask_from_the_runs_own_metrics():
    """Exercises 9 and 11 ask whether the ranks agree and how their norms add up against one device's: the cells
    print each rank's own loss and norm, one device's norm beside them, run 24's stages, and (Part 7) every check
    passed or failed, from the metrics the runs recorded (no launch of their own)."""
    run = ch14.Shown(1, 1.0, {}, "", {"checks": [], "extra": {
        "rank_losses": [[4.5, 4.25, 4.5, 4.125]], "rank_grad_norms": [[0.75, 0.5, 0.25, 1.0], [1.0, 1.0, 1.0, 1.0]],
        "one_device_grad_norms": [1.369]}})
    assert ch14.per_step(run) == ["step 0: each rank's own loss [4.5, 4.25, 4.5, 4.125]",
                                  "step 0: gradient norm logged by each rank [0.75, 0.5, 0.25, 1.0]; one device's 1.369",
                                  "step 1: gradient norm logged by each rank [1.0, 1.0, 1.0, 1.0]"]
    assert ch14.per_step(ch14.Shown(1, 1.0, {}, "", {"checks": [], "extra": {}})) == []
    for part in ("four more runs", "three more wrong numbers"):
        cell = _cell_printing(part)
        assert "exercises.per_step(run)" in cell and "exercises.run(" in cell and "launch" not in cell, part
    part7 = _cell_printing("three more wrong numbers")
    assert "'PASS' if found['passed'] else 'FAIL'" in part7 and '"1F1B"' in part7   # replicas agree; who holds what


def test_part_7_shows_the_count_of_sequences_a_step_trains_on_not_the_words_of_the_question():
    """Exercise 11 asks how many sequences a step trains on against the recipe's: the check that measures it is shown
    by what it counts, so the answer is read from the numbers, not matched with the check's name."""
    shown = ch14.shown_check_name("sequences per optimizer step = the global batch asked for (--batch)")
    assert shown == "sequences per optimizer step"
    assert ch14._shown_line("[FAIL] sequences per optimizer step = the global batch asked for (--batch)  (16, tolerance"
                            " == 8)") == "[FAIL] sequences per optimizer step  (16, tolerance == 8)"
