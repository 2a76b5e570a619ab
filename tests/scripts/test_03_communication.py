"""Chapter 03: every collective equals its definition; bandwidths use the right factors; the ring all-reduce works."""

from helpers import assert_all_checks_passed, assert_config_error

from labkit import launch

COLLECTIVES = "scripts/03_communication/collectives.py"
BANDWIDTH = "scripts/03_communication/bandwidth.py"
RING = "scripts/03_communication/ring_allreduce.py"


def test_every_collective_matches_its_definition_under_torchrun():
    result = launch.run(COLLECTIVES, nproc=4, launcher="torchrun", stream=False)
    metrics = assert_all_checks_passed(result, min_checks=13)
    assert {c["collective"] for c in metrics["comm"]} == {
        "broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}
    assert all(c["measured_bytes"] == c["analytic_bytes"] for c in metrics["comm"])
    # bytes each rank sends: derived from the measured payload by the ring model, and labelled so
    assert all(c["sent_bytes_per_rank_derived"] > 0 for c in metrics["comm"])
    gathered = next(c for c in metrics["comm"] if c["collective"] == "all_gather")
    assert gathered["analytic_bytes"] == 4 * 8 * 4  # 4 ranks x 8 floats x 4 bytes: the gathered output


def test_bandwidth_table_uses_the_bus_factors():
    result = launch.run(BANDWIDTH, nproc=4, args=["--max-bytes", "64K", "--iters", "2"], stream=False)
    metrics = assert_all_checks_passed(result, min_checks=6)   # per collective: results correct, bytes counted
    rows = metrics["extra"]["bandwidth"]
    assert {r["collective"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter"}
    for row in rows:
        factor = 1.5 if row["collective"] == "all_reduce" else 0.75  # 2(n-1)/n and (n-1)/n for n = 4
        assert abs(row["busbw"] - factor * row["algbw"]) <= 1e-9 * row["busbw"]
        assert abs(row["algbw"] - row["bytes"] / row["seconds"]) <= 1e-9 * row["algbw"]
    assert sorted({r["bytes"] for r in rows}) == [4096, 16384, 65536]
    # NCCL's algorithm and protocol are recorded on NCCL only (gloo here); the counter saw one untimed call a size
    assert all(r["nccl_algorithm"] is None for r in rows)
    assert all(c["measured_bytes"] == c["analytic_bytes"] for c in metrics["comm"]) and len(metrics["comm"]) == 9


def test_ring_all_reduce_on_four_ranks_sends_the_formula_bytes():
    metrics = assert_all_checks_passed(launch.run(RING, nproc=4, stream=False), min_checks=5)
    assert metrics["comm"][0]["measured_bytes"] == metrics["comm"][0]["analytic_bytes"] == 3 * 4096 * 4 // 2


def test_collectives_alone_is_a_config_error():
    assert_config_error(COLLECTIVES, [], "at least 2 ranks", nproc=1)


def test_ring_with_fewer_elements_than_ranks_is_a_config_error():
    assert_config_error(RING, ["--numel", "3"], "every rank needs a chunk")


def test_unreadable_size_is_a_config_error():
    assert_config_error(BANDWIDTH, ["--max-bytes", "lots"], "cannot read size", nproc=2)
