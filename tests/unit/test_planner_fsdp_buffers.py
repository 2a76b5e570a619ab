"""FSDP's temporary buffers in the planner against torch's own count of them.

``dry_run.fsdp_buffers_counted`` shards the course's transformer as chapter 05's ``train_fsdp.py`` does (each block,
then the root), runs forward and backward on a fake process group of 4 ranks under torch's ``FSDPMemTracker``, and
reads FSDP2's buffers at their peak: the gathered weights, the unsharded gradients and the reduce-scatter input. The
planner's ``temporary_bytes`` for the same model and layout must equal the backward peak to the byte, and hold the
forward's too. The root (embedding, final norm, output layer) stays gathered through the whole backward: a planner
that forgets it, or counts only the largest unit twice, fails here."""

from __future__ import annotations

import pytest

from distlab import models, planner
from distlab.planner import dry_run
from distlab.planner.memory import stage_params

WORLD = 4

# (vocabulary, blocks, mixed precision, reshard after forward): a root larger than a block and one smaller,
# resharding (the search's FSDP) and keeping the weights from forward to backward (train_fsdp.py's flag)
CASES = [(2048, 3, True, True), (128, 4, True, True), (2048, 3, False, False), (512, 4, True, False)]


def case(vocab, layers, mixed, reshard):
    cfg = models.TransformerConfig(vocab_size=vocab, dim=128, n_layers=layers, n_heads=4, ffn_hidden=384, seq_len=64)
    spec = planner.from_config(cfg, micro_batch=1, global_batch=WORLD)
    options = planner.Options(zero_stage=3, precision="mixed" if mixed else "fp32", reshard_after_forward=reshard,
                              activation_checkpointing="none")
    return cfg, spec, options


@pytest.fixture(scope="module")
def counted():
    return {c: dry_run.fsdp_buffers_counted(case(*c)[0], WORLD, 1, c[2], c[3]) for c in CASES}


@pytest.mark.parametrize("which", CASES, ids=lambda c: f"v{c[0]}-L{c[1]}-{'bf16' if c[2] else 'fp32'}-"
                                                       f"{'reshard' if c[3] else 'kept'}")
def test_the_planners_buffers_are_fsdp2s_backward_peak_to_the_byte(which, counted):
    cfg, spec, options = case(*which)
    layout = planner.Layout(dp=WORLD, zero_stage=3)
    planned = planner.temporary_bytes(spec, layout, 0, options)
    peaks = counted[which]
    assert planned == peaks["backward"]["total"], (planned, peaks)
    assert peaks["forward"]["total"] <= planned
    if which[3]:   # resharding: the root and two blocks gathered at the peak, the root the whole backward long
        params = stage_params(spec, layout, 0)
        number = 2 if which[2] else 4
        assert peaks["backward"]["gathered"] == number * (params["root_unit"] + 2 * params["largest_block"])


def test_the_moments_the_planner_leaves_out_hold_less_for_every_preset(counted):
    """The forward's peak, counted above: the root and the unit before the computing block gathered, that block and
    the one prefetched (p (R + max(R, B) + 2 B), p the compute dtype's bytes); the root's own reduction at the end of
    backward holds at most its gradients and its fp32 reduce-scatter input, (p + 4) R. For every preset, FSDP over a
    node and over 64 GPUs, both are below the backward's peak the planner counts."""
    for which in CASES:
        if not which[3]:
            continue
        cfg, spec, options = case(*which)
        params = stage_params(spec, planner.Layout(dp=WORLD, zero_stage=3), 0)
        root, block, number = params["root_unit"], params["largest_block"], 2 if which[2] else 4
        assert counted[which]["forward"]["total"] == number * (root + max(root, block) + 2 * block)
    for name, spec in planner.MODELS.items():
        for layout in (planner.Layout(dp=8, zero_stage=3), planner.Layout(tp=8, dp=8, zero_stage=3)):
            params = stage_params(spec, layout, 0)
            root, block = params["root_unit"], params["largest_block"]
            planned = planner.temporary_bytes(spec, layout, 0, planner.Options())
            assert planned > 2 * (root + max(root, block) + 2 * block) and planned > (2 + 4) * root, (name, layout)
