"""Chapter 11's numbers, recomputed: every table of chapters/11_choosing_a_strategy.md comes from distlab.planner,
and every claim the prose makes about them is checked here. The test fails when the text drifts."""

from __future__ import annotations

from pathlib import Path

import pytest

from distlab import planner, sizing

CHAPTER = Path(__file__).resolve().parents[2] / "chapters" / "11_choosing_a_strategy.md"


@pytest.fixture(scope="module")
def raw():
    return CHAPTER.read_text()


@pytest.fixture(scope="module")
def text(raw):
    return " ".join(raw.split())


@pytest.mark.parametrize("name,make", [("decision path", planner.decision_path_markdown),
                                       ("trade-offs", planner.tradeoffs_markdown),
                                       ("published layouts", planner.published_table_markdown),
                                       ("sizing check", planner.sizing_check_markdown)])
def test_every_table_is_what_the_planner_computes(raw, name, make):
    table = make()
    assert table in raw, f"the {name} table is stale; the code gives:\n{table}"


def test_the_mixture_of_experts_sentence(text):
    assert planner.moe_markdown() in text


def test_stated_assumptions_are_the_planners(text):
    options = planner.Options()
    assert f"{options.prefetched_units} gathered units" in text
    assert f"at {options.compute_efficiency:.0%} of the dense peak" in text
    assert f"| {options.reserve_bytes / planner.GIB:.0f} GiB: CUDA context" in text
    peaks = {name: c.peak_flops / 1e12 for name, c in planner.CLUSTERS.items()}
    assert (peaks["a100-40gb"], peaks["h100-80gb"], peaks["v100-32gb"]) == (312, 989, 125)
    assert "A100 bf16 312, H100 989 TFLOP/s; V100 has no bf16: fp16 125" in text
    assert planner.CLUSTERS["a100-40gb"].gpu_bytes == 40 * planner.GIB and '"40 GB" A100 has 40 GiB' in text


def test_ddp_is_as_fast_as_the_best_for_a_model_that_fits_one_gpu(text):
    plans = planner.search(planner.MODELS["1b"], planner.CLUSTERS["a100-80gb"], 8)
    ddp = next(p for p in plans if p.layout == planner.Layout(dp=8, zero_stage=0))
    assert ddp.fits and ddp.mfu == pytest.approx(plans[0].mfu, rel=1e-9)
    assert "the planner finds DDP as fast as anything else there" in text


def test_each_published_layout_fits_near_the_top_and_gpt3_does_not_fit_with_ddp(text):
    rows = planner.published_table()
    assert all(r["fits"] and r["rank"] <= 10 for r in rows)
    assert "Each published layout is found feasible" in text and "ranks near the top" in text
    gpt3 = planner.evaluate(planner.MODELS["gpt3-175b"], planner.CLUSTERS["v100-32gb"], planner.Layout(8, 8, 16, 1, 0))
    assert not gpt3.fits and "with DDP (ZeRO 0) does not fit a 32 GiB V100" in text
    assert planner.MODELS["405b"].layers % 16 and "126 layers do not divide into 16 stages" in text


def test_the_planner_needs_one_node_less_for_70b_with_a_pipeline_of_9(text):
    cluster = planner.CLUSTERS["a100-40gb"]
    nodes = planner.fewest_nodes(planner.MODELS["70b"], cluster)
    assert nodes == sizing.min_nodes("70B") - 1 == 9
    layout = planner.best(planner.MODELS["70b"], cluster, nodes * cluster.gpus_per_node).layout
    assert (layout.pp, layout.tp) == (9, 4)
    assert "it needs one node less for 70B: a pipeline of 9 stages, each with a TP of 4" in text


def test_the_decision_path_says_what_the_prose_reads_from_it():
    steps = planner.decision_path()
    assert "DDP: does not fit" in steps[1]["answer"] and "FSDP dp=8: fits" in steps[1]["answer"]
    fsdp_alone = planner.evaluate(planner.MODELS["70b"], planner.CLUSTERS["a100-40gb"],
                                  planner.Layout(dp=64, zero_stage=3))
    best = planner.search(planner.MODELS["70b"], planner.CLUSTERS["a100-40gb"], 64)[0]
    assert fsdp_alone.fits and best.mfu > fsdp_alone.mfu and best.layout.tp > 1 and best.layout.pp > 1


def test_the_cp_section_states_the_searchs_rule(text):
    options = planner.Options()
    assert f"at least `cp_min_tokens` = {options.cp_min_tokens} tokens of a sequence" in text
    assert f"`--cp-min-tokens`, {options.cp_min_tokens}, of a sequence" in text
    spec = planner.MODELS["70b"]
    degrees = {seq: planner.cp_degrees(planner.replace(spec, seq_len=seq), 64) for seq in (4096, 32768, 131072)}
    assert (degrees[4096], max(degrees[32768]), max(degrees[131072])) == ([1], 4, 16)
    assert "none at 4K, up to CP 4 at 32K, up to CP 16 at 128K" in text
    # "With CP free, the search would put it everywhere, even on 4K-token sequences"
    free = planner.search(spec, planner.CLUSTERS["h100-80gb"], 64, planner.Options(cp_min_tokens=1))
    assert free[0].layout.cp > 1 and "even on 4K-token sequences" in text
    assert "the search's own choice is CP 16 with FSDP over the other 4 ways" in text
    best = planner.decision_path()[-1]["answer"]
    assert "tp=1,pp=1,dp=4,cp=16,zero=3" in best and "nothing without CP fits" in best


def test_the_long_context_layout_needs_what_the_8k_one_needs(text):
    rows = planner.published_table()
    short, long = rows[2], rows[3]
    assert "128K" in long["claim"] and "cp=16" in long["layout"] and "cp" not in short["layout"].replace("dp", "")
    assert long["gib_per_gpu"] == short["gib_per_gpu"]
    assert (f"**{long['gib_per_gpu']:.1f} GiB** against **{short['gib_per_gpu']:.1f} GiB**" in text
            and "exactly what its 8K layout needs" in text)
