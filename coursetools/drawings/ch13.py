"""Chapter 13's pictures of its mechanism: one dispatch and combine of a tiny expert-parallel layer.

The picture is drawn from :func:`dispatch_and_combine_example`, which runs ``distlab.moe``'s own routing
(``route``, ``sort_by_expert``, ``dispatch_matrix``) on 6 tokens: 2 ranks, 4 experts (2 a rank), top-2. The
chapter's worked example states its numbers, and its text test reads them from the same function."""

from __future__ import annotations

RANKS, EXPERTS, TOP_K, TOKENS_A_RANK, DIM, SEED = 2, 4, 2, 3, 8, 1


def dispatch_and_combine_example() -> dict:
    """The routing of 6 tokens (3 on each of 2 ranks) by a softmax router over 4 experts, top-2, and what each rank
    sends, computes and gets back. Rows are (token, expert, weight); a rank's experts are ``EXPERTS // RANKS``
    consecutive ones (rank 0: experts 0, 1; rank 1: experts 2, 3)."""
    import torch

    from distlab import moe

    per_rank = EXPERTS // RANKS
    cfg = moe.MoEConfig(dim=DIM, ffn_hidden=2 * DIM, num_experts=EXPERTS, top_k=TOP_K)
    torch.manual_seed(SEED)
    layer = moe.MoE(cfg)
    x = torch.randn(RANKS * TOKENS_A_RANK, DIM)
    with torch.no_grad():
        weights, chosen, _ = moe.route(layer.router, x, TOP_K, cfg.scoring)
    keep = torch.ones_like(chosen, dtype=torch.bool)
    sent, received = [], [[] for _ in range(RANKS)]
    for rank in range(RANKS):
        mine = slice(rank * TOKENS_A_RANK, (rank + 1) * TOKENS_A_RANK)
        tokens, kept_weights, experts, _ = moe.sort_by_expert(chosen[mine], weights[mine], keep[mine], EXPERTS)
        rows = [(int(t) + rank * TOKENS_A_RANK, int(e), float(w)) for t, e, w in zip(tokens, experts, kept_weights)]
        sent.append(rows)
        for row in rows:                            # arrival order: by source rank, then by expert
            received[row[1] // per_rank].append(row)
    computed = [sorted(rows, key=lambda r: (r[1], r[0])) for rows in received]   # regrouped by expert
    return {"x": x, "layer": layer, "chosen": chosen, "weights": weights, "sent": sent, "computed": computed,
            "matrix": moe.dispatch_matrix(chosen, keep, RANKS, per_rank), "per_rank": per_rank}


def _box(ax, x, y, w, h, text, colour, fontsize=7.5, alpha=0.35):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=colour,
                                alpha=alpha, edgecolor="black", linewidth=0.7))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def draw_dispatch_and_combine(fig) -> None:
    """Tokens on 2 ranks routed to 4 experts (2 a rank): sorted by expert, sent by an all-to-all to the rank of
    their expert, computed there grouped by expert, sent back by a second all-to-all, weighted by their gate and
    summed. Each row keeps the colour of the rank its token lives on."""
    from coursetools.figures import RANK_COLOURS   # here, not at the top: coursetools.figures imports this module

    example = dispatch_and_combine_example()
    per_rank, chosen, weights = example["per_rank"], example["chosen"], example["weights"]
    ax = fig.subplots()
    row_h, gap = 0.78, 0.22
    band_h = 8 * (row_h + gap)                    # the busiest rank's 7 rows, and a line under them
    band_y = {0: band_h + 0.9, 1: 0.0}            # rank 0 on top
    cols = {"tokens": 0.0, "sorted": 3.8, "computed": 8.2, "combined": 12.6}
    widths = {"tokens": 3.0, "sorted": 1.9, "computed": 2.2, "combined": 4.4}

    def y_of(rank, i):
        return band_y[rank] + band_h - (i + 1) * (row_h + gap) + gap / 2

    for rank in range(RANKS):
        ax.add_patch(__import__("matplotlib.patches", fromlist=["Rectangle"]).Rectangle(
            (-0.3, band_y[rank] - 0.1), 17.4, band_h + 0.2, facecolor=RANK_COLOURS[rank], alpha=0.06,
            edgecolor="none"))
        experts = ", ".join(str(e) for e in range(rank * per_rank, (rank + 1) * per_rank))
        ax.text(-0.45, band_y[rank] + band_h / 2, f"rank {rank}\n(experts {experts})", rotation=90, ha="right",
                va="center", fontsize=8.5, fontweight="bold", color=RANK_COLOURS[rank])

    def colour_of_token(t):
        return RANK_COLOURS[t // TOKENS_A_RANK]

    # 1. each rank's tokens, routed: two experts and two gate weights each
    token_y = {}
    for t in range(RANKS * TOKENS_A_RANK):
        rank, i = divmod(t, TOKENS_A_RANK)
        y = y_of(rank, 2 * i) - (row_h + gap) / 2
        token_y[t] = y
        picks = ", ".join(f"e{int(e)} {float(w):.2f}" for e, w in zip(chosen[t], weights[t]))
        _box(ax, cols["tokens"], y, widths["tokens"], row_h * 1.3, f"x{t} → {picks}", colour_of_token(t))

    # 2. sorted by expert (the block for each destination rank is contiguous)
    sent_y = {}
    for rank, rows in enumerate(example["sent"]):
        for i, (t, e, w) in enumerate(rows):
            y = y_of(rank, i)
            sent_y[(t, e)] = y
            _box(ax, cols["sorted"], y, widths["sorted"], row_h, f"x{t} for e{e}", colour_of_token(t))
            ax.plot([cols["tokens"] + widths["tokens"], cols["sorted"]], [token_y[t] + row_h * 0.65, y + row_h / 2],
                    color="0.6", lw=0.5)

    # 3. computed on the rank of the expert, grouped by expert; 4. the outputs go back, weighted and summed
    out_y = {}
    for rank, rows in enumerate(example["computed"]):
        for i, (t, e, w) in enumerate(rows):
            y = y_of(rank, i)
            out_y[(t, e)] = y
            _box(ax, cols["computed"], y, widths["computed"], row_h, f"e{e}(x{t})", colour_of_token(t))
            crosses = t // TOKENS_A_RANK != rank
            ax.annotate("", xy=(cols["computed"], y + row_h / 2),
                        xytext=(cols["sorted"] + widths["sorted"], sent_y[(t, e)] + row_h / 2),
                        arrowprops=dict(arrowstyle="->", lw=1.3 if crosses else 0.7,
                                        color=colour_of_token(t) if crosses else "0.55"))
            ax.annotate("", xy=(cols["combined"], token_y[t] + row_h * 0.65),
                        xytext=(cols["computed"] + widths["computed"], y + row_h / 2),
                        arrowprops=dict(arrowstyle="->", lw=1.3 if crosses else 0.7,
                                        color=colour_of_token(t) if crosses else "0.55"))
    for t in range(RANKS * TOKENS_A_RANK):
        terms = " + ".join(f"{float(w):.2f}·e{int(e)}(x{t})" for e, w in zip(chosen[t], weights[t]))
        _box(ax, cols["combined"], token_y[t], widths["combined"], row_h * 1.3, f"y{t} = {terms}",
             colour_of_token(t))
    for rank in range(RANKS):
        experts = range(rank * per_rank, (rank + 1) * per_rank)
        counts = [sum(1 for r in example["computed"][rank] if r[1] == e) for e in experts]
        ax.text(cols["computed"] + widths["computed"] / 2, band_y[rank] + 0.25,
                ", ".join(f"e{e}: {c} rows" for e, c in zip(experts, counts)), ha="center", va="bottom", fontsize=7)

    top = 2 * band_h + 1.1
    for label, x, w in (("route each token:\ntwo experts, two gate weights", cols["tokens"], widths["tokens"]),
                        ("sort the rows\nby expert", cols["sorted"], widths["sorted"]),
                        ("the experts compute\ntheir rows", cols["computed"], widths["computed"]),
                        ("weight each output by its gate\nand sum, on the token's rank", cols["combined"],
                         widths["combined"])):
        ax.text(x + w / 2, top, label, ha="center", va="bottom", fontsize=8)
    for label, x in (("dispatch:\nall-to-all", (cols["sorted"] + widths["sorted"] + cols["computed"]) / 2),
                     ("combine:\nall-to-all back", (cols["computed"] + widths["computed"] + cols["combined"]) / 2)):
        ax.text(x, top, label, ha="center", va="bottom", fontsize=8, fontweight="bold")
    sends = [int(example["matrix"][r].sum() - example["matrix"][r, r]) for r in range(RANKS)]
    ax.text(8.5, -0.35, f"coloured arrows cross to the other rank: rank 0 sends {sends[0]} rows, rank 1 sends "
            f"{sends[1]}; grey ones stay on their rank", ha="center", va="top", fontsize=7.5)
    ax.set_xlim(-1.2, 17.2)
    ax.set_ylim(-1.0, top + 1.3)
    ax.axis("off")


FIGURES = {"13_dispatch_and_combine.png": (draw_dispatch_and_combine, (11.5, 5.6))}
