"""Context parallelism beside tensor parallelism, measured: 4 CPU ranks as 2 CP x 2 TP run one attention layer with
all-gather CP (tests/unit/cp_tp_ranks.py) and the planner's CP collectives for that layout equal what each rank
sent, for multi-head attention (each TP rank gathers its 2 of 4 key/value heads) and for grouped-query attention
with fewer key/value heads than TP ranks (each keeps, and gathers, a whole replicated head)."""

from __future__ import annotations

import json

import pytest

from distlab import planner
from distlab.planner import dry_run
from distlab.planner.communication import comm_per_step
from labkit import launch

RANKS = "tests/unit/cp_tp_ranks.py"
LAYOUT = planner.Layout(tp=2, pp=1, dp=1, cp=2, zero_stage=1)
OPTIONS = planner.Options(zero_stage=1, cp_attention="all_gather", activation_checkpointing="none", precision="fp32")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_tp") / "ranks.json"
    launch.run(RANKS, nproc=4, args=[str(out)], stream=False, launcher="fork", metrics=False)
    return json.loads(out.read_text())


def spec_of(shape, kv_heads: int) -> planner.ModelSpec:
    batch, heads, seq, head_dim = shape
    hidden = heads * head_dim
    return planner.ModelSpec("cp-tp", 1, hidden, heads, kv_heads, 4 * hidden, 100, seq, batch, batch)


def planned(shape, kv_heads: int) -> dict:
    return comm_per_step(spec_of(shape, kv_heads), LAYOUT, 0, OPTIONS)["cp"]


def test_the_groups_are_the_planners_mesh(measured):
    """DeviceMesh (pp, dp, cp, tp) as the planner's dry run builds it: rank = (cp index) x tp + (tp index)."""
    names, sizes = dry_run.mesh_shape(LAYOUT)
    assert names == ("pp", "dp", "cp", "tp") and sizes == (1, 1, 2, 2)
    for record in measured["ranks"]:
        rank = record["rank"]
        assert record["cp_group"] == [rank % 2, rank % 2 + 2]
        assert record["tp_group"] == [rank // 2 * 2, rank // 2 * 2 + 1]


def compare(measured, kv_heads: int) -> None:
    """What each rank sent over its CP group against the planner's CP collectives (and the by-hand count)."""
    shape = measured["shape"]
    batch, heads, seq, head_dim = shape
    predicted = planned(shape, kv_heads)
    # by hand: K and V of this TP rank's key/value heads (2 of 4; or the one replicated), the whole sequence, fp32
    for record in measured["ranks"]:
        layer = record["layers"][str(kv_heads)]
        assert layer["equal"], f"rank {record['rank']}: outputs or gradients differ from full attention"
        sent = {}
        for collective, payload, group in layer["calls"]:
            assert group == LAYOUT.cp
            sent[collective] = sent.get(collective, 0) + payload
        assert sent == predicted, f"rank {record['rank']} sent {sent}, the planner plans {predicted}"
    kv_per_rank = 2 * batch * seq * (kv_heads // 2 if kv_heads >= 2 else 1) * head_dim * 4
    assert predicted == {"all_gather": kv_per_rank, "reduce_scatter": kv_per_rank}


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "gqa-one-kv-head"])
def test_cp_bytes_beside_tp_equal_what_each_rank_sent(measured, kv_heads):
    compare(measured, kv_heads)


PLANTS = {4: lambda self, tp: self.kv_dim,                   # TP's share forgotten: every rank moves every head
          1: lambda self, tp: self.kv_dim // tp}             # the whole-head floor forgotten: half a head a rank


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha-tp-share-forgotten", "gqa-whole-head-forgotten"])
def test_a_planner_that_mishandles_tp_in_cp_fails_the_comparison(measured, monkeypatch, kv_heads):
    """Planted: the planner's TP share of the key/value heads forgotten (multi-head attention), or the whole
    replicated head forgotten (grouped-query attention with fewer key/value heads than TP ranks). The comparison
    above fails on each."""
    from distlab.planner import communication

    monkeypatch.setattr(planner.ModelSpec, "kv_dim_per_tp_rank", PLANTS[kv_heads])
    communication.ledger.cache_clear()   # answers cached before the plant would hide it
    try:
        with pytest.raises(AssertionError, match="sent .*, the planner plans"):   # a rank's bytes fail it
            compare(measured, kv_heads)
    finally:
        communication.ledger.cache_clear()
