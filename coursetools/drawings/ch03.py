"""Chapter 03's pictures of its mechanisms: what each of the six collectives leaves on every rank, drawn from the
collectives' definitions run on labels (chunk i of rank r's tensor is a letter for the rank and the index i: rank 0's
chunks are A0 A1 A2 A3), the definitions ``scripts/03_communication/collectives.py`` checks every rank against."""

from __future__ import annotations

LETTERS = "ABCDEFGH"
SUM = "Σ"            # "Σ2": chunk 2 summed over every rank


def inputs_on_labels(ranks: int = 4) -> list[list[str]]:
    """Rank r's tensor, cut into one chunk per rank: ``["A0", "A1", ...]`` for rank 0."""
    return [[f"{LETTERS[r]}{i}" for i in range(ranks)] for r in range(ranks)]


def collective_on_labels(name: str, before: list[list[str]]) -> list[list[str]]:
    """What every rank ends with after collective ``name``, as chunk labels (the definitions of chapter 03)."""
    n = len(before)
    if name == "broadcast":                                   # rank 0's tensor everywhere
        return [list(before[0]) for _ in range(n)]
    if name == "all_reduce":                                  # the sum, chunk by chunk, everywhere
        return [[f"{SUM}{i}" for i in range(n)] for _ in range(n)]
    if name == "all_gather":                                  # every tensor, in rank order, everywhere
        return [[label for tensor in before for label in tensor] for _ in range(n)]
    if name == "reduce_scatter":                              # chunk r of the sum on rank r
        return [[f"{SUM}{r}"] for r in range(n)]
    if name == "all_to_all":                                  # chunk r of every tensor on rank r
        return [[before[j][r] for j in range(n)] for r in range(n)]
    if name == "send_recv":                                   # each rank's tensor moves one rank to the right
        return [list(before[(r - 1) % n]) for r in range(n)]
    raise ValueError(f"unknown collective {name!r}")


COLLECTIVES = [("broadcast", "broadcast (from rank 0)"), ("all_reduce", "all-reduce (sum)"),
               ("all_gather", "all-gather"), ("reduce_scatter", "reduce-scatter (sum)"),
               ("all_to_all", "all-to-all"), ("send_recv", "send/recv (to the right)")]


def identity_panel(ranks: int = 4) -> tuple[list[list[str]], list[list[str]]]:
    """The seventh panel, under the reduce-scatter's: an all-gather whose input is the reduce-scatter's output (one
    summed chunk a rank). What it leaves is the all-reduce's result: all-reduce = reduce-scatter, then all-gather."""
    scattered = collective_on_labels("reduce_scatter", inputs_on_labels(ranks))
    return scattered, collective_on_labels("all_gather", scattered)


def draw_collectives(fig) -> None:
    from matplotlib.patches import Rectangle

    from coursetools.figures import RANK_COLOURS  # here, not at the top: coursetools.figures imports this module

    n = 4
    before = inputs_on_labels(n)
    ax = fig.subplots()
    panel_width, panel_height = 13.5, 6.5
    where = {"broadcast": (0, 0), "all_reduce": (1, 0), "reduce_scatter": (2, 0), "all_to_all": (0, 1),
             "send_recv": (1, 1), "all_gather": (0, 2), "identity": (2, 1)}
    panels = [(name, title, before, collective_on_labels(name, before)) for name, title in COLLECTIVES]
    panels.append(("identity", "all-gather of the reduce-scatter's output\n(= all-reduce)", *identity_panel(n)))
    for name, title, inputs, after in panels:
        column, row = where[name]
        left, top = column * panel_width, row * panel_height
        for side, (x0, tensors) in enumerate(((left, inputs), (left + n + 2.5, after))):
            for r, labels in enumerate(tensors):
                for k, label in enumerate(labels):
                    colour = "#bbbbbb" if label.startswith(SUM) else RANK_COLOURS[LETTERS.index(label[0])]
                    ax.add_patch(Rectangle((x0 + k, top + r), 0.94, 0.8, facecolor=colour,
                                           alpha=0.85 if side else 0.45, edgecolor="black", linewidth=0.4))
                    ax.text(x0 + k + 0.47, top + r + 0.4, label, ha="center", va="center", fontsize=6.5)
                if side == 0:
                    ax.text(left - 0.3, top + r + 0.4, f"rank {r}", ha="right", va="center", fontsize=6.5)
        ax.annotate("", xy=(left + n + 2.2, top + n / 2), xytext=(left + n + 0.3, top + n / 2),
                    arrowprops={"arrowstyle": "->", "linewidth": 1.0})
        ax.text(left + n + 1.25, top - 0.5, title, ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-2.5, 3 * panel_width)
    ax.set_ylim(3 * panel_height - 1.8, -1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.suptitle("The six collectives on 4 ranks: before (left) and after (right). A0 is chunk 0 of rank 0's "
                 f"tensor; {SUM}2 is chunk 2 summed over the ranks.\nUnder the reduce-scatter: its output "
                 "all-gathered is the all-reduce's result", fontsize=9)


def ring_allreduce_on_numbers(inputs: list[list[float]]):
    """The ring all-reduce of chapter 03 run on numbers, one number a chunk: ``[(title, state, messages)]``, the
    inputs first, then the state after each of the 2(n - 1) steps; ``messages`` are ``(sender, receiver, chunk,
    value)``. Reduce-scatter step s: rank r sends chunk (r - s) mod n, the right neighbour adds it; all-gather step
    s: rank r sends the finished chunk (r + 1 - s) mod n, the right neighbour stores it."""
    n = len(inputs)
    state = [list(row) for row in inputs]
    history = [("inputs", [list(row) for row in state], [])]
    for phase, first in (("reduce-scatter", 0), ("all-gather", 1)):
        for step in range(n - 1):
            messages = [(r, (r + 1) % n, (r + first - step) % n, state[r][(r + first - step) % n]) for r in range(n)]
            for _, receiver, chunk, value in messages:
                state[receiver][chunk] = state[receiver][chunk] + value if phase == "reduce-scatter" else value
            history.append((f"{phase} step {step + 1}", [list(row) for row in state], messages))
    return history


RING_EXAMPLE = [[1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [100.0, 200.0, 300.0]]


def draw_ring_worked_example(fig) -> None:
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from coursetools.figures import RANK_COLOURS  # here, not at the top: coursetools.figures imports this module

    history = ring_allreduce_on_numbers(RING_EXAMPLE)
    n = len(RING_EXAMPLE)
    ax = fig.subplots()
    width, gap = n * 1.0, 2.2
    for k, (title, state, messages) in enumerate(history):
        left = k * (width + gap)
        received = {(receiver, chunk) for _, receiver, chunk, _ in messages}
        sent = {(sender, chunk) for sender, _, chunk, _ in messages}
        for r in range(n):
            for i in range(n):
                complete = state[r][i] == sum(row[i] for row in RING_EXAMPLE)
                ax.add_patch(Rectangle((left + i, r * 1.4), 0.92, 0.9, facecolor=RANK_COLOURS[r] if k == 0 else
                                       ("#2ca02c" if complete else "#dddddd"), alpha=0.35 if k == 0 else
                                       (0.8 if complete else 1.0), edgecolor="black",
                                       linewidth=2.0 if (r, i) in received else 0.4))
                ax.text(left + i + 0.46, r * 1.4 + 0.45, f"{state[r][i]:g}", ha="center", va="center", fontsize=7,
                        fontweight="bold" if (r, i) in sent else "normal")
            if k == 0:
                ax.text(left - 0.2, r * 1.4 + 0.45, f"rank {r}", ha="right", va="center", fontsize=7)
        for sender, receiver, chunk, value in messages:
            x = left + chunk + 0.46
            if receiver > sender:
                start, end, bend = (x, sender * 1.4 + 0.9), (x, receiver * 1.4), 0.0
            else:  # the last rank sends to rank 0: round the ring
                start, end, bend = (left + n, sender * 1.4 + 0.45), (left + n, receiver * 1.4 + 0.45), 0.45
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="->", mutation_scale=7, linewidth=0.7,
                                         connectionstyle=f"arc3,rad={bend}", color="black"))
        ax.text(left + width / 2, -0.45, title, ha="center", va="bottom", fontsize=7.5)
    ax.set_xlim(-1.6, len(history) * (width + gap))
    ax.set_ylim(n * 1.4 + 0.1, -1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.suptitle("The ring all-reduce on 3 ranks, one number a chunk: each arrow is a message to the right neighbour "
                 "(rank 2's goes round to rank 0).\nBold number: what a rank sent; bold border: what it received; "
                 "green: a complete sum", fontsize=8.5)


FIGURES = {"03_collectives.png": (draw_collectives, (11, 5.6)),
           "03_ring_worked_example.png": (draw_ring_worked_example, (11, 2.6))}
