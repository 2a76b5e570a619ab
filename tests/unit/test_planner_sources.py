"""Every published run the planner is held against carries its source, and the quoted words hold what the row says.

The quotes live in distlab/planner/sources.py, each read in the paper or the repository (or, SECONDARY, in a
quotation of it). These tests do not trust the rows: they parse the quoted text and compare."""

from __future__ import annotations

import re

import pytest

from distlab import planner
from distlab.planner.published import RUN_SOURCES, RUNS, source_of
from distlab.planner.sources import NOT_FOUND, SECONDARY, SOURCES


def test_every_published_row_names_its_sources_and_each_has_a_quote():
    assert set(RUN_SOURCES) == {run.label for run in RUNS}, "a published row without its sources"
    for run in RUNS:
        for key in RUN_SOURCES[run.label]:
            source = source_of(key)
            assert source.work and source.where and len(source.quote) > 40, key


def test_every_source_says_where_it_was_read():
    for key, source in {**SOURCES, **SECONDARY}.items():
        assert source.work and source.where and source.quote, key
    assert not set(SOURCES) & set(SECONDARY) and not set(SOURCES) & set(NOT_FOUND)


def _table_row(quote: str, first: str) -> list[str]:
    for line in quote.splitlines():
        cells = [c.strip() for c in line.split("|")] if "|" in line else line.split()
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in the quote")


@pytest.mark.parametrize("run", [r for r in RUNS if r.label.startswith("Llama 3")], ids=lambda r: r.label)
def test_llama_rows_equal_table_4(run):
    quote = SOURCES["llama3_table4"].quote
    rows = [line.split() for line in quote.splitlines() if line[:1].isdigit()]
    gpus, tp, cp, pp, dp, seq, batch_per_dp, _, tflops, mfu = next(
        r for r in rows if int(r[0].replace(",", "")) == run.gpus and int(r[5].replace(",", "")) == run.model.seq_len)
    layout = run.layout
    assert (layout.tp, layout.cp, layout.pp, layout.dp) == (int(tp), int(cp), int(pp), int(dp))
    assert run.model.global_batch == int(batch_per_dp) * layout.dp
    assert run.stated == ("mfu", int(mfu.rstrip("%")) / 100)


def test_llamas_published_settings_are_the_papers():
    options = planner.published.LLAMA_PIPELINE
    assert "without activation checkpointing" in SOURCES["llama3_no_activation_checkpointing"].quote
    assert options.activation_checkpointing == "none"
    assert "do not reshard after forward" in SOURCES["llama3_fsdp"].quote and all(
        r.layout.zero_stage == 3 for r in RUNS[:3])   # FSDP; under PP the planner keeps a stage gathered
    assert "all-gather the key (K) and value (V)" in SOURCES["llama3_cp_all_gather"].quote
    assert options.cp_attention == "all_gather"
    # "N=5" is the paper's Figure 6 (4 ranks), not a setting of the 405B run: the planner does not take it
    assert "N=5" in SOURCES["llama3_pipeline_schedule"].quote and not hasattr(options, "microbatches_per_round")


@pytest.mark.parametrize("key,label", [("megatron_sc21_run_table_1_145b", "Megatron 145.6B, 1,536 A100"),
                                       ("megatron_sc21_run_table_1_310b", "Megatron 310.1B, 1,920 A100"),
                                       ("megatron_sc21_run_table_1_530b", "Megatron 529.6B, 2,520 A100"),
                                       ("megatron_sc21_run_table_1_1t", "Megatron 1T, 3,072 A100")])
def test_megatron_rows_run_at_run_table_1s_settings(key, label):
    """The micro-batch and the interleave of NVIDIA's examples/sc21/run_table_1.sh, read from the quoted line."""
    run = next(r for r in RUNS if r.label == label)
    line = SOURCES[key].quote
    value = {k: int(v) for k, v in re.findall(r"\b(TP|PP|MBS|GBS|NLS|HS|NAH)=(\d+)", line)}
    per_virtual = re.search(r"--num-layers-per-virtual-pipeline-stage (\d+)", line)
    chunks = value["NLS"] // value["PP"] // int(per_virtual.group(1)) if per_virtual else 1
    assert (run.layout.tp, run.layout.pp) == (value["TP"], value["PP"])
    assert (run.model.layers, run.model.hidden, run.model.heads) == (value["NLS"], value["HS"], value["NAH"])
    assert run.model.global_batch == value["GBS"] and run.model.micro_batch == value["MBS"]
    assert planner.chunks(run.options) == chunks and not run.options.search_micro_batch
    assert (run.options.schedule == "interleaved_1f1b") == (chunks > 1)
    # and the figure: Table 1's row of the same size
    size = label.split()[1].rstrip(",").rstrip("B").replace("1T", "1008.0")
    row = _table_row(SOURCES["megatron_sc21_table1"].quote, size)
    assert run.stated == ("megatron_tflops", int(row[8])) and int(row[6]) == run.gpus


def test_the_secondary_and_readme_rows_hold_their_figures():
    assert "60.1" in SECONDARY["mtnlg_iteration_times"].quote
    assert next(r for r in RUNS if r.label.startswith("MT-NLG")).stated == ("iteration_seconds", 60.1)
    readme = SOURCES["korthikanti_megatron_readme_mfu_hfu"].quote
    for size, label in (("175B", "Megatron 175B"), ("22B", "Megatron 22B")):
        row = next(line for line in readme.splitlines() if line.startswith(f"| {size} "))
        mfu = float(row.split("|")[2].strip().rstrip("%")) / 100
        assert next(r for r in RUNS if r.label.startswith(label)).stated == ("mfu", mfu)
