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
            ax.text((start[0] + end[0]) / 2 + 0.08, (start[1] + end[1]) / 2 + 0.05, label, fontsize=6.5,
                    color="#1a7f37" if said else "#b42318")
    ax.text(5, -0.7, "then the planner's search ranks every layout that fits (its first choice may add more than the "
                     "path names), and --dry-run builds it at full size", ha="center", fontsize=7, style="italic")


def draw_gemm_efficiency_and_width(fig) -> None:
    """Left: the share of the peak a square GEMM reaches, by its size, as planner.gemm models it on an A100 and an
    H100, with OpenXLA's measured H100 points. Right: Table 1's per-GPU TFLOP/s by model and the planner's, at each
    row's published settings."""
    from coursetools.figures import RANK_COLOURS
    from distlab.planner import gemm, published

    left, right = fig.subplots(1, 2)
    sizes = [2 ** (x / 4) for x in range(32, 57)]   # 256 to 16384
    for colour, (name, label) in zip(RANK_COLOURS, (("a100-80gb", "A100 (model)"), ("h100-80gb", "H100 (model)"))):
        hardware = gemm.MATMUL_HARDWARE[name]
        left.plot(sizes, [gemm.gemm_efficiency(gemm.Gemm("", int(n), int(n), int(n)), hardware) for n in sizes],
                  color=colour, label=label)
    cubes = [(m, v) for (m, n, k), v in gemm.XLA_H100_BF16.items() if m == n == k]
    left.scatter([m for m, _ in cubes], [v / gemm.MATMUL_HARDWARE["h100-80gb"].peak_flops for _, v in cubes],
                 color=RANK_COLOURS[1], marker="x", zorder=3, label="H100 measured (OpenXLA)")
    left.set_xscale("log", base=2)
    left.set_xlabel("n of an n x n x n bf16 GEMM")
    left.set_ylabel("share of the dense peak")
    left.set_ylim(0, 1)
    left.legend(fontsize=7, loc="lower right")
    left.set_title("A GEMM's speed grows with its size", fontsize=9)
    rows = published.megatron_width_table()
    x = range(len(rows))
    right.plot(x, [r["published"] for r in rows], marker="o", color="black", label="Table 1 (published)")
    right.plot(x, [r["predicted"] for r in rows], marker="s", color=RANK_COLOURS[0],
               label="planner, at the published settings")
    right.set_xticks(list(x), [r["label"].split(",")[0].replace("Megatron ", "").replace("1008.0B", "1T")
                               for r in rows], rotation=45, fontsize=7)
    right.set_ylabel("TFLOP/s per A100 (Megatron's count)")
    right.set_ylim(100, 180)
    right.legend(fontsize=7, loc="lower right")
    right.set_title("Megatron-LM's Table 1: per-GPU throughput by model", fontsize=9)
    fig.tight_layout()


FIGURES = {"11_decision_flowchart.png": (draw_decision_flowchart, (10, 6)),
           "11_gemm_width.png": (draw_gemm_efficiency_and_width, (10, 4))}
