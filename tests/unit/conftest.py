import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one():
    """A one-rank gloo process group in this process (DDP, the collectives' counters), unless one already exists."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()
