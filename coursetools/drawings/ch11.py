"""Chapter 11's pictures: the decision path as a flowchart, drawn from the planner's own tree of questions
(``planner.DECISION_QUESTIONS``): each question once, its yes and no, and the worked cases each outcome receives,
routed by the planner's answers (``planner.decision_route``); and a GEMM's speed by its shape (``planner.gemm``)
beside Megatron-LM's Table 1, the planner's predictions at each row's published settings."""

from __future__ import annotations

import textwrap

# where each node of the tree sits (x, y) on a 10 x 6 canvas; the tree itself is the planner's
_PLACE = {"replica": (3.6, 5.35), "sequence": (3.6, 4.0), "batch": (1.9, 2.6), "long": (6.3, 2.6),
          "DDP": (8.3, 5.35), "FSDP": (1.0, 0.95), "TP + PP": (3.1, 0.95), "TP": (5.3, 0.95), "CP": (7.9, 0.95)}
_OUTCOME_WIDTH = 1.8   # the leaves under question 3 sit 0.3 apart
# what happens on the way down an edge (the "no" of the first question shards the state)
_ON_EDGE = {("replica", False): "no: shard the state (FSDP)"}


def draw_decision_flowchart(fig) -> None:
    from matplotlib.patches import FancyBboxPatch

    from coursetools.figures import RANK_COLOURS   # here, not at the top: coursetools.figures imports this module
    from distlab import planner

    questions, outcomes = planner.DECISION_QUESTIONS, planner.DECISION_OUTCOMES
    reached: dict[str, list[str]] = {}
    for case in planner.decision_cases():
        reached.setdefault(planner.decision_route(case)[1], []).append(case.name)
    ax = fig.subplots()
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.75, 6)
    ax.axis("off")

    def box(node, text, width, colour, face):
        x, y = _PLACE[node]
        lines = textwrap.wrap(text, 30 if width > 2.5 else 22)
        height = 0.22 + 0.2 * len(lines)
        ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.03",
                                    facecolor=face, edgecolor=colour))
        ax.text(x, y, "\n".join(lines), ha="center", va="center", fontsize=7.5)
        return height

    heights = {}
    for number, (node, (text, _, yes, no)) in enumerate(questions.items(), start=1):
        heights[node] = box(node, f"{number}. {text}", 3.2, RANK_COLOURS[0], "#eef3fb")
    for node, text in outcomes.items():
        heights[node] = box(node, text, _OUTCOME_WIDTH, RANK_COLOURS[1], "#fdf1e6")
        x, y = _PLACE[node]
        cases = [textwrap.fill(name, 28) for name in reached.get(node, [])]
        if cases:
            ax.text(x, y - heights[node] / 2 - 0.1, "\n".join(cases), ha="center", va="top", fontsize=5.5,
                    color="#555555")
    for node, (_, _, yes, no) in questions.items():
        x, y = _PLACE[node]
        for target, said in ((yes, True), (no, False)):
            tx, ty = _PLACE[target]
            start = (x + 1.6, y) if ty == y else (x, y - heights[node] / 2)
            end = (tx - _OUTCOME_WIDTH / 2 - 0.05, ty) if ty == y else (tx, ty + heights[target] / 2)
            ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": "#333333"})
            label = _ON_EDGE.get((node, said), "yes" if said else "no")
            # beside the arrow, on the side away from its line: an arrow down and to the left has its label to the
            # upper left of its middle, one down and to the right (or straight) to the upper right
            left = end[0] < start[0] - 1e-9
            ax.text((start[0] + end[0]) / 2 + (-0.08 if left else 0.08), (start[1] + end[1]) / 2 + 0.05, label,
                    fontsize=6.5, ha="right" if left else "left", color="#1a7f37" if said else "#b42318")
    ax.text(5, -0.7, "then the planner's search ranks every layout that fits (its first choice may add more than the "
                     "path names), and --dry-run builds it at full size", ha="center", fontsize=7, style="italic")


def draw_gemm_efficiency_and_width(fig) -> None:
    """Left: where one block's forward time goes on one TP rank, for each of Table 1's rows as planner.gemm models
    them (no flash kernel, s = 2,048): the GEMMs of the weights, attention's s x s work, the other kernels. Right:
    Table 1's per-GPU TFLOP/s by model and the planner's, at each row's published settings."""
    from coursetools.figures import RANK_COLOURS
    from distlab.planner import gemm, published

    left, right = fig.subplots(1, 2)
    rows = published.megatron_width_table()
    x = list(range(len(rows)))
    names = [r["label"].split(",")[0].replace("Megatron ", "").replace("1008.0B", "1T") for r in rows]
    colours = dict(zip(gemm.TIME_PARTS, ("#4c72b0", "#dd8452", "#c44e52", "#8c8c8c", "#2f2f2f")))
    bottom = [0.0] * len(rows)
    for part in gemm.TIME_PARTS:
        shares = [r["time_shares"][part] for r in rows]
        left.bar(x, shares, bottom=bottom, color=colours[part], label=part, width=0.7)
        bottom = [b + s for b, s in zip(bottom, shares)]
    left.set_xticks(x, names, rotation=45, fontsize=7)
    left.set_ylabel("share of a block's time on one TP rank")
    left.set_ylim(0, 1.35)
    left.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
    left.legend(fontsize=6.5, loc="upper left", ncol=2)
    left.set_title("Where a block's time goes (model; s = 2,048, no flash kernel)", fontsize=9)
    right.plot(x, [r["published"] for r in rows], marker="o", color="black", label="Table 1 (published)")
    right.plot(x, [r["predicted"] for r in rows], marker="s", color=RANK_COLOURS[0],
               label="planner, at the published settings")
    flat = [r["published"] for r in rows[:6]]
    right.axhspan(min(flat), max(flat), xmin=0, xmax=5.5 / (len(rows) - 0.5), color="0.9", zorder=0)
    right.text(2.5, max(flat) + 1.5, "published: flat to 76.1B", ha="center", fontsize=7)
    right.set_xticks(x, names, rotation=45, fontsize=7)
    right.set_ylabel("TFLOP/s per A100 (Megatron's count)")
    right.set_ylim(100, 180)
    right.legend(fontsize=7, loc="lower right")
    right.set_title("Megatron-LM's Table 1: per-GPU throughput by model", fontsize=9)
    fig.tight_layout()


FIGURES = {"11_decision_flowchart.png": (draw_decision_flowchart, (10, 6)),
           "11_gemm_width.png": (draw_gemm_efficiency_and_width, (10, 4))}
