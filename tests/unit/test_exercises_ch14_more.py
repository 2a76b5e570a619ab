"""Lab 14's graded prompts under their "### Exercise N: ..." headings, which chapter 14's Exercises name: each
heading leads to the check cells that grade it, in the lab and in the learner's copy alike."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from coursetools import chapters
from labkit.exercises import ch14

ROOT = Path(__file__).resolve().parents[2]
LABS = [ROOT / "notebooks" / "14_when_it_goes_wrong.ipynb", ROOT / "notebooks" / "student" / "14_when_it_goes_wrong.ipynb"]
# heading -> the checks it grades: each diagnosis part by its name, then every fix
GRADED = {
    "Exercise 1: name the cause of a run that is stuck or slow": ['check_diagnoses(diagnoses_part1, "stuck or slow")'],
    "Exercise 2: name the cause of a run that stops or prints nonsense":
        ['check_diagnoses(diagnoses_part2, "stops or prints nonsense")'],
    "Exercise 3: name the cause of ranks that disagree": ['check_diagnoses(diagnoses_part3, "ranks that disagree")'],
    "Exercise 4: name the cause of a run that is wrong against one device":
        ['check_diagnoses(diagnoses_part4, "wrong against one device")'],
    "Exercise 5: fix each run": ["check_fix_"],
    "Exercise 6: name the cause of two more jobs that stop":
        ['check_diagnoses(diagnoses_part5, "two more jobs that stop")'],
    "Exercise 7: fix the two jobs that stop": ["check_fix_"],
    "Exercise 8: name the cause of four more runs":
        ['check_diagnoses(diagnoses_part6, "four more runs")'],
    "Exercise 9: fix four more runs": ["check_fix_"],
    "Exercise 10: name the cause of three more wrong numbers":
        ['check_diagnoses(diagnoses_part7, "three more wrong numbers")'],
    "Exercise 11: fix three more wrong numbers": ["check_fix_"],
}


def graded_under_each_heading(lab: Path) -> dict[str, list[str]]:
    """The source of every check cell (tagged ``check``), under the exercise heading above it."""
    under: dict[str, list[str]] = {}
    heading = None
    for cell in json.loads(lab.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            found = re.findall(r"^###\s+(Exercise[^\n]*?)\s*$", source, flags=re.M)
            heading = found[-1] if found else heading
        elif "check" in cell.get("metadata", {}).get("tags", []):
            under.setdefault(heading, []).append(source)
    return under


@pytest.mark.parametrize("lab", LABS, ids=lambda p: p.parent.name)
def test_each_exercise_heading_leads_to_the_checks_it_grades(lab):
    under = graded_under_each_heading(lab)
    assert None not in under, f"a check before any exercise heading: {under.get(None)}"
    assert list(under) == list(GRADED)
    for heading, checks in GRADED.items():
        assert all(any(check in source for check in checks) for source in under[heading]), heading
    assert len(under["Exercise 7: fix the two jobs that stop"]) == 2
    assert len(under["Exercise 9: fix four more runs"]) == len(ch14.PARTS["four more runs"])
    # runs 22 and 23's functions in one check (one launch), run 24's in another
    assert [("check_fix_batch_and_tokens(" in s, "check_fix_stage_clip(" in s)
            for s in under["Exercise 11: fix three more wrong numbers"]] == [(True, False), (False, True)]
    fixes = under["Exercise 5: fix each run"]   # every run's fix: runs 7, 8 and 9's in one check (one launch)
    assert len(fixes) == 14 and sum("check_fix_ranks_that_disagree(" in source for source in fixes) == 1


def test_the_chapter_names_the_labs_exercises_by_their_titles():
    assert chapters.lab_exercises("14") == list(GRADED)
    items = chapters.exercise_items(chapters.pages("14")[-1].read_text())
    assert 2 <= len(items) <= 3 and all(any(f'"{title}"' in item for title in GRADED) for item in items)


def test_the_labs_counts_of_runs_are_its_labels():
    """The opening and the take-away count the runs the lab shows: one per label of the checks."""
    lab = json.loads((ROOT / "notebooks" / "14_when_it_goes_wrong.ipynb").read_text())
    text = " ".join(" ".join("".join(cell["source"]) for cell in lab["cells"]).split())
    count = len(ch14.LABELS)
    word = {17: "seventeen", 18: "eighteen", 19: "nineteen", 20: "twenty", 21: "twenty-one", 22: "twenty-two",
            24: "twenty-four", 25: "twenty-five"}[count]
    assert f"{word.capitalize()} runs of the course's own scripts" in text and f"`run 1` to `run {count}`" in text
    assert f"You named {word} causes" in text and f"the {word} runs start in the background" in text


def _cell_printing(part: str) -> str:
    lab = json.loads((ROOT / "notebooks" / "14_when_it_goes_wrong.ipynb").read_text())
    return next("".join(c["source"]) for c in lab["cells"] if f'exercises.PARTS["{part}"]' in "".join(c["source"]))


def test_parts_6_and_7_print_what_their_exercises_ask_from_the_runs_own_metrics():
    """Exercises 8 and 10 ask whether the ranks agree and how their norms add up against one device's: the cells
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
    """Exercise 10 asks how many sequences a step trains on against the recipe's: the check that measures it is shown
    by what it counts, so the answer is read from the numbers, not matched with the check's name."""
    shown = ch14.shown_check_name("sequences per optimizer step = the global batch asked for (--batch)")
    assert shown == "sequences per optimizer step"
    assert ch14._shown_line("[FAIL] sequences per optimizer step = the global batch asked for (--batch)  (16, tolerance"
                            " == 8)") == "[FAIL] sequences per optimizer step  (16, tolerance == 8)"
