"""Chapter 08: sequence parallelism saves activations at the same traffic; ring attention equals full attention."""

from helpers import assert_all_checks_passed, assert_config_error

from labkit import launch

SEQUENCE_PARALLEL = "scripts/08_sequence_parallel/sp_transformer.py"
RING = "scripts/08_sequence_parallel/ring_attention.py"


def test_sequence_parallel_equals_one_device_and_saves_activation_memory():
    metrics = assert_all_checks_passed(launch.run(SEQUENCE_PARALLEL, nproc=4, args=["--steps", "2"], stream=False),
                                       min_checks=8)
    saved = metrics["memory"]["activation_bytes"]
    assert saved["TP 4 + SP"]["measured"] < saved["TP 4"]["measured"] < saved["single device"]["measured"]
    for entry in saved.values():
        assert entry["measured"] == entry["total"]  # exact on a CPU
    traffic = metrics["extra"]["activation_traffic_per_rank"]
    assert traffic["tp"] == traffic["tp+sp"]
    collectives = {r["collective"] for r in metrics["comm"] if r["plan"] == "tp+sp" and r["where"] == "blocks"}
    assert collectives == {"all_gather", "reduce_scatter"}


def test_ring_attention_equals_full_attention_and_zigzag_balances_under_torchrun():
    """The ring by hand (both layouts), then in the same launch all-gather CP and Ulysses by hand and torch 2.13's own
    context-parallel attention with each rotate method: each equals full attention, torch's equals this ring."""
    metrics = assert_all_checks_passed(launch.run(RING, nproc=4, launcher="torchrun", stream=False), min_checks=45)
    ring = metrics["extra"]["ring"]
    assert ring["zigzag"]["blocks_per_rank"] == [9, 9, 9, 9]
    assert ring["contiguous"]["blocks_per_rank"] == [3, 7, 11, 15]
    names = [c["name"] for c in metrics["checks"]]
    assert sum("cover the causal triangle" in n for n in names) == 2          # counted from what was computed
    computed = [pair for rank_log in ring["zigzag"]["steps"] for entry in rank_log for pair in entry["computed"]]
    assert len(computed) == 36 and all(0 <= k <= q for q, k in computed)   # the key chunks that really arrived
    # K and V blocks alive, read off the storages: forward 3 at every step but the last (own, computing, arriving),
    # backward 5 ((K, V) own, then two messages of K, V, dK, dV: the one added to and the one arriving)
    for layout in ("zigzag", "contiguous"):
        assert metrics["memory"][layout]["kv_blocks_held_forward"] == [[3, 3, 3, 2]] * 4
        assert metrics["memory"][layout]["kv_blocks_held_backward"] == [[5, 5, 5, 4]] * 4
    # each rank sends 3 hops of (K, V) forward; 3 of (K, V, dK, dV) and 1 of (dK, dV) backward; 8 KiB per shard
    sent = {(r["layout"], r["phase"]): r["measured_bytes"] for r in metrics["comm"]}
    assert sent[("zigzag", "forward")] == sent[("contiguous", "forward")] == 3 * 2 * 8192
    assert sent[("zigzag", "backward")] == sent[("contiguous", "backward")] == (3 * 4 + 2) * 8192

    # the other ways, measured: what each rank handed its collectives (payloads), forward and backward
    methods = {name: entry["payload_bytes"] for name, entry in metrics["extra"]["methods"].items()}
    whole_kv = 4 * 2 * 8192                                               # K and V of the whole sequence
    assert methods["all-gather"] == {"forward": {"all_gather": whole_kv}, "backward": {"reduce_scatter": whole_kv}}
    assert methods["ulysses"] == {"forward": {"all_to_all": 4 * 8192}, "backward": {"all_to_all": 4 * 8192}}
    # torch's default gathers K and V (every rank holds all of them); "alltoall" is a ring of P - 1 hops;
    # dK, dV go around by all-to-all (P hops) under either
    assert methods["torch allgather"] == {"forward": {"all_gather": whole_kv},
                                          "backward": {"all_gather": whole_kv, "all_to_all": 4 * 2 * 8192}}
    assert methods["torch alltoall"] == {"forward": {"all_to_all": 3 * 2 * 8192},
                                         "backward": {"all_to_all": (3 + 4) * 2 * 8192}}
    assert sum("equal this script's ring" in n for n in names) == 2
    assert sum("equal this script's all-gather" in n for n in names) == 2
    for method in ("all-gather", "ulysses", "torch allgather", "torch alltoall"):
        assert sum(n.startswith(f"{method}: ") and "equals full attention" in n for n in names) == 4


def test_a_ring_that_computes_with_the_wrong_block_fails_the_coverage_check_and_ulysses_groups_several_heads():
    """The coverage check counts the key chunks that really arrived (found by their first key row), not the ones the
    ring meant to send: a ring that keeps computing with its own block fails it. In the same launch Ulysses runs with
    two heads a rank (8 heads on 4 ranks), where a slip in grouping the heads would show."""
    result = launch.run(RING, nproc=4, args=["--methods", "ring", "ulysses", "--layout", "zigzag", "--heads", "8",
                                             "--planted-bug", "keep-own-block"], stream=False, check=False)
    assert result.returncode == 1
    failed = {c["name"] for c in result.metrics["checks"] if not c["passed"]}
    assert "zigzag: the blocks computed cover the causal triangle, each block once" in failed
    assert not any(name.startswith("ulysses") for name in failed)
    ulysses = [c for c in result.metrics["checks"] if c["name"].startswith("ulysses")]
    assert len(ulysses) == 6 and result.metrics["config"]["heads"] == 8   # 4 tensors, 2 payload checks
    steps = result.metrics["extra"]["ring"]["zigzag"]["steps"]
    assert {k for rank_log in steps for entry in rank_log for _, k in entry["computed"]} == {0, 1, 2, 3, 4, 5, 6, 7}


def test_sequence_that_does_not_split_over_ranks_exits_2():
    assert_config_error(SEQUENCE_PARALLEL, ["--seq-len", "30"], "sequence length 30 does not split over 4 ranks")


def test_ring_sequence_that_does_not_split_into_chunks_exits_2():
    assert_config_error(RING, ["--seq-len", "60"], "does not split into 8 chunks")

# --native on a CPU, and heads that Ulysses cannot split: check_config refuses both, tested in-process
# (tests/unit/test_ring_attention_math.py); the launch above proves that a refusal ends every rank with exit 2.
