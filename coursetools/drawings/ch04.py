"""Chapter 04's picture of data parallelism: replicas, a split batch, averaged gradients.

Drawn from a model of the mechanism: a one-weight model ``y = w x`` with the loss ``(w x - y)² / 2`` on the global
batch ``x = 1..8`` (targets ``y = 2 x``), split over 4 ranks. Autograd computes each rank's local gradient; the
picture shows them, their mean (what an all-reduce and a division by 4 leave on every rank) and the one step every
replica then takes. The chapter's worked example quotes the same numbers.
"""

from __future__ import annotations

SAMPLES = [float(x) for x in range(1, 9)]   # the global batch: x = 1..8, targets y = 2 x
RANKS, START, LR = 4, 1.0, 0.01


def slice_gradient(xs: list[float], w: float = START) -> float:
    """The gradient, by autograd, of the mean loss over the samples ``xs`` for the model ``y = w x``."""
    import torch

    weight = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    x = torch.tensor(xs, dtype=torch.float64)
    (0.5 * (weight * x - 2 * x) ** 2).mean().backward()
    return float(weight.grad)


def data_parallel_step(samples=SAMPLES, ranks=RANKS, w=START, lr=LR) -> dict:
    """One data-parallel step of the toy model: each rank's slice and local gradient, their mean, the step."""
    per = len(samples) // ranks
    slices = [samples[r * per:(r + 1) * per] for r in range(ranks)]
    local = [slice_gradient(s, w) for s in slices]
    mean = sum(local) / ranks
    return {"slices": slices, "local": local, "mean": mean, "weight": w - lr * mean}


def _box(ax, x, y, w, h, text, colour, fontsize=7.5, alpha=0.35):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", facecolor=colour, alpha=alpha,
                                edgecolor="black", lw=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def _arrow(ax, start, end):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", lw=0.9))


def draw_replicas_split_batch(fig) -> None:
    from coursetools.figures import RANK_COLOURS   # here: coursetools.figures imports this module

    step = data_parallel_step()
    ax = fig.subplots()
    rows = [6.3 - 1.75 * r for r in range(RANKS)]                 # the bottom of each rank's row
    height = 1.35
    # the global batch, each sample coloured by the rank it goes to
    ax.text(0.75, 8.0, "global batch\n(8 samples)", ha="center", va="bottom", fontsize=8)
    for i, x in enumerate(SAMPLES):
        rank = i // (len(SAMPLES) // RANKS)
        _box(ax, 0.3, 7.1 - 0.85 * i - 0.05 * rank, 0.9, 0.65, f"x = {x:g}", RANK_COLOURS[rank], alpha=0.6)
    for r, (bottom, xs, grad) in enumerate(zip(rows, step["slices"], step["local"])):
        _arrow(ax, (1.35, 7.45 - 0.85 * 2 * r - 0.05 * r - 0.4), (2.3, bottom + height / 2))
        _box(ax, 2.4, bottom, 3.6, height,
             f"rank {r}: a full replica, w = {START:g}\nits slice: x = {', '.join(f'{x:g}' for x in xs)}\n"
             f"local gradient {grad:g}", RANK_COLOURS[r])
        _arrow(ax, (6.1, bottom + height / 2), (7.4, 3.9))
        _box(ax, 11.3, bottom, 3.5, height,
             f"mean gradient {step['mean']:g}\nstep: w = {START:g} - {LR:g} x ({step['mean']:g})\n"
             f"= {step['weight']:g} on every rank", RANK_COLOURS[r])
        _arrow(ax, (10.3, 3.9), (11.2, bottom + height / 2))
    _box(ax, 7.5, 2.2, 2.7, 3.4,
         f"all-reduce (sum)\nthen divide by {RANKS}:\n\nmean gradient\n{step['mean']:g}\n\n= the gradient of\nthe whole "
         "batch's\nmean loss", "#bbbbbb", fontsize=8, alpha=0.5)
    ax.text(4.2, 8.0, "replicas: same weights,\nanother quarter of the batch", ha="center", va="bottom", fontsize=8)
    ax.text(13.05, 8.0, "every replica takes\nthe same step", ha="center", va="bottom", fontsize=8)
    ax.set_xlim(0, 15)
    ax.set_ylim(0.3, 9.1)
    ax.axis("off")
    ax.set_title("data parallelism on 4 ranks, model y = w x, loss (w x - 2 x)² / 2", fontsize=9)


FIGURES = {"04_replicas_split_batch.png": (draw_replicas_split_batch, (10, 4.6))}
