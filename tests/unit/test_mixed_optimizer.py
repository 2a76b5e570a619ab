"""models.adamw_for_mixed_parameters: DTensors beside plain tensors in one optimizer, on the GPU's foreach path.

On a GPU, AdamW's default foreach kernels refuse a mix of DTensors and plain tensors; tp_transformer.py (norms
left out of the TP plan) and moe_transformer.py (experts kept out of FSDP) both have that mix. A GPU run of
moe_transformer.py crashed on it (H100, 2026-11-26); the CPU's default loop had hidden it."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from distlab import models


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def mixed_parameters(mesh):
    torch.manual_seed(0)
    sharded = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
    plain = torch.nn.Parameter(torch.randn(3))
    for p in (sharded, plain):
        p.grad = torch.ones_like(p)
    return sharded, plain


def test_one_foreach_group_with_the_mix_fails_as_on_a_gpu(mesh):
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torch.optim.AdamW(mixed_parameters(mesh), lr=0.1, foreach=True).step()


def test_the_helper_steps_the_mix_as_plain_adamw_would(mesh):
    sharded, plain = mixed_parameters(mesh)
    expected = [sharded.full_tensor().detach().clone(), plain.detach().clone()]
    reference = [torch.nn.Parameter(t) for t in expected]
    for p in reference:
        p.grad = torch.ones_like(p)
    optimizer = models.adamw_for_mixed_parameters([sharded, plain], lr=0.1)
    assert optimizer.defaults["foreach"] is True and len(optimizer.param_groups) == 2
    optimizer.step()
    torch.optim.AdamW(reference, lr=0.1, foreach=False).step()
    assert isinstance(sharded, DTensor)
    assert torch.allclose(sharded.full_tensor(), reference[0]) and torch.allclose(plain, reference[1])
