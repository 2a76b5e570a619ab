"""Chapter 02's picture of its mechanism: the two ways to divide a training step over GPUs, and what each GPU then
holds, drawn from the course's memory model (``labkit.widgets``, ``distlab.memory``) for a 7B model on 4 GPUs."""

from __future__ import annotations


def two_ways_per_gpu(num_params: float = 7e9, gpus: int = 4) -> dict:
    """Per GPU under each way: the share of the batch it runs and the GiB of training state it holds (16 bytes a
    parameter: every byte on every GPU when the batch is cut; a 1/gpus share of every part when the model is)."""
    from labkit import widgets

    return {"data parallel": {"batch": 1 / gpus, "state_gib": widgets.state_bytes_per_gpu(num_params, 1, 0) / widgets.GIB},
            "model parallel": {"batch": 1.0,
                               "state_gib": widgets.state_bytes_per_gpu(num_params, gpus, 3) / widgets.GIB}}


def draw_two_ways(fig) -> None:
    """Chapter 02: data parallelism (whole model, a quarter of the batch on each GPU) against model parallelism (a
    quarter of the layers, the whole batch, activations passed on), with each GPU's training state against 40 GiB."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from coursetools.figures import RANK_COLOURS   # here: coursetools.figures imports this module

    gpus, shares = 4, two_ways_per_gpu()
    axes = fig.subplots(1, 2)
    for ax, (way, share) in zip(axes, shares.items()):
        for g in range(gpus):
            x = g * 2.6
            ax.add_patch(Rectangle((x, 0), 2.2, 4.6, fill=False, lw=1.2))
            ax.text(x + 1.1, 4.8, f"GPU {g}", ha="center", fontsize=7)
            if way == "data parallel":
                for layer in range(4):   # the whole model: every layer, in grey
                    ax.add_patch(Rectangle((x + 0.25, 2.0 + layer * 0.55), 1.7, 0.45, color="#999999", alpha=0.6))
                ax.text(x + 1.1, 1.55, "all 4 layers", ha="center", fontsize=6.5)
                ax.add_patch(Rectangle((x + 0.25, 0.25), 1.7, 0.9, color=RANK_COLOURS[g]))
                ax.text(x + 1.1, 0.7, f"samples {g * 2}-{g * 2 + 1}\nof 8", ha="center", va="center", fontsize=6.5,
                        color="white")
            else:
                ax.add_patch(Rectangle((x + 0.25, 2.0 + g * 0.55), 1.7, 0.45, color=RANK_COLOURS[g]))
                ax.text(x + 1.1, 1.55, f"layer {g + 1} only", ha="center", fontsize=6.5)
                ax.add_patch(Rectangle((x + 0.25, 0.25), 1.7, 0.9, color="#999999", alpha=0.6))
                ax.text(x + 1.1, 0.7, "all 8\nsamples", ha="center", va="center", fontsize=6.5)
                if g < gpus - 1:
                    ax.add_patch(FancyArrowPatch((x + 2.0, 2.2 + g * 0.55), (x + 2.85, 2.2 + (g + 1) * 0.55),
                                                 arrowstyle="->", mutation_scale=8, lw=0.9))
        ax.text(5.1, -0.55, f"7B model: {share['state_gib']:.1f} GiB of training state on each GPU "
                f"({'fits' if share['state_gib'] <= 40 else 'over'} 40 GiB)", ha="center", fontsize=7)
        note = ("every GPU: the whole model, a quarter of the batch;\nthen the GPUs average their gradients"
                if way == "data parallel" else
                "every GPU: a quarter of the model, the whole batch;\nactivations pass from GPU to GPU")
        ax.set_title(f"{way}: cut the {'batch' if way == 'data parallel' else 'model'}\n{note}", fontsize=7.5)
        ax.set_xlim(-0.2, 10.4)
        ax.set_ylim(-0.9, 5.2)
        ax.axis("off")


FIGURES = {"02_two_ways.png": (draw_two_ways, (10, 3.3))}
