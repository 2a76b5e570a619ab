"""Chapter 09's pictures of its mechanisms: a weight sharded over a 2-D (dp, tp) mesh, and rings across two nodes
with their NICs. Both are drawn from a model of the mechanism (the splits run on row labels; the groups from
``distlab.hybrid``), never from a measured run."""

from __future__ import annotations

NVLINK, NETWORK = "#2ca02c", "#1f77b4"
# coursetools.figures is imported inside the functions: it gathers this module when it is itself imported


def two_d_owners(rows: int, dp: int, tp: int, tp_dim: int) -> list[list[tuple[int, int]]]:
    """Which (dp, tp) coordinate holds each element of a ``rows x rows`` weight after TP, then FSDP.

    TP splits the weight first, along ``tp_dim`` (0: a column-wise linear splits its output rows; 1: a row-wise
    linear splits its input columns). FSDP then splits *each TP shard's* rows (dim 0) into dp pieces."""
    owners = [[(0, 0)] * rows for _ in range(rows)]
    for i in range(rows):
        for j in range(rows):
            t = (i if tp_dim == 0 else j) // (rows // tp)
            local_row = i % (rows // tp) if tp_dim == 0 else i          # the row inside this TP shard
            local_rows = rows // tp if tp_dim == 0 else rows
            d = local_row // (local_rows // dp)
            owners[i][j] = (d, t)
    return owners


def draw_two_d_sharded_weight(fig) -> None:
    """A row-wise and a column-wise 8 x 8 weight on the (dp, tp) = (2, 2) mesh: each cell coloured by the rank that
    stores it (rank = dp_rank x tp + tp_rank, DeviceMesh's order)."""
    from matplotlib.patches import Rectangle

    from coursetools.figures import RANK_COLOURS

    dp = tp = 2
    rows = 8
    axes = fig.subplots(1, 2)
    titles = {1: "row-wise linear (wo, w2): (Shard(dim=0), Shard(dim=1))\n"
                 "tp splits the columns, then dp splits the rows",
              0: "column-wise linear (wq, w1): (_StridedShard(dim=0, sf=2), Shard(dim=0))\n"
                 "tp splits the rows, then dp splits each tp half's rows"}
    for ax, tp_dim in zip(axes, (1, 0)):
        owners = two_d_owners(rows, dp, tp, tp_dim)
        for i in range(rows):
            for j in range(rows):
                d, t = owners[i][j]
                ax.add_patch(Rectangle((j, rows - 1 - i), 1, 1, facecolor=RANK_COLOURS[d * tp + t], alpha=0.75,
                                       edgecolor="white", lw=0.5))
        ax.add_patch(Rectangle((0, 0), rows, rows, fill=False, lw=1.2))
        for i in range(rows):   # the dp coordinate of each row's owner, read down dim 0
            label = ", ".join(sorted({f"dp {owners[i][j][0]}" for j in range(rows)}))
            ax.text(-0.2, rows - 0.5 - i, f"row {i}: {label}", ha="right", va="center", fontsize=6)
        ax.set_title(titles[tp_dim], fontsize=7.5)
        ax.set_xlim(-3.2, rows + 0.2)
        ax.set_ylim(-0.6, rows + 0.2)
        ax.set_aspect("equal")
        ax.axis("off")
    handles = [Rectangle((0, 0), 1, 1, facecolor=RANK_COLOURS[d * tp + t], alpha=0.75)
               for d in range(dp) for t in range(tp)]
    fig.legend(handles, [f"rank {d * tp + t} (dp {d}, tp {t})" for d in range(dp) for t in range(tp)],
               loc="lower center", ncol=4, fontsize=7, frameon=False)


def ring_hops(group: list[int], gpus_per_node: int) -> list[tuple[int, int, bool]]:
    """The hops of a ring over ``group`` in its order: ``(sender, receiver, leaves the node)``."""
    from distlab import hybrid

    hops = []
    for i, sender in enumerate(group):
        receiver = group[(i + 1) % len(group)]
        crosses = hybrid.node_of(sender, gpus_per_node) != hybrid.node_of(receiver, gpus_per_node)
        hops.append((sender, receiver, crosses))
    return hops


def _ring_panel(ax, group: list[int], gpus_per_node: int, title: str) -> None:
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    from distlab import hybrid

    nodes = 2
    gpu = {}
    for node in range(nodes):
        x0 = node * 5.2
        ax.add_patch(FancyBboxPatch((x0, 0), 4.4, 2.3, boxstyle="round,pad=0.05", facecolor="#f4f4f4",
                                    edgecolor="#777777"))
        ax.text(x0 + 0.1, 2.22, f"node {node}", fontsize=7, va="top", color="#555555")
        for i in range(gpus_per_node):
            rank = node * gpus_per_node + i
            gx = x0 + 0.3 + i * 1.05
            member = rank in group
            ax.add_patch(Rectangle((gx, 1.1), 0.75, 0.6, facecolor="white" if member else "#e4e4e4",
                                   edgecolor="black" if member else "#aaaaaa"))
            ax.text(gx + 0.375, 1.4, f"GPU {rank}", ha="center", va="center", fontsize=6.5,
                    color="black" if member else "#999999")
            ax.add_patch(Rectangle((gx + 0.12, 0.2), 0.5, 0.35, facecolor="#dde8f4", edgecolor=NETWORK))
            ax.text(gx + 0.375, 0.375, "NIC", ha="center", va="center", fontsize=6, color=NETWORK)
            ax.plot([gx + 0.375, gx + 0.375], [0.55, 1.1], color="#aaaaaa", lw=0.8)
            gpu[rank] = (gx + 0.375, 1.7)
    leaving = {node: [r for r in group if hybrid.node_of(r, gpus_per_node) == node] for node in range(nodes)}
    for sender, receiver, crosses in ring_hops(group, gpus_per_node):
        if not crosses:
            (x0, y), (x1, _) = gpu[sender], gpu[receiver]
            ax.add_patch(FancyArrowPatch((x0, y), (x1, y), connectionstyle="arc3,rad=-0.5", arrowstyle="-|>",
                                         mutation_scale=8, color=NVLINK, lw=1.4))
    # the hop that leaves a node: its bytes spread over the NICs of the group's GPUs on that node (the count the
    # chapter makes, per NIC), through the switch between the nodes
    ax.add_patch(Rectangle((4.45, -0.75), 0.7, 0.4, facecolor="white", edgecolor=NETWORK))
    ax.text(4.8, -0.55, "switch", ha="center", va="center", fontsize=6, color=NETWORK)
    for node in range(nodes):
        for rank in leaving[node]:
            x = gpu[rank][0]
            ax.plot([x, x, 4.8], [0.2, -0.55, -0.55], color=NETWORK, lw=1.2, ls="--")
    crossing = sum(c for _, _, c in ring_hops(group, gpus_per_node))
    inside = len(group) - crossing
    per_node = len(leaving[0])
    ax.text(4.8, -1.05, f"{inside} hops on NVLink (green); {crossing} hops leave a node,\n"
            f"their bytes spread over {per_node} NIC{'s' if per_node > 1 else ''} a node (blue)",
            ha="center", va="top", fontsize=7)
    ax.set_title(title, fontsize=8)
    ax.set_xlim(-0.2, 9.8)
    ax.set_ylim(-1.7, 2.6)
    ax.axis("off")


def draw_ring_across_two_nodes(fig) -> None:
    """Two rings on two nodes of 4 GPUs, each GPU with its own NIC: plain (1-D) FSDP's ring over all 8 GPUs (page
    9.2's, laid out node by node) and a TP group of the guide's (HybridParallelContext) order, which puts 2 of its
    ranks on each node."""
    from distlab import hybrid

    axes = fig.subplots(1, 2)
    everyone = list(range(8))
    guide_tp = hybrid.grid_groups((1, 2, 4), "hybrid_context")["tp"][0]
    _ring_panel(axes[0], everyone, 4, f"plain (1-D) FSDP over all 8 GPUs, as on page 9.2: ring over {everyone}")
    _ring_panel(axes[1], guide_tp, 4, f"a TP group of the guide's (HybridParallelContext) order: ring over {guide_tp}")


FIGURES = {
    "09_two_d_sharded_weight.png": (draw_two_d_sharded_weight, (9, 3.6)),
    "09_ring_across_two_nodes.png": (draw_ring_across_two_nodes, (11, 3.0)),
}
