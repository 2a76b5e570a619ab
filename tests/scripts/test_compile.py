"""torch.compile across the course, on the CPU (inductor builds C++ here): chapter 01's ladder switches change how a
step runs, not what it computes; chapter 05's FSDP2 and chapter 06's DTensor TP with compiled blocks equal one device.
One file, so one pytest worker runs them in this order: the FSDP ranks compile chapter 01's graph (8 rows of 32
tokens), and inductor's cache on disk serves it. Every run is a launch, forked from make test's server where torch is
imported once (the ladder's three single-rank runs took 15.2 s as new interpreters, 12.0 s forked, cold cache);
make test compiles in each rank's own process (TORCHINDUCTOR_COMPILE_THREADS=1)."""


from helpers import assert_all_checks_passed

from labkit import launch

SCRIPT = "scripts/01_single_device_baseline/train_baseline.py"
FSDP = "scripts/05_fully_sharded/train_fsdp.py"
TP = "scripts/06_tensor_parallel/tp_transformer.py"
P = 123_200  # parameters of the tiny transformer


def test_the_ladders_switches_change_how_not_what(tmp_path):
    """Chapter 01's ladder: compiled blocks (inductor's C++ on the CPU) with fused AdamW, and activation checkpointing
    with the unfused math attention (the CPU's default is its flash kernel), each train the plain run's losses.
    Tolerance 1e-5: fp32, only the order of sums may differ (measured: equal to the last digit here); a 0.1% change
    planted in the checkpointed block fails it. The compiled run's graph is the one chapter 05's FSDP test compiles
    (8 rows of 32 tokens a rank): inductor's cache on disk serves the second. The GPU measures them."""
    runs = {"plain": [], "compiled": ["--compile", "--fused-adamw", "--profile-out", str(tmp_path / "p.json")],
            "checkpointed": ["--activation-checkpointing", "--attention", "math"]}
    metrics = {}
    for name, extra in runs.items():   # one rank each, forked from make test's server (torch imported once)
        metrics[name] = assert_all_checks_passed(launch.run(SCRIPT, nproc=1, args=["--steps", "4", *extra],
                                                            stream=False, timeout=240))
    plain = metrics["plain"]["losses"]
    for name in ("compiled", "checkpointed"):
        assert len(metrics[name]["losses"]) == len(plain) == 4
        assert max(abs(a - b) for a, b in zip(metrics[name]["losses"], plain)) <= 1e-5, name
        assert not any("saved activations measured" in c["name"] for c in metrics[name]["checks"])
    # one graph for every block (and both runs): the blocks share their code, their weights are the graph's inputs
    # (chapter 01: "One compiled graph serves all 24 blocks")
    assert [c["value"] for c in metrics["compiled"]["checks"] if c["name"].startswith("the blocks ran compiled")] == [1]
    # checkpointed blocks keep only their inputs: far fewer saved bytes
    assert metrics["checkpointed"]["memory"]["measured_activations"] < metrics["plain"]["memory"]["measured_activations"] / 2
    assert not (tmp_path / "p.json").exists()  # the device-time breakdown is of GPU kernels: none on a CPU


def test_fsdp_with_compiled_blocks_equals_one_device_and_gathers_as_before():
    """torchtitan's order (compile each block, then shard it) on 2 CPU ranks: inductor's kernels inside, FSDP2's
    collectives in its hooks outside; the script's own checks compare with one device (loss 1e-5) and count that a
    graph was captured (a dispatch mode left on makes it fail: seen)."""
    metrics = assert_all_checks_passed(launch.run(FSDP, nproc=2, args=["--steps", "3", "--batch", "16", "--compile"],
                                                  stream=False), min_checks=12)
    assert any(c["name"].startswith("the blocks ran compiled") for c in metrics["checks"])
    comm = {c["collective"]: c for c in metrics["comm"]}
    assert comm["all_gather"]["measured_bytes"] == 2 * 4 * P


def test_tensor_parallel_with_compiled_blocks_equals_one_device_and_sends_the_formulas_bytes():
    """torchtitan's order (the TP plan, then compile each block) on 2 CPU ranks: DTensor's collectives inside the
    compiled graphs. The script's checks: step-0 gradients and losses equal one device (1e-6, 1e-5), a graph was
    captured, and the step's all-reduces, read off the profiler (a dispatch mode would turn compile off), equal the
    formula's totals. Seen failing: without the copy of the embedding's output the first backward raises; a payload
    counted at half its bytes fails the ledger check."""
    metrics = assert_all_checks_passed(launch.run(TP, nproc=2, args=["--compile", "--steps", "3"], stream=False),
                                       min_checks=5)
    assert any(c["name"].startswith("the blocks ran compiled") for c in metrics["checks"])
    (row,) = metrics["comm"]
    assert (row["collective"], row["phase"], row["measured_calls"]) == ("all_reduce", "step", 13)
    assert row["measured_bytes"] == row["analytic_bytes"] == 10 * 4 * 32 * 64 * 4 + 3 * 4 * 32 * 4
