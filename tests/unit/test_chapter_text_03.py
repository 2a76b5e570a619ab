"""Chapter 03's numbers, recomputed: the test fails when the chapter's pages (chapters/03_communication.md, 03.2_*.md)
drift from the code."""

import sys
from pathlib import Path

import pytest

from coursetools import chapters
from distlab import comm

REPO = Path(__file__).resolve().parents[2]
TEXT = chapters.text("03")  # every page of the chapter: a claim may move from one page to the next
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
    # one row a protocol: NCCL 2.30.7's ring step latencies, call latency (tuning.cc:151-171) and the share of the
    # link's bandwidth its model gives the ring (tuning.cc:327-329: LL x .5, LL128 x 0.92, Simple all)
    share = {"LL": 0.5, "LL128": 0.92, "Simple": 1}
    for p in ("LL", "LL128", "Simple"):
        row = (f"| {p} | {step['nvlink'][p] * 1e6:g} | {step['network'][p] * 1e6:g} | {call[p] * 1e6:g} | "
               f"{share[p]:g} |")
        assert row in TEXT, f"chapter 03's protocol table has no row {row!r}"
    says("(the network column is\nfor one GPU a node, where every step crosses it)")
    # the crossover with the bandwidth NCCL's model gives LL: half the link's
    half = comm.latency_bound_below("all_reduce", 4, share["LL"] * NVLINK[0], step["nvlink"]["LL"]) / 1e6
    says(f"With the half that\n  NCCL's model gives LL, the first falls to {half:.2f} MB.")
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


def _show(values) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"


def test_the_two_rank_example_is_what_the_collectives_leave():
    import torch

    inputs = [torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 20, 30, 40])]
    total = torch.stack(inputs).sum(0)
    halves = list(total.chunk(2))
    to_all = [torch.cat([x.chunk(2)[r] for x in inputs]) for r in range(2)]
    says(f"rank 0 holds {_show(inputs[0])} and rank 1 holds {_show(inputs[1])}. All-reduce leaves both with "
         f"{_show(total)}. Reduce-scatter leaves rank 0 with {_show(halves[0])} and rank 1 with {_show(halves[1])}")
    says(f"All-gather those halves and both hold {_show(torch.cat(halves))} again, the all-reduce's result.")
    says(f"All-to-all leaves rank 0 with {_show(to_all[0])} and rank 1 with {_show(to_all[1])}")


def test_the_three_rank_ring_is_the_ring_run_step_by_step():
    """The ring of the chapter, run here on numbers (chunk (r - s) mod n sent right in reduce-scatter, (r + 1 - s)
    mod n in all-gather): the partial sums the text walks through, the result and the bytes."""
    n, chunks = 3, [[1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [100.0, 200.0, 300.0]]
    made, sent = [], [0] * n
    for step in range(n - 1):
        outgoing = {r: ((r - step) % n, chunks[r][(r - step) % n]) for r in range(n)}
        for r, (i, value) in outgoing.items():
            chunks[(r + 1) % n][i] += value
            sent[r] += 4
        made.append({(r + 1) % n: (i, chunks[(r + 1) % n][i]) for r, (i, _) in outgoing.items()})
    complete = [(r, (r + 1) % n, chunks[r][(r + 1) % n]) for r in range(n)]
    for step in range(n - 1):
        outgoing = {r: ((r + 1 - step) % n, chunks[r][(r + 1 - step) % n]) for r in range(n)}
        for r, (i, value) in outgoing.items():
            chunks[(r + 1) % n][i] = value
            sent[r] += 4
    assert all(row == [111.0, 222.0, 333.0] for row in chunks)
    from coursetools.drawings import ch03  # the picture of this example is drawn from the same steps

    drawn = ch03.ring_allreduce_on_numbers(ch03.RING_EXAMPLE)
    assert ch03.RING_EXAMPLE == [[1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [100.0, 200.0, 300.0]]
    assert len(drawn) == 1 + 2 * (n - 1) and drawn[-1][1] == chunks
    assert {(receiver, (chunk, value)) for _, receiver, chunk, value in drawn[1][2]} == {
        (1, (0, 1.0)), (2, (1, 20.0)), (0, (2, 300.0))}
    assert [row[(r + 1) % n] for r, row in enumerate(drawn[n - 1][1])] == [222.0, 333.0, 111.0]
    assert made[0] == {1: (0, 11.0), 2: (1, 220.0), 0: (2, 303.0)}
    says("rank 0 sends its 1 to rank 1, which now holds 11 in chunk 0. Rank 1 sends 20 to rank 2 (220 in chunk 1), "
         "and rank 2 sends 300 to rank 0 (303 in chunk 2).")
    (r0, i0, v0), (r1, i1, v1), (r2, i2, v2) = complete
    says(f"Rank {r0} ends with {v0:g} in chunk {i0}, rank {r1} with {v1:g} in chunk {i1}, rank {r2} with {v2:g} in "
         f"chunk {i2}: each holds one complete sum")
    says(f"every rank holds {_show(chunks[0])}")
    payload = 4 * n
    assert sent == [comm.bytes_sent_per_rank("all_reduce", payload, n)] * n == [16] * n
    says(f"That took\n{2 * (n - 1)} steps, and each rank sent {2 * (n - 1)} messages of one number: {sent[0]} bytes "
         f"of fp32 for a {payload}-byte tensor.")
    says(f"NVLink carries {NVLINK[0] / SLINGSHOT[0]:.0f} times\nwhat one network card does")


def test_the_collectives_picture_is_the_scripts_definitions():
    """03_collectives.png is drawn from coursetools.drawings.ch03's definitions on labels; with numbers in place of
    the labels they give what collectives.py checks every rank against."""
    import torch

    from coursetools.drawings import ch03

    sys.path.insert(0, str(REPO / "scripts" / "03_communication"))
    try:
        import collectives
    finally:
        sys.path.pop(0)
    world, numel, seed = 4, 8, 0
    every = [collectives.contribution(r, numel, seed) for r in range(world)]

    def value(label: str):
        index = int(label[1:])
        if label.startswith(ch03.SUM):
            return torch.stack(every).sum(0).chunk(world)[index]
        return every[ch03.LETTERS.index(label[0])].chunk(world)[index]

    for name in ("broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        after = ch03.collective_on_labels(name, ch03.inputs_on_labels(world))
        for rank in range(world):
            drawn = torch.cat([value(label) for label in after[rank]])
            assert torch.equal(drawn, collectives.expected_results(rank, world, numel, seed)[name]), (name, rank)


def test_an_uneven_ring_sends_2_n_minus_1_payloads_in_all_but_not_equally():
    """The ring of the chapter on a tensor of 10 numbers and 4 ranks (chunks of 3, 3, 2, 2): the ranks send different
    bytes, and together 2(n - 1) x S."""
    n, sizes = 4, [3, 3, 2, 2]
    sent = [0] * n
    for step in range(n - 1):
        for r in range(n):
            sent[r] += 4 * sizes[(r - step) % n] + 4 * sizes[(r + 1 - step) % n]  # reduce-scatter, all-gather
    payload = 4 * sum(sizes)
    assert sum(sent) == 2 * (n - 1) * payload and len(set(sent)) > 1
    says("All\nranks together still send 2(n - 1) x S, since every chunk makes n - 1 hops in each phase.")


def test_the_bandwidth_bound_is_argued_to_its_conclusion():
    says("So on average each rank sends (n-1)/n x S twice, 2(n-1)/n x S.")
    assert comm.ring_factor("all_reduce", 4) == 2 * (4 - 1) / 4


def test_the_ring_pictures_panels_are_the_texts_steps():
    """03_ring_allreduce.png titles its panels with the text's s, counted from 0 (coursetools/figures.py draws it)."""
    import inspect

    from coursetools import figures
    source = inspect.getsource(figures.draw_ring_allreduce)
    assert 'f"after RS s={step - 1}"' in source and 'f"after AG s={step - n}"' in source
    says("each panel shows the chunks after step s of the text below, s\ncounted from 0.")


def test_terms_used_in_chapter_03_are_defined():
    says("Let K be the size of one group")
    says("(Each rank's input is drawn from a generator\nseeded with its rank, so every rank can rebuild all of them.)")
    says("a **batch system** (PBS or Slurm) gives your job its nodes")
    assert "replicas of one shard" not in FLAT


def test_the_lab_says_what_the_ring_script_and_checker_do():
    import json

    lab = json.loads((REPO / "notebooks" / "03_communication.ipynb").read_text())
    cells = ["".join(c["source"]) for c in lab["cells"]]
    assert "dist.batch_isend_irecv" in (REPO / "scripts" / "03_communication" / "ring_allreduce.py").read_text()
    assert any("`ring_allreduce.py`" in c and "`dist.batch_isend_irecv`" in c for c in cells)
    # the checker compares the bytes of all ranks together (the cases include uneven splits)
    assert any("sum(network.bytes_sent) != 2 * (n - 1) * payload" in c for c in cells)
    assert any("the bytes all ranks sent together, 2(n - 1) x S" in c for c in cells)


def test_the_gpu_expectation_is_the_cost_models():
    step, call = comm.NCCL_RING_STEP_LATENCY_S["nvlink"]["Simple"], comm.NCCL_RING_CALL_LATENCY_S["Simple"]
    t = comm.ring_time("all_reduce", 1e9, 4, NVLINK[0], step, call)
    algorithm, bus = comm.bus_bandwidth("all_reduce", 1e9, t, 4)
    says(f"at 1 GB on 4 ranks: {t * 1e3:.1f}\nms, an algorithm bandwidth of {algorithm / 1e9:.0f} GB/s and a bus "
         f"bandwidth of {bus / 1e9:.0f} GB/s, almost NVLink's {NVLINK[0] / 1e9:.0f}")
    assert "shows NCCL's bus bandwidth approaching NVLink's" not in FLAT   # no GPU run is recorded to show it


def test_the_collectives_picture_shows_the_identity():
    """The picture's seventh panel, under the reduce-scatter's, all-gathers the reduce-scatter's output and ends with the all-reduce's result; the
    caption says its input is one chunk a rank, where the all-gather panel's is a whole tensor."""
    from coursetools.drawings import ch03

    scattered, gathered = ch03.identity_panel(4)
    assert all(len(chunks) == 1 for chunks in scattered)
    assert gathered == ch03.collective_on_labels("all_reduce", ch03.inputs_on_labels(4))
    assert all(len(chunks) == 4 for chunks in ch03.inputs_on_labels(4))
    says("The panel under the reduce-scatter all-gathers its output, one summed chunk a rank, and every rank ends "
         "with the all-reduce's result. The all-gather panel starts from whole tensors instead.")
