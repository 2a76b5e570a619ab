"""Chapter 01's pictures of its mechanisms: what a training step holds in memory, moment by moment, and the three
matrix products each weight costs. Drawn from the course's memory model (``distlab.memory``) and a preset's shapes,
never from a measured run."""

from __future__ import annotations

TERMS = ("weights", "AdamW moments", "saved activations", "loss gradients", "gradients", "AdamW temporaries")
# coursetools.figures' RANK_COLOURS, then two more (imported where drawn: coursetools.figures imports this module)
COLOURS = dict(zip(TERMS, ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]))


def step_memory_timeline(preset: str = "a100", batch: int = 4) -> list[tuple[str, dict]]:
    """The bytes alive at each moment of one fp32 training step of ``preset`` on a GPU (foreach AdamW), term by term.

    A model of the mechanism, layer by layer: forward saves each block's share of the activations; the loss adds its
    two fp32 gradients of B x T x V numbers at the top of backward; backward frees each block's activations as it
    makes that block's gradients; the optimizer step adds foreach AdamW's one temporary a parameter; zero_grad frees
    the gradients. Its two largest moments are :func:`distlab.memory.predict_step_peak`'s two phases."""
    from distlab import memory, models

    cfg = models.preset(preset)
    state = memory.training_state_bytes(cfg.num_params())
    activations = memory.transformer_activation_bytes(cfg, batch)
    loss = memory.loss_gradient_bytes(batch, cfg.seq_len, cfg.vocab_size)
    temporaries = memory.FOREACH_ADAMW_TEMPORARY_BYTES_PER_PARAM * cfg.num_params()
    layers = cfg.n_layers

    def moment(saved=0.0, loss_grads=0, grads=0.0, temps=0):
        return {"weights": state.params, "AdamW moments": state.optimizer, "saved activations": saved,
                "loss gradients": loss_grads, "gradients": grads, "AdamW temporaries": temps}

    points = [("start", moment())]
    points += [(f"forward {i + 1}", moment(saved=activations * (i + 1) / layers)) for i in range(layers)]
    points.append(("top of backward", moment(saved=activations, loss_grads=loss)))
    points += [(f"backward {i + 1}", moment(saved=activations * (layers - i - 1) / layers,
                                           grads=state.grads * (i + 1) / layers)) for i in range(layers)]
    points.append(("optimizer step", moment(grads=state.grads, temps=temporaries)))
    points.append(("zero_grad", moment()))
    return points


def draw_step_memory(fig) -> None:
    """Chapter 01: the memory of one training step of the ``a100`` preset at batch 4 (fp32), moment by moment."""
    points = step_memory_timeline("a100", 4)
    ax = fig.subplots()
    gib = 2**30
    x = range(len(points))
    bottom = [0.0] * len(points)
    for term in TERMS:
        heights = [terms[term] / gib for _, terms in points]
        ax.bar(x, heights, bottom=bottom, width=1.0, color=COLOURS[term], label=term, linewidth=0)
        bottom = [b + h for b, h in zip(bottom, heights)]
    totals = bottom
    for name in ("top of backward", "optimizer step"):
        i = [label for label, _ in points].index(name)
        ax.annotate(f"{name}: {totals[i]:.1f} GiB", xy=(i, totals[i]), xytext=(i - 9, totals[i] + 4.5),
                    fontsize=7, arrowprops={"arrowstyle": "->", "linewidth": 0.8})
    ax.axhline(40, color="grey", linestyle="--", linewidth=0.8)
    ax.text(len(points) - 1, 40.6, "one A100-40GB: 40 GiB", ha="right", fontsize=6.5, color="grey")
    layers = (len(points) - 4) // 2
    ticks = {0: "start", layers // 2: "forward,\nblock by block", layers + 1: "loss",
             layers + 1 + layers // 2: "backward,\nblock by block", 2 * layers + 2: "optimizer\nstep",
             2 * layers + 3: "\n\nzero_grad"}
    ax.set_xticks(list(ticks), list(ticks.values()), fontsize=6.5)
    ax.set_ylabel("GiB alive", fontsize=7)
    ax.set_ylim(0, 48)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=6.5, frameon=False, loc="upper left", ncol=3)
    ax.set_title("one training step of the a100 preset, batch 4, fp32, foreach AdamW: what is alive, moment by moment"
                 " (a model)", fontsize=8)


def draw_three_products(fig) -> None:
    """Chapter 01: the three matrix products a linear layer's weight takes part in, 2 FLOPs a weight a token each."""
    from coursetools.figures import RANK_COLOURS, _matrix

    ax = fig.subplots()
    grey, weight, grad = ["#bbbbbb"], [RANK_COLOURS[0]], [RANK_COLOURS[1]]
    # T tokens of width d meet a d x k weight: shapes (width, height) drawn to scale, T = d = 1, k = 1.6
    rows = [("forward:  y = x W", ("x  (T x d)", grey, 1.0, 1.0), ("W  (d x k)", weight, 1.6, 1.0),
             ("y  (T x k)", grey, 1.6, 1.0)),
            ("backward, input gradient:  dx = dy Wᵀ", ("dy  (T x k)", grad, 1.6, 1.0), ("Wᵀ  (k x d)", weight, 1.0, 1.6),
             ("dx  (T x d)", grad, 1.0, 1.0)),
            ("backward, weight gradient:  dW = xᵀ dy", ("xᵀ  (d x T)", grey, 1.0, 1.0), ("dy  (T x k)", grad, 1.6, 1.0),
             ("dW  (d x k)", grad, 1.6, 1.0))]
    for r, (title, *matrices) in enumerate(rows):
        y = (2 - r) * 3.4
        ax.text(-0.2, y + 1.85, title + "   (2 FLOPs a weight a token)", fontsize=8, fontweight="bold")
        x = 0.0
        for i, (label, colour, width, height) in enumerate(matrices):
            _matrix(ax, x, y + 1.0 - height, width, height, label, colour, fontsize=6.5)
            x += width + 0.3
            if i < 2:
                ax.text(x - 0.22, y + 0.5, "x" if i == 0 else "=", fontsize=10, va="center")
                x += 0.15
    ax.text(5.6, 3.9, "each weight: 3 products x 2 FLOPs\n= 6 FLOPs a weight a token\n(a multiply and an add each)",
            fontsize=8, va="center", bbox={"boxstyle": "round", "fc": "#f3f3f3", "ec": "#999999"})
    ax.set_xlim(-0.3, 9.5)
    ax.set_ylim(-1.0, 9.2)
    ax.axis("off")
    ax.set_title("why training costs 6 FLOPs a weight a token: a token's row x meets weight W three times", fontsize=9)


FIGURES = {
    "01_step_memory.png": (draw_step_memory, (9, 3.2)),
    "01_three_products.png": (draw_three_products, (8, 4.4)),
}
