"""DDP's memory and bytes in the planner against torch's own DDP, run as chapter 04 runs it: bf16 autocast over fp32
weights (``train_ddp.py``, chapter 04.2's "fp32 weights and gradients").

The course's transformer is wrapped in ``DistributedDataParallel`` on a gloo group of one rank (DDP builds its
buckets and all-reduces them at any world size; a replica is the same on 1 rank as on 8), runs one step under
autocast, and is read: its parameters, gradients and AdamW moments off the tensors, its buckets from DDP's own
logging data (``bucket_sizes``, bytes). The planner's parts for the same model under DDP on 8 GPUs must equal them to
the byte; its all-reduce moves what the buckets hold. A model cast to bf16 instead shows what decides a bucket's
dtype: the gradients' own (torch 2.13 ``nn/parallel/distributed.py:731-735``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from distlab import memory, models, planner

CFG = models.TransformerConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_hidden=176, seq_len=16)
BATCH = 2


def ddp_step(tmp_path, dtype, autocast: bool) -> dict:
    """One DDP step of the course's transformer on one gloo rank: bytes by part, and DDP's bucket bytes."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / f"store-{dtype}"), 1), rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        model = models.Transformer(CFG).to(dtype)
        ddp = DistributedDataParallel(model)
        tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = models.lm_loss(ddp(tokens), tokens)
        loss.backward()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer.step()
        buckets = sum(int(size) for size in str(ddp._get_ddp_logging_data()["bucket_sizes"]).split(","))
        state = memory.ledger(model, optimizer)
    finally:
        dist.destroy_process_group()
    return {"params": state.params, "grads": state.grads, "optimizer": state.optimizer, "buckets": buckets}


@pytest.fixture(scope="module")
def autocast_run(tmp_path_factory):
    return ddp_step(tmp_path_factory.mktemp("ddp"), torch.float32, autocast=True)


def test_ddps_parts_are_torchs_under_autocast_to_the_byte(autocast_run):
    spec = planner.from_config(CFG, micro_batch=BATCH, global_batch=8 * BATCH)
    assert spec.num_params() == CFG.num_params()
    layout = planner.Layout(dp=8, zero_stage=0)
    parts = planner.memory_per_gpu(spec, layout, 0, planner.Options(activation_checkpointing="none"))
    measured = autocast_run
    assert (parts["params"], parts["grads"], parts["optimizer"], parts["temporary"]) == (
        measured["params"], measured["grads"], measured["optimizer"], measured["buckets"])
    # what DDP all-reduces is what its buckets hold: 4 bytes a parameter, as much as it keeps
    assert planner.comm_per_step(spec, layout, 0, planner.Options())["dp"] == {"all_reduce": measured["buckets"]}
    assert measured["buckets"] == measured["grads"] == 4 * spec.num_params()


def test_a_bucket_takes_the_gradients_dtype(tmp_path, autocast_run):
    """A bf16 model (no autocast): bf16 gradients, bf16 buckets, half the bytes: the dtype is the gradients'."""
    bf16 = ddp_step(tmp_path, torch.bfloat16, autocast=False)
    assert bf16["buckets"] == bf16["grads"] == autocast_run["buckets"] // 2
    # and gradient_as_bucket_view drops the copy, as the planner's option does
    spec = planner.from_config(CFG, micro_batch=BATCH, global_batch=8 * BATCH)
    view = planner.Options(activation_checkpointing="none", ddp_bucket_view=True)
    assert planner.memory_per_gpu(spec, planner.Layout(dp=8), 0, view)["temporary"] == 0


def test_zero1_keeps_fp32_gradients_in_one_buffer_as_megatrons_distributed_optimizer():
    """ZeRO-1 reduce-scatters fp32 gradients: it keeps them in fp32 (4 bytes), in a buffer its buckets are views of
    (no copy), beside bf16 weights and its shard of the fp32 master copy and moments: 2 + 4 + 12/d."""
    spec = planner.from_config(CFG, micro_batch=BATCH, global_batch=8 * BATCH)
    n, d = spec.num_params(), 8
    parts = planner.memory_per_gpu(spec, planner.Layout(dp=d, zero_stage=1), 0, planner.Options())
    assert (parts["params"], parts["grads"], parts["optimizer"], parts["temporary"]) == (2 * n, 4 * n, 12 * n / d, 0)
    wire = planner.comm_per_step(spec, planner.Layout(dp=d, zero_stage=1), 0, planner.Options())["dp"]
    assert wire["reduce_scatter"] == parts["grads"]
