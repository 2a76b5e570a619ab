"""Chapter 08's numbers, recomputed: the test fails when the chapter's pages (chapters/08_sequence_parallel.md,
08.2_ring_attention.md, 08.3_all_gather_and_ulysses.md, read as one text) drift from the code."""

import re
import sys
from pathlib import Path

import torch

from coursetools import chapters
from distlab import comm, models
from distlab import context_parallel as cpm
from distlab import tensor_parallel as tp

REPO = Path(__file__).resolve().parents[2]
TEXT = chapters.text("08")
GIB = 2**30


def says(phrase: str) -> None:
    """The phrase, word for word; line breaks and runs of spaces count as one space (the prose is rewrapped freely)."""
    assert " ".join(phrase.split()) in " ".join(TEXT.split()), (
        f"chapter 08 no longer says {phrase!r}: the code computes it; update the text")


def test_activation_bytes_tiny_and_a100():
    tiny, a100 = models.preset("tiny"), models.preset("a100")
    one, plain, sp = (tp.activation_bytes(tiny, 4, 32, t, sequence_parallel=s)["total"]
                      for t, s in ((1, False), (4, False), (4, True)))
    says(f"the script measures {one:,} bytes on one device,\n{plain:,} per rank under TP 4 and {sp:,} under TP 4 + SP")
    big = [tp.activation_bytes(a100, 2, 1024, t, sequence_parallel=s) for t, s in ((1, False), (4, False), (4, True))]
    says(f"{big[0]['total'] / GIB:.2f} GiB on one GPU, {big[1]['total'] / GIB:.2f} GiB under TP 4, of which the "
         f"replicated norms are {big[1]['norms'] / GIB:.2f} GiB")
    says(f"inputs {big[1]['tp_inputs'] / GIB:.2f} GiB, and {big[2]['total'] / GIB:.2f} GiB under TP 4 + SP")


def test_tp_and_sp_send_the_same_activation_bytes():
    tiny = models.preset("tiny")
    sent = [sum(comm.bytes_sent_per_rank(r["collective"], r["payload_bytes"], 4)
                for r in tp.tp_comm_formula(tiny, 4, 32, 4, sequence_parallel=s)
                if r["where"] not in ("loss", "norm weights")) for s in (False, True)]
    assert sent[0] == sent[1]
    says(f"the activation bytes each rank sends in one tiny step are {sent[0]:,.0f}\nunder TP and {sent[1]:,.0f}")


def _tiny_ring_shape():
    """ring_attention.py, its tiny shape, and one rank's K (or V) block of it in bytes (fp32, 4 ranks)."""
    sys.path.insert(0, str(REPO / "scripts" / "08_sequence_parallel"))
    try:
        import ring_attention
    finally:
        sys.path.pop(0)
    shape = ring_attention.SHAPES["tiny"]
    return ring_attention, shape, shape["batch"] * shape["heads"] * (shape["seq_len"] // 4) * shape["head_dim"] * 4


def test_ring_attention_bytes_and_blocks():
    ring_attention, shape, shard = _tiny_ring_shape()
    sent = tp.ring_comm_formula(shard, 4)
    says(f"forward\n({sent['forward']:,} bytes)")
    says(f"backward ({sent['backward']:,} bytes)")
    contiguous, zigzag = tp.causal_blocks_per_rank(4, "contiguous"), tp.causal_blocks_per_rank(4, "zigzag")
    says(f"on 4 ranks they compute {', '.join(map(str, contiguous[:-1]))} and {contiguous[-1]} blocks")
    assert len(set(zigzag)) == 1 and sum(zigzag) == sum(contiguous)
    says(f"{zigzag[0]} blocks on every rank, the same {sum(zigzag)}\nin total")
    big = ring_attention.SHAPES["a100"]
    says(f"{big['heads']} heads of {big['head_dim']} dimensions over {big['seq_len']:,} positions")


def test_h_is_the_width():
    assert not re.search(r"\bH\b", TEXT)


# ---- context parallelism besides the ring (issue 36) ------------------------------------------------------------

FLAT = " ".join(TEXT.split())


def says_flat(phrase: str) -> None:
    """``says``, line breaks and runs of spaces counting as one space (the text is rewrapped freely)."""
    assert " ".join(phrase.split()) in FLAT, f"chapter 08 no longer says {phrase!r}: the code computes it"


TORCH_CP = (Path(torch.__file__).parent / "distributed" / "tensor" / "experimental" / "_context_parallel"
            / "_attention.py")
# What the chapter cites, line by line, in torch 2.13's source: the line must still say it.
TORCH_CP_LINES = {
    75: "convert_to_f32: bool = True",                                    # dK, dV accumulated (and sent) in fp32
    77: "rotate_method: _RotateMethod = _RotateMethod.ALL_GATHER",        # the default rotate method
    253: "class _AllToAllRotater(_RingRotater):",
    273: "class _AllGatherRotater(_RingRotater):",
    438: "next_kv = torch.cat([key.flatten(), value.flatten()])",          # the copy each hop sends
    520: "dkv_rotater = _create_rotater(group, 2, method=_RotateMethod.ALL_TO_ALL)",  # dK, dV: always all-to-all
    917: "call_maps: dict[torch._ops.OpOverload, Callable] = {",             # the CUDA kernels it handles
    1693: "def set_rotate_method(rotate_method: str) -> None:",
}


def test_torch_context_parallel_is_cited_where_torch_says_it():
    lines = TORCH_CP.read_text().splitlines()
    for number, text in TORCH_CP_LINES.items():
        assert text in lines[number - 1], f"_attention.py:{number} no longer says {text!r}: torch changed"
        says_flat(f"`_attention.py:{number}`")
    cited = {int(n) for n in re.findall(r"`_attention\.py:(\d+)`", TEXT)}
    assert cited == set(TORCH_CP_LINES), cited
    says_flat("`rotate_method: _RotateMethod = _RotateMethod.ALL_GATHER`")
    # the CUDA kernels are the only ones handled (no CPU one). Read, not imported: importing DTensor costs 1-2 s, and
    # ring_attention.py imports and runs it, with each rotate method, in the chapter's torchrun test.
    handled = " ".join(lines[916:925])
    assert "_scaled_dot_product_flash_attention.default" in handled and "for_cpu" not in handled


def test_the_table_of_what_each_way_sends():
    ring_attention, shape, shard = _tiny_ring_shape()
    says_flat(f"(B = {shape['batch']}, {shape['heads']} heads of {shape['head_dim']} dimensions, S = {shape['seq_len']}, "
         f"c = 4)")
    rows = {"ring (`ring_attention.py`)": "ring", "all-gather (by hand)": "all-gather",
            'torch, "allgather" (its default)': "torch allgather", 'torch, "alltoall"': "torch alltoall",
            "Ulysses (above)": "ulysses"}
    sent = {}
    for label, method in rows.items():
        sent[method] = cpm.cp_bytes_sent_per_rank(method, shard, 4)
        says_flat(f"| {label} | {sent[method]['forward']:,.0f} | {sent[method]['backward']:,.0f} |")
    assert sent["ring"] == tp.ring_comm_formula(shard, 4)  # the ring's row is the formula chapter 11 uses
    assert sent["all-gather"]["forward"] == sent["ring"]["forward"]               # "sends what the ring sends"
    assert sent["all-gather"]["backward"] < sent["ring"]["backward"] / 2           # "less than half"
    assert sent["ulysses"]["forward"] == sent["ring"]["forward"] / 2               # "half of the ring's forward"
    # torch's two rotate methods send what the ring sends: (2P - 1) x (dK, dV)-sized messages backward either way
    assert sent["torch alltoall"] == sent["torch allgather"] == sent["ring"]


def test_causal_imbalance_and_what_zigzag_saves():
    blocks = tp.causal_blocks_per_rank(4, "contiguous")
    halves = [sum(row[r] for row in cpm.ring_step_work(4, "contiguous", 0.5)) for r in range(4)]
    assert blocks[-1] / blocks[0] == 5 and halves[-1] / halves[0] == 7
    says_flat("Counted in blocks the last rank does five times the first one's work")
    says_flat(f"{halves[-1]:.0f} blocks against {halves[0]:.0f}: seven times")
    contiguous, zigzag = (cpm.ring_time_in_blocks(4, layout, 1.0) for layout in ("contiguous", "zigzag"))
    steps = [max(row) for row in cpm.ring_step_work(4, "contiguous", 1.0)]
    says_flat(f"{contiguous:.0f} blocks in all ({' + '.join(f'{s:.0f}' for s in steps)}). Zig-zag takes {zigzag:.0f}")
    half_c, half_z = (cpm.ring_time_in_blocks(4, layout, 0.5) for layout in ("contiguous", "zigzag"))
    says_flat(f"{contiguous / zigzag:.2f} times faster counted in blocks, {half_c / half_z:.2f} times ({half_c:.0f} against "
         f"{half_z:.0f})")
    assert contiguous == max(blocks)  # the ring's time is the busiest rank's total here


def test_all_gather_memory_in_llama3_405b_and_its_source():
    from distlab.planner import MODELS
    from distlab.planner.sources import SOURCES

    quote = " ".join(SOURCES["llama3_cp_all_gather"].quote.split())
    chapter_quote = re.search(r'"(our CP implementation adopts.*?we still adopt this\s+approach)"', FLAT, re.S)
    assert chapter_quote and " ".join(chapter_quote.group(1).split()) in quote
    assert "16,384 8 16 16 8 131,072" in SOURCES["llama3_table4"].quote  # GPUs TP CP PP DP Seq. Len.
    says_flat("405B at 131,072 tokens with CP 16")
    model, tp_degree, cp_degree, seq, mib = MODELS["405b"], 8, 16, 131072, 2**20
    head_dim = model.hidden // model.heads
    says_flat(f"({model.heads} query heads, {model.kv_heads} key/value heads of {head_dim} dimensions)")
    kv = 2 * seq * model.kv_dim // tp_degree * 2                              # whole sequence, this TP rank's heads
    queries = seq // cp_degree * model.hidden // tp_degree * 2
    mha = 2 * seq * model.hidden // tp_degree * 2
    says_flat(f"take {kv / mib:,.0f} MiB a layer in bf16, {kv / queries:.0f} times its own queries ({queries / mib:,.0f} MiB)")
    says_flat(f"they would take {mha / mib:,.0f} MiB, {mha / queries:.0f} times")
    says_flat(f"TP {tp_degree} leaves a GPU {model.heads // tp_degree} query heads and {model.kv_heads // tp_degree} "
              f"key/value head, and CP {cp_degree} leaves it {seq // cp_degree:,} positions of the queries")


def test_when_a_ring_step_hides_its_transfer():
    from distlab import metrics

    peak = metrics.PEAK_FLOPS[("A100", "bf16")]
    says_flat(f"A100 at its {peak / 1e12:.0f} TFLOP/s peak")
    links = (tp.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S, tp.SLINGSHOT11_NIC_BYTES_PER_S)
    says_flat(f"one Slingshot NIC ({links[1] / 1e9:.0f} GB/s)")
    mha = [cpm.ring_break_even_tokens_per_rank(8, 8, peak, link) for link in links]
    gqa = [cpm.ring_break_even_tokens_per_rank(8, 1, peak, link) for link in links]
    # a ring hop goes to one neighbour: in a 4 x A100 node (no NVSwitch) only the four links between the two GPUs
    peer = cpm.NVLINK3_A100_4GPU_PEER_BYTES_PER_S
    assert peer == links[0] * 4 / 12 == 100e9
    node = [cpm.ring_break_even_tokens_per_rank(8, kv, peak, peer) for kv in (8, 1)]
    says_flat(f"the break-even is {node[0]:,.0f} tokens per rank between neighbours in a 4 x A100 node")
    says_flat(f"({peer / 1e9:.0f} GB/s each way: four of each GPU's twelve NVLinks go to each other GPU")
    says_flat(f"{mha[0]:,.0f} where an NVSwitch gives any peer all {links[0] / 1e9:.0f} GB/s")
    says_flat(f"and {mha[1]:,.0f} over one Slingshot NIC")
    says_flat(f"with 8 times fewer key/value heads, {node[1]:,.0f}, {gqa[0]:,.0f} and {gqa[1]:,.0f}")
    assert "NVLink (300 GB/s each way)" not in FLAT  # a ring hop does not get a GPU's every link
    # the break-even is where a step's compute equals its transfer, and it does not move with S
    # the a100 preset's positions a rank, against the break-even: not hidden in a 4 x A100 node, hidden with NVSwitch
    ring_attention, _, _ = _tiny_ring_shape()
    big = ring_attention.SHAPES["a100"]
    per_rank = big["seq_len"] // 4
    assert node[1] < mha[0] < per_rank < node[0]
    says_flat(f"hides the ring's hops only from {node[0]:,.0f} tokens per rank, or under GQA from {node[1]:,.0f}")
    says_flat(f"gives each of 4 ranks {per_rank:,} positions with as many key/value heads as query heads. That is "
              f"below the node's {node[0]:,.0f}, so its hops would not hide at peak FLOP/s")
    says_flat(f"an NVSwitch node's {mha[0]:,.0f} would hide them")
    step = cpm.ring_step_seconds(round(mha[0]), 16, 16, 128, peak, links[0])
    assert abs(step["compute"] / step["transfer"] - 1) < 1e-3


def test_ulysses_is_taught_since_chapter_10_refers_to_it():
    says_flat("## Ulysses: all-to-all over heads")
    assert "chapter 08's Ulysses" in chapters.text("10")


def test_what_a_ring_rank_holds_of_k_and_v():
    """The ring keeps its own K, V for backward besides the block it computes with and the one arriving (three), and
    torch's "alltoall" ring also holds the copy it sends (torch.cat, in flight while the step computes): four."""
    script = (REPO / "scripts" / "08_sequence_parallel" / "ring_attention.py").read_text()
    assert "ctx.save_for_backward(q, k, v, out, lse)" in script  # its own K, V kept for backward
    lines = TORCH_CP.read_text().splitlines()
    assert "next_kv = torch.cat([key.flatten(), value.flatten()])" in lines[438 - 1]
    assert "next_kv = rotater.exchange_buffers(next_kv)" in lines[439 - 1]  # the copy goes out while the step computes
    # measured on the storages by the script (tests/scripts/test_08_sequence_parallel.py holds the numbers): three
    # in forward because each step frees the block it is done with; four without that
    assert "del keys, values" in script and "memory.StorageLedger()" in script
    assert "more than three blocks of K and V at once" not in FLAT
    says_flat("In forward it is three at every step but the last: its own (kept for backward), the one it computes "
              "with and the one arriving.")
    says_flat("would make it four at steps 1 to c - 2")
    # backward measures [5, 5, 5, 4] (tests/scripts/test_08_sequence_parallel.py): the last message is dK, dV only
    says_flat("Backward holds five at every step but the last: its own K and V, and two messages of K, V, dK and dV")
    says_flat("| ring (`ring_attention.py`) | 49,152 | 114,688 | three blocks: its own, the visiting one, the arriving one "
              "(measured) |")
    says_flat("| four blocks: also the copy it sends |")
    # the copy's source line sits in "How we know", beside the row it explains
    says_flat("its copy is the `torch.cat` at `_attention.py:438`, in flight while the step computes (the fourth block "
              'of the "alltoall" row)')
    assert "more than two blocks" not in FLAT and "two blocks at a time" not in FLAT
    assert "more than two blocks" not in (REPO / "scripts" / "08_sequence_parallel" / "ring_attention.py").read_text()


def test_the_hybrids_placement_across_nodes_is_llama_3s():
    """Across nodes a ring hides its hops; an all-gather does not hide, and Llama 3 ran it there: CP next to TP in
    its order, TP 8 filling a server of eight GPUs."""
    from distlab.planner.sources import SOURCES

    assert "[TP, CP, PP, DP]" in SOURCES["llama3_parallelism_order"].quote
    assert "Each server is equipped with eight GPUs" in " ".join(SOURCES["llama3_compute"].quote.split())
    assert "16,384 8 16 16 8 131,072" in SOURCES["llama3_table4"].quote  # TP 8, CP 16
    says_flat("a ring across nodes, where only neighbours talk and the hops can hide behind attention;")
    says_flat("or, across nodes, an all-gather, exposed but small under GQA: Llama 3's CP groups span servers, its TP "
              "filling each one.")


def test_the_labs_balance_and_summary_say_what_the_code_computes():
    """Lab 08's prose: the causal-balance figures computed here, and its summary tells torch's default all-gather
    (the ring's bytes both ways) from the all-gather by hand (less backward)."""
    import json

    cells = json.loads((REPO / "notebooks" / "08_sequence_parallel.ipynb").read_text())["cells"]
    lab = " ".join(" ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown").split())
    blocks = tp.causal_blocks_per_rank(4, "contiguous")
    halves = [sum(row[r] for row in cpm.ring_step_work(4, "contiguous", 0.5)) for r in range(4)]
    full = [cpm.ring_time_in_blocks(4, layout, 1.0) for layout in ("contiguous", "zigzag")]
    half = [cpm.ring_time_in_blocks(4, layout, 0.5) for layout in ("contiguous", "zigzag")]
    zigzag = tp.causal_blocks_per_rank(4, "zigzag")
    for phrase in (f"rank 3 computes {blocks[3]} blocks and rank 0 computes {blocks[0]}",
                   f"seven times ({halves[3]:.0f} against {halves[0]:.0f})", f"zig-zag ({zigzag[0]} blocks on every rank)",
                   f"{full[0]:.0f} blocks against {full[1]:.0f}, {full[0] / full[1]:.2f} times faster "
                   f"({half[0] / half[1]:.2f} counting halves)",
                   f"runs {full[0] / full[1]:.2f} to {half[0] / half[1]:.2f} times faster"):
        assert phrase in lab, f"lab 08 no longer says {phrase!r}"
    sent = {m: cpm.cp_bytes_sent_per_rank(m, 8192, 4) for m in ("ring", "all-gather", "torch allgather")}
    assert sent["torch allgather"] == sent["ring"] and sent["all-gather"]["backward"] < sent["ring"]["backward"]
    assert "The all-gather by hand (Llama 3's) sends the ring's forward bytes and less backward" in lab
    assert "Either way torch's context parallelism sends the ring's bytes both ways" in lab
    # the lab speaks the chapter's symbols: h the width, t the TP degree, c the CP degree (P is the pipeline's)
    assert not re.search(r"\b[HP]\b", lab) and "divided by tp" not in lab and "the table of section 5" not in lab


def test_torch_sends_dk_and_dv_in_fp32_and_the_chapter_says_so():
    """torch 2.13 accumulates dK, dV in fp32 by default and sends the accumulators: under bf16, twice the bytes of a
    bf16 dK, dV (measured in tests/unit/test_ring_attention_math.py)."""
    lines = TORCH_CP.read_text().splitlines()
    assert "accum_dtype = torch.float32 if _cp_options.convert_to_f32 else query.dtype" in lines[512 - 1]
    assert "grad_key = torch.zeros_like(key, dtype=accum_dtype)" in lines[514 - 1]
    assert "next_grad_kv = torch.cat([grad_key.flatten(), grad_value.flatten()])" in lines[625 - 1]
    assert "dkv_rotater.exchange_buffers(next_grad_kv)" in lines[627 - 1]
    assert cpm.TORCH_CP_GRAD_BYTES == 4
    bf16 = cpm.cp_comm_payloads("torch allgather", 4096, 4, dtype_bytes=2)["backward"]["all_to_all"]
    assert bf16 == 4 * 2 * 4096 * 2                      # P hops of (dK, dV), each number 4 bytes where K is 2
    says_flat("Those dK and dV hops are fp32 whatever the inputs' dtype.")
    says_flat("(`convert_to_f32 = True`, `_attention.py:75` and `512-515`) and sends the accumulators (`:625-627`)")
    says_flat("So under bf16 its backward moves twice the bytes of a bf16 dK and dV.")


def test_the_coverage_check_counts_what_arrived_and_ulysses_runs_with_several_heads_a_rank():
    script = (REPO / "scripts" / "08_sequence_parallel" / "ring_attention.py").read_text()
    assert "computed.append([my_chunks[i], key_chunks[j]])" not in script   # the plan, not what arrived
    assert "keys[j][0, 0, 0].clone()" in script
    says_flat("The key chunk is the one that really arrived: the script finds it by its first key row")
    says_flat("`--planted-bug keep-own-block` makes every rank compute with its own block at every step.")
    says_flat("Its tests run Ulysses with one head a rank and with two (8 heads on 4 ranks)")
    test = (REPO / "tests" / "scripts" / "test_08_sequence_parallel.py").read_text()
    assert '"--heads", "8"' in test and '"--planted-bug", "keep-own-block"' in test



def test_what_megatron_saves_of_the_gathered_matmul_input():
    """Megatron-LM's LinearWithGradAccumulationAndAsyncCommunication (megatron/core/tensor_parallel/layers.py, forward:
    ``ctx.save_for_backward(input, weight)`` before the sequence-parallel all-gather; backward: all-gathers ``input``
    again) keeps the sequence shard: the 2bsh term becomes 2bsh / t, a saving of 2bsh (t - 1) / t, not 2bsh."""
    flat = " ".join(TEXT.split())
    assert "That saves another 2bsh per layer" not in flat
    says("That cuts this term from 2bsh to 2bsh / t per layer, for one extra all-gather per region.")


# ---- the teach-first worked examples (issue 48) -------------------------------------------------------------------

def test_the_tiny_sequence_parallel_example_is_the_tiny_models():
    """8.1's worked example: the residual stream a rank holds between the regions, plain TP against TP + SP."""
    tiny, t = models.preset("tiny"), 4
    batch, seq, width = 4, tiny.seq_len, tiny.dim
    says(f"B = {batch} sequences of S = {seq} tokens, h = {width}, on t = {t} ranks")
    says(f"{batch} x {seq} x {width} = {batch * seq * width:,} numbers")
    local = seq // t
    says(f"positions\n{local}r to {local}r + {local - 1} of every sequence: {batch} x {local} x {width} = "
         f"{batch * local * width:,} numbers, a quarter")
    assert batch * local * width * t == batch * seq * width
    says(f"Attention runs on {tiny.n_heads // t} of the {tiny.n_heads} heads per rank")
    # the activations the script counts are this batch and sequence (the 'tiny run' of the next numbers)
    assert tp.activation_bytes(tiny, batch, seq, 1, sequence_parallel=False)["total"] == 1_613_316


def test_the_merge_example_is_full_attention():
    """8.2's worked merge: two blocks of keys, merged through their log-sum-exps, equal full attention."""
    scores = torch.tensor([0.0, torch.log(torch.tensor(3.0)), torch.log(torch.tensor(4.0))], dtype=torch.float64)
    values = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    full = float(torch.softmax(scores, 0) @ values)
    blocks = [(scores[:2], values[:2]), (scores[2:], values[2:])]
    outs = [float(torch.softmax(s, 0) @ v) for s, v in blocks]
    lses = [torch.logsumexp(s, 0) for s, _ in blocks]
    lse = torch.logaddexp(*lses)
    merged = sum(float(torch.exp(l - lse)) * o for l, o in zip(lses, outs))
    z = [float(torch.exp(l)) for l in lses]
    assert abs(merged - full) < 1e-12
    says(f"Z_A =\n1 + 3 = {z[0]:.0f} and out_A = (1 + 6) / 4 = {outs[0]:.2f}")
    says(f"Z_B = {z[1]:.0f} and\nout_B = {outs[1]:.0f}")
    says(f"Z = {sum(z):.0f}, a half each: out = 0.5 x {outs[0]:.2f} + 0.5 x {outs[1]:.0f} = {merged:.3f}")
    says(f"Full\nattention gives (1 + 6 + 12) / 8 = {full:.3f} too")


def test_the_proof_sits_in_how_we_know_on_the_last_page():
    """Tolerances, planted bugs and torch's source lines are in the appendix, not in the pages a learner reads."""
    pages = chapters.pages("08")
    body = "\n".join(chapters.split_appendix(p.read_text())[0] for p in pages)
    appendix = chapters.split_appendix(pages[-1].read_text())[1]
    for proof in ("tolerance 1e-5", "--planted-bug keep-own-block", "`_attention.py:77`", "tolerance 1e-6"):
        assert proof in " ".join(appendix.split()) and proof not in body, proof


# ---- the cold reviews' findings on chapter 08 (learn0813, src0813) ----------------------------------------------

def test_the_recap_tells_torchs_default_from_the_all_gather_by_hand():
    """torch's default all-gathers K and V but sends the ring's bytes backward; only the all-gather by hand sends
    less (the table's rows). The recap said torch's default sent less."""
    _, _, shard = _tiny_ring_shape()
    sent = {m: cpm.cp_bytes_sent_per_rank(m, shard, 4) for m in ("ring", "all-gather", "torch allgather")}
    assert sent["torch allgather"]["backward"] == sent["ring"]["backward"] > sent["all-gather"]["backward"]
    assert "(Llama 3's, and torch's default) sends less backward" not in FLAT
    says_flat("The all-gather by hand (Llama 3's) sends less backward")
    says_flat("torch's default all-gathers too, but it gathers again in backward and sends the ring's bytes.")


def test_ulysses_and_the_ring_in_numbers_under_gqa():
    """Ulysses sends (c-1)/c of q, k, v and the output: 2 B S (h + h_kv)/c x (c-1)/c numbers a way; the ring
    2 B S h_kv (c-1)/c. Checked against cp_bytes_sent_per_rank with K and V narrower than Q (GQA) and without."""
    B, S, c = 2, 64, 4
    for h, h_kv in ((64, 64), (64, 16)):
        q_shard, kv_shard = B * S // c * h * 4, B * S // c * h_kv * 4           # fp32 bytes of one rank's q, k
        ulysses = cpm.cp_bytes_sent_per_rank("ulysses", kv_shard, c, q_shard_bytes=q_shard)["forward"]
        ring = cpm.cp_bytes_sent_per_rank("ring", kv_shard, c)["forward"]
        assert ulysses == 2 * B * S * (h + h_kv) / c * (c - 1) / c * 4
        assert ring == 2 * B * S * h_kv * (c - 1) / c * 4
    says_flat("So Ulysses sends 2 B S (h + h_kv)/c x (c - 1)/c numbers each way, which falls as ranks are added. The "
              "ring sends 2 B S h_kv (c - 1)/c forward, which does not.")
    says_flat("Counted in numbers (times 4 bytes in fp32)")
    assert "about 4 B S h / P" not in FLAT and "about 4 B S h / c" not in FLAT


def test_a_collective_gets_the_nodes_every_link_and_a_hop_its_pair():
    """One bandwidth model for chapters 06, 08 and 09: a ring hop gets the 4 NVLinks to its neighbour (100 GB/s),
    an NCCL collective inside the node all 12 (300 GB/s each way), through its channels."""
    per_direction, peer = tp.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S, cpm.NVLINK3_A100_4GPU_PEER_BYTES_PER_S
    assert per_direction == 3 * peer == 300e9
    says_flat(f"Each A100 has twelve NVLinks, {per_direction / 1e9:.0f} GB/s each way in all, and in a 4 x A100 node "
              f"four of them go to each of the three other GPUs.")
    says_flat("NCCL runs it as several rings at once, its channels, each ordering the GPUs differently, so together "
              "they use every NVLink of the node.")
    says_flat(f"So an all-reduce inside the node, as in chapters 06 and 09, gets the whole {per_direction / 1e9:.0f} "
              f"GB/s.")
    says_flat("a single point-to-point hop (ring attention's) uses a third of them")
    says_flat("(github.com/NVIDIA/nccl issue 299)")
    says_flat("Across nodes the channels leave each node through different GPUs' NICs, so a collective uses every NIC "
              "of the node, which chapter 09 counts on.")
    says_flat('"entering/exiting the node through a NIC", several at once on NVLink systems (issue 412)')
    # chapter 06 times its in-node all-reduces at that same 300 GB/s
    assert (f"{per_direction / 1e9:.0f} GB/s in each direction. An all-reduce gets all of it, since NCCL runs several "
            f"rings at once, each over different links" in " ".join(chapters.text("06").split()))


def test_the_ten_all_reduces_of_the_tiny_step():
    """8.1 rebuilds its 491,520 bytes: ten all-reduces of one 4 x 32 x 64 fp32 activation, 2 (t-1)/t of it sent."""
    tiny, t = models.preset("tiny"), 4
    rows = [r for r in tp.tp_comm_formula(tiny, 4, 32, t, sequence_parallel=False)
            if r["where"] not in ("loss", "norm weights")]
    one = 4 * 32 * tiny.dim * 4
    assert {r["collective"] for r in rows} == {"all_reduce"} and sum(r["payload_bytes"] for r in rows) == 10 * one
    each = comm.bytes_sent_per_rank("all_reduce", one, t)
    assert tiny.n_layers == 2 and 10 * each == 491_520
    says(f"Those {10 * each:,.0f} bytes come from ten all-reduces, since the tiny model has {tiny.n_layers} layers.")
    says(f"Each carries one 4 x 32 x 64 activation, {one:,} bytes in fp32. On 4 ranks each rank sends 2 x 3/4 of it, "
         f"{each:,.0f} bytes, and ten of them make {10 * each:,.0f}.")


def test_the_per_step_blocks_of_both_layouts():
    """Each step's busiest rank, contiguous and zig-zag: 3 + 4 + 4 + 4 and 3 + 2 + 2 + 2 blocks."""
    steps = {layout: [max(row) for row in cpm.ring_step_work(4, layout, 1.0)] for layout in ("contiguous", "zigzag")}
    assert steps == {"contiguous": [3, 4, 4, 4], "zigzag": [3, 2, 2, 2]}
    says_flat(f"Zig-zag takes {sum(steps['zigzag']):.0f} ({' + '.join(f'{s:.0f}' for s in steps['zigzag'])})")
    says_flat("at step 0 every rank computes its own 2 x 2 corner: two diagonal blocks and one full one")
    # away from the diagonal a zig-zag rank computes two of its four chunk pairs, whole (none is half masked)
    kinds = [tp.block_kind(q, k) for q in tp.ring_chunks(1, 4, "zigzag") for k in tp.ring_chunks(2, 4, "zigzag")]
    assert sorted(kinds) == ["full", "full", "skipped", "skipped"]
    says_flat("Two of its four chunk pairs are skipped whole")
    assert "of which half are masked" not in FLAT


def test_one_letter_one_meaning():
    """The CP degree is c (P is chapter 07's pipeline ranks); chapter 06's operator f is named as such."""
    assert re.findall(r"\bP\b", FLAT) == ["P"], re.findall(r"\bP\b", FLAT)   # only where c is defined against it
    says_flat("Each of c ranks (c is the CP degree; chapter 07's P stays the pipeline's)")
    says_flat("Plain TP had chapter 06's operator f there (Megatron's name, not the feed-forward width f)")
    assert "Megatron's f there" not in FLAT
    assert "the tiny run (B = 2" not in FLAT and "the tiny ring run (B = 2" in FLAT
    assert "the output projection's input" not in FLAT and "LM head all-gathers its input" in FLAT


def test_what_a_second_cold_reader_missed():
    # after0610 B5: SP's saving is the norms' three quarters plus the head's final norm, which also shards
    a100 = models.preset("a100")
    plain, sp = (tp.activation_bytes(a100, 2, 1024, 4, sequence_parallel=s) for s in (False, True))
    head_saving = plain["head"] - sp["head"]
    assert head_saving > 0 and plain["total"] - sp["total"] == plain["norms"] * 3 // 4 + head_saving
    says("SP divides the norms' share by 4, and the final norm in the head shrinks too.")
    # B6: the embedding's and the head's halves, one in each direction
    says("For the embedding and the head, one of the two runs in forward and the other in backward.")
    # B2: what NCCL does with two separate calls (chapter 03's pitfall), not "requires"
    assert "as NCCL requires" not in " ".join(TEXT.split())
    says("With NCCL, two separate calls can deadlock (each rank's send waits for a receive queued behind it); "
         "grouping them rules that out (chapter 03).")
