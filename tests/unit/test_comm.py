"""The ring cost model, bus bandwidth factors, and the bytes CommCounter records."""

import pytest
import torch
import torch.distributed as dist

from distlab import comm, models


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_factors(n):
    assert comm.ring_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for collective in ("all_gather", "reduce_scatter", "all_to_all"):
        assert comm.ring_factor(collective, n) == pytest.approx((n - 1) / n)
    assert comm.ring_factor("broadcast", n) == 1.0
    # an all-reduce is a reduce-scatter followed by an all-gather
    assert comm.ring_factor("all_reduce", n) == pytest.approx(
        comm.ring_factor("reduce_scatter", n) + comm.ring_factor("all_gather", n))
    with pytest.raises(KeyError):
        comm.ring_factor("gossip", n)


def test_bytes_sent_per_rank_approach_twice_the_payload():
    sent = [comm.bytes_sent_per_rank("all_reduce", 1000, n) for n in (2, 4, 8, 1024)]
    assert sent[:3] == [1000, 1500, 1750] and 1998 < sent[3] < 2000


# nccl-tests' bus bandwidth factors (its PERFORMANCE.md), written out as numbers: bandwidth.py's table uses
# comm.bus_bandwidth, and this is where its factors are checked (the script no longer checks a formula
# against a copy of itself).
@pytest.mark.parametrize("collective, ranks, factor", [
    ("all_reduce", 4, 1.5), ("all_gather", 4, 0.75), ("reduce_scatter", 4, 0.75), ("broadcast", 4, 1.0),
    ("all_reduce", 8, 1.75), ("all_gather", 8, 0.875), ("reduce_scatter", 8, 0.875), ("all_reduce", 2, 1.0)])
def test_bus_bandwidth_factors_are_nccl_tests(collective, ranks, factor):
    algorithm, bus = comm.bus_bandwidth(collective, 8e9, 2.0, ranks)
    assert algorithm == 4e9 and bus == pytest.approx(factor * 4e9)


def test_ring_time_is_latency_bound_small_and_bandwidth_bound_large():
    latency, bandwidth = 5e-6, 100e9
    # all-reduce on 4 ranks: 2(n-1) = 6 steps of latency, 1.5 S bytes over the link
    assert comm.ring_time("all_reduce", 0, 4, bandwidth, latency) == pytest.approx(6 * latency)
    assert comm.ring_time("all_reduce", 1e9, 4, bandwidth, latency) == pytest.approx(6 * latency + 1.5e9 / bandwidth)
    small = comm.ring_time("all_reduce", 1e3, 4, bandwidth, latency)
    assert 6 * latency / small > 0.99  # 1 kB: all latency
    large = comm.ring_time("all_reduce", 1e9, 4, bandwidth, latency)
    assert 1.5e9 / bandwidth / large > 0.99  # 1 GB: all bandwidth
    assert comm.ring_time("all_gather", 4e6, 4, bandwidth, latency) == pytest.approx(3 * latency + 3e6 / bandwidth)


@pytest.fixture
def world_of_one():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def test_comm_counter_records_payloads(world_of_one):
    x, original = torch.ones(16), dist.all_reduce
    with comm.CommCounter() as counter:
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
        out = torch.empty(16)
        dist.all_gather_single(out, x)
        dist.reduce_scatter_single(out, x)
    assert [c.collective for c in counter.calls] == ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]
    assert counter.total() == 4 * 64 and counter.total("all_reduce") == 64
    assert counter.by_collective()["all_gather"] == {"calls": 1, "payload_bytes": 64,
                                                        "sent_bytes_per_rank_derived": 0.0}
    assert dist.all_reduce is original  # the patches are gone after the block


def test_chapter_03_ring_model_numbers():
    """The alpha-beta examples chapter 03 quotes (link figures are the chapter's stated assumptions)."""
    nvlink, slingshot = (300e9, 5e-6), (25e9, 10e-6)
    assert comm.ring_time("all_reduce", 1e9, 4, *nvlink) * 1e3 == pytest.approx(5.03, abs=0.005)
    assert comm.ring_time("all_reduce", 1e9, 4, *slingshot) * 1e3 == pytest.approx(60.06, abs=0.005)
    # crossover where the 2(n-1) latencies cost as much as the bytes: 2(n-1) alpha beta / (2(n-1)/n)
    for (bandwidth, latency), crossover_mb in ((nvlink, 6.0), (slingshot, 1.0)):
        crossover = 6 * latency * bandwidth / 1.5
        assert crossover / 1e6 == pytest.approx(crossover_mb)
        assert comm.ring_time("all_reduce", crossover, 4, bandwidth, latency) == pytest.approx(12 * latency)
    assert [round(comm.ring_factor("all_reduce", n), 3) for n in (2, 4, 8, 64)] == [1.0, 1.5, 1.75, 1.969]



@pytest.mark.parametrize("cap_mb", [25, 0.1, 0.025, 0.04, 1e-6])
def test_ddp_bucket_sizes_is_ddps_own_assignment(cap_mb):
    """Our rule against the one DDP calls (torch's private _compute_bucket_assignment_by_size), on the tiny
    transformer's gradients in backward's order (the reverse of its parameters)."""
    grads = [torch.empty_like(p) for p in reversed(list(models.build_transformer(models.preset("tiny")).parameters()))]
    indices, _ = dist._compute_bucket_assignment_by_size(grads, [int(cap_mb * comm.MIB)])
    torch_sizes = [sum(grads[i].numel() * 4 for i in bucket) for bucket in indices]
    assert comm.ddp_bucket_sizes([g.numel() * 4 for g in grads], cap_mb) == torch_sizes


def test_ddp_bucket_sizes_of_the_tiny_model():
    sizes = [p.numel() * 4 for p in reversed(list(models.build_transformer(models.preset("tiny")).parameters()))]
    assert comm.ddp_bucket_sizes(sizes, 25) == [492_800]
    assert comm.ddp_bucket_sizes(sizes, 0.1) == [131_328, 114_944, 147_712, 98_816]  # what train_ddp.py measures
    assert len(comm.ddp_bucket_sizes(sizes, 0.025)) == 12
    with pytest.raises(ValueError):
        comm.ddp_bucket_sizes(sizes, 0)
