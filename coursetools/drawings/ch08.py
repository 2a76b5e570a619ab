"""Chapter 08's pictures of its mechanisms: ring context parallelism against all-gather context parallelism, and
Ulysses' head swap. Each is drawn from a model run on labels: the ring's block owners and bytes come from
``distlab.context_parallel``, and the head swap is ``distlab.context_parallel.sequence_to_heads`` itself, run for
every rank in one process on tensors whose entries name the rank that holds them."""

from __future__ import annotations

from unittest import mock

RANKS = 4


def ring_owners(ranks: int = RANKS) -> list[list[int]]:
    """``owners[step][rank]``: whose K, V block each rank computes with at each step of the ring. The owner is
    read off :func:`distlab.context_parallel.ring_step_work`'s rule through the zig-zag chunks it pairs."""
    from distlab import tensor_parallel

    owners = []
    for step in range(ranks):
        row = []
        for rank in range(ranks):
            owner = (rank - step) % ranks
            # the block really is the owner's: its two chunks are the owner's zig-zag chunks
            assert tensor_parallel.ring_chunks(owner, ranks, "zigzag") == [owner, 2 * ranks - 1 - owner]
            row.append(owner)
        owners.append(row)
    return owners


def swap_labels(ranks: int = RANKS, heads: int = 8, positions: int = 2):
    """Ulysses' swap on labels: before, rank r holds ``positions`` positions of every head, each entry naming where
    it came from (``1000 r + 10 head + local position``). ``distlab.context_parallel.sequence_to_heads`` runs for
    each rank in turn, its all-to-all played by hand (rank j receives block j of every rank, in rank order).
    Returns (before, after): each rank's (heads, positions) grid of labels."""
    import torch

    from distlab import context_parallel as cpm

    head = torch.arange(heads).reshape(heads, 1) * 10
    before = [(1000 * r + head + torch.arange(positions)).reshape(1, heads, positions, 1).double()
              for r in range(ranks)]
    sent = {}

    def record(blocks, group):            # pass 1: what each rank hands the all-to-all
        sent[len(sent)] = blocks
        return blocks

    with mock.patch.object(cpm.dist, "get_world_size", return_value=ranks), \
            mock.patch.object(cpm, "_swap", side_effect=record):
        for x in before:
            cpm.sequence_to_heads(x)
    after = []
    for j in range(ranks):               # pass 2: rank j receives block j of every rank i
        received = torch.stack([sent[i][j] for i in range(ranks)])
        with mock.patch.object(cpm.dist, "get_world_size", return_value=ranks), \
                mock.patch.object(cpm, "_swap", return_value=received):
            after.append(cpm.sequence_to_heads(before[j]))
    return [x[0, :, :, 0].long() for x in before], [x[0, :, :, 0].long() for x in after]


def read_label(label: int, positions: int = 2) -> tuple[int, int, int]:
    """(rank that held it before, its head, its position in the sequence) from a label of :func:`swap_labels`."""
    rank = label // 1000
    return rank, label % 1000 // 10, rank * positions + label % 10


def draw_ring_vs_allgather(fig) -> None:
    from matplotlib.patches import Rectangle

    from coursetools.figures import RANK_COLOURS  # here, not at the top: coursetools.figures imports this module

    from distlab import context_parallel as cpm

    ring_ax, gather_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [RANKS + 1.2, 3.2]})
    owners = ring_owners()
    for step, row in enumerate(owners):
        for rank, owner in enumerate(row):
            ring_ax.add_patch(Rectangle((step, RANKS - 1 - rank), 0.8, 0.7, fc=RANK_COLOURS[owner], alpha=0.75,
                                        ec="black", lw=0.6))
            ring_ax.text(step + 0.4, RANKS - 1 - rank + 0.35, f"KV{owner}", ha="center", va="center", fontsize=7)
            if step < RANKS - 1:
                ring_ax.annotate("", xy=(step + 1.0, RANKS - 1 - (rank + 1) % RANKS + 0.35),
                                 xytext=(step + 0.8, RANKS - 1 - rank + 0.35),
                                 arrowprops=dict(arrowstyle="->", lw=0.5, color="#555555"))
    for rank in range(RANKS):
        ring_ax.text(-0.15, RANKS - 1 - rank + 0.35, f"rank {rank}", ha="right", va="center", fontsize=7)
    for step in range(RANKS):
        ring_ax.text(step + 0.4, RANKS - 0.05, f"step {step}", ha="center", fontsize=7)
    # the tiny run's bytes: B = 2, 4 heads of 16 dimensions, S = 64, c = 4, fp32
    shard = 2 * 4 * (64 // RANKS) * 16 * 4
    ring, gather = (cpm.cp_bytes_sent_per_rank(m, shard, RANKS) for m in ("ring", "all-gather"))
    ring_ax.text(0, -0.45, f"ring: {RANKS - 1} hops to the next rank, each while a block computes.\n"
                 f"Sent a rank: {ring['forward']:,.0f} B forward, {ring['backward']:,.0f} B backward\n"
                 "(K, V travel again with dK, dV)", fontsize=7, va="top")
    ring_ax.set_xlim(-1.1, RANKS + 0.1)
    ring_ax.set_ylim(-1.4, RANKS + 0.3)
    ring_ax.axis("off")
    ring_ax.set_title("ring: one visiting K, V block a step", fontsize=8)
    for rank in range(RANKS):
        for owner in range(RANKS):
            gather_ax.add_patch(Rectangle((owner * 0.6, RANKS - 1 - rank), 0.55, 0.7, fc=RANK_COLOURS[owner],
                                          alpha=0.75, ec="black", lw=0.6))
            gather_ax.text(owner * 0.6 + 0.275, RANKS - 1 - rank + 0.35, f"KV{owner}", ha="center", va="center",
                           fontsize=6)
    gather_ax.text(1.2, RANKS - 0.05, "after one all-gather", ha="center", fontsize=7)
    gather_ax.text(0, -0.45, f"all-gather: every rank holds the whole\nsequence's K, V, kept for backward.\n"
                   f"Sent: {gather['forward']:,.0f} B forward, {gather['backward']:,.0f} B backward\n"
                   "(a reduce-scatter of dK, dV only)", fontsize=7, va="top")
    gather_ax.set_xlim(-0.2, 2.6)
    gather_ax.set_ylim(-1.4, RANKS + 0.3)
    gather_ax.axis("off")
    gather_ax.set_title("all-gather: every block at once", fontsize=8)
    fig.suptitle("context parallelism on 4 ranks: each rank's queries meet every rank's keys and values (KVr: "
                 "rank r's block)", fontsize=9)


def draw_ulysses_head_swap(fig) -> None:
    from matplotlib.colors import ListedColormap

    from coursetools.figures import RANK_COLOURS

    before, after = swap_labels()
    axes = fig.subplots(2, RANKS)
    cmap = ListedColormap(RANK_COLOURS)
    for row, (grids, what) in enumerate(((before, "before: each rank holds S/c = 2 positions of all a = 8 heads"),
                                         (after, "after one all-to-all: each rank holds all S = 8 positions of "
                                                 "a/c = 2 heads"))):
        for rank, grid in enumerate(grids):
            ax = axes[row][rank]
            labels = [[read_label(int(v)) for v in line] for line in grid.tolist()]
            ax.imshow([[owner for owner, _, _ in line] for line in labels], cmap=cmap, vmin=-0.5,
                      vmax=RANKS - 0.5, aspect="auto", alpha=0.8)
            ax.set_yticks(range(len(labels)), [f"h{line[0][1]}" for line in labels])
            ax.set_xticks(range(len(labels[0])), [str(position) for _, _, position in labels[0]])
            ax.tick_params(labelsize=6, length=0)
            ax.set_title(f"rank {rank}", fontsize=7)
            ax.set_xlabel("sequence position", fontsize=6)
        fig.text(0.06, 0.93 - row * 0.47, what, fontsize=8, fontweight="bold")
    fig.suptitle("Ulysses on 4 ranks: an all-to-all trades a sequence shard for a head shard "
                 "(colour: the rank that held the numbers before)", fontsize=9, y=1.02)
    fig.subplots_adjust(left=0.06, right=0.98, top=0.86, bottom=0.1, hspace=0.75, wspace=0.25)


FIGURES = {
    "08_ring_vs_allgather_cp.png": (draw_ring_vs_allgather, (10, 3.2)),
    "08_ulysses_head_swap.png": (draw_ulysses_head_swap, (10, 4.2)),
}
