"""Chapter 03's numbers, recomputed: the test fails when chapters/03_communication.md drifts from the code."""

import sys
from pathlib import Path

import pytest

from distlab import comm

REPO = Path(__file__).resolve().parents[2]
TEXT = (REPO / "chapters" / "03_communication.md").read_text()
FLAT = " ".join(TEXT.split())  # the text as read: a phrase matches whatever the line breaks
NVLINK, SLINGSHOT = (300e9, 0.6e-6), (25e9, 5.0e-6)  # the chapter's (bandwidth B/s, NCCL's LL step s)


def says(phrase: str) -> None:
    assert " ".join(phrase.split()) in FLAT, \
        f"chapter 03 no longer says {phrase!r}: the code computes it; update the text"


def test_ring_factors_quoted():
    factors = [comm.ring_factor("all_reduce", n) for n in (2, 4, 8, 64)]
    says(f"grows from {factors[0]:g} for two ranks to {factors[1]:g} for four, {factors[2]:g} for eight and "
         f"{factors[3]:.3f} for sixty-four")


def test_alpha_beta_examples():
    step, call = comm.NCCL_RING_STEP_LATENCY_S, comm.NCCL_RING_CALL_LATENCY_S
    says(f"A ring step costs {step['nvlink']['LL'] * 1e6:g}, {step['nvlink']['LL128'] * 1e6:g} or "
         f"{step['nvlink']['Simple'] * 1e6:g} microseconds\nover NVLink")
    says(f"and {step['network']['LL'] * 1e6:g}, {step['network']['LL128'] * 1e6:g} or "
         f"{step['network']['Simple'] * 1e6:g} across the network when every step\ncrosses it (one GPU a node")
    says(f"every ring call adds {call['LL'] * 1e6:g}, {call['LL128'] * 1e6:g} or {call['Simple'] * 1e6:g} microseconds")
    assert step["network"]["LL"] == SLINGSHOT[1]
    says(f"Take {NVLINK[0] / 1e9:.0f} GB/s in each direction")
    says(f"NCCL's LL step over NVLink, {step['nvlink']['LL'] * 1e6:g} microseconds")
    says(f"{SLINGSHOT[0] / 1e9:.0f} GB/s for one Slingshot-11 network card with NCCL's LL step\nacross the network, "
         f"{step['network']['LL'] * 1e6:g} microseconds")
    big = [comm.ring_time("all_reduce", 1e9, 4, bandwidth, step[link]["Simple"], call["Simple"])
           for bandwidth, link in ((NVLINK[0], "nvlink"), (SLINGSHOT[0], "network"))]
    says(f"takes {big[0] * 1e3:.1f} ms over NVLink and {big[1] * 1e3:.1f} ms over the network")
    steps_only = [comm.latency_bound_below("all_reduce", 4, bandwidth, step[link]["LL"]) / 1e6
                  for bandwidth, link in ((NVLINK[0], "nvlink"), (SLINGSHOT[0], "network"))]
    with_call = [comm.latency_bound_below("all_reduce", 4, bandwidth, step[link]["LL"], call["LL"]) / 1e6
                 for bandwidth, link in ((NVLINK[0], "nvlink"), (SLINGSHOT[0], "network"))]
    says(f"By the steps alone, messages below about {steps_only[0]:.2f} MB (NVLink) or {steps_only[1]:.2f} MB "
         f"(network) are latency-bound.")
    says(f"Once the {call['LL'] * 1e6:g} microseconds of a call are counted too, the bounds move out to about "
         f"{with_call[0]:.1f} MB and {with_call[1]:.2f} MB.")
    guessed = comm.latency_bound_below("all_reduce", 4, NVLINK[0], 5e-6) / 1e6
    says(f"(An assumed 5 microseconds a step would put NVLink's crossover at {guessed:.1f} MB, "
         f"{round(guessed / steps_only[0])} times too large.)")
    # where 2(n-1) alpha = 2(n-1)/n S / beta: S = n alpha beta
    assert comm.latency_bound_below("all_reduce", 4, *NVLINK) == pytest.approx(4 * NVLINK[1] * NVLINK[0])
    says("latency terms equal the bandwidth term, is at S = n alpha beta for the steps alone")


def test_bus_bandwidth_caveats():
    flat = " ".join(TEXT.split())
    says("data sheets quote NVLink's both ways")
    assert "with in-network reduction (NVLS, SHARP, CollNet)" in flat
    assert "NCCL's tree runs" not in flat and "a tree only between nodes" in flat
    assert "NCCL switches to tree algorithms, which need only about 2 log2(n) steps" not in flat
    assert "host clock with one synchronisation at the end, and that time *averaged* over the ranks" in flat


def test_beta_is_stated_as_a_bandwidth():
    says("Here beta is a bandwidth, in bytes per second")
    # ring_time divides by the bandwidth: doubling beta halves the bandwidth term
    big = 1e12
    assert comm.ring_time("all_reduce", big, 4, 2 * NVLINK[0], 0) == pytest.approx(
        comm.ring_time("all_reduce", big, 4, NVLINK[0], 0) / 2)


def test_all_to_all_is_not_what_ring_attention_uses():
    says("(Ring attention, chapter 08, does not: it passes key and value blocks around a ring with\n  send/recv.)")
    assert "ring and Ulysses" not in FLAT
    ring_attention = (REPO / "scripts" / "08_sequence_parallel" / "ring_attention.py").read_text()
    assert "all_to_all" not in ring_attention and "isend" in ring_attention  # what the code really uses


def test_process_group_grid_is_the_scripts():
    sys.path.insert(0, str(REPO / "scripts" / "03_communication"))
    try:
        import process_groups
    finally:
        sys.path.pop(0)
    rows, columns = process_groups.rank_grid(4, 2)
    says(f"(for N = 4 and K = 2, {rows[0]} and {rows[1]}), a **column** the ranks K apart ({columns[0]} and "
         f"{columns[1]})")
    assert process_groups.rank_grid(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
