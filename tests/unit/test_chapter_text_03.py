"""Chapter 03's numbers, recomputed: the test fails when chapters/03_communication.md drifts from the code."""

import sys
from pathlib import Path

import pytest

from distlab import comm

REPO = Path(__file__).resolve().parents[2]
TEXT = (REPO / "chapters" / "03_communication.md").read_text()
NVLINK, SLINGSHOT = (300e9, 5e-6), (25e9, 10e-6)  # the chapter's assumed (bandwidth B/s, latency s) per link


def says(phrase: str) -> None:
    assert phrase in TEXT, f"chapter 03 no longer says {phrase!r}: the code computes it; update the text"


def test_ring_factors_quoted():
    factors = [comm.ring_factor("all_reduce", n) for n in (2, 4, 8, 64)]
    says(f"grows from {factors[0]:g} for two ranks to {factors[1]:g} for four, {factors[2]:g} for eight and "
         f"{factors[3]:.3f} for sixty-four")


def test_alpha_beta_examples():
    says(f"Take\n{NVLINK[0] / 1e9:.0f} GB/s and {NVLINK[1] * 1e6:.0f} microseconds per step")
    says(f"a 1 GB all-reduce then takes {comm.ring_time('all_reduce', 1e9, 4, *NVLINK) * 1e3:.1f} ms over NVLink "
         f"and {comm.ring_time('all_reduce', 1e9, 4, *SLINGSHOT) * 1e3:.1f} ms")
    crossover = []
    for bandwidth, latency in (NVLINK, SLINGSHOT):
        # where 2(n-1) alpha = 2(n-1)/n S / beta: S = n alpha beta, and the ring time is twice the latency term
        size = 4 * latency * bandwidth
        assert comm.ring_time("all_reduce", size, 4, bandwidth, latency) == pytest.approx(2 * 6 * latency)
        crossover.append(size / 1e6)
    says(f"messages below about {crossover[0]:.1f} MB (NVLink) or {crossover[1]:.1f} MB (network) are latency-bound")
    says("The crossover, where the\ntwo terms are equal, is at S = n alpha beta")


def test_beta_is_stated_as_a_bandwidth():
    says("Here beta is a bandwidth, in bytes per second")
    # ring_time divides by the bandwidth: doubling beta halves the bandwidth term
    big = 1e12
    assert comm.ring_time("all_reduce", big, 4, 2 * NVLINK[0], 0) == pytest.approx(
        comm.ring_time("all_reduce", big, 4, NVLINK[0], 0) / 2)


def test_all_to_all_is_not_what_ring_attention_uses():
    says("(Ring attention, chapter 08, does not: it passes key and value blocks around a ring with\n  send/recv.)")
    assert "ring and Ulysses" not in TEXT
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
