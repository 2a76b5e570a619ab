"""Chapter 13: a mixture-of-experts layer with its experts over 4 ranks equals one device, its all-to-alls = formula."""

from pathlib import Path

import pytest
from helpers import assert_all_checks_passed, assert_config_error

from coursetools import chapters
from labkit import launch

EP = "scripts/13_expert_parallel/ep_from_scratch.py"


@pytest.fixture(scope="module")
def dropless():
    return launch.run(EP, nproc=4, stream=False)


def test_dropless_softmax_routing_equals_one_device(dropless):
    metrics = assert_all_checks_passed(dropless, min_checks=7)
    assert metrics["config"]["ep"] == 4 and len(metrics["losses"]) == 4
    load = metrics["extra"]["load"]
    # every step routes 8 sequences x 16 tokens x top-2 = 256 assignments, none dropped
    assert [sum(step) for step in load] == [256] * 4 and metrics["extra"]["dropped"] == [0] * 4
    assert metrics["extra"]["experts_ran_as"] == "loop"   # no grouped matrix multiply on a CPU


def test_each_all_to_all_sends_the_formulas_bytes(dropless):
    rows = dropless.metrics["comm"]
    assert [r["kind"] for r in rows] == ["dispatch", "combine", "dispatch", "combine"]
    assert all(r["measured_bytes"] == r["analytic_bytes"] > 0 for r in rows)
    # the dispatch is tokens x top-k x hidden x 4 bytes x the share that left: 32 x 2 x 32 x 4 x share
    share = dropless.metrics["extra"]["leaving_share"]
    assert rows[0]["measured_bytes"] == round(32 * 2 * 32 * 4 * share)
    assert dropless.metrics["extra"]["uniform_leaving_share"] == 0.75


@pytest.mark.parametrize("args", [
    ["--capacity-factor", "1.0", "--scoring", "sigmoid", "--shared-expert", "--balance", "bias"],
    ["--balance", "aux-loss", "--top-k", "1"],
], ids=["capacity+sigmoid+shared+bias", "aux-loss+top1"])
def test_the_variants_equal_one_device(args):
    metrics = assert_all_checks_passed(launch.run(EP, nproc=4, args=args, stream=False), min_checks=7)
    if "--capacity-factor" in args:   # capacity = ceil(1.0 x 32 x 2 / 8) = 8 a rank and expert: some dropped
        assert metrics["extra"]["capacity"] == 8 and sum(metrics["extra"]["dropped"]) > 0


def test_experts_that_do_not_split_over_the_ranks_exit_2():
    assert_config_error(EP, ["--experts", "6"], "6 experts do not split over an EP degree of 4")


def test_top_k_larger_than_the_experts_exits_2():
    assert_config_error(EP, ["--top-k", "9"], "top-k 9 must be between 1 and the 8 experts")


@pytest.mark.parametrize("bug, failing", [
    ("router-not-all-reduced", {"step-0 gradients", "losses", "parameters after training"}),
    ("experts-not-regrouped", {"step-0 outputs", "step-0 gradients", "losses", "parameters after training"}),
])
def test_the_planted_bugs_fail_the_single_device_comparison(bug, failing):
    result = launch.run(EP, nproc=4, args=["--planted-bug", bug], stream=False, check=False)
    assert result.returncode == 1
    failed = {c["name"].split(" = ")[0] for c in result.metrics["checks"] if not c["passed"]}
    assert failing <= failed, failed


def test_the_chapter_states_what_the_run_measured(dropless):
    text = " ".join(chapters.text("13").split())
    dispatch = dropless.metrics["comm"][0]["measured_bytes"]
    share = dropless.metrics["extra"]["leaving_share"]
    assert f"rank 0 dispatched {dispatch:,} B at step 1 (32 tokens x 2 x 32 x 4 B x {share:.3f})" in text
    assert "gloo accepts uneven splits" in text and dropless.metrics["config"]["ep"] == 4
    assert "(on these CPU ranks: the loop)" in text and dropless.metrics["extra"]["experts_ran_as"] == "loop"


MOE_TRANSFORMER = "scripts/13_expert_parallel/moe_transformer.py"


@pytest.mark.parametrize("ep", [4, 2])
def test_a_moe_transformer_with_fsdp_over_dp_and_experts_over_ep_equals_one_device(ep):
    metrics = assert_all_checks_passed(launch.run(MOE_TRANSFORMER, nproc=4, args=["--ep", str(ep)], stream=False),
                                       min_checks=8)
    assert metrics["config"]["ep"] == ep and metrics["config"]["dp"] == 4
    assert len(metrics["extra"]["load"]) == 4 and len(metrics["extra"]["load"][0]) == 2   # steps x blocks
    rows = {r["collective"]: r for r in metrics["comm"]}
    assert rows["reduce_scatter"]["measured_bytes"] == rows["reduce_scatter"]["analytic_bytes"] > 0
    # ep 2: each expert on 2 ranks (one per EP group), its gradient all-reduced between them: 2 blocks x 4 experts
    expert_bytes = 2 * (8 // ep) * 3 * 64 * 64 * 4
    assert rows["all_reduce"]["measured_bytes"] == (expert_bytes if ep == 2 else 0)


def test_on_one_rank_as_gpu_check_runs_it_on_one_gpu():
    """One rank (make gpu-check on a one-GPU machine): FSDP2 then calls no collective at all, and the byte check
    must expect none (it expected the padded parameters, and failed on an H100)."""
    metrics = assert_all_checks_passed(launch.run(MOE_TRANSFORMER, nproc=1, args=["--batch", "1"], stream=False),
                                       min_checks=8)
    rows = {r["collective"]: r for r in metrics["comm"]}
    assert rows["reduce_scatter"]["measured_bytes"] == rows["reduce_scatter"]["analytic_bytes"] == 0


def test_an_ep_degree_that_does_not_divide_the_ranks_exits_2():
    assert_config_error(MOE_TRANSFORMER, ["--ep", "3"], "--ep 3 does not divide the 4 ranks")


def test_a_moe_transformer_whose_experts_do_not_split_over_dp_exits_2():
    assert_config_error(MOE_TRANSFORMER, ["--experts", "6"], "6 experts do not split over an EP degree of 4")


def test_the_dispatch_picture_is_what_the_run_sent(dropless):
    """chapters/figures/13_expert_dispatch.png is drawn from the single-device routing; its row of rank 0, off the
    diagonal, is the dispatch the 4-rank run measured at step 1, and the chapter's numbers are the picture's."""
    from coursetools import figures

    matrix = figures.expert_dispatch_of_step()
    sent = int(matrix[0].sum() - matrix[0, 0])
    assert sent * 32 * 4 == dropless.metrics["comm"][0]["measured_bytes"]
    computed = matrix.sum(dim=0).tolist()
    text = " ".join(chapters.text("13").split())
    assert f"keeps {int(matrix[0, 0])} of its {int(matrix[0].sum())} assignments and sends {sent} rows" in text
    assert f"compute between {min(computed)} and {max(computed)} rows" in text
    assert "figures/13_expert_dispatch.png" in text
    assert (Path(__file__).resolve().parents[2] / "chapters" / "figures" / "13_expert_dispatch.png").exists()


def test_the_mixtral_row_is_what_the_planner_counts():
    """Chapter 13's table: Mixtral 8x7B's 47 B stored and 13 B used per token, as the planner counts its published
    shape (chapter 11 checks the same count against a model built on the meta device)."""
    from distlab import planner

    counted = planner.moe_params(**planner.MIXTRAL_8X7B)
    text = chapters.text("13")
    row = f"| Mixtral 8x7B | 8 | 2 | {counted['total'] / 1e9:.0f} B | {counted['active'] / 1e9:.0f} B |"
    assert row in text, row


def test_tp_for_attention_beside_ep_equals_one_device():
    """A (dp 2, tp 2) mesh: attention split over TP, each TP rank routing half of the tokens, the experts over all
    4 ranks, a shared expert in every block (replicated like the router: its gradients summed over TP too);
    losses, gradients, parameters and load = one device; the TP all-gathers and the reduction over TP counted."""
    metrics = assert_all_checks_passed(launch.run(MOE_TRANSFORMER, nproc=4, args=["--tp", "2", "--shared-expert"],
                                                  stream=False), min_checks=10)
    assert metrics["config"]["tp"] == 2 and metrics["config"]["dp"] == 2 and metrics["config"]["ep"] == 4
    assert metrics["config"]["moe"]["shared_expert"]
    # reduced over TP: each block's router (8 x 64) and shared expert (3 x 64 x 64), this rank's FSDP shard (1/2)
    reduced = next(r for r in metrics["comm"] if r["collective"] == "all_reduce")["measured_bytes"]
    assert reduced == 2 * (8 * 64 + 3 * 64 * 64) * 4 // 2
    names = [c["name"] for c in metrics["checks"]]
    assert any(n.startswith("TP all-gathers per block and step = 2") for n in names)
    # the chapter's picture: each data-parallel rank's tokens, halved over the TP pair
    gathered = next(c for c in metrics["checks"] if c["name"].startswith("TP all-gathers"))["value"][0]
    tokens = gathered // (64 * 4)
    text = " ".join(chapters.text("13").split())
    assert tokens == 128 and f"{tokens} tokens" in text and f"tokens {tokens // 2}..{tokens - 1}" in text


@pytest.mark.parametrize("bug,failing", [
    # the router's and shared expert's gradients left partial: every check that follows from them fails, and the
    # bytes reduced over TP are none
    ("router-not-reduced-over-tp", {"losses", "step-0 gradients", "parameters after training",
                                    "expert load of every block and step", "all-reduced bytes"}),
    # the experts' gradients halved: the gradients and (Adam's epsilon) the parameters; Adam hides it from the
    # losses and the routing
    ("experts-divided-by-world", {"step-0 gradients", "parameters after training"}),
])
def test_tp_beside_ep_planted_bugs_fail_the_single_device_comparison(bug, failing):
    """Each planted bug fails exactly the checks it should, not only the first (one block is enough: half the time)."""
    result = launch.run(MOE_TRANSFORMER, nproc=4, args=["--tp", "2", "--shared-expert", "--layers", "1",
                                                        "--planted-bug", bug], stream=False, check=False)
    assert result.returncode == 1
    failed = {c["name"].split(" = ")[0] for c in result.metrics["checks"] if not c["passed"]}
    assert failed == failing, failed


def test_a_tp_degree_that_does_not_fit_exits_2():
    assert_config_error(MOE_TRANSFORMER, ["--tp", "3"], "--tp 3 does not divide the 4 ranks")
    # the a100 preset is refused as fast, before a model of its size is built
    assert_config_error(MOE_TRANSFORMER, ["--preset", "a100", "--tp", "32"], "--tp 32 does not divide the 4 ranks")
    assert_config_error(MOE_TRANSFORMER, ["--preset", "a100", "--tp", "2", "--batch", "3"],
                        "--batch 3 sequences do not split over 2 data-parallel ranks")
    assert_config_error(MOE_TRANSFORMER, ["--tp", "2", "--ep", "2"], "--tp with --ep")
