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
    """The alpha-beta examples chapter 03 quotes, with NCCL's own latencies (its tuning.cc constants)."""
    step, call = comm.NCCL_RING_STEP_LATENCY_S, comm.NCCL_RING_CALL_LATENCY_S
    nvlink, network = 300e9, 25e9
    # 1 GB on the Simple protocol: the latencies are 28.8 us (NVLink) and 92.4 us (network) of 5 and 60 ms
    assert comm.ring_time("all_reduce", 1e9, 4, nvlink, step["nvlink"]["Simple"], call["Simple"]) * 1e3 == \
        pytest.approx(5.0288)
    assert comm.ring_time("all_reduce", 1e9, 4, network, step["network"]["Simple"], call["Simple"]) * 1e3 == \
        pytest.approx(60.0924)
    # crossover where the latencies cost as much as the bytes: n alpha beta for the steps alone
    for bandwidth, latency, crossover in ((nvlink, step["nvlink"]["LL"], 0.72e6), (network, step["network"]["LL"], 0.5e6)):
        assert comm.latency_bound_below("all_reduce", 4, bandwidth, latency) == pytest.approx(crossover)
        assert comm.latency_bound_below("all_reduce", 4, bandwidth, latency) == pytest.approx(4 * latency * bandwidth)
        assert comm.ring_time("all_reduce", crossover, 4, bandwidth, latency) == pytest.approx(12 * latency)
    # with the fixed cost of a call, (a0 + 2(n-1) alpha) beta / (2(n-1)/n)
    with_call = comm.latency_bound_below("all_reduce", 4, nvlink, step["nvlink"]["LL"], call["LL"])
    assert with_call == pytest.approx((6.6e-6 + 6 * 0.6e-6) * nvlink / 1.5)
    assert comm.ring_time("all_reduce", with_call, 4, nvlink, step["nvlink"]["LL"], call["LL"]) == \
        pytest.approx(2 * (6.6e-6 + 6 * 0.6e-6))
    # an assumed 5 us a step puts NVLink's crossover 8 times too far out
    assert comm.latency_bound_below("all_reduce", 4, nvlink, 5e-6) / 1e6 == pytest.approx(6.0)
    assert round(5e-6 / step["nvlink"]["LL"]) == 8
    assert [round(comm.ring_factor("all_reduce", n), 3) for n in (2, 4, 8, 64)] == [1.0, 1.5, 1.75, 1.969]


# NVIDIA/nccl src/graph/tuning.cc at 5067397c (NCCL 2.30.7), lines 151, 159 and 171, as read there
NCCL_TUNING_LINES = (
    "{  6.8, 14.0,  8.4 }, {  6.6, 14.0,  8.4 },  // Tree, Ring",
    "{ { 0.6, 1.25, 4.0 }, { 0.6, 1.9, 3.4 }, /* Tree (LL/LL128/Simple), Ring (LL/LL128/Simple)*/",
    "{ { 5.0, 8.5, 14 }, { 2.7, 4.0, 14.0 }, /* Tree (LL/LL128/Simple), Ring (LL/LL128/Simple)*/",
)


def _ring_triple(line: str, which: int = 1) -> list[float]:
    """The second {a, b, c} of a tuning.cc line: the ring's LL, LL128, Simple (``which=0``: the first, the tree's)."""
    import re
    return [float(x) for x in re.findall(r"\{\s*([\d.]+),\s*([\d.]+),\s*([\d.]+)\s*\}", line)[which]]


def test_nccl_latencies_are_the_ones_in_nccls_source():
    protocols = ("LL", "LL128", "Simple")
    base, nvlink = (_ring_triple(line) for line in NCCL_TUNING_LINES[:2])
    # a ring whose every step crosses the network (one GPU a node) is charged the tree's network figures:
    # tuning.cc:386-387, interLat = ppn == 1 ? hwLatencies[NCCL_HW_NET][NCCL_ALGO_TREE][p] : ...[NCCL_ALGO_RING][p]
    network = _ring_triple(NCCL_TUNING_LINES[2], which=0)
    assert [comm.NCCL_RING_CALL_LATENCY_S[p] * 1e6 for p in protocols] == pytest.approx(base)
    assert [comm.NCCL_RING_STEP_LATENCY_S["nvlink"][p] * 1e6 for p in protocols] == pytest.approx(nvlink)
    assert [comm.NCCL_RING_STEP_LATENCY_S["network"][p] * 1e6 for p in protocols] == pytest.approx(network)


def test_nccls_tuning_lines_are_parsed():
    log = ("gpu1:4242:4242 [0] NCCL INFO AllReduce: 4096 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}\n"
           "gpu1:4242:4242 [0] NCCL INFO Latency/AlgBw | Tree/LL | ...\n"
           "gpu1:4242:4242 [0] NCCL INFO AllGather: 1048576 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..15}\n")
    assert comm.nccl_tuning_choices(log) == [("AllReduce", 4096, "RING", "LL"),
                                             ("AllGather", 1048576, "RING", "SIMPLE")]
    assert comm.nccl_tuning_choices("") == []


def test_bandwidth_py_reads_only_the_timed_calls_choice():
    # 16 bytes on 4 ranks, one timed call per block, three blocks: each block's barrier is a 4-byte AllReduce
    # (16 // 4), which must not count for the all-reduce (it did when any of size, size // world matched)
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "03_communication"))
    try:
        import bandwidth
    finally:
        sys.path.pop(0)
    line = "h:1:1 [0] NCCL INFO {}: {} Bytes -> Algo {} proto {} channel{{Lo..Hi}}={{0..0}}\n"
    blocks = (line.format("AllReduce", 4, "TREE", "LL") + line.format("AllReduce", 16, "RING", "LL")) * 3
    assert bandwidth.nccl_choice_for("all_reduce", 16, 4, blocks) == "RING/LL"
    gathers = line.format("AllReduce", 4, "TREE", "LL") + line.format("AllGather", 4, "RING", "SIMPLE")
    assert bandwidth.nccl_choice_for("all_gather", 16, 4, gathers) == "RING/SIMPLE"
    assert bandwidth.nccl_choice_for("reduce_scatter", 16, 4, gathers) is None
    # a size it cannot read is a configuration error (one line, exit 2), an infinite one included
    from distlab import runtime
    assert bandwidth.parse_size("64K") == 65536
    for text in ("lots", "infK", "1e400M", "nanK", ""):
        with pytest.raises(runtime.ConfigError, match="cannot read size"):
            bandwidth.parse_size(text)


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
