"""Chapter 14's pages against the code: its diagnosis table and list of sources are what labkit.diagnosis_table
renders from the registry of broken runs, its recap and its picture of the diagnosis paths are what
coursetools.drawings.ch14 reads from the same registry, every broken run has its section under the group of what a
user sees, the numbers it states come from the committed runs, and its prose keeps issue 33's style (measured for
every text in tests/unit/test_prose_style.py). The chapter is read whole, all its pages, through
coursetools.chapters.text("14"); what proves (torch's lines, the registry's table) sits in its "How we know".
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from coursetools import chapters
from coursetools.drawings import ch14
from helpers import lab_cells
from labkit import diagnosis_table

ROOT = Path(__file__).resolve().parents[2]
CHAPTER = chapters.text("14")
FLAT = " ".join(CHAPTER.split())
BODY, APPENDIX = chapters.split_appendix(CHAPTER)
FLAT_APPENDIX = " ".join(APPENDIX.split())
NUMBER_WORDS = {8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}
REGENERATE = "run `python -m labkit.diagnosis_table --write` (it rewrites the generated parts only)"


def registry():
    return pytest.importorskip("labkit.broken_runs", reason="helper A's registry of broken runs is not here yet")


# ---- the style of issue 33 is measured for every text at once: tests/unit/test_prose_style.py


# ---- the table and the sources, rendered from the registry


def test_the_diagnosis_table_is_the_registrys():
    """The registry's own words for every case, as diagnosis_table renders them, sit in "How we know" (they cite
    torch's lines); the body's recap is the short table of the diagnosis paths."""
    cases = registry().BROKEN_RUNS
    table = diagnosis_table.diagnosis_markdown(cases)
    assert table in APPENDIX, f"chapter 14's diagnosis table is stale: {REGENERATE}"
    assert table not in BODY and len(cases) >= 12
    assert ch14.recap_markdown(cases) in chapters.section(BODY, "Recap"), "the recap table is stale"


def test_the_diagnosis_paths_are_the_registrys_cases_grouped_by_what_a_user_sees():
    """Every case of the registry has its path (what you see, what to look at, the cause), and the groups are read
    from the registry's own fields: a hang or an error stops the run, a resume has an interrupted run first, a slow
    run is judged by its throughput."""
    cases = registry().BROKEN_RUNS
    taught = [name for page in chapters.pages("14")   # each case's section, in the order the pages teach them
              for name in re.findall(r"^### .*\(`([a-z0-9-]+)`\)\s*$", page.read_text(), flags=re.M)]
    assert sorted(taught) == sorted(case.name for case in cases)
    assert list(ch14.PATHS) == taught   # the picture's and the recap's order is the chapter's
    groups = dict(ch14.grouped(cases))
    names = {group: [case.name for case in members] for group, members in groups.items()}
    assert names["Hangs, timeouts and errors"] == ["uneven-inputs", "fsdp-before-tp", "mismatched-collectives",
                                                   "full-state-on-rank-0", "rank-0-evaluation", "unused-parameter",
                                                   "token-out-of-vocabulary"]
    assert [name for name in taught if name in names["Wrong numbers"]] == names["Wrong numbers"]
    assert names["Slow steps"] == ["too-few-microbatches", "slow-rank"]
    assert names["Resumes"] == ["checkpoint-one-shard", "resume-without-rng"]
    assert all(case.hang for case in cases if case.name in ("uneven-inputs", "mismatched-collectives"))
    assert len(names["Wrong numbers"]) == 14 and sum(map(len, names.values())) == len(cases)
    for words in ch14.PATHS.values():
        assert len(words) == 3 and all(0 < len(w.split()) <= 8 for w in words), words
    assert "![" in BODY and "(figures/14_diagnosis_paths.png)" in chapters.pages("14")[0].read_text()


def test_a_case_is_grouped_by_its_own_fields():
    """The rule of :func:`ch14.seen`, seen failing: a made-up case moves group when its fields say so."""
    from dataclasses import replace

    base = registry().case("loss-averaged-twice")
    assert ch14.seen(base) == "Wrong numbers"
    assert ch14.seen(replace(base, hang_cause="skipped collective")) == "Hangs, timeouts and errors"
    assert ch14.seen(replace(base, symptom="It stops with RuntimeError: no.")) == "Hangs, timeouts and errors"
    assert ch14.seen(replace(base, evidence=("throughput",))) == "Slow steps"
    assert ch14.seen(replace(base, prepare_args=("--stop-after", "3"))) == "Resumes"


def test_every_section_names_its_wrong_fixes_and_reports_as_the_registry_and_sources_have_them():
    from labkit import diagnosis_sources

    sections = re.split(r"^### ", CHAPTER, flags=re.M)
    for case in registry().BROKEN_RUNS:
        section = next(part for part in sections if part.split("\n", 1)[0].endswith(f"(`{case.name}`)"))
        line = diagnosis_table.sources_line(case.name)
        assert line in section.splitlines(), f"{case.name}: its reports are stale: {REGENERATE}"
        wrong = [line for line in section.splitlines() if line.startswith("**Not a fix.**")]
        assert wrong == diagnosis_table.wrong_fix_lines(case), f"{case.name}: its wrong fixes are stale: {REGENERATE}"
    left_out = next(part for part in sections if part.startswith("Left out"))
    assert all(diagnosis_table.sources_line(name) in left_out for name in diagnosis_sources.LEFT_OUT)
    assert "none found" not in CHAPTER


def test_every_broken_run_has_its_section_under_the_group_of_what_a_user_sees():
    """Cases come by what a user sees (wrong numbers, hangs and errors, slow steps, resumes), each in its group's
    section of the body, the groups in the order of the picture."""
    headings = re.findall(r"^(##+) (.+)$", BODY, flags=re.M)
    order = []
    for case in registry().BROKEN_RUNS:
        titles = [(level, title) for level, title in headings if f"(`{case.name}`)" in title]
        assert len(titles) == 1 and titles[0][0] == "###", f"{case.name}: no section of its own"
        above = [title for level, title in headings[:headings.index(titles[0])] if level == "##"][-1]
        assert above.startswith(ch14.seen(case)), (case.name, above, ch14.seen(case))
        order.append((headings.index(titles[0]), ch14.GROUPS.index(ch14.seen(case))))
    assert [group for _, group in sorted(order)] == sorted(group for _, group in order)
    for name in registry_left_out():
        assert "Left out: dropout" in CHAPTER and name.startswith("tp-dropout")


def registry_left_out():
    from labkit import diagnosis_sources

    return list(diagnosis_sources.LEFT_OUT)


def test_the_scripts_and_the_example_commands_are_the_registrys():
    broken_runs = registry()
    # the website's chapter links read every page (coursetools.site.chapter_text); the list is proof, not teaching
    assert diagnosis_table.scripts_markdown(broken_runs.BROKEN_RUNS) in FLAT_APPENDIX
    assert diagnosis_table.scripts_markdown(broken_runs.BROKEN_RUNS) not in " ".join(BODY.split())
    scripts = len({c.script for c in broken_runs.BROKEN_RUNS})
    assert f"live in {NUMBER_WORDS[scripts]} scripts of earlier chapters" in FLAT_APPENDIX
    case = broken_runs.case("accumulation-never-syncs")
    for fixed in (False, True):
        assert " ".join(case.command(fixed=fixed)) in CHAPTER.splitlines(), fixed


def test_the_cases_the_gpu_job_leaves_out_are_the_registrys():
    left_out = [case for case in registry().BROKEN_RUNS if case.gpu_note]
    assert [case.name for case in left_out] == ["mismatched-collectives"]   # "One case stays on the CPU"
    for case in left_out:
        assert f"`{case.name}`, because {case.gpu_note}." in FLAT
    for job in ("pbs/14_when_it_goes_wrong.pbs", "slurm/14_when_it_goes_wrong.sbatch"):
        assert (ROOT / job).is_file() and f"`{job}`" in CHAPTER


# ---- the numbers of the prose, from the committed runs behind the figures and from torch's source


def sci(value: float) -> str:
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def measured(name: str) -> dict:
    import json

    return json.loads((ROOT / "chapters" / "figures" / "data" / name).read_text())


def test_the_bf16_numbers_are_the_measured_ones():
    import torch

    rows = measured("14_bf16_reduction.json")["rows"]
    at = {(r["world_size"], r["reduce_dtype"]): r["gradient_diff"] for r in rows}
    fp32 = max(v for (_, dtype), v in at.items() if dtype == "fp32")
    assert f"within {sci(fp32)} of one device's" in FLAT
    assert f"{sci(at[2, 'bf16'])} away on 2 ranks and {sci(at[4, 'bf16'])} on 4" in FLAT
    assert f"On 8 ranks the largest error is {sci(at[8, 'bf16'])} again" in FLAT and at[8, "bf16"] == at[4, "bf16"]
    # 8 ranks measure no more than 4: growth with the rank count is not a symptom to rely on, the bytes are
    assert at[8, "bf16"] <= at[4, "bf16"] and "more on 4 ranks than on 2" not in FLAT
    assert "do not judge by the rank count" in FLAT
    assert torch.finfo(torch.bfloat16).eps == 2 ** -7 and "keeps 8 significant bits" in FLAT   # 7 stored + 1

def test_the_bf16_reports_say_what_the_chapter_says_of_them():
    from labkit import diagnosis_sources

    quotes = {s["url"].rsplit("/", 3)[1]: s["quote"] for s in diagnosis_sources.SOURCES["bf16-gradient-reduction"]}
    assert "trained well on 12x8 GPUs" in quotes["pytorch"] and "unstable on 48x8 GPUs" in quotes["pytorch"]
    assert "stable on 12 x 8 GPUs turn unstable on 48 x 8" in FLAT
    assert "N-1 hops" in quotes["Megatron-LM"] and "grows as √N" in quotes["Megatron-LM"]
    assert "rounds at each of its N-1 hops" in FLAT and "error to grow as √N" in FLAT


def test_the_bubble_numbers_are_the_measured_ones_and_the_formulas():
    from distlab import schedules

    for run in measured("14_pipeline_bubble.json")["runs"]:
        m, p = run["microbatches"], run["stages"]
        assert run["bubble"]["formula"] == pytest.approx(schedules.bubble_fraction(p, m))
        formula, seen = f"{100 * schedules.bubble_fraction(p, m):.0f}%", f"{100 * run['bubble']['measured']:.0f}%"
        assert seen in FLAT and formula in FLAT, (m, seen, formula)
    assert "With 2 microbatches on 4 stages that is 60%. With 8 it is 27%." in FLAT
    assert schedules.bubble_fraction(4, 8) < schedules.bubble_fraction(4, 2) / 2   # the chain's conclusion
    assert "Four times as many microbatches cut the idle share to less than half" in FLAT


def test_the_straggler_numbers_are_the_measured_ones():
    source = (ROOT / "scripts" / "12_hpc_operations" / "profile_step.py").read_text()
    slow_rank, seconds = re.search(r"^SLOW_RANK, SLOW_RANK_SECONDS = (\d+), ([\d.]+)$", source, flags=re.M).groups()
    ranks = measured("14_straggler_vs_hang.json")["slow"]["ranks"]
    others = [1e3 * r["communication"] / r["steps"] for r in ranks if r["rank"] != int(slow_rank)]
    assert f"rank {slow_rank} is given {float(seconds):g} s of extra work a step before its forward" in FLAT
    # the trace's view of that work: compute more than each other rank's by the range the text says, and with the
    # late rank's extra idle time (waiting for a core) the planted seconds again
    late = next(r for r in ranks if r["rank"] == int(slow_rank))
    peers = [r for r in ranks if r["rank"] != int(slow_rank)]
    extra = [(late["compute"] - r["compute"]) / r["steps"] for r in peers]
    assert f"Its trace shows {min(extra):.2f} to {max(extra):.2f} s more compute a step than each other rank's" in FLAT
    busy = [(late["compute"] + late["idle"] - r["compute"] - r["idle"]) / r["steps"] for r in peers]
    assert sum(busy) / len(busy) == pytest.approx(float(seconds), abs=0.03), busy
    assert f"the rest of the {float(seconds):g} s is idle, waiting for one of the 2 cores its 4 ranks share" in FLAT
    low, high = 10 * math.floor(min(others) / 10), 10 * math.ceil(max(others) / 10)
    own = 1e3 * late["communication"] / late["steps"]   # the last to arrive waits for nobody: the all-reduce itself
    assert f"The three others spend {low} to {high} ms a step waiting in communication" in FLAT
    assert f"which costs rank {slow_rank}, the last to arrive, {own:.0f} ms a step" in FLAT
    assert abs(sum(others) / len(others) - (1e3 * float(seconds) + own)) < 30   # the wait: the lateness, the transfer
    journals = measured("14_straggler_vs_hang.json")["hang"]["journals"].values()   # the hang's earlier batches
    assert min(sum(c["done"] for c in j["calls"]) for j in journals) >= 1             # completed on every rank
    assert "The last step never completes." in FLAT and "No step completes" not in FLAT


def test_the_resume_numbers_are_the_measured_ones():
    run = measured("14_resumes.json")
    # the learner's review s16, finding 20: the jump is said against the step's first loss, which was one device's
    shard = run["checkpoint-one-shard"]
    first = shard["first_step"]
    before, after = shard["earlier"][str(first)], shard["broken"]["losses_by_step"][str(first)]
    assert before == shard["uninterrupted"][first] and after - before == pytest.approx(shard["jump"])
    assert (f"step {first} is trained twice. The second time its loss is {shard['jump']:.2f} above the first, which "
            "was one device's") in FLAT
    assert "the loss jumps by" not in FLAT
    rng = run["resume-without-rng"]
    assert f"trains step {rng['steps_trained_twice'][0]} a second time, and gets another loss, {rng['jump']:.2f} away" \
        in FLAT


def test_the_torch_lines_the_chapter_cites():
    import torch

    torch_dir = Path(torch.__file__).parent
    sampler = (torch_dir / "utils" / "data" / "distributed.py").read_text().splitlines()
    assert sampler[110].strip() == "g.manual_seed(self.seed + self.epoch)"
    assert "the same ordering will be always used" in " ".join(sampler[47:52])
    assert "(torch/utils/data/distributed.py:111)" in FLAT_APPENDIX and "(lines 48-52)" in FLAT_APPENDIX
    ddp = (torch_dir / "nn" / "parallel" / "distributed.py").read_text()
    no_sync = ddp[ddp.index("    def no_sync(self):"):][:600]
    assert "synchronized in the first\n        forward-backward pass exiting the context" in no_sync
    assert '"the first forward-backward pass exiting the context"' in FLAT
    api = (torch_dir / "distributed" / "tensor" / "_api.py").read_text().splitlines()
    assert "if tensor.device_mesh != device_mesh:" in api[952] and "Cannot distribute a DTensor with device mesh" in \
        api[954] and "to a different device mesh" in api[955]
    assert "(torch/distributed/tensor/_api.py:953-957)" in FLAT_APPENDIX


def test_the_generated_parts_are_written_again_from_the_registry_and_nothing_else_moves():
    cases = registry().BROKEN_RUNS
    for page in chapters.pages("14"):   # what `python -m labkit.diagnosis_table --write` does, page by page
        assert diagnosis_table.update_chapter(page.read_text(), cases) == page.read_text(), page.name
    assert diagnosis_table.update_chapter(CHAPTER, cases) == CHAPTER
    stale = CHAPTER.replace(cases[0].symptom, "an old symptom", 1)
    stale = stale.replace(diagnosis_table.sources_line(cases[1].name) + "\n", "", 1)
    stale = stale.replace(diagnosis_table.wrong_fix_lines(cases[0])[0], "**Not a fix.** `--old`: old.", 1)
    assert stale != CHAPTER and diagnosis_table.update_chapter(stale, cases) == CHAPTER


def test_a_wrong_fix_is_named_by_the_flags_it_changes():
    class Case:
        args = ("--steps", "3", "--microbatches", "2", "--planted-bug", "x")
        wrong_fixes = ((("--steps", "3", "--microbatches", "4", "--planted-bug", "x", "--no-shuffle"), "still | slow"),)

    expected = "**Not a fix.** `--microbatches 4 --no-shuffle`: still \\| slow."
    assert diagnosis_table.wrong_fix_lines(Case()) == [expected]


def test_a_table_cell_cannot_break_the_table():
    class Case:
        name, family, symptom, cause, tell_apart = "x", "data", "a | b", "one\nline", "c"

    assert diagnosis_table.diagnosis_markdown([Case()]).splitlines()[-1] == "| data | a \\| b | one line | c |"


# ---- each claim about a curve, tested against the committed curve (issue 47)


def test_the_data_parallel_claims_are_the_committed_curves():
    runs = measured("14_data_parallel_losses.json")["runs"]
    cases = {case.name: case for case in registry().BROKEN_RUNS}
    gaps = runs["accumulation-never-syncs"]["from_one_device"]   # off one device after the first update, more each step
    assert gaps[0] < 1e-5 and all(b > a for a, b in zip(gaps[1:], gaps[2:])), gaps
    assert f"{gaps[1]:.2f} away at step 1, then further at every step, {gaps[-1]:.2f} at step {len(gaps) - 1}" in FLAT
    assert "the gap grows at every step" in cases["accumulation-never-syncs"].symptom
    epoch = runs["no-set-epoch"]["from_one_device"]               # departs at the turn, the run's last step
    assert max(epoch[:-1]) < 1e-5 and epoch[-1] > 1e-2 and len(epoch) == 5, epoch
    assert f"the last step of this run, it departs, by {epoch[-1]:.3f}" in FLAT
    for claim in ("drift further apart", "stays apart", "never rejoins", "differ more every step", "to 1e-5"):
        assert claim not in FLAT and not any(claim in c.symptom for c in cases.values()), claim


def test_the_one_shard_resume_stays_above_one_device_by_the_committed_gaps():
    run = measured("14_resumes.json")["checkpoint-one-shard"]
    after = run["broken"]["losses_by_step"]
    gaps = [after[step] - run["uninterrupted"][int(step)] for step in sorted(after, key=int)]
    assert all(gap > 0.1 for gap in gaps) and all(b < a for a, b in zip(gaps, gaps[1:])), gaps   # shrinking
    assert f"by {gaps[0]:.2f}, {gaps[1]:.2f} and {gaps[2]:.2f}: the gap shrinks" in FLAT
    assert "stays above one device's to the end of the run, the gap shrinking" in \
        registry().case("checkpoint-one-shard").symptom


def test_the_torch_lines_of_the_second_pass():
    import torch

    torch_dir = Path(torch.__file__).parent / "distributed"
    schedules = (torch_dir / "pipelining" / "schedules.py").read_text().splitlines()
    one_f_one_b = next(i for i, line in enumerate(schedules) if line.startswith("class Schedule1F1B("))
    assert one_f_one_b < 1019 and schedules[1019].strip() == "if n_microbatches < self._num_stages:"
    assert "raise ValueError(" in schedules[1020] and "must be greater than" in schedules[1021]
    assert not any(line.startswith("class ") for line in schedules[one_f_one_b + 1:1020])   # still 1F1B's
    assert "(torch/distributed/pipelining/schedules.py:1020-1024)" in FLAT_APPENDIX and "This run chooses GPipe" in FLAT
    api = (torch_dir / "fsdp" / "_fully_shard" / "_fsdp_api.py").read_text().splitlines()
    assert api[32].strip().startswith("reduce_dtype (Optional[torch.dtype])")
    assert "uses the compute dtype" in api[35] and "(Default: ``None``)" in api[39]
    assert "(torch/distributed/fsdp/_fully_shard/_fsdp_api.py:33-40)" in FLAT_APPENDIX
    assert "_fsdp_api.py:33-40" in registry().case("bf16-gradient-reduction").cause
    gather = (torch_dir / "_state_dict_utils.py").read_text().splitlines()
    assert "# FSDP all_gather" in gather[269] and "value = value.redistribute(" in gather[275]
    assert "(torch/distributed/_state_dict_utils.py:270-279)" in FLAT_APPENDIX
    assert "is a collective" in registry().case("checkpoint-one-shard").fix


def test_the_tp_case_is_the_data_layout_not_the_mesh():
    case = registry().case("data-by-global-rank")
    assert case.script.endswith("fsdp_tp_hybrid.py") and "--planted-bug" in case.args
    assert "mesh.get_local_rank('dp')" in case.fix and "innermost" not in case.fix
    assert "groups read back from the model's mesh are right" in case.symptom
    assert not registry().__dict__.get("tp-on-dp-group") and "tp-on-dp-group" not in CHAPTER


def test_the_sources_that_do_not_show_their_symptom_are_gone():
    from labkit import diagnosis_sources

    urls = {s["url"] for sources in diagnosis_sources.SOURCES.values() for s in sources}
    for gone in ("snowfall/issues/152", "sparseml/pull/135", "pytorch/issues/64625", "huggingface.co/spaces/rockeycoss",
                 "Neuron_SP/issues/589", "fairseq/issues/2033"):   # fairseq #2033 asks how to keep the batch
        assert not any(gone in url for url in urls), gone
    assert not any(s["url"].endswith("/pull/144702") for s in diagnosis_sources.SOURCES["too-few-microbatches"])
    first, second = diagnosis_sources.TORCH_CHANGES["too-few-microbatches"]
    assert first["url"].endswith("/pull/144702") and "GPipe worked with MB < PP" in first["quote"]
    assert second["url"].endswith("/pull/171462") and "check only for 1F1B" in second["quote"]
    assert "Pull request #144702 added that refusal" not in FLAT
    assert FLAT_APPENDIX.index("#144702") < FLAT_APPENDIX.index("#171462")
    assert "refused it for every single-stage schedule, GPipe too" in FLAT_APPENDIX
    assert "moved the check into `Schedule1F1B` alone" in FLAT_APPENDIX
    assert "144702" not in BODY   # its title reads the comparison backwards: cited where it is explained


def test_the_fsdp_param_lines_the_optimizer_case_cites():
    import torch

    lines = (Path(torch.__file__).parent / "distributed" / "fsdp" / "_fully_shard" / "_fsdp_param.py").read_text() \
        .splitlines()
    assert lines[324].strip() == "self.sharded_param = nn.Parameter(" and \
        lines[330].strip() == "self._setattr_on_modules(self.sharded_param)"
    assert "(torch/distributed/fsdp/_fully_shard/_fsdp_param.py:325-331)" in FLAT_APPENDIX
    assert "_fsdp_param.py:325-331" in registry().case("optimizer-before-sharding").cause


def test_the_debug_level_that_checks_collectives_is_torchs():
    import torch

    lines = (Path(torch.__file__).parent / "distributed" / "distributed_c10d.py").read_text().splitlines()
    assert "enables enhanced collective checking for debuggability" in lines[2287]
    assert lines[2288].strip() == "if get_debug_level() == DebugLevel.DETAIL:"
    assert "_create_process_group_wrapper(" in lines[2297] and lines[2305].strip() == ")"
    assert '"enables enhanced collective checking for debuggability" (torch/distributed/distributed_c10d.py:2287-2306)' \
        in FLAT_APPENDIX and "`TORCH_DISTRIBUTED_DEBUG=DETAIL` checks each collective's kind and shapes" in FLAT
    wrapper = (Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d" /
               "ProcessGroupWrapper.hpp").read_text().splitlines()
    assert "monitored" in wrapper[187] and "collective fingerprint collecting" in wrapper[188]
    assert "(torch/include/torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp:188-189)" in FLAT_APPENDIX
    from labkit import diagnosis_sources

    introduced, turned_on = diagnosis_sources.TORCH_CHANGES["mismatched-collectives"]
    assert introduced["url"].endswith("/pull/58224") and "CollectiveFingerPrint" in introduced["quote"]
    assert turned_on["url"].endswith("/pull/58281") and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in turned_on["quote"]
    assert "124447" not in CHAPTER and FLAT_APPENDIX.index("#58224") < FLAT_APPENDIX.index("#58281")


# ---- the two cold reviews of the teach-first chapter: each finding held by the text it fixed


def section_of(name: str) -> str:
    """The text of a case's section (its ### heading to the next heading)."""
    return " ".join(re.search(rf"^### [^\n]*\(`{re.escape(name)}`\)\n(.*?)(?=^##)", CHAPTER, flags=re.M | re.S)
                    .group(1).split())


def test_a_hang_as_a_user_on_gpus_with_nccl_sees_it():
    """Each hang case says what NCCL's watchdog prints after torch's default 10 minutes; 2 s is the CPU runs'."""
    import torch

    from labkit import broken_runs

    c10d = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
    nccl = (c10d / "ProcessGroupNCCL.hpp").read_text().splitlines()
    assert nccl[156].strip() == "constexpr auto kProcessGroupNCCLDefaultTimeout =" and \
        nccl[157].strip() == "std::chrono::milliseconds(10 * 60 * 1000);"
    assert "(torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp:157-158)" in FLAT_APPENDIX
    assert broken_runs.HANG_TIMEOUT == ("--pg-timeout", "2") and "timeout, 2 s in the broken runs" in FLAT
    job = (ROOT / "pbs" / "14_when_it_goes_wrong.pbs").read_text()
    assert 'broken uneven-inputs "$deadlocks" --hang uneven-inputs --pg-timeout 10 ' in job
    assert "`--pg-timeout 2` (`HANG_TIMEOUT` in `labkit/broken_runs.py`); the GPU job passes 10 s" in FLAT_APPENDIX
    hangs = " ".join(chapters.section(BODY, "Hangs, timeouts and errors").split())
    assert "`Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., OpType=...)`, after 10 minutes" in hangs
    assert "flight recorder" in hangs and "here 2 s" not in hangs
    uneven, mismatched = section_of("uneven-inputs"), section_of("mismatched-collectives")
    assert "the same `SeqNum`, with `OpType=ALLREDUCE`" in uneven
    assert "`OpType=BROADCAST` on rank 0 and `OpType=ALLREDUCE` on the others" in mismatched
    # a lost node: NCCL's own error, the survivors in one call, torchrun's agent stopping the node's other ranks
    assert "though it rarely prints a connection error" not in FLAT
    assert "remote process exited or there was a network error" in mismatched and "`ncclRemoteError`" in mismatched
    assert "The ranks that remain all wait in the same collective" in mismatched
    agent = (Path(torch.__file__).parent / "distributed" / "elastic" / "agent" / "server" / "api.py").read_text() \
        .splitlines()
    assert agent[939].strip() == "elif state in {WorkerState.UNHEALTHY, WorkerState.FAILED}:"
    assert agent[951].strip() == "self._restart_workers(self._worker_group)" and \
        agent[953].strip() == "self._stop_workers(self._worker_group)"
    assert "(torch/distributed/elastic/agent/server/api.py:940-956)" in FLAT_APPENDIX
    assert "`src/init.cc:3068` at tag v2.29.7-1" in FLAT_APPENDIX


def test_the_tools_of_chapter_12_are_said_where_they_are_first_used():
    """A reader of chapters 01-10 and 13 meets the journal, the profiler and TrainingState with a clause each."""
    first = " ".join(chapters.pages("14")[0].read_text().split())
    assert "read it first" in first[:1200]
    flat_body = " ".join(BODY.split())
    for term, says in (("journal", "records every collective"), ("profiler", "records when each operator"),
                       ("TrainingState", "saves the random generators")):
        at = flat_body.index(term)
        assert says in flat_body[max(0, at - 250):at + 250], term


def test_the_findings_on_the_cases_are_fixed():
    from labkit import broken_runs

    twice = section_of("loss-averaged-twice")
    source = (ROOT / "scripts" / "04_data_parallel" / "ddp_from_scratch.py").read_text()
    assert "def average_gradients(model):" in source and "param.grad.div_(world_size)" in source
    assert "`ddp_from_scratch.py`" in twice and "`average_gradients`" in twice and "DDP already averages" not in twice
    assert "This run computes in fp32 too" not in FLAT and "so its fix is that one argument" in FLAT
    assert "A mesh built with its names swapped fails that check instead" not in FLAT
    assert "the order the field asks about most" not in FLAT
    assert "`DistributedSampler`, which pads the shards to equal length, is the usual choice" in section_of(
        "uneven-inputs")
    drill = (ROOT / "scripts" / "12_hpc_operations" / "fault_drill.py").read_text()
    assert "MASK_FRACTION = 0.1 " in drill and "replaces a random tenth of the input tokens" in FLAT
    assert "other random masks" not in FLAT and "other random masks" not in broken_runs.case("resume-without-rng").cause
    slow = section_of("slow-rank")
    assert "CUDA events" in slow and "GPU timeline" in slow
    assert "overlapped: communication that ran while the rank computed" in FLAT
    assert "under `if rank == 0:`" in section_of("checkpoint-one-shard")


def test_a_bubble_far_above_the_formula_is_said_by_where_the_idle_time_sits():
    """The formula's idle time is the staircase; any gap between two forwards or two backwards of a rank is a
    message or a slow neighbour: here under 4 ms, against stages of 10 ms."""
    for run in measured("14_pipeline_bubble.json")["runs"]:
        gaps = []
        for rank in range(run["stages"]):
            ops = sorted((e for e in run["timeline"] if e["rank"] == rank), key=lambda e: e["start"])
            gaps += [1e3 * (b["start"] - a["end"]) for a, b in zip(ops, ops[1:]) if a["kind"] == b["kind"]]
        assert max(gaps) < 4, max(gaps)
        argv = run["argv"]
        assert argv[argv.index("--stage-compute-ms") + 1] == "10"
    assert "either a message (under 4 ms here, against 10 ms of forward work) or a wait for a slow neighbour" in FLAT


def test_the_resumes_say_where_the_checkpoint_was_taken():
    run = measured("14_resumes.json")
    shard, rng = run["checkpoint-one-shard"], run["resume-without-rng"]
    saved_shard, saved_rng = shard["first_step"] - 1, min(rng["steps_trained_twice"]) - 1
    assert f"the checkpoint after step {saved_shard}" in FLAT and f"the checkpoint after step {saved_rng}" in FLAT
    # the first training of the step trained twice is the fixed run's: both ran the same first attempt
    step = saved_rng + 1
    assert abs(rng["fixed"]["losses"][step] - rng["broken"]["losses"][step]) == pytest.approx(rng["jump"], abs=1e-6)
    import json

    markdown = " ".join("".join(c["source"]) for c in lab_cells("14") if c["cell_type"] == "markdown")
    assert f"from its checkpoint after step {saved_rng}" in markdown and "checkpoint of step 4" not in markdown
    assert f"interrupted after step {shard['first_step']}" in markdown


def test_the_exercises_lead_to_every_exercise_of_the_lab():
    listed = " ".join(chapters.exercise_items(BODY))
    titles = chapters.lab_exercises("14")
    assert len(titles) == 12 and all(f'"{title}"' in listed for title in titles), titles


def test_each_exercise_is_listed_under_the_notebook_that_asks_it():
    """Cold review s16, finding 8: the list item under each notebook's path quotes exactly that notebook's
    exercise headings, in its order, read from the notebooks themselves (and their learner's copies, the paths the
    page names); every notebook of the lab has its item, in working order."""
    labs = chapters.labs("14")
    expected = {}
    for lab in labs:
        path = f"notebooks/student/{lab.name}"
        expected[path] = chapters.notebook_exercises(lab)
        assert expected[path] and chapters.notebook_exercises(ROOT / path) == expected[path], path
    named = []
    for item in chapters.exercise_items(BODY):
        paths = re.findall(r"`(notebooks/student/14_\w+\.ipynb)`", item)
        assert len(paths) == 1, item[:80]
        named.append(paths[0])
        assert re.findall(r'"(Exercise \d+: [^"]*)"', item) == expected[paths[0]], paths[0]
    assert named == list(expected)


def test_the_exercise_list_says_which_of_the_first_pages_questions_each_notebook_asks():
    """Cold review s16, finding 7: "asks the first questions" and "asks the third" read, after the bullet
    "Exercise 3", as exercises. Each notebook's item quotes the first page's questions it asks, in the page's words."""
    first = chapters.pages("14")[0].read_text()
    questions = [q[0].lower() + q[1:] for q in re.findall(r"^\d\. \*\*(.+?)\*\*", first, flags=re.M)]
    assert len(questions) == 3 and questions[2] == "does the run agree with one device?", questions
    items = chapters.exercise_items(BODY)
    assert f"the first page's first two questions ({questions[0]} {questions[1]})" in items[0]
    assert "The runs that stop or print nonsense come between them" in items[0]
    assert f"the first page's third question ({questions[2]})" in items[1]
    assert "asks the first questions" not in FLAT and "asks the third:" not in FLAT


def test_exercise_11s_hint_asks_what_the_notebook_asks_of_its_three_runs():
    """Cold review s16, finding 11: the notebook's Exercise 11 asks what the ranks share (run 24), how many sequences
    a step trains on (run 22) and what a step's loss averages over (run 23); the chapter's hint asks all three."""
    import json

    lab = ROOT / "notebooks" / "14_more_failures.ipynb"
    cells = ["".join(c["source"]) for c in json.loads(lab.read_text())["cells"] if c["cell_type"] == "markdown"]
    asked = " ".join(next(c for c in cells if c.startswith("### Exercise 11:")).split())
    assert "their weights, their own losses, the norms they clip by?" in asked
    assert "How many sequences does one step train on" in asked and "What does one step's loss average over" in asked
    item = next(i for i in chapters.exercise_items(BODY) if "14_more_failures" in i)
    hint = item[item.index('"Exercise 11:'):item.index('"Exercise 12:')]
    assert "their weights, their own losses, the norm they clip by" in hint
    assert "how many sequences a step trains on" in hint and "what its loss averages over" in hint


def test_the_picture_shows_which_question_sends_you_to_each_band():
    assert list(ch14.QUESTIONS) == list(ch14.GROUPS)
    assert ch14.QUESTIONS["Hangs, timeouts and errors"].startswith("question 1")
    assert ch14.QUESTIONS["Slow steps"].startswith("question 1")
    assert ch14.QUESTIONS["Wrong numbers"].startswith("questions 2 and 3")
    assert ch14.QUESTIONS["Resumes"].startswith("question 3")
    first = " ".join(chapters.pages("14")[0].read_text().split())
    assert "Question 1 sends a run that stops to the hangs and errors, and a slow one to the slow steps." in first


def test_the_two_resume_cases_share_their_symptom_and_the_text_names_the_check_that_parts_them():
    # a learner could not tell the two resumes apart by what they show: both train a step twice and get two losses
    import json
    data = json.loads((ROOT / "chapters" / "figures" / "data" / "14_resumes.json").read_text())
    shard, rng = data["checkpoint-one-shard"], data["resume-without-rng"]
    step = shard["first_step"]
    assert abs(shard["broken"]["losses_by_step"][str(step)] - shard["earlier"][str(step)]) > 0.05
    assert rng["steps_trained_twice"] and rng["jump"] > 0.05
    assert ("Both also show the same symptom: a step trained twice, with two different losses. To tell them apart, "
            "compare the reloaded weights with the saved ones") in FLAT


def test_the_hang_timeout_of_the_broken_runs_is_theirs():
    broken = registry()
    from distlab import runtime
    assert broken.HANG_TIMEOUT == ("--pg-timeout", "2") and runtime.DEFAULT_PG_TIMEOUT_S == 300
    assert ("2 s in the broken runs (their own `--pg-timeout`, against the course's default of 300 s)") in FLAT


def test_the_per_rank_init_case_cites_torchs_lines_and_states_the_measured_gap():
    """fully_shard keeps the rank's own chunk of what it was given; DDP broadcasts rank 0's weights when built. The
    gap the page states is the registry's symptom, which tests/scripts/test_14 holds to the run."""
    import torch

    torch_dir = Path(torch.__file__).parent
    fsdp_param = (torch_dir / "distributed" / "fsdp" / "_fully_shard" / "_fsdp_param.py").read_text().splitlines()
    assert fsdp_param[297].strip().startswith("chunks = _chunk_with_empty(param_data, shard_world_size")
    assert fsdp_param[298].strip() == "sharded_param = chunks[shard_rank]"
    ddp = (torch_dir / "nn" / "parallel" / "distributed.py").read_text().splitlines()
    assert ddp[1064].strip().startswith("# Sync params and buffers") and ddp[1065].strip() == "_sync_module_states("
    assert ddp[1069].strip() == "src=0,"
    cause = registry().case("per-rank-init").cause
    for cited in ("torch/distributed/fsdp/_fully_shard/_fsdp_param.py:298-299", "torch/nn/parallel/distributed.py:1065-1073"):
        assert cited in cause and cited in FLAT_APPENDIX
    gap = re.search(r"differ by the same amount \(([\d.]+)\)", registry().case("per-rank-init").symptom)[1]
    assert f"they differ by {gap} before the first step" in " ".join(section_of("per-rank-init").split())


def test_the_local_grad_norm_case_cites_torchs_lines_and_states_the_measured_norms():
    """A DTensor's norm is a partial p-norm, all-reduced as x^p (torch's own docstring); clip_grad_norm_ scales by
    max_norm / (total_norm + 1e-6), clamped at 1. The norms the page states are the registry's symptom's, which
    tests/scripts/test_14 holds to the run."""
    import torch

    torch_dir = Path(torch.__file__).parent
    math_ops = (torch_dir / "distributed" / "tensor" / "_ops" / "_math_ops.py").read_text().splitlines()
    assert math_ops[65].strip() == "@dataclass(frozen=True)" and math_ops[66].startswith("class _NormPartial(Partial):")
    assert "x^p -> allreduce sum -> x^(1/p)" in math_ops[77]
    clip = (torch_dir / "nn" / "utils" / "clip_grad.py").read_text().splitlines()
    assert clip[163].strip() == "clip_coef = max_norm / (total_norm + 1e-6)"
    assert clip[167].strip() == "clip_coef_clamped = torch.clamp(clip_coef, max=1.0)"
    case = registry().case("local-grad-norm")
    assert "torch/distributed/tensor/_ops/_math_ops.py:66-79" in case.cause and "_math_ops.py:66-79" in FLAT_APPENDIX
    low, high, whole = re.search(r"\(([\d.]+) to ([\d.]+) at step 0\), none near one device's \(([\d.]+)\)",
                                 case.symptom).groups()
    assert f"{low} to {high} at step 0, where one device's norm is {whole}" in section_of("local-grad-norm")
    assert f"a total norm of {case.fixed_args[case.fixed_args.index('--max-grad-norm') + 1]}," in section_of(
        "local-grad-norm")


def test_the_nan_case_states_the_registrys_step_and_the_rank_the_run_plants():
    """The step the page states is the registry's (tests/scripts/test_14 holds it to the run's own losses), and the
    rank the registry names is the one train_ddp.py plants the masked micro-batch on, with 4 ranks."""
    case = registry().case("nan-from-one-rank")
    step = re.search(r"nan from step (\d+)", case.symptom)[1]
    assert f"then prints `nan` from step {step} on" in section_of("nan-from-one-rank")
    script = (ROOT / case.script).read_text()
    assert f"NAN_STEP = {step} " in script and "nan_rank = min(2, world - 1)" in script and "On rank 2," in case.cause


def test_the_unused_parameter_case_quotes_torchs_words_as_the_run_prints_them():
    """The page quotes the registry's words, which tests/scripts/test_14 finds in the run's own error."""
    quoted = registry().case("unused-parameter").symptom.split("'")[1]
    assert f'every rank stops: "{quoted}"' in section_of("unused-parameter")
    assert "0 bytes all-reduced" in section_of("unused-parameter")
def test_every_case_says_how_it_looks_on_nccl_beside_its_cpu_run():
    """Each case's section carries its registry's on_nccl line (one table cell: 40 words at most), written by
    labkit.diagnosis_table; a case without one would leave its GPU look unsaid."""
    from labkit import broken_runs

    for case in broken_runs.BROKEN_RUNS:
        assert case.on_nccl and len(case.on_nccl.split()) <= 40, case.name
        assert f"{diagnosis_table.NCCL_LINE} {' '.join(case.on_nccl.split())}" in section_of(case.name), case.name


def test_who_can_see_each_cases_evidence_is_the_registrys():
    """Every evidence key of every case is sorted into what a user's tools show and what only the course's
    instrumentation shows, and the appendix holds that table as diagnosis_table renders it (not the body)."""
    from labkit import broken_runs

    keys = {key for case in broken_runs.BROKEN_RUNS for key in case.evidence}
    assert keys <= set(broken_runs.SEEN_BY) and set(broken_runs.SEEN_BY.values()) == {"user", "course"}
    table = diagnosis_table.evidence_markdown(broken_runs.BROKEN_RUNS)
    assert table in APPENDIX and table not in BODY
    assert broken_runs.SEEN_BY["extra.diffs.baseline_loss"] == "course" == broken_runs.SEEN_BY["extra.journals"]
    assert broken_runs.SEEN_BY["extra.rank_losses"] == "user" == broken_runs.SEEN_BY["extra.flight_recorder"]
    # torch's own error, printed on every rank, is unused-parameter's first evidence: any user reads it
    assert broken_runs.case("unused-parameter").evidence[0] == "output"
    # per-rank-init's replicas compared shard by shard: train_fsdp.py's own words, "what any HSDP user can check"
    assert broken_runs.SEEN_BY["extra.replica_weight_gaps"] == "user"
    assert "what any HSDP user can check" in (ROOT / "scripts/05_fully_sharded/train_fsdp.py").read_text()


def test_the_nccl_lines_of_the_gpu_look():
    """The NCCL variables and FSDP2's averaging in bf16, as the appendix cites them in the installed torch 2.13."""
    import torch

    c10d = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
    header = (c10d / "ProcessGroupNCCL.hpp").read_text().splitlines()[59:85]
    for name in ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_DESYNC_DEBUG"):
        assert any(f'"{name}"' in line for line in header), name
    assert header[-1].strip() == '"NCCL_DESYNC_DEBUG"};'   # the last name's declaration ends on the range's line
    assert "(torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp:60-85)" in FLAT_APPENDIX
    # the flight recorder dumps on a timeout by default: torch 2.13's own test has to turn it off
    test = (Path(torch.__file__).parent / "testing" / "_internal" / "distributed" / "distributed_test.py") \
        .read_text().splitlines()
    assert "disable TORCH_NCCL_DUMP_ON_TIMEOUT otherwise this test times out" in test[8941]
    assert test[8942].strip() == 'os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "0"'
    assert "torch/testing/_internal/distributed/distributed_test.py:8942-8943" in FLAT_APPENDIX
    assert "`TORCH_NCCL_DUMP_ON_TIMEOUT=1`" not in FLAT and "dumps them on a timeout by default" in FLAT
    fsdp = (Path(torch.__file__).parent / "distributed" / "fsdp" / "_fully_shard" / "_fsdp_collectives.py") \
        .read_text().splitlines()
    assert "use NCCL's built-in division" in fsdp[829] and "torch.float32, torch.bfloat16" in fsdp[830]
    assert fsdp[845].strip() == "return None, None, ReduceOp.AVG, ReduceOp.AVG"
    assert "(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:829-846)" in FLAT_APPENDIX
    assert "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1580, OpType=ALLREDUCE" in FLAT_APPENDIX


def test_what_the_gpu_look_rests_on_is_cited():
    """The on_nccl lines' public sources: the watchdog's line at the end of an epoch, at a save and after an
    evaluation, and a waiting GPU shown busy."""
    for link in ("https://github.com/hiyouga/LlamaFactory/issues/7396", "https://github.com/jpata/particleflow/issues/390",
                 "https://github.com/NVIDIA/nccl/issues/968", "https://github.com/cupy/cupy/issues/3557",
                 "https://github.com/huggingface/transformers/pull/35234",
                 "https://github.com/meta-pytorch/torchtune/issues/2093", "https://github.com/ACEsuit/mace/issues/1348"):
        assert link in APPENDIX, link
    assert "full utilisation at low power" in section_of("slow-rank")
    assert "OpType=_ALLGATHER_BASE" in section_of("full-state-on-rank-0") and "OpType=_ALLGATHER_BASE" in APPENDIX
    assert "OpType=ALLREDUCE" in section_of("rank-0-evaluation")


def _number_word(n: int) -> str:
    """21 -> "twenty-one": how the chapter writes a count."""
    ones = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
           "seventeen eighteen nineteen".split()
    tens = {2: "twenty", 3: "thirty", 4: "forty"}
    return ones[n] if n < 20 else tens[n // 10] + ("" if n % 10 == 0 else "-" + ones[n % 10])


def test_the_first_pages_counts_are_the_registrys_and_the_pictures():
    """The count of broken runs is the registry's, the count of paths that start "off one device" is the
    picture's, and question 2 is not said to find a single case (several cases' ranks disagree)."""
    first = " ".join(chapters.pages("14")[0].read_text().split())
    runs = _number_word(len(registry().BROKEN_RUNS))
    assert f"answers with {runs} broken runs" in first
    assert f"![{runs.capitalize()} paths" in first
    alike = sum(words[0].startswith("off one device") for words in ch14.PATHS.values())
    assert f"{_number_word(alike)} runs look alike: \"off one device\"" in first
    assert "Question 2 finds the cases whose ranks disagree" in first and "the one wrong-numbers case" not in first
    assert _number_word(21) == "twenty-one" and _number_word(4) == "four" and _number_word(30) == "thirty"


def test_no_run_number_is_tied_to_its_case_before_the_learner_names_it():
    """The lab's runs are numbered so that a number says nothing of the cause. The chapter never speaks of a run
    by its number; the learner's copy mentions a run before the part that asks for its cause only in the range
    of names ("`run 1` to `run 21`") or in a call that shows it; the checks' help() names no run."""
    import inspect
    import json

    from labkit.exercises import ch14 as lab

    number = re.compile(r"\b[Rr]uns? \d+")
    assert not number.findall(CHAPTER), number.findall(CHAPTER)
    cells = ["".join(c["source"]) for c in lab_cells("14", student=True)]   # every notebook, in working order
    # a notebook's opening names its labels as ranges ("`run 1` to `run 9`, and `run 25`"): neutral
    neutral = re.compile(r"`run \d+` to `run \d+`(, and `run \d+`)?|exercises\.run\(\"run \d+\"\)")
    parts = [i for i, cell in enumerate(cells) if cell.startswith("## Part ")]   # in the order of lab.PARTS
    assert len(parts) == len(lab.PARTS)
    for first, (part, runs) in zip(parts, lab.PARTS.items()):
        for cell in cells[:first]:
            said = {f"run {n}" for n in re.findall(r"\b[Rr]uns? (\d+)", neutral.sub("", cell))}
            assert not said & set(runs), (part, said & set(runs), cell[:300])
    for name, check in inspect.getmembers(lab, inspect.isfunction):
        if name.startswith("check_fix"):
            assert not number.findall(check.__doc__ or ""), name


def test_the_unused_parameter_case_says_ddps_first_iteration_takes_one_bucket():
    """Why unused-parameter's step 0 all-reduces 0 bytes, on any model: without find_unused_parameters (and with no
    per-bucket caps), torch 2.13's DDP puts every parameter in one bucket on its first iteration, whatever
    bucket_cap_mb says, so the one bucket waits for the head's gradient. Not the model's size against the cap."""
    import torch

    ddp = (Path(torch.__file__).parent / "nn" / "parallel" / "distributed.py").read_text().splitlines()
    assert "disable initial bucketing" in ddp[150] and "(put all params in one bucket initially)" in ddp[151]
    assert ddp[152].strip() == "if static_graph or not find_unused_parameters:"
    assert ddp[153].strip() == "bucket_size_limits = [sys.maxsize]"
    assert "we only disable bucketing for the first iteration" in ddp[1404]
    script = (ROOT / "scripts/04_data_parallel/train_ddp.py").read_text()
    assert "bucket_cap_mb=args.bucket_mb," in script and "bucket_cap_mb_list" not in script   # no per-bucket caps
    section = " ".join(section_of("unused-parameter").split())
    assert "On its first iteration DDP puts every parameter in one bucket" in section and "on any model" in section
    assert "fit in DDP's first bucket" not in FLAT and "fit in one bucket of" not in FLAT
    assert "(torch/nn/parallel/distributed.py:151-154; 1405)" in FLAT_APPENDIX


def test_the_resume_fix_names_every_part_a_checkpoint_can_hold_and_why_the_loss_log_stays_out():
    """Lab 14's resume exercise offers ch14.CHECKPOINT_PARTS: the chapter's fix says what each is and which to keep
    out, so that the answer the job accepts can be found in the text."""
    from labkit.exercises import ch14 as lab

    case = BODY[BODY.index("### Resumed without the random state and the data position (`resume-without-rng`)"):]
    fix = " ".join(case[case.index("**The fix.**"):case.index("**On a GPU (NCCL).**")].split())
    words = {"model": "the model", "optimizer": "the optimizer", "rng": "random generators",
             "data_position": "the loader's state", "step": "the step counter", "loss_history": "the log of losses"}
    assert set(words) == set(lab.CHECKPOINT_PARTS)
    assert all(said in fix for said in words.values()), fix
    assert "Keep the log of losses out: written back on a restart, it erases what was logged since the" in fix


def test_the_pipeline_clip_case_does_not_say_fsdp2_reduces_over_the_stages():
    """A DTensor's norm is all-reduced over the mesh its placements name (_NormPartial), and a pipeline's stages
    are not in that mesh: with PP and FSDP2 together clip_grad_norm_ still takes one stage's norm (torchtitan #596,
    whose answer says DTensor dispatch 'is not aware of PP'). Neither the page nor the registry may say FSDP2 fixes it."""
    case = registry().case("stage-grad-norm")
    section = " ".join(section_of("stage-grad-norm").split())
    assert "Under FSDP2 the same call is right" not in section
    assert "the same call on DTensors would reduce it" not in case.tell_apart
    assert "pytorch/torchtitan #596" in section
    assert "with PP and FSDP2 together" in section and "over the pipeline's ranks" in section
    # the fix scales as torch does: clip_coef clamped at 1 (clip_grad.py:164-168), so a small norm is left alone
    assert "scales by `min(1, max_norm / norm)`" in section and "(when above 1)" in case.fix


def _train_ddp():
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "scripts" / "04_data_parallel"))   # as the script runs: beside ddp_from_scratch
    spec = importlib.util.spec_from_file_location("train_ddp", ROOT / "scripts" / "04_data_parallel" / "train_ddp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_token_mean_case_states_the_kept_targets_the_run_keeps():
    """A sequence keeps its first 1 to S targets, S the tiny model's sequence length (kept_targets, run on the
    shortest and the longest first token), as the page and train_ddp.py's --help both say; the page's gap is the
    registry's, which tests/scripts/test_14 holds to the run."""
    import torch

    from distlab import models

    seq_len = models.preset("tiny").seq_len
    tokens = torch.tensor([[0] * (seq_len + 1), [seq_len - 1] * (seq_len + 1)])   # token_sample: seq_len + 1 tokens
    fewest, most = _train_ddp().kept_targets(tokens).sum(dim=1).tolist()
    section = " ".join(section_of("token-mean-per-micro-batch").split())
    assert f"on its first targets only, {fewest} to {most} of them (a sequence holds {seq_len} targets)" in section
    source = (ROOT / "scripts" / "04_data_parallel" / "train_ddp.py").read_text()
    said = " ".join(re.search(r'"--uneven-lengths", action="store_true",\s*help=((?:\s*"[^"]*")+)', source)[1]
                    .replace('"', "").split())
    assert (fewest, most) == (1, seq_len) and "its first 1 to S of its S targets only (S: the preset's sequence " \
        "length;" in said, said
    worst = re.search(r"\(([\d.]+) at worst\)", registry().case("token-mean-per-micro-batch").symptom)[1]
    assert f"off one device's from the first step, {worst} at worst" in section


def test_the_global_batch_case_states_the_registrys_numbers_and_the_recipe_the_script_keeps():
    """The page's batches, steps and gap are the registry's symptom's (tests/scripts/test_14 holds them to the run);
    the recipe's ranks, micro-batches and sequences are the script's TUNED_WORLD, the data cases' --accumulation and
    the script's default global batch."""
    from labkit import broken_runs

    case = registry().case("global-batch-grows")
    grown, recipe, turn, worst, samples, grown_epoch, recipe_epoch = re.search(
        r"global batch (\d+) where the recipe's is (\d+), .* most at step (\d+) \(([\d.]+) below\), where a "
        r"second epoch starts: (\d+) samples, (\d+) steps an epoch, not (\d+)", case.symptom).groups()
    section = " ".join(section_of("global-batch-grows").split())
    assert f"says global batch {grown}; the recipe's is {recipe}." in section
    assert f"most at step {turn}, {worst} below, where a second epoch starts" in section
    assert f"the run's {samples} samples make an epoch of {grown_epoch} steps, not {recipe_epoch}" in section
    assert f"From step {turn} the run reads samples it has already trained on" in section
    tuned = _train_ddp().TUNED_WORLD
    accumulation = int(broken_runs.DDP_RUN[broken_runs.DDP_RUN.index("--accumulation") + 1])
    default = int(re.search(r"args\.batch = args\.batch or \(16 if args\.preset == \"a100\" else (\d+)\)",
                            (ROOT / case.script).read_text())[1])
    assert default == int(recipe)
    assert (f"tuned on {tuned} ranks: {accumulation} micro-batches of {default // (tuned * accumulation)} sequences a "
            f"rank, a global batch of {default}") in section


def test_the_pipeline_clip_case_states_the_registrys_norms():
    """The norms the page states are the registry's symptom's, which tests/scripts/test_14 holds to the run; the
    total norm it clips to is the run's --max-grad-norm."""
    case = registry().case("stage-grad-norm")
    low, high, whole = re.search(r"\(([\d.]+) to ([\d.]+) at step 0\), none near one device's \(([\d.]+)\)",
                                 case.symptom).groups()
    section = " ".join(section_of("stage-grad-norm").split())
    assert f"{low} to {high} at step 0, where one device's norm is {whole}" in section
    assert f"clips to a total norm of {case.args[case.args.index('--max-grad-norm') + 1]}," in section


def test_the_torch_lines_of_the_newest_cases():
    """The lines the appendix cites for stage-grad-norm, token-mean-per-micro-batch, global-batch-grows and NCCL's
    remote error, read in the installed torch: a torch upgrade that moves them fails here."""
    import torch

    torch_dir = Path(torch.__file__).parent
    clip = (torch_dir / "nn" / "utils" / "clip_grad.py").read_text().splitlines()
    assert clip[94].strip() == "norms.extend(torch._foreach_norm(device_tensors, norm_type))"   # each tensor's norm
    assert "torch.linalg.vector_norm(g, norm_type) for g in device_tensors" in clip[101]
    assert clip[104].strip() == "total_norm = torch.linalg.vector_norm(" and "torch.stack(" in clip[105]   # normed again
    assert clip[229].strip().startswith("total_norm = _get_total_norm(grads,")
    assert clip[230].strip().startswith("_clip_grads_with_norm_(parameters, max_norm, total_norm")
    assert not any("process_group" in line or "all_reduce" in line for line in clip[80:232])   # no group anywhere
    assert "(torch/nn/utils/clip_grad.py:95-107, called at 230-231)" in FLAT_APPENDIX
    loss = (torch_dir / "nn" / "modules" / "loss.py").read_text().splitlines()
    owner = next(line for line in reversed(loss[:1277]) if line.startswith("class "))
    assert owner.startswith("class CrossEntropyLoss(") and "ignore_index" in loss[1277]
    assert "the loss is averaged over non-ignored targets" in " ".join(x.strip() for x in loss[1278:1280])
    assert "(torch/nn/modules/loss.py:1278-1281)" in FLAT_APPENDIX
    sampler = (torch_dir / "utils" / "data" / "distributed.py").read_text().splitlines()
    assert sampler[101].strip().startswith("self.num_samples = math.ceil(len(self.dataset) / self.num_replicas)")
    assert sampler[102].strip() == "self.total_size = self.num_samples * self.num_replicas"
    assert "(torch/utils/data/distributed.py:102-103)" in FLAT_APPENDIX
    nccl = (torch_dir / "include" / "torch" / "csrc" / "distributed" / "c10d" / "NCCLUtils.hpp").read_text().splitlines()
    assert nccl[62].startswith("#define C10D_NCCL_CHECK(cmd, failureReason)")
    assert "TORCH_CHECK_WITH(DistBackendError, false, err);" in nccl[69] and nccl[71].strip() == "} while (0)"
    assert "(`C10D_NCCL_CHECK` in torch/include/torch/csrc/distributed/c10d/NCCLUtils.hpp:63-72)" in FLAT_APPENDIX


def test_the_default_timeout_is_named_as_the_courses_beside_torchs():
    """300 s is distlab.runtime's default, not torch's: torch's own is default_pg_timeout (30 minutes, gloo) and
    kProcessGroupNCCLDefaultTimeout (10 minutes, NCCL), read from the installed torch."""
    import torch

    from distlab import runtime

    gloo = int(torch.distributed.constants.default_pg_timeout.total_seconds() // 60)
    nccl = (Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d" /
            "ProcessGroupNCCL.hpp").read_text().splitlines()
    minutes = int(re.search(r"milliseconds\((\d+) \* 60 \* 1000\)", nccl[157])[1])
    said = (f"against the course's default of {runtime.DEFAULT_PG_TIMEOUT_S} s), and every rank prints its journal. "
            f"Torch's own default is {gloo} minutes on gloo, {minutes} on NCCL.")
    assert said in FLAT


def test_the_error_one_rank_raises_cites_torchs_summary_as_torch_writes_it():
    """token-out-of-vocabulary's check is torch's failure summary: @record writes an uncaught exception to
    TORCHELASTIC_ERROR_FILE (whole seconds), the agent names one file a worker, polls every 0.1 s, stops the rest on
    the first failure, and torchrun's ChildFailedError lists the failures, the root cause last, the smallest timestamp.
    The appendix cites those lines in the installed torch 2.13; the section says what a user reads."""
    import torch

    elastic = Path(torch.__file__).parent / "distributed" / "elastic"
    errors = (elastic / "multiprocessing" / "errors" / "__init__.py").read_text().splitlines()
    assert errors[388].strip() == "except Exception as e:" and errors[389].strip() == "error_handler.record_exception(e)"
    assert errors[199].strip() == "Root Cause (first observed failure):" and errors[196].strip() == "Failures:"
    assert errors[192].startswith("_MSG_FORMAT_TEMPLATE") and errors[201].strip() == '${boarder}"""'
    assert "min(self.failures.keys(), key=lambda r: self.failures[r].timestamp)" in errors[248]
    assert errors[139].strip() == "if self.exitcode < 0:" and "To enable traceback see" in errors[149]
    handler = (elastic / "multiprocessing" / "errors" / "error_handler.py").read_text().splitlines()
    assert handler[75].strip() == "file = self._get_error_file_path()" and '"timestamp": str(int(time.time()))' in \
        handler[82] and handler[87].strip() == "json.dump(data, fp)"
    assert 'os.environ.get("TORCHELASTIC_ERROR_FILE", None)' in handler[41]
    api = (elastic / "multiprocessing" / "api.py").read_text().splitlines()
    assert 'error_file = os.path.join(clogdir, "error.json")' in api[383]
    assert api[389].strip() == 'envs[local_rank]["TORCHELASTIC_ERROR_FILE"] = error_file'
    assert api[987].strip() == "# if ALL procs are finished or ANY have failed" and "self.close()" in api[989]
    launcher = (elastic.parent / "launcher" / "api.py").read_text().splitlines()
    assert launcher[382].strip() == "raise ChildFailedError(" and launcher[385].strip() == ")"
    run = (elastic.parent / "run.py").read_text().splitlines()
    assert run[498].strip() == '"--monitor-interval",' and run[502].strip() == "default=0.1,"
    for cited in ("(torch/distributed/elastic/multiprocessing/errors/__init__.py:389-391; error_handler.py:76-88)",
                  "(torch/distributed/elastic/multiprocessing/api.py:384-390)", "(torch/distributed/run.py:498-504)",
                  "(torch/distributed/elastic/multiprocessing/api.py:988-992)",
                  "(torch/distributed/launcher/api.py:379-386)",
                  "(torch/distributed/elastic/multiprocessing/errors/__init__.py:193-202)", "(lines 248-250)",
                  "(lines 137-150)"):
        assert cited in FLAT_APPENDIX, cited
    from labkit import diagnosis_sources

    printed, moved = diagnosis_sources.TORCH_CHANGES["token-out-of-vocabulary"]
    assert printed["url"].endswith("/pull/64036") and "`@record` annotation" in printed["quote"]
    assert moved["url"].endswith("/pull/66182") and "since the logs are being \"tailed\"" in moved["quote"]
    assert "otherwise no traceback is printed" in moved["quote"]
    section = section_of("token-out-of-vocabulary")
    assert '"Root Cause (first observed failure)"' in section and "torch's `@record`" in section
    assert "Read the first failure, not the last lines." in section
    docs = next(s for s in diagnosis_sources.SOURCES["token-out-of-vocabulary"] if "notes/cuda" in s["url"])
    assert "CUDA_LAUNCH_BLOCKING=1" in docs["quote"] and "does not show where it was requested" in docs["quote"]
    assert "CUDA_LAUNCH_BLOCKING=1 reports it at the lookup" in section and "device-side assert" in section
    assert "does not show where it was requested" in FLAT_APPENDIX and "No GPU run of the case" in FLAT_APPENDIX


def test_the_token_case_states_the_vocabulary_and_the_step_the_run_has():
    """The id, the vocabulary, the rank and the step the section states are the tiny preset's and train_ddp.py's
    (tests/scripts/test_14 holds the registry's to the run)."""
    from distlab import models

    vocabulary = models.preset("tiny").vocab_size
    script = _train_ddp()
    section = section_of("token-out-of-vocabulary")
    assert f"A sequence rank {script.BAD_TOKEN_RANK} reads holds token id {vocabulary}." in section
    assert f"The vocabulary has {vocabulary} ids, 0 to {vocabulary - 1}" in section
    assert f"Step {script.BAD_TOKEN_STEP - 1} trains. At step {script.BAD_TOKEN_STEP} the job stops." in section
    assert f"Rank {script.BAD_TOKEN_RANK} raises `IndexError: index out of range in self`" in section


def test_the_token_case_says_what_torchrun_shows_and_what_the_fork_launcher_shows():
    """torchrun's agent stops every other rank at its first poll that finds a failure (api.py:988-992), so a rank
    still waiting prints nothing; labkit.forkrun gives the others a few seconds (forkrun.GRACE_SECONDS), so there every
    rank prints its own error. The section says both, as each run shows them (tests/scripts/test_14 runs both); the
    registry's symptom and the recap no longer say that every rank prints a traceback."""
    from labkit import broken_runs, forkrun

    section = section_of("token-out-of-vocabulary")
    assert "Under torchrun its agent then stops every other rank at once" in section and "any still waiting prints nothing" in section
    assert "The course's fork launcher gives them a few seconds, so there all three print gloo's error" in section
    assert forkrun.GRACE_SECONDS >= 2
    case = broken_runs.case("token-out-of-vocabulary")
    assert "stopped at once by torchrun" in case.symptom and "every rank stops with a traceback" not in case.symptom
    assert "every rank's traceback" not in ch14.PATHS[case.name][0] and "every rank prints a traceback" not in FLAT
    assert "unlike torchrun" in forkrun.__doc__ and "as torchrun does" not in forkrun.__doc__


def test_the_token_case_keeps_the_bad_ids_out_of_the_input_not_only_out_of_the_loss():
    """The lookup reads the input: masking the targets (ignore_index) still feeds id V to the embedding. The guard
    replaces a rejected sequence's ids before the forward and masks its targets, as train_ddp.py does."""
    from labkit import broken_runs

    script = (ROOT / "scripts/04_data_parallel/train_ddp.py").read_text()
    assert "tokens = torch.where(ok[:, None], tokens, torch.zeros_like(tokens))" in script
    assert "return tokens, kept_targets(tokens, every) & ok[:, None]" in script
    section = section_of("token-out-of-vocabulary")
    assert "out of the model's input, not only out of the loss" in section and "replace its ids before the forward" \
        in section and "before `.to(device)`" in section
    assert "out of the model's input" in broken_runs.case("token-out-of-vocabulary").fix
    assert "is left out of the loss" not in broken_runs.case("token-out-of-vocabulary").fix


def test_the_token_case_on_a_gpu_says_the_faulting_ranks_watchdog_may_abort_it_first():
    """torch 2.13's NCCL watchdog rethrows CUDA errors by default (TORCH_NCCL_RETHROW_CUDA_ERRORS): after the
    device-side assert, the sticky error reaches the watchdog's query of an NCCL work's event and the process is
    aborted (SIGABRT), perhaps before @record writes (pytorch/pytorch #126544). The GPU line says so, the appendix
    cites it, and the job's check accepts that rank's SIGABRT as the root cause when its log holds the assert."""
    import torch

    from labkit import broken_runs

    hpp = (Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d" /
           "ProcessGroupNCCL.hpp").read_text().splitlines()
    assert hpp[108].strip() == "// Whether to rethrow CUDA Errors in the watchdog (default true)"
    assert "TORCH_NCCL_RETHROW_CUDA_ERRORS" in hpp[109] and "TORCH_NCCL_RETHROW_CUDA_ERRORS" in hpp[110]
    on_nccl = broken_runs.case("token-out-of-vocabulary").on_nccl
    assert "own NCCL watchdog" in on_nccl and "SIGABRT" in on_nccl and "before @record writes" in on_nccl
    assert "(torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp:109-111)" in FLAT_APPENDIX
    assert "https://github.com/pytorch/pytorch/issues/126544" in FLAT_APPENDIX
    assert "or with SIGABRT when its log holds the assert" in FLAT_APPENDIX


QUESTION_2 = ("same-samples-every-rank", "accumulation-never-syncs", "per-rank-init", "local-grad-norm",
              "nan-from-one-rank", "stage-grad-norm")


def test_question_2s_rows_are_found_in_the_picture_by_the_ranks_they_name():
    """The learner's review: after question 2 ("the ranks disagree") no box of the picture said so. Question 2's
    cases name the ranks, the replicas or the stages in their first box; no other wrong number does, and no two
    first boxes of a group say the same words. resume-without-rng's middle box is the check that parts it from
    checkpoint-one-shard: the reloaded weights equal, yet the loss differs. per-rank-init's row no longer shares
    its words with two question-3 rows."""
    names = re.compile(r"\b(ranks?|replicas|stages)\b")
    for group, members in ch14.grouped(registry().BROKEN_RUNS):
        if group == "Wrong numbers":
            for case in members:
                assert bool(names.search(ch14.PATHS[case.name][0])) == (case.name in QUESTION_2), case.name
    assert ch14.PATHS["resume-without-rng"][1] == "reloaded weights equal, the loss differs"
    assert ch14.PATHS["per-rank-init"][0] != ch14.PATHS["data-by-global-rank"][0]
    first = " ".join(chapters.pages("14")[0].read_text().split())
    assert "In the picture, these rows' first box names the ranks or the replicas." in first
    assert "**Do the ranks agree where they must?**" in first and "read the same samples" in first


def test_the_worked_example_says_why_the_broken_run_exits_1():
    """The broken run of the worked example ends with exit 1 and torchrun's ChildFailedError though no rank crashed:
    the script's report returns 1 when a check fails, and train_ddp.py exits with it."""
    metrics = (ROOT / "distlab" / "metrics.py").read_text()
    assert "code = 0 if self.all_passed else 1" in metrics
    script = (ROOT / "scripts" / "04_data_parallel" / "train_ddp.py").read_text()
    assert "code = report.finish(args.metrics_out)" in script and "sys.exit(code)" in script
    first = " ".join(chapters.pages("14")[0].read_text().split())
    assert ("The broken run still ends with exit code 1 and torchrun's `ChildFailedError`, which names a rank as its "
            "\"Root Cause\". No rank crashed in training. The script exits 1 when a check against one device fails")\
        in first


def test_the_bubbles_idle_time_sits_where_each_rank_is_in_the_pipeline():
    """The learner's review: the text said the idle time sits at the step's start and end, but on the measured
    timeline with 2 microbatches rank 0 idles between its last forward and its first backward, in the middle of the
    step, while the last rank idles at the start and the end (chapter 07 says it so). The section, the registry's
    symptom and the lab's hint say so."""
    import json

    run = min(measured("14_pipeline_bubble.json")["runs"], key=lambda r: r["microbatches"] if "microbatches" in r
              else int(r["argv"][r["argv"].index("--microbatches") + 1]) if "--microbatches" in r["argv"] else 2)
    ops = sorted((e for e in run["timeline"] if e["rank"] == 0), key=lambda e: e["start"])
    gaps = [(b["start"] - a["end"], a["kind"], b["kind"]) for a, b in zip(ops, ops[1:])]
    widest = max(gaps)
    assert widest[1] != widest[2] and widest[0] > 0.05, gaps   # rank 0: a forward, then a long wait, then a backward
    slow = " ".join(chapters.pages("14")[3].read_text().split())
    assert "at the start, in the middle or at the end of the step, depending on the rank" in slow
    assert "the staircase at the step's start and end" not in FLAT and "at the start and the end" not in \
        registry().case("too-few-microbatches").symptom
    hint = " ".join("".join(c["source"]) for c in lab_cells("14") if "### Exercise 1:" in "".join(c["source"]))
    assert "at the start and the end of the step?" not in hint and "where in the step each rank waits" in hint


def test_the_exercise_list_counts_part_2s_runs_as_the_lab_holds_them():
    """Part 2 holds three runs: two that stop with an error and one that prints nan (review finding 8)."""
    from labkit.exercises import ch14 as lab

    names = [next(r.name for r in registry().BROKEN_RUNS if lab._token(r.name) == lab._TOKENS[label])
             for label in lab.PARTS["stops or prints nonsense"]]
    errors = sum("Error:" in registry().case(name).symptom for name in names)
    assert (errors, len(names) - errors) == (2, 1)
    assert "two errors and a printed `nan`" in " ".join(chapters.exercise_items(BODY))


def test_the_mismatched_collectives_reports_show_ranks_in_different_operations():
    """Sources review, finding 9: a report of this case shows two ranks at one position in different operations
    (their OpTypes differ), not a timeout whose ranks all wait in one all-reduce (pytorch #118369, a maintainer's
    general remark, now only the network-failure distractor's background)."""
    from labkit import diagnosis_sources

    reports = [s for s in diagnosis_sources.SOURCES["mismatched-collectives"] if s["url"].startswith("https://github")]
    assert reports
    for report in reports:
        assert len(set(re.findall(r"OpType=(\w+)", report["quote"]))) >= 2, report["url"]
    assert "118369" not in section_of("mismatched-collectives")
    assert "speechbrain/speechbrain #2401" in section_of("mismatched-collectives")


def test_the_slow_steps_say_why_gpipe_and_read_the_straggler_picture_as_totals():
    """The learner's review, findings 8 and 10, and the sources review's finding 11. Why the run uses GPipe is said in
    its "Why" (Schedule1F1B refuses fewer microbatches than stages: there the mistake is an error), not in the NCCL
    line. The straggler's bars are totals, each as tall (every rank at the straggler's pace), and who arrives last is
    read from each rank's time before its first collective. The GPU line says the straggler's kernels run longer only
    when its GPU is the slow part."""
    from labkit import broken_runs

    section = section_of("too-few-microbatches")
    why = section[section.index("**Why.**"):section.index("**The check.**")]
    assert "`Schedule1F1B` refuses fewer microbatches than stages" in why and "not a slow step" in why
    assert "Schedule1F1B" not in broken_runs.case("too-few-microbatches").on_nccl
    ranks = measured("14_straggler_vs_hang.json")["slow"]["ranks"]
    tall = [1e3 * r["window_seconds"] / r["steps"] for r in ranks]
    assert max(tall) - min(tall) < 0.05 * min(tall)   # the same height, to 5%
    assert f"Every bar is about as tall, {min(tall):.0f} to {max(tall):.0f} ms a step" in FLAT
    late = max(ranks, key=lambda r: r["before_sync_seconds"])
    others = max(r["before_sync_seconds"] for r in ranks if r is not late)
    assert (f"The bars are totals, not a timeline: they do not show who reaches the all-reduce last. Each rank's "
            f"time before its first collective does: {late['before_sync_seconds']:.2f} s a step on rank {late['rank']}, "
            f"at most {others:.2f} s on the others.") in FLAT
    on_nccl = broken_runs.case("slow-rank").on_nccl
    assert "compute kernels longer when its GPU is the slow part" in on_nccl
    assert "otherwise a gap before its first kernel each step" in on_nccl and len(on_nccl.split()) <= 40


def test_the_late_evaluation_is_found_without_the_courses_journals():
    """The learner's review, finding 11: "busy alone" is the course's journal; on their own job a learner dumps every
    rank's stack during the wait with py-spy, which chapter 12 teaches: the waiting ranks' stacks end in the
    all-reduce, the late rank's in its evaluation."""
    assert "`py-spy dump --pid PID`" in (ROOT / "chapters" / "12.2_hangs.md").read_text()
    section = section_of("rank-0-evaluation")
    check = section[section.index("**The check.**"):section.index("**The fix.**")]
    assert "`py-spy dump` on every rank during the wait (chapter 12)" in check
    assert "the late rank's in its evaluation" in check


def test_the_token_mean_fix_counts_the_steps_tokens_before_the_first_backward():
    """The learner's review, finding 15: the step's count of kept tokens divides the first micro-batch's loss, so the
    fix loads the step's micro-batches first and all-reduces their count before any backward, as train_ddp.py does;
    and it multiplies each loss by N, which DDP's average divides by (step_token_loss)."""
    script = (ROOT / "scripts" / "04_data_parallel" / "train_ddp.py").read_text()
    loaded, counted = script.index("micro_batches.append(tokens)"), script.index("dist.all_reduce(step_tokens)")
    first_backward = script.index("loss.backward()", counted)
    assert loaded < counted < script.index("token_losses(outputs, targets), kept, step_tokens, world)") < first_backward
    assert "return (per_token * mask).sum() * world_size / step_tokens" in script
    section = section_of("token-mean-per-micro-batch")
    fix = section[section.index("**The fix.**"):section.index("**On a GPU (NCCL).**")]
    assert "The first backward already needs that count" in fix
    assert "load the step's micro-batches (or their masks) first, all-reduce their count of kept tokens" in fix
    assert "DDP divides the summed gradients by N, so multiply each loss by N to undo it" in fix


def test_question_3_says_how_to_build_a_reference_for_a_model_that_does_not_fit():
    """The learner's review, finding 4: one device cannot hold a model that needs sharding; the question says what
    to compare with then, and that another layout is compared by its trend, not to the last digit."""
    first = " ".join(chapters.pages("14")[0].read_text().split())
    question = first[first.index("3. **Does the run agree with one device?**"):first.index("A hang answers")]
    assert "A model that needs sharding does not fit on one device" in question
    assert "the same code small, with fewer layers and a smaller width" in question
    assert "a simpler layout of the job" in question and "the losses of a run you trust" in question
    assert "compare the trend, not the last digit" in question


def test_the_middle_column_is_what_a_user_can_measure_and_says_how(world_of_one):
    """The learner's review, finding 5: the three look-alikes' middle boxes are the picture's, said as what a user
    measures or reruns; the bytes all-reduced are counted by a comm hook (chapter 04 showed 0 bytes, then 492,800),
    the reduce-scatter's from a profile recorded with shapes, whose collective events carry each input's shape and
    dtype (seen here on a one-rank gloo group, in bf16 as the case reduces)."""
    import torch
    import torch.distributed as dist

    first = " ".join(chapters.pages("14")[0].read_text().split())
    alike = [words[1] for words in ch14.PATHS.values() if words[0].startswith("off one device")]
    paragraph = first[first.index("three runs look alike"):first.index("## One broken run")]
    assert all(middle in paragraph for middle in alike), alike
    assert "always a measurement" not in FLAT and "what you can measure or rerun on your own job" in paragraph
    assert "with a DDP comm hook that adds up its buckets' sizes (chapter 04)" in section_of("accumulation-never-syncs")
    assert "The comm hook shows it with `--accumulation 2`: 0 bytes, then 492,800 bytes" in \
        (ROOT / "chapters" / "04.2_ddp.md").read_text()
    output = torch.empty(1000, dtype=torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.reduce_scatter_single(output, torch.ones(1000, dtype=torch.bfloat16))   # FSDP2's call
    seen = [(e.input_shapes[0], e.input_dtypes[0]) for e in prof.events() if "reduce_scatter" in e.name]
    assert ([1000], "c10::BFloat16") in seen, seen
    bf16 = section_of("bf16-gradient-reduction")
    assert "A profile recorded with `record_shapes=True` gives them" in bf16
    assert "each collective's event carries its input's shape and dtype, here `c10::BFloat16`" in bf16


def test_what_you_see_marks_what_only_a_reference_shows():
    """The learner's review, finding 6: "one device's" in a "What you see" is the course's reference, which a user
    has only once they build one; the cases whose symptom is only that say so."""
    first = " ".join(chapters.pages("14")[0].read_text().split())
    assert ("In each \"What you see\" below, \"one device's\" means that reference: on your own job you see it only "
            "once you build one (question 3).") in first
    twice = section_of("loss-averaged-twice")
    assert "Only the reference shows it: the gradients are a quarter of one device's" in twice
    optimizer = section_of("optimizer-before-sharding")
    seen = optimizer[:optimizer.index("**Why.**")]
    assert seen.index("AdamW's moments take 0 bytes") < seen.index("Beside one device, the step-0 gradients are equal")


def test_what_the_checks_cost_is_computed_from_the_model_the_scripts_and_torch():
    """The learner's review, finding 16: a short section says what each check costs, every number computed here:
    the tiny model's step all-reduce (4 bytes a parameter), the fingerprint ddp_from_scratch.py gathers (one float64
    per weight tensor), the flight recorder's default size and NCCL's default timeout in the installed torch, the
    GPU time a hang costs on a node of 4 GPUs, and the one-device reference (fp32 weights, gradients and AdamW's two
    moments, trained on rank 0 on the whole global batch)."""
    import torch

    from distlab import models

    cost = " ".join(chapters.section(BODY, "What the checks cost").split())
    model = models.build_transformer(models.preset("tiny"), seed=0, device="cpu")
    parameters = list(model.parameters())
    count = sum(p.numel() for p in parameters)
    assert f"the tiny model's on 4 ranks: {count:,} fp32 parameters, whose step all-reduces {4 * count:,} bytes" in cost
    scratch = (ROOT / "scripts" / "04_data_parallel" / "ddp_from_scratch.py").read_text()
    assert "torch.stack([p.detach().double().sum() + p.detach().double().abs().sum() for p in model.parameters()])" \
        in scratch and "dist.all_gather(everyone, mine)" in scratch
    fingerprint = len(parameters) * torch.finfo(torch.float64).bits // 8
    share = f"{100 * fingerprint / (4 * count):.2f} %"
    assert share == "0.03 %"
    assert (f"one float64 for each of the model's {len(parameters)} weight tensors (its sum plus the sum of its "
            f"absolute values): {fingerprint} bytes a rank, {share} of the step's all-reduce") in cost
    # finding 14: the latency, and the host's wait on a GPU number (torch's own words for .item())
    assert ("Their cost is a call's latency, not their bytes: one small all-gather each time, every step for the "
            "loss") in cost
    assert "dist.all_gather(each_rank, step_loss)" in (ROOT / "scripts" / "04_data_parallel" / "train_ddp.py").read_text()
    torch_dir = Path(torch.__file__).parent
    scaler = (torch_dir / "amp" / "grad_scaler.py").read_text().splitlines()
    assert scaler[563].strip() == "def get_scale(self) -> float:" and "incurs a CPU-GPU sync" in scaler[567]
    assert "scale.item()" in "\n".join(scaler[563:575])
    assert '"incurs a CPU-GPU sync" (torch/amp/grad_scaler.py:564-575)' in FLAT_APPENDIX
    assert "Printing a number also costs what `.item()` costs on one GPU: the host waits for the GPU's queued work" \
        in cost
    c10d = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
    recorder = (c10d / "FlightRecorder.hpp").read_text().splitlines()
    entries = int(re.search(r'"TORCH_NCCL_TRACE_BUFFER_SIZE"\}, (\d+)\);', recorder[110])[1])
    assert "TORCH_FR_BUFFER_SIZE" in recorder[110] and "max_entries_ = getCvarInt(" in recorder[109]
    assert recorder[113].strip() == "enabled_ = max_entries_ > 0;"   # on unless set to 0
    assert (f"keeps each rank's last {entries:,} collectives, in a circular buffer in host memory. Torch turns it on "
            "by default, so its cost is already in every NCCL run") in cost
    # finding 16: the buffer, a vector in the process, used as a ring
    assert recorder[187].strip() == "std::vector<Entry> entries_;" and "circular entries" in recorder[118]
    assert 'a `std::vector<Entry>` in the process (line 188), used as "the circular entries buffer" (lines 119-121)' \
        in FLAT_APPENDIX
    assert "(torch/include/torch/csrc/distributed/c10d/FlightRecorder.hpp:110-114)" in FLAT_APPENDIX
    nccl = (c10d / "ProcessGroupNCCL.hpp").read_text().splitlines()
    minutes = int(re.search(r"milliseconds\((\d+) \* 60 \* 1000\)", nccl[157])[1])
    assert f"NCCL's default {minutes} minutes is {4 * minutes} GPU-minutes on a node of 4 GPUs" in cost
    wrapper = (c10d / "ProcessGroupWrapper.hpp").read_text().splitlines()
    assert "intercepts" in wrapper[11] and "verify consistency across ranks before dispatching" in wrapper[12]
    assert "(torch/include/torch/csrc/distributed/c10d/ProcessGroupWrapper.hpp:12-14)" in FLAT_APPENDIX
    assert "`TORCH_DISTRIBUTED_DEBUG=DETAIL` adds an exchange on a gloo group before every collective" in cost
    # finding 15: what a rerun's checks cost is not measured here, and the page says so and where to measure it
    assert ("This page does not measure how much: time a few steps of your own job with and without it.") in cost
    ddp = (torch_dir / "nn" / "parallel" / "distributed.py").read_text().splitlines()
    assert "find_unused_parameters (bool): Traverse the autograd graph from all" in ddp[718]
    assert "if self.find_unused_parameters and not self.static_graph:" in ddp[1834]
    assert "self.reducer.prepare_for_backward(list(_find_tensors(output)))" in ddp[1836]
    assert "(torch/nn/parallel/distributed.py:719-721)" in FLAT_APPENDIX and "(lines 1835-1837)" in FLAT_APPENDIX
    adamw = 4 + 4 + 2 * 4   # fp32 weights, gradients, and AdamW's two moments (chapter 05 counts them)
    assert f"{adamw} bytes a parameter in fp32 with AdamW (chapter 05), {adamw * count:,} bytes here" in cost
    script = (ROOT / "scripts" / "04_data_parallel" / "train_ddp.py").read_text()
    assert "if rt.rank == 0:\n                baseline = models.build_transformer(" in script
    assert "indices = global_batch_indices(all_samplers, step, args.batch // world, steps_per_epoch)" in script
    assert "Rank 0 also trains it on the whole global batch, four ranks' work, while the others wait" in cost
    # finding 18: which question 3, in its own words
    first = " ".join(chapters.pages("14")[0].read_text().split())
    assert "3. **Does the run agree with one device?**" in first
    assert "then train the same code small, with fewer layers and a smaller width" in first
    assert ("A large job compares with a small copy instead: the first page's question 3, the same code with fewer "
            "layers and a smaller width.") in cost


def test_the_nan_fix_keeps_every_rank_in_the_step():
    """Under DDP a rank that skips a step alone never joins its all-reduce, and its peers wait (uneven-inputs): the
    fix keeps the batch (a zero loss, still a backward), and skips only by a decision every rank shares."""
    case = registry().case("nan-from-one-rank")
    section = " ".join(section_of("nan-from-one-rank").split())
    for text in (section, case.fix):
        assert "skip a batch with no target" not in text, text
        assert "still runs its backward" in text and "a decision every rank shares" in text, text


def test_the_resume_without_rng_curve_is_said_as_the_committed_data_has_it():
    """The broken resume leaves one device's curve at the resume and stays off it but for one step, where the two
    cross (the committed losses: a gap under 0.01 at one step only)."""
    run = measured("14_resumes.json")["resume-without-rng"]
    gaps = [abs(a - b) for a, b in zip(run["broken"]["losses"], run["fixed"]["losses"])]
    resume = next(step for step, gap in enumerate(gaps) if gap > 1e-6)
    crossings = [step for step, gap in enumerate(gaps) if step > resume and gap < 0.01]
    assert len(crossings) == 1 and all(gap > 0.05 for gap in gaps[resume:] if gaps.index(gap) not in crossings), gaps
    assert f"crosses it once, at step {crossings[0]}" in FLAT
    assert "never come back to it" not in FLAT


def test_the_not_a_fix_bubble_and_the_evaluation_time_are_computed():
    """(P-1)/(M+P-1) at M = P = 4, as distlab.schedules computes it, is the share the page says; rank 0's evaluation
    lasts deadlocks.py's default, 1.5 times the process group's timeout (the case passes no --eval-seconds)."""
    from distlab import schedules

    case = registry().case("too-few-microbatches")
    share = f"{round(100 * schedules.bubble_fraction(4, 4))}% idle"
    assert f"= {share}" in section_of("too-few-microbatches") and any(share in w[1] for w in case.wrong_fixes)
    deadlocks = (ROOT / "scripts" / "12_hpc_operations" / "deadlocks.py").read_text().splitlines()
    default = re.search(r"else ([\d.]+) \* rt\.pg_timeout_s", deadlocks[236])[1]
    evaluation = registry().case("rank-0-evaluation")
    assert "--eval-seconds" not in evaluation.args and f"for {default} times the timeout" in evaluation.cause


def test_the_optimizer_gpu_line_and_the_one_shard_fix_say_the_visible_part():
    """fully_shard copies each shard into new storage (new_zeros, then copy_): an optimizer built before it keeps the
    whole unsharded model alive, so memory does not shrink by the number of ranks. The one-shard fix reads the full
    file back too: set_model_state_dict with full_state_dict and broadcast_from_rank0 (state_dict.py's docstring)."""
    import torch

    torch_dir = Path(torch.__file__).parent
    param = (torch_dir / "distributed" / "fsdp" / "_fully_shard" / "_fsdp_param.py").read_text().splitlines()
    assert "param_data.new_zeros(padded_sharded_size)" in param[306] and ".copy_(sharded_param)" in param[310]
    assert "_fsdp_param.py:325-331). It copies each shard into new storage (lines 307-311)" in FLAT_APPENDIX
    state = (torch_dir / "distributed" / "checkpoint" / "state_dict.py").read_text().splitlines()
    assert "``broadcast_from_rank0``" in state[122] and "``full_state_dict`` must be set to True" in state[126]
    optimizer = " ".join(section_of("optimizer-before-sharding").split())
    assert "does not shrink by the number of ranks" in optimizer and "does not shrink" in registry().case(
        "optimizer-before-sharding").on_nccl
    one_shard = " ".join(section_of("checkpoint-one-shard").split())
    assert "set_model_state_dict" in one_shard and "broadcast_from_rank0=True" in one_shard
    # the learner's review s16, finding 19: why the load does not fail. The script copies rank 0's local shards into
    # each rank's own, and on 4 ranks every weight's first dimension splits evenly: the shapes match
    from distlab import models

    script = (ROOT / "scripts" / "05_fully_sharded" / "checkpoint_resume.py").read_text()
    assert "param.to_local().copy_(saved[name])" in script
    assert "torch.save({name: param.to_local() for name, param in model.named_parameters()}," in script
    tiny = models.build_transformer(models.preset("tiny"), seed=0, device="cpu")
    assert all(p.shape[0] % 4 == 0 for p in tiny.parameters())
    assert ("The resume copied that file into every rank's own shards. The shapes match, since every shard is a "
            "quarter of its weight, so nothing complains. Every rank's shard became rank 0's.") in one_shard
    assert "set_model_state_dict" in registry().case("checkpoint-one-shard").fix
    # cold review s16 ch11_14, finding 9: the registry's cause (the table in "How we know") tells the body's account
    cause = registry().case("checkpoint-one-shard").cause
    assert "The resume copied that file into every rank's own shards" in cause and "as if it were" not in cause
    assert "as if it were the model" not in FLAT
    assert "state_dict.py:123-127" in FLAT_APPENDIX


def test_the_norm_clip_grad_norm_returns_is_reduced_inside_it():
    """Why the returned norm is Replicate under FSDP2 (torch 2.13, a p-norm): the per-gradient norms of Shard(0)
    DTensors are _NormPartial, whose reduce_op is "sum" (_math_ops.py:82-84); the last vector_norm over their stack
    (clip_grad.py:105-107) is not linear in a "sum" partial, so its strategy asks for Replicate inputs
    (_math_ops.py:280-291), and the all-reduce runs there, before clip_grad_norm_ returns (clip_grad.py:232). .item()
    on a Partial DTensor reduces nothing (_sharding_prop.py skips aten._local_scalar_dense), so the guard of
    tests/scripts/test_14_when_it_goes_wrong.py's clip_and_log_the_local_piece does tell the two apart. Traced and
    measured on 2 gloo ranks in session 16. (The run that shows it: that test file's right clip that logs its
    piece.)"""
    import torch

    root = Path(torch.__file__).parent

    def lines(name, first, last):
        return "".join((root / name).read_text().splitlines(keepends=True)[first - 1:last])

    assert "total_norm = torch.linalg.vector_norm(" in lines("nn/utils/clip_grad.py", 105, 105)
    assert "torch.stack([norm.to(first_device) for norm in norms]), norm_type" in lines("nn/utils/clip_grad.py", 106, 106)
    assert "return total_norm" in lines("nn/utils/clip_grad.py", 232, 232)
    assert 'super().__init__("sum")' in lines("distributed/tensor/_ops/_math_ops.py", 82, 84)
    rule = lines("distributed/tensor/_ops/_math_ops.py", 280, 291)
    assert "if isinstance(p, Partial) and p.reduce_op != reduction_op:" in rule and "replicate_reduction_dims(" in rule
    assert "_local_scalar_dense" in lines("distributed/tensor/_sharding_prop.py", 745, 746)
