"""Chapter 08's numbers, recomputed: the test fails when chapters/08_sequence_parallel.md drifts from the code."""

import re
import sys
from pathlib import Path

from distlab import comm, models
from distlab import tensor_parallel as tp

REPO = Path(__file__).resolve().parents[2]
TEXT = (REPO / "chapters" / "08_sequence_parallel.md").read_text()
GIB = 2**30


def says(phrase: str) -> None:
    assert phrase in TEXT, f"chapter 08 no longer says {phrase!r}: the code computes it; update the text"


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


def test_ring_attention_bytes_and_blocks():
    sys.path.insert(0, str(REPO / "scripts" / "08_sequence_parallel"))
    try:
        import ring_attention
    finally:
        sys.path.pop(0)
    shape = ring_attention.SHAPES["tiny"]
    shard = shape["batch"] * shape["heads"] * (shape["seq_len"] // 4) * shape["head_dim"] * 4
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
