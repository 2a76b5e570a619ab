"""Chapter 05's pictures of its mechanisms: what each GPU holds under DDP, ZeRO-1, ZeRO-2, ZeRO-3 and FSDP.

Drawn from the library's own accounting: which kinds of state a stage shards comes from
``distlab.memory.zero_state_bytes`` (a kind is sharded when its bytes on one GPU are 1/N of the whole), the bytes
per parameter written beside each GPU are that function's, and the sizes of FSDP's units are those of the course's
``tiny`` transformer (``distlab.memory.fsdp_unit_bytes`` over ``distlab.models.preset("tiny")``). Under ZeRO-3 all
three kinds are cut by unit: FSDP2 shards each parameter, its gradient and its AdamW moments alike (Shard(0)).
"""

from __future__ import annotations

GPUS = 4
KINDS = [("params", "weights"), ("grads", "gradients"), ("optimizer", "optimizer state")]
# the bytes per parameter are a total: the ZeRO paper's 2 + 2 + 12 and FSDP2's fp32 4 + 4 + 8 both make 16
TITLE = ("What each of 4 GPUs holds of the training state (AdamW, 16 bytes per parameter: the ZeRO paper's "
         "2 + 2 + 12, or FSDP2's 4 + 4 + 8)")
STRATEGIES = [("DDP", 0, False), ("ZeRO-1", 1, False), ("ZeRO-2", 2, False), ("ZeRO-3 (FSDP),\nbetween units", 3, False),
              ("ZeRO-3 (FSDP),\nwhile block 0 runs", 3, True)]


def sharded_kinds(stage: int, gpus: int = GPUS) -> dict[str, bool]:
    """Which kinds of state a ZeRO stage shards, read off ``zero_state_bytes``: one GPU holds 1/N of a kind."""
    from distlab import memory

    whole, mine = memory.zero_state_bytes(1, 1, 0), memory.zero_state_bytes(1, gpus, stage)
    return {field: getattr(mine, field) * gpus == getattr(whole, field) for field, _ in KINDS}


def tiny_units() -> list[tuple[str, int]]:
    """FSDP's units on the tiny transformer as ``train_fsdp.py`` makes them: each block, then the root (the
    embedding, the final norm and the output layer), with their parameter counts."""
    from distlab import memory, models

    cfg = models.preset("tiny")
    units = memory.fsdp_unit_bytes(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.num_params(), param_bytes=1)
    block, root = units["a block's gathered weights"], units[memory.ROOT_GATHERED]
    return [(f"block {i}", block) for i in range(cfg.n_layers)] + [("root", root)]


def _bar(ax, x, y, width, height, pieces, held, gathered=()):
    """One kind of state on one GPU: ``pieces`` (relative sizes) each cut into GPUS quarters; a quarter is filled in
    its owner's colour when ``held(piece, quarter)``, hatched when its piece is in ``gathered``, else left white."""
    from matplotlib.patches import Rectangle

    from coursetools.figures import RANK_COLOURS  # here, not above: coursetools.figures imports this module

    total = sum(pieces)
    left = x
    for p, size in enumerate(pieces):
        w = width * size / total
        for q in range(GPUS):
            filled = held(p, q)
            ax.add_patch(Rectangle((left + q * w / GPUS, y), w / GPUS, height, facecolor=RANK_COLOURS[q] if filled
                                   else "white", alpha=0.85 if filled else 1, edgecolor="#999999", lw=0.3,
                                   hatch="////" if filled and p in gathered else None))
        ax.add_patch(Rectangle((left, y), w, height, fill=False, edgecolor="black", lw=0.6))
        left += w


def draw_what_each_gpu_holds(fig) -> None:
    from matplotlib.patches import Patch

    from coursetools.figures import RANK_COLOURS
    from distlab import memory

    ax = fig.subplots()
    units = tiny_units()
    width, height, gap, panel = 2.4, 0.2, 0.04, 3.3
    for s, (title, stage, running) in enumerate(STRATEGIES):
        x = s * panel
        sharded = sharded_kinds(stage)
        ax.text(x + width / 2, GPUS * 1.0 + 0.1, title, ha="center", va="bottom", fontsize=8, weight="bold")
        for gpu in range(GPUS):
            y0 = (GPUS - 1 - gpu) * 1.0 + 0.2
            for k, (field, name) in enumerate(KINDS):
                y = y0 + (2 - k) * (height + gap)
                mine = (lambda p, q, g=gpu, f=field: not sharded[f] or q == g)
                if stage == 3:   # FSDP2 cuts each parameter, its gradient and its AdamW state alike: by unit
                    gathers = running and field == "params"   # block 0's weights only are gathered whole
                    _bar(ax, x, y, width, height, [size for _, size in units],
                         (lambda p, q, g=gpu, whole=gathers: q == g or (whole and p == 0)),
                         gathered=(0,) if gathers else ())
                else:
                    _bar(ax, x, y, width, height, [1], mine)
                if s == 0:
                    ax.text(x - 0.08, y + height / 2, name, ha="right", va="center", fontsize=6)
            state = memory.zero_state_bytes(1, GPUS, stage)
            label = f"GPU {gpu}: {state.total:g} B/param" + (" + block 0" if running else "")
            ax.text(x + width / 2, y0 - 0.14, label, ha="center", va="center", fontsize=6.5)
    ax.text(3.5 * panel + width / 2, -0.3, "weights, gradients and optimizer state cut into FSDP's units: "
            + ", ".join(n for n, _ in units),
            ha="center", fontsize=6, style="italic")
    ax.legend(handles=[Patch(facecolor=RANK_COLOURS[q], label=f"the quarter GPU {q} owns") for q in range(GPUS)]
              + [Patch(facecolor="white", edgecolor="#999999", label="not held: another GPU owns it"),
                 Patch(facecolor="#bbbbbb", hatch="////", label="gathered whole for the moment")],
              loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=6, fontsize=6.5, frameon=False)
    ax.set_xlim(-1.3, 4 * panel + width + 0.1)
    ax.set_ylim(-0.45, GPUS + 0.55)
    ax.axis("off")
    ax.set_title(TITLE, fontsize=9)


FIGURES = {"05_what_each_gpu_holds.png": (draw_what_each_gpu_holds, (11, 4.2))}
