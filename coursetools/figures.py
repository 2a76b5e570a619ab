"""The chapters' pictures, drawn from the library's own functions: ``python -m coursetools.figures`` (``make figures``).

Each figure is one function ``draw_<name>(ax_or_fig)`` over the same code the scripts run (the ring all-reduce
simulated chunk by chunk, ``memory.zero_state_bytes``, ``schedules.simulate``, ``tensor_parallel.ring_chunks``),
and ``FIGURES`` maps each file in ``chapters/figures/`` to its function. The chapters embed the PNGs;
``tests/unit/test_figures.py`` checks that every figure a chapter references exists and that every generator runs.
Small PNGs (about 100 dpi) from the Agg backend, with no timestamp in their metadata.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RANK_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
DPI = 90


# ---- chapter 03: the ring all-reduce, chunk by chunk ---------------------------------------------------------

def ring_allreduce_contributions(ranks: int = 4) -> list[list[list[int]]]:
    """After each of the 2(n-1) steps of the ring all-reduce, how many ranks' inputs each chunk of each rank holds.

    Runs the algorithm of chapter 03 on sets of contributors instead of numbers: at reduce-scatter step s rank r
    sends chunk (r - s) mod n to the right, which adds it into its own; at all-gather step s rank r sends the
    finished chunk (r + 1 - s) mod n, which the right neighbour stores. Returns ``[step][rank][chunk]`` counts,
    step 0 being the inputs (every chunk holds 1).
    """
    n = ranks
    held = [[{r} for _ in range(n)] for r in range(n)]
    history = [[[len(c) for c in row] for row in held]]
    for step in range(n - 1):
        outgoing = {r: ((r - step) % n, set(held[r][(r - step) % n])) for r in range(n)}
        for r, (chunk, contributors) in outgoing.items():
            held[(r + 1) % n][chunk] |= contributors
        history.append([[len(c) for c in row] for row in held])
    for step in range(n - 1):
        outgoing = {r: ((r + 1 - step) % n, set(held[r][(r + 1 - step) % n])) for r in range(n)}
        for r, (chunk, contributors) in outgoing.items():
            held[(r + 1) % n][chunk] = contributors
        history.append([[len(c) for c in row] for row in held])
    return history


def draw_ring_allreduce(fig) -> None:
    import numpy as np

    history = ring_allreduce_contributions(4)
    n = 4
    axes = fig.subplots(1, len(history))
    for step, (ax, counts) in enumerate(zip(axes, history)):
        ax.imshow(np.array(counts), cmap="Greens", vmin=0, vmax=n)
        for r in range(n):
            for c in range(n):
                ax.text(c, r, counts[r][c], ha="center", va="center", fontsize=8,
                        color="white" if counts[r][c] == n else "black")
        phase = "inputs" if step == 0 else f"after RS s={step - 1}" if step < n else f"after AG s={step - n}"
        ax.set_title(phase, fontsize=8)
        ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=6)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)] if step == 0 else [""] * n, fontsize=6)
    fig.suptitle("ring all-reduce on 4 ranks: how many ranks' inputs each chunk holds "
                 "(reduce-scatter, then all-gather)", fontsize=9)


# ---- chapter 05: ZeRO stages -------------------------------------------------------------------------------

def draw_zero_stages(fig) -> None:
    from distlab import memory

    ax = fig.subplots()
    gpus = 4
    parts = [("weights (2 B: bf16 in the paper)", "params", "#1f77b4"),
             ("gradients (2 B: bf16 in the paper)", "grads", "#ff7f0e"),
             ("optimizer (fp32 master + moments)", "optimizer", "#2ca02c")]
    labels = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    for stage, label in enumerate(labels):
        state = memory.zero_state_bytes(1, gpus, stage)  # bytes per parameter on one GPU, mixed precision
        for gpu in range(gpus):
            x = stage * (gpus + 1.5) + gpu
            bottom = 0.0
            for name, field, colour in parts:
                height = getattr(state, field)
                ax.bar(x, height, bottom=bottom, color=colour, width=0.8,
                       label=name if stage == 0 and gpu == 0 else None)
                bottom += height
        ax.text(stage * (gpus + 1.5) + (gpus - 1) / 2, state.total + 0.4, f"{label}\n{state.total:g} B/param",
                ha="center", fontsize=8)
    ax.set_xticks([])
    ax.set_ylim(0, 19.5)
    ax.set_ylabel("bytes per parameter, each GPU")
    ax.set_title("ZeRO stages on 4 GPUs: what each GPU keeps (the ZeRO paper's mixed-precision AdamW)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right", frameon=False)


# ---- chapter 06: column and row splits ---------------------------------------------------------------------

def _matrix(ax, x, y, w, h, label, colours=None, split=None, fontsize=7):
    """A rectangle; ``split`` 'cols' or 'rows' cuts it into len(colours) coloured blocks."""
    from matplotlib.patches import Rectangle

    colours = colours or ["#bbbbbb"]
    for i, colour in enumerate(colours):
        if split == "cols":
            ax.add_patch(Rectangle((x + i * w / len(colours), y), w / len(colours), h, color=colour, alpha=0.75))
        elif split == "rows":
            ax.add_patch(Rectangle((x, y + h - (i + 1) * h / len(colours)), w, h / len(colours), color=colour,
                                   alpha=0.75))
        else:
            ax.add_patch(Rectangle((x, y), w, h, color=colour, alpha=0.75))
    ax.add_patch(Rectangle((x, y), w, h, fill=False, lw=1))
    ax.text(x + w / 2, y - 0.35, label, ha="center", va="top", fontsize=fontsize)


def draw_tensor_parallel_split(fig) -> None:
    ax = fig.subplots()
    grey = ["#bbbbbb"]
    _matrix(ax, 0, 1, 1.2, 2, "X\n(replicated)", grey)
    ax.text(1.6, 2, "x", fontsize=12, va="center")
    _matrix(ax, 2.0, 0.6, 2.4, 2.8, "W1ᵀ: column parallel\n(rank r: output block r)", RANK_COLOURS, "cols")
    ax.text(4.8, 2, "=", fontsize=12, va="center")
    _matrix(ax, 5.2, 1, 2.4, 2, "Y1 split by columns\n(+ SiLU, local)", RANK_COLOURS, "cols")
    ax.text(8.0, 2, "x", fontsize=12, va="center")
    _matrix(ax, 8.4, 0.6, 1.2, 2.8, "W2ᵀ: row parallel\n(rank r: input block r)", RANK_COLOURS, "rows")
    ax.text(10.0, 2, "=", fontsize=12, va="center")
    for r, colour in enumerate(RANK_COLOURS):
        _matrix(ax, 10.4 + r * 0.35, 1.3 + r * 0.15, 1.2, 1.4, "partial sums" if r == 0 else "", [colour])  # under the stack
    ax.annotate("all-reduce", xy=(13.9, 2), xytext=(12.3, 3.3), fontsize=8,
                arrowprops=dict(arrowstyle="->", lw=1))
    _matrix(ax, 13.9, 1.3, 1.2, 1.4, "Y (replicated)", grey)
    ax.set_xlim(-0.3, 15.4)
    ax.set_ylim(-0.6, 3.8)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("a column-parallel layer feeds a row-parallel one: one all-reduce per pair (4 ranks)", fontsize=9)


# ---- chapter 08: the sequence-parallel regions, and ring attention's work per rank ---------------------------

def draw_sequence_parallel_regions(fig) -> None:
    from matplotlib.patches import FancyBboxPatch

    ax = fig.subplots()
    boxes = [("RMSNorm\n(S/t positions)", "seq"), ("all-gather\nalong S", "comm"),
             ("attention\n(a/t heads)", "tp"), ("reduce-scatter\nalong S", "comm"), ("+ residual\n(S/t)", "seq"),
             ("RMSNorm\n(S/t)", "seq"), ("all-gather\nalong S", "comm"), ("SwiGLU\n(f/t features)", "tp"),
             ("reduce-scatter\nalong S", "comm"), ("+ residual\n(S/t)", "seq")]
    colours = {"seq": "#9ecae1", "tp": "#fdd0a2", "comm": "#ffffff"}
    for i, (label, kind) in enumerate(boxes):
        ax.add_patch(FancyBboxPatch((i * 1.7, 0), 1.45, 1, boxstyle="round,pad=0.05", fc=colours[kind],
                                    ec="black", lw=1, ls="--" if kind == "comm" else "-"))
        ax.text(i * 1.7 + 0.72, 0.5, label, ha="center", va="center", fontsize=6.5)
        if i:
            ax.annotate("", xy=(i * 1.7 - 0.06, 0.5), xytext=(i * 1.7 - 0.2, 0.5),
                        arrowprops=dict(arrowstyle="->", lw=0.8))
    ax.text(0, -0.45, "blue: sharded along the sequence (SP)   orange: tensor parallel (TP)   dashed: collectives "
            "(TP alone: identity in, all-reduce out)", fontsize=7)
    ax.set_xlim(-0.2, len(boxes) * 1.7)
    ax.set_ylim(-0.7, 1.3)
    ax.axis("off")
    ax.set_title("one transformer block under TP + sequence parallelism (t ranks)", fontsize=9)


def draw_ring_attention_blocks(fig) -> None:
    import numpy as np

    from distlab import tensor_parallel

    ranks = 4
    chunks = 2 * ranks
    axes = fig.subplots(1, 2)
    for ax, layout in zip(axes, ("contiguous", "zigzag")):
        owner = {c: r for r in range(ranks) for c in tensor_parallel.ring_chunks(r, ranks, layout)}
        grid = np.full((chunks, chunks), np.nan)
        for q in range(chunks):
            for k in range(chunks):
                if tensor_parallel.block_kind(q, k) != "skipped":
                    grid[q, k] = owner[q]  # the rank that holds query chunk q computes the block
        from matplotlib.colors import ListedColormap

        ax.imshow(grid, cmap=ListedColormap(RANK_COLOURS), vmin=-0.5, vmax=ranks - 0.5)
        for q in range(chunks):
            for k in range(chunks):
                if tensor_parallel.block_kind(q, k) == "diagonal":
                    ax.text(k, q, "◣", ha="center", va="center", fontsize=7, color="white")
        counts = tensor_parallel.causal_blocks_per_rank(ranks, layout)
        ax.set_title(f"{layout}: blocks per rank {counts}", fontsize=8)
        ax.set_xlabel("key chunk", fontsize=7)
        ax.set_ylabel("query chunk", fontsize=7)
        ax.tick_params(labelsize=6)
    fig.suptitle("ring attention under a causal mask: who computes which block (colour = rank)", fontsize=9)


# ---- chapter 09: meshes on nodes, ZeRO with PP, the sizing guide ------------------------------------------------

LINK_COLOURS = {"tp": "#2ca02c", "dp": "#1f77b4", "pp": "#d62728"}


def _gpus_on_nodes(ax, nodes: list[tuple[float, float, list[int]]], gpu_width=0.8, gpu_height=0.55):
    """Node boxes with their GPUs in a row; returns ``{rank: (x, y)}`` of each GPU's centre."""
    from matplotlib.patches import FancyBboxPatch, Rectangle

    centres = {}
    for node, (x, y, ranks) in enumerate(nodes):
        width = len(ranks) * (gpu_width + 0.25) + 0.25
        ax.add_patch(FancyBboxPatch((x, y), width, 1.25, boxstyle="round,pad=0.05", facecolor="#f4f4f4",
                                    edgecolor="#777777"))
        ax.text(x + 0.1, y + 1.12, f"node {node}", fontsize=7, va="top", color="#555555")
        for i, rank in enumerate(ranks):
            gx = x + 0.25 + i * (gpu_width + 0.25)
            ax.add_patch(Rectangle((gx, y + 0.2), gpu_width, gpu_height, facecolor="white", edgecolor="black"))
            ax.text(gx + gpu_width / 2, y + 0.2 + gpu_height / 2, f"GPU\n{rank}", ha="center", va="center",
                    fontsize=6.5)
            centres[rank] = (gx + gpu_width / 2, y + 0.2 + gpu_height / 2)
    return centres


def draw_mesh_two_nodes(fig) -> None:
    """The 2-D (dp, tp) = (2, 4) mesh on two 4-GPU nodes: the groups are ``hybrid.grid_groups``' (DeviceMesh's
    order, tp innermost), the links the chapter's: NVLink inside a node, Slingshot across."""
    from distlab import hybrid

    groups = hybrid.grid_groups((1, 2, 4), "device_mesh")
    ax = fig.subplots()
    centres = _gpus_on_nodes(ax, [(0, 0, groups["tp"][0]), (5.5, 0, groups["tp"][1])])
    for group in groups["tp"]:   # a TP group: one bar under its GPUs (NVLink connects them all)
        xs = [centres[r][0] for r in group]
        y = centres[group[0]][1] - 0.45
        ax.plot([min(xs), max(xs)], [y, y], color=LINK_COLOURS["tp"], lw=3)
        for x in xs:
            ax.plot([x, x], [y, y + 0.18], color=LINK_COLOURS["tp"], lw=1.5)
        ax.text((min(xs) + max(xs)) / 2, y - 0.08, f"TP group {group}: NVLink, 4 all-reduces per block",
                ha="center", va="top", fontsize=6.5, color=LINK_COLOURS["tp"])
    for i, group in enumerate(groups["dp"]):   # an FSDP group: an arc over the nodes
        (x0, y0), (x1, _) = centres[group[0]], centres[group[1]]
        x0, x1 = x0 + 0.25, x1 + 0.25   # right of centre: clear of the "node" labels
        height = 0.55 + 0.25 * i          # every arc above the node boxes
        ax.plot([x0, x0, x1, x1], [y0 + 0.3, y0 + 0.3 + height, y0 + 0.3 + height, y0 + 0.3],
                color=LINK_COLOURS["dp"], lw=1.2, ls="--")
        ax.text(4.95, y0 + 0.3 + height, f"FSDP group {group}", fontsize=6, va="center", ha="center",
                color=LINK_COLOURS["dp"], bbox=dict(facecolor="white", edgecolor="none", pad=0.6))  # in the gap
    ax.text(5.05, 2.35, "Slingshot (25 GB/s a GPU): FSDP's all-gathers (2) and reduce-scatter (1) per unit a step",
            ha="center", fontsize=7, color=LINK_COLOURS["dp"])
    ax.set_xlim(-0.2, 11.6)
    ax.set_ylim(-0.9, 2.5)
    ax.axis("off")
    ax.set_title("init_device_mesh(\"cuda\", (2, 4), mesh_dim_names=(\"dp\", \"tp\")) on two nodes", fontsize=9)


def draw_mesh_3d(fig) -> None:
    """The 3-D (pp, dp, tp) = (2, 2, 4) mesh of the 16-GPU reference layout on four nodes: a pipeline stage is
    two nodes (its dp ranks, FSDP shards), a TP group one node; the pp sends join ranks of equal (dp, tp)."""
    from distlab import hybrid

    groups = hybrid.grid_groups((2, 2, 4), "device_mesh")
    ax = fig.subplots()
    nodes = [(0 if n < 2 else 6.2, 1.9 * (1 - n % 2), groups["tp"][n]) for n in range(4)]   # nodes 0-1: stage 0
    centres = _gpus_on_nodes(ax, nodes)
    for n, (x, y, ranks) in enumerate(nodes):
        coords = hybrid.grid_coordinates(ranks[0], (2, 2, 4))
        ax.text(x + 4.4, y + 1.12, f"stage {coords['pp']}, dp {coords['dp']}", fontsize=6,
                va="top", ha="right", color="#555555")
        ax.text(x + 2.2, y + 0.03, f"TP group {ranks}", fontsize=6, va="bottom", ha="center",
                color=LINK_COLOURS["tp"])
    for group in groups["dp"]:   # the FSDP groups: ranks of equal (pp, tp), one on each node of a stage
        (x0, y0), (x1, y1) = centres[group[0]], centres[group[1]]
        ax.plot([x0, x1], [y0 - 0.3, y1 + 0.3], color=LINK_COLOURS["dp"], lw=1, ls="--")
    for node in (0, 1):   # the pp groups between a node of stage 0 and its node of stage 1
        pairs = [g for g in groups["pp"] if g[0] in groups["tp"][node]]
        y = nodes[node][1] + 0.55
        ax.annotate("", xy=(6.15, y), xytext=(4.55, y),
                    arrowprops=dict(arrowstyle="->", color=LINK_COLOURS["pp"], lw=1.5))
        ax.text(5.35, y + 0.12, "pp groups", ha="center", fontsize=6, color=LINK_COLOURS["pp"])
        ax.text(5.35, y - 0.12, " ".join(str(g) for g in pairs[:2]), ha="center", va="top", fontsize=5.5,
                color=LINK_COLOURS["pp"])
        ax.text(5.35, y - 0.32, " ".join(str(g) for g in pairs[2:]), ha="center", va="top", fontsize=5.5,
                color=LINK_COLOURS["pp"])
    ax.text(5.3, 3.45, "pp: a stage sends its activations to the next, rank r to r + 8, one per microbatch",
            ha="center", fontsize=7, color=LINK_COLOURS["pp"])
    ax.text(5.3, -0.35, "dp (dashed): FSDP over the two nodes of a stage (each holds a shard); tp: inside a node",
            ha="center", fontsize=7, color=LINK_COLOURS["dp"])
    ax.set_xlim(-0.2, 10.8)
    ax.set_ylim(-0.55, 3.6)
    ax.axis("off")
    ax.set_title("(pp, dp, tp) = (2, 2, 4) on 16 GPUs: tp innermost, pp outermost", fontsize=9)


FIGURE_DATA = Path(__file__).resolve().parent.parent / "chapters" / "figures" / "data"
HYBRID_STEP_TIMELINE = FIGURE_DATA / "09_hybrid_step_timeline.json"


def draw_hybrid_step_timeline(fig) -> None:
    """One measured step of ``fsdp_tp_hybrid.py --dp 2 --tp 2`` on 4 CPU ranks (rank 0): compute, the collectives
    on the tp link and on the dp link, from the profiler's trace (``--timeline-out``, kept in
    ``chapters/figures/data``: a measurement, redrawn by ``make figures``, re-measured by running the script)."""
    import json

    run = json.loads(HYBRID_STEP_TIMELINE.read_text())
    rows = run["rows"]
    ax = fig.subplots()
    lanes = {"compute": 2, "tp": 1, "dp": 0}
    colours = {"all_reduce": RANK_COLOURS[1], "all_gather": RANK_COLOURS[0], "compute": "#888888"}
    for row in rows:
        if row["lane"] == "backward":
            ax.axvspan(row["start"] * 1e3, row["end"] * 1e3, color="#f3eee0", zorder=0)
            ax.text(row["start"] * 1e3 + 0.5, 2.55, "backward", fontsize=7, color="#8a6d1c")
            continue
        colour = colours["compute"] if row["lane"] == "compute" else colours.get(row["kind"], "black")
        ax.barh(lanes[row["lane"]], (row["end"] - row["start"]) * 1e3, left=row["start"] * 1e3, color=colour,
                height=0.55)
    ax.set_yticks(list(lanes.values()), ["compute (main thread)", f"tp link: TP group ({run['tp']} ranks)",
                                         f"dp link: FSDP group ({run['dp']} ranks)"], fontsize=7)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=colours["all_gather"], label="all-gather (FSDP: a unit's weights)"),
                       Patch(color=colours["all_reduce"], label="all-reduce (TP: activations; dp: FSDP's "
                                                                "reduce-scatter, which gloo runs as one)")],
              fontsize=6.5, loc="upper left", bbox_to_anchor=(0, -0.22), ncol=2, frameon=False)
    ax.set_xlabel("ms from the step's start (measured, torch.profiler)", fontsize=7)
    ax.set_ylim(-0.5, 2.8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"one step of fsdp_tp_hybrid.py, (dp, tp) = ({run['dp']}, {run['tp']}), rank {run['rank']}, "
                 f"{run['model']['n_layers']} blocks, on {run['world_size']} CPU ranks (gloo)", fontsize=9)


def draw_zero_with_pipeline(fig) -> None:
    """One stage's passes under 1F1B (``schedules.simulate``) and where its data-parallel gradient sync runs: a
    reduce-scatter after every microbatch (the naive ZeRO-2/3); torch's DDP stage, whose once-per-step all-reduce
    starts inside the last backward (``stage.py``, ``backward_maybe_with_nosync``); torch's FSDP stage, whose
    once-per-step reduce-scatter runs in REDUCE_GRAD after the last backward (``perform_reduce_grad``), exposed.
    The bytes each way from ``hybrid_pipeline.dp_gradient_sync_bytes``; the sync drawn as long as one backward."""
    from distlab import hybrid_pipeline, schedules

    ranks, microbatches, stage = 4, 8, 1
    events = [e for e in schedules.simulate(schedules.one_f_one_b(ranks, microbatches)) if e.stage == stage]
    backwards = [e for e in events if e.kind == "B"]
    last = backwards[-1]
    sync_length = last.end - last.start
    axes = fig.subplots(3, 1, sharex=True)
    params = 1_000_000
    once = hybrid_pipeline.dp_gradient_sync_bytes(params, microbatches, "fsdp", False)["reduce_scatter"]
    panels = [("naive ZeRO-2/3: a reduce-scatter after every microbatch", "fsdp", True,
               [(e.end, 0.5) for e in backwards]),
              ("torch's DDP stage: no_sync() but the last backward; its all-reduce starts inside it, overlapped",
               "ddp", False, [(last.start + 0.25 * sync_length, sync_length)]),
              ("torch's FSDP stage: REDUCE_GRAD after the last backward; the reduce-scatter is exposed",
               "fsdp", False, [(last.end, sync_length)])]
    for ax, (title, mode, every, syncs) in zip(axes, panels):
        for e in events:
            colour = RANK_COLOURS[0] if e.kind == "F" else RANK_COLOURS[1]
            ax.barh(1, e.end - e.start, left=e.start, color=colour, edgecolor="white", height=0.6)
            ax.text((e.start + e.end) / 2, 1, f"{e.kind}{e.microbatch}", ha="center", va="center", fontsize=6,
                    color="white")
        for start, length in syncs:
            ax.barh(0, length, left=start, color=LINK_COLOURS["dp"], height=0.6)
        step_end = max([last.end] + [start + length for start, length in syncs])
        ax.axvline(step_end, color="#444444", linestyle=":", linewidth=1)
        collective = "all_reduce" if mode == "ddp" else "reduce_scatter"
        sent = hybrid_pipeline.dp_gradient_sync_bytes(params, microbatches, mode, every)[collective]
        ax.set_yticks([0, 1], ["dp link", f"stage {stage}"], fontsize=7)
        ax.set_title(f"{title}: {sent // once} x the gradients' bytes", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    axes[-1].set_xlabel("time (units of one forward; 1F1B, P = 4, M = 8, simulated; dotted: the optimizer step "
                        "may start)", fontsize=7)
    fig.tight_layout()


def draw_sizing_chart(fig) -> None:
    """The sizing guide's table as bars: GiB per A100-40GB at the fewest nodes each model fits, by part
    (``sizing.sizing_table``), against the GPU's 40 GiB."""
    from distlab import sizing

    rows = [r for r in sizing.sizing_table() if r["gib_per_gpu"]]
    ax = fig.subplots()
    parts = [("state", "training state (sharded over dp x tp)", RANK_COLOURS[0]),
             ("fsdp_unit", "FSDP units gathered", RANK_COLOURS[1]),
             ("activations", "activations (checkpointed)", RANK_COLOURS[2]),
             ("reserve", "reserve (CUDA, NCCL, fragmentation)", "#aaaaaa")]
    for i, row in enumerate(rows):
        bottom = 0.0
        for key, label, colour in parts:
            value = row["gib_per_gpu"][key]
            ax.bar(i, value, bottom=bottom, color=colour, width=0.6, label=label if i == 0 else None)
            bottom += value
    gpu = sizing.Assumptions().gpu_bytes / sizing.GIB
    ax.axhline(gpu, color="black", lw=0.8, ls="--")
    ax.text(len(rows) - 0.5, gpu + 0.5, f"{gpu:.0f} GiB", fontsize=7, ha="right")
    ax.set_xticks(range(len(rows)), [f"{r['model']}\non {r['min_nodes']} node{'s' * (r['min_nodes'] > 1)}"
                                     for r in rows], fontsize=8)
    ax.set_ylabel("GiB per GPU (derived)")
    ax.set_ylim(0, gpu * 1.25)
    ax.set_title("fewest 4 x A100-40GB nodes (TP = 4 in a node, FSDP across), and what fills each GPU there",
                 fontsize=9)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)


# ---- chapter 11: the planner against published runs, and the decision path ---------------------------------

def draw_predicted_vs_published(fig) -> None:
    """Each row of the validation table: predicted MFU against published MFU, with y = x and the +-15 % band; a
    named miss (a row the planner misses at its published settings, with the reason in the table) hollow."""
    from distlab.planner import published

    ax = fig.subplots()
    rows = published.validation_table()
    top = max(max(r["published_mfu"], r["predicted_mfu"]) for r in rows) * 1.2
    line = [0, top]
    ax.fill_between(line, [x * (1 - published.BAND) for x in line], [x * (1 + published.BAND) for x in line],
                    color="#dddddd", label=f"within {published.BAND:.0%}")
    ax.plot(line, line, color="black", linewidth=0.8, label="predicted = published")
    for i, (run, row) in enumerate(zip(published.RUNS, rows)):
        gpu = run.cluster.name.split("-")[0].upper()
        colour = {"A100": RANK_COLOURS[0], "H100": RANK_COLOURS[1]}[gpu]
        # a named miss (the planner misses the row at its published settings, the table says why): hollow
        ax.scatter(row["published_mfu"], row["predicted_mfu"], s=28, zorder=3,
                   facecolors="none" if row["miss"] else colour, edgecolors=colour)
        # points crowd near 35 %: a number beside each, on the side away from its nearest neighbour, its run in the
        # key below right
        x, y = row["published_mfu"], row["predicted_mfu"]
        others = [(r["published_mfu"], r["predicted_mfu"]) for j, r in enumerate(rows) if j != i]
        nx, ny = min(others, key=lambda p: (p[0] - x) ** 2 + (p[1] - y) ** 2)
        dx, dy = x - nx, y - ny
        norm = max((dx * dx + dy * dy) ** 0.5, 1e-9)
        ax.annotate(str(i + 1), (x, y), fontsize=6, xytext=(7 * dx / norm - 2, 7 * dy / norm - 3),
                    textcoords="offset points")
    key = "\n".join(f"{i + 1}  {r['label'].split(',')[0]} ({r['gpus']:,} GPUs{', a named miss' if r['miss'] else ''})"
                     for i, r in enumerate(rows))
    ax.text(1.03, 0.0, key, transform=ax.transAxes, fontsize=7, ha="left", va="bottom", multialignment="left",
            bbox={"facecolor": "white", "edgecolor": "#cccccc"})
    ax.set_xlim(0.2, top)
    ax.set_ylim(0.2, top)
    ax.set_xlabel("published MFU (converted to the chapter's definition)")
    ax.set_ylabel("planner's MFU (derived)")
    ax.set_title(f"The planner against {len(rows)} measured training runs, at their published settings", fontsize=9)
    from matplotlib.lines import Line2D
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], marker="o", linestyle="", color=RANK_COLOURS[0], label="A100"),
                Line2D([], [], marker="o", linestyle="", color=RANK_COLOURS[1], label="H100"),
                Line2D([], [], marker="o", linestyle="", markerfacecolor="none", color="grey",
                       label="a named miss (the table says why)")]
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    fig.tight_layout()


# ---- the registry and the command line -------------------------------------------------------------------

DDP_OVERLAP = Path(__file__).resolve().parent.parent / "chapters" / "figures" / "data" / "04_ddp_overlap.json"
DDP_OVERLAP_ARGS = ["--bucket-mb", "0.1", "--steps", "3"]


def measure_ddp_overlap(path=DDP_OVERLAP) -> Path:
    """Run ``train_ddp.py --bucket-mb 0.1`` on 4 CPU ranks and keep rank 0's last step: each gradient's ready time
    and each bucket's all-reduce (its comm hook's stamps). A measurement, redrawn by ``make figures``; measured again
    by calling this function (``python -c "from coursetools import figures; figures.measure_ddp_overlap()"``)."""
    import json

    import torch

    from labkit import launch

    run = launch.run("scripts/04_data_parallel/train_ddp.py", nproc=4, args=DDP_OVERLAP_ARGS, stream=False)
    extra = run.metrics["extra"]
    kept = {"script": "scripts/04_data_parallel/train_ddp.py", "argv": DDP_OVERLAP_ARGS,
            "world_size": run.metrics["world_size"], "torch": torch.__version__, "param_bytes": extra["param_bytes"],
            "buckets": extra["buckets"], "overlap": extra["overlap"], "backward_timeline": extra["backward_timeline"]}
    Path(path).write_text(json.dumps(kept, indent=1) + "\n")
    return Path(path)


def draw_ddp_overlap(fig) -> None:
    """Chapter 04: one measured backward of DDP on 4 CPU ranks (rank 0): each gradient as it becomes ready, coloured
    by its bucket, and each bucket's all-reduce from its launch to its finish (``DDP_OVERLAP``'s data)."""
    import json

    run = json.loads(DDP_OVERLAP.read_text())
    overlap, events = run["overlap"], run["backward_timeline"]
    origin = overlap["backward_start"]
    ms = lambda t: 1e3 * (t - origin)  # noqa: E731 - one conversion, named where it is used
    ax = fig.subplots()
    ax.axvspan(0, ms(overlap["last_gradient"]), color="#f3eee0", zorder=0)
    ax.text(0.05, -0.75, "backward computing", fontsize=7, color="#8a6d1c")
    colour = lambda b: RANK_COLOURS[b % len(RANK_COLOURS)]  # noqa: E731
    for e in events:
        if e["kind"] == "grad_ready":
            ax.plot([ms(e["t"])] * 2, [len(run["buckets"]) - 0.3, len(run["buckets"]) + 0.3], color=colour(e["bucket"]),
                    linewidth=1.2)
    for b in overlap["buckets"]:
        ax.barh(b["index"], ms(b["end"]) - ms(b["launch"]), left=ms(b["launch"]), color=colour(b["index"]),
                height=0.55)
        ax.text(ms(b["end"]), b["index"], f" {b['bytes']:,} B", va="center", fontsize=6.5)
    ax.axvline(ms(overlap["backward_end"]), color="black", linestyle="--", linewidth=0.8)
    ax.text(ms(overlap["backward_end"]), -0.75, " backward returns", fontsize=6.5)
    ax.set_yticks(list(range(len(run["buckets"]))) + [len(run["buckets"])],
                  [f"bucket {b['index']} all-reduce" for b in run["buckets"]] + ["gradients ready"], fontsize=7)
    ax.set_ylim(-1, len(run["buckets"]) + 0.9)
    ax.invert_yaxis()
    ax.set_xlabel("ms since backward began (measured: comm hook and gradient hooks, rank 0)", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.set_title(f"DDP's buckets during one backward: train_ddp.py {' '.join(run['argv'])}, "
                 f"{run['world_size']} CPU ranks (gloo)", fontsize=8.5)


ZERO3_MEMORY = FIGURE_DATA / "05_zero3_memory.json"
ZERO3_MEMORY_ARGS = ["--steps", "2"]


ZERO3_SCRIPT = "scripts/05_fully_sharded/zero3_from_scratch.py"


def _measure_zero3(path, argv: list[str], keep) -> Path:
    """Run ``zero3_from_scratch.py argv`` on 4 CPU ranks and write what ``keep(metrics)`` picks of rank 0's
    metrics to ``path``, with the run's script, flags, world size and torch version."""
    import json

    import torch

    from labkit import launch

    run = launch.run(ZERO3_SCRIPT, nproc=4, args=argv, stream=False)
    kept = {"script": ZERO3_SCRIPT, "argv": argv, "world_size": run.metrics["world_size"], "torch": torch.__version__,
            **keep(run.metrics)}
    Path(path).write_text(json.dumps(kept, indent=1) + "\n")
    return Path(path)


def measure_zero3_memory(path=ZERO3_MEMORY) -> Path:
    """Run ``zero3_from_scratch.py`` on 4 CPU ranks and keep rank 0's last step: the bytes of gathered parameters
    still alive after each gather and each drop, read off their storages. Measured again by calling this function
    (``python -c "from coursetools import figures; figures.measure_zero3_memory()"``)."""
    return _measure_zero3(path, ZERO3_MEMORY_ARGS, lambda metrics: {
        key: metrics["memory"][key] for key in ("timeline", "units", "whole_model_bytes", "slices_bytes",
                                                "gathered_peak_bytes")})


def draw_zero3_memory(fig) -> None:
    """Chapter 05: the weights one rank holds during a step of ZeRO-3 by hand (measured) against ZeRO-2's, which
    keeps them all: the slices every rank keeps, and each unit whole from its gather to its drop."""
    import json

    run = json.loads(ZERO3_MEMORY.read_text())
    kib = lambda b: b / 1024  # noqa: E731
    events = run["timeline"]
    ax = fig.subplots()
    x = list(range(len(events) + 1))
    held = [kib(run["slices_bytes"] + e["bytes"]) for e in events]
    ax.step(x, [kib(run["slices_bytes"])] + held, where="post", color="#1f77b4", linewidth=1.6,
            label="ZeRO-3: its slices + the gathered unit (measured on the storages)")
    ax.axhline(kib(run["whole_model_bytes"]), color="#d62728", linestyle="--", linewidth=1.2,
               label="ZeRO-1 and 2: every weight, all the time")
    ax.axhline(kib(run["slices_bytes"]), color="#7f7f7f", linestyle=":", linewidth=1,
               label="the slices alone (1/N of the weights)")
    largest = max(run["units"].values())    # inside its gather: the received buffer beside the copies out of it
    inside = kib(run["slices_bytes"] + 2 * largest)
    first = next(i for i, e in enumerate(events) if e["bytes"] == largest)
    ax.plot([first + 1], [inside], marker="x", color="black", markersize=7, linestyle="none",
            label=f"inside a block's gather: slices + its buffer + its copies, {inside:.0f} KiB (not an event)")
    half = next(i for i, e in enumerate(events) if "backward" in e["event"])
    ax.axvspan(half + 1, len(events) + 1, color="#f3eee0", zorder=0)
    ax.text(0.2, kib(run["whole_model_bytes"]) * 1.03, "forward", fontsize=7)
    ax.text(half + 1.2, kib(run["whole_model_bytes"]) * 1.03, "backward", fontsize=7)
    for i, e in enumerate(events):
        if "gathered" in e["event"]:
            ax.text(i + 1.5, kib(run["slices_bytes"] + e["bytes"]) + 8, e["event"].split(":")[0], fontsize=6,
                    ha="center", rotation=90, va="bottom")   # event i's level holds from x = i + 1 to i + 2
    ax.set_xticks([])
    ax.set_xlabel("events of one step, in order (each gather, each drop)", fontsize=7)
    ax.set_ylabel("KiB of weights on rank 0", fontsize=7)
    ax.set_ylim(0, max(kib(run["whole_model_bytes"]), inside) * 1.15)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6.5, loc="lower center", ncol=2)
    ax.set_title(f"ZeRO-3 by hand: zero3_from_scratch.py, {run['world_size']} CPU ranks, tiny model (fp32)",
                 fontsize=8.5)


ZERO3_PREFETCH = FIGURE_DATA / "05_zero3_prefetch.json"
ZERO3_PREFETCH_ARGS = ["--steps", "2", "--prefetch"]


def measure_zero3_prefetch(path=ZERO3_PREFETCH) -> Path:
    """Run ``zero3_from_scratch.py --prefetch`` on 4 CPU ranks and keep rank 0's last forward: each unit's compute and
    each all-gather from its issue to the moment the host had its weights. Measured again by calling this function
    (``python -c "from coursetools import figures; figures.measure_zero3_prefetch()"``)."""
    return _measure_zero3(path, ZERO3_PREFETCH_ARGS, lambda metrics: {
        "gathered_peak_bytes": metrics["memory"]["gathered_peak_bytes"], "units": metrics["memory"]["units"],
        **metrics["extra"]["prefetch_timeline"]})


def draw_zero3_prefetch(fig) -> None:
    """Chapter 05: one forward of ZeRO-3 by hand with --prefetch on rank 0 (host clock, 4 CPU ranks): each unit's
    compute, and each all-gather from its issue to the moment its weights were there, issued ahead or on demand."""
    import json

    run = json.loads(ZERO3_PREFETCH.read_text())
    units = [c["unit"] for c in run["computes"]]
    ax = fig.subplots()
    for c in run["computes"]:
        ax.barh(units.index(c["unit"]), 1e3 * (c["end"] - c["start"]), left=1e3 * c["start"], color="#1f77b4",
                height=0.35)
    for g in run["gathers"]:
        if g["phase"] == "forward" and g["unit"] in units:
            colour = "#ff7f0e" if g["prefetched"] else "#d62728"
            ax.barh(units.index(g["unit"]) + 0.38, 1e3 * (g["ready"] - g["issued"]), left=1e3 * g["issued"],
                    color=colour, height=0.3)
            ax.plot([1e3 * g["waited"]] * 2, [units.index(g["unit"]) + 0.23, units.index(g["unit"]) + 0.53],
                    color="black", linewidth=0.8)
    ax.set_yticks(range(len(units)), units, fontsize=7)
    ax.invert_yaxis()
    ax.tick_params(labelsize=7)
    ax.set_xlabel("ms since the first gather (rank 0's host clock); black tick: where the unit began to wait",
                  fontsize=7)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color="#1f77b4", label="the unit's forward"),
                       Patch(color="#ff7f0e", label="its all-gather, issued one unit ahead"),
                       Patch(color="#d62728", label="its all-gather, on demand")], fontsize=6.5, loc="upper right")
    ax.set_title(f"ZeRO-3 by hand with --prefetch: one forward, {run['world_size']} CPU ranks (gloo), tiny model",
                 fontsize=8.5)


HANG = Path(__file__).resolve().parent.parent / "chapters" / "figures" / "data" / "12_hang_journals.json"
HANG_ARGS = ["--hang", "skipped-barrier"]


def measure_hang(path=HANG) -> Path:
    """Run ``deadlocks.py --hang skipped-barrier`` on 4 CPU ranks and keep every rank's call journal and the
    diagnosis it printed (measured again by calling this function)."""
    import json

    from labkit import launch

    run = launch.run("scripts/12_hpc_operations/deadlocks.py", nproc=4, args=HANG_ARGS, stream=False)
    extra = run.metrics["extra"]
    kept = {"script": "scripts/12_hpc_operations/deadlocks.py", "argv": HANG_ARGS, "cause": extra["cause"],
            "verdict": extra["verdict"], "seconds_to_diagnosis": extra["seconds_to_diagnosis"],
            "journals": extra["journals"]}
    Path(path).write_text(json.dumps(kept, indent=1) + "\n")
    return Path(path)


def draw_journals(ax, journals: dict, second_line, note) -> None:
    """Each rank's journal of calls as a row of boxes (grey: completed; red, hatched: waiting when the timeout
    struck), each box its operation over ``second_line(i, call)``, and ``note(journal)`` after the row when it is
    not None. Chapters 12 and 14 draw their hangs with it."""
    for rank, journal in sorted(journals.items()):
        for i, call in enumerate(journal["calls"]):
            waiting = not call["done"]
            ax.barh(rank, 0.92, left=i, color="#f4c7c3" if waiting else "#dddddd",
                    edgecolor="#c0392b" if waiting else "#999999", hatch="//" if waiting else None)
            # a waiting call's label on a white patch: the hatching must not run over the cell the picture is about
            ax.text(i + 0.46, rank, f"{call['op']}\n{second_line(i, call)}", ha="center", va="center", fontsize=5.5,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6} if waiting else None)
        if note(journal):
            ax.text(len(journal["calls"]) + 0.05, rank, note(journal), va="center", fontsize=6.5, color="#c0392b")
    ax.set_yticks(sorted(journals), [f"rank {r}" for r in sorted(journals)], fontsize=7)
    ax.invert_yaxis()


def draw_hang(fig) -> None:
    """Chapter 12: a planted hang as every rank's journal shows it: the calls each rank completed, the one it waits
    in, and the one a rank never made (``HANG``'s data, read by ``hangs.diagnose``)."""
    import json
    import textwrap

    run = json.loads(HANG.read_text())
    journals = {int(r): j for r, j in run["journals"].items()}
    ax = fig.subplots()
    longest = max(len(j["calls"]) for j in journals.values())
    draw_journals(ax, journals,
                  lambda i, call: f"to {call['peer']}" if call["op"] in ("send", "recv") else call["group"],
                  lambda journal: "  never calls the barrier" if len(journal["calls"]) < longest else None)
    ax.set_xlim(0, longest + 2.2)
    ax.set_xticks([])
    ax.set_xlabel("each rank's calls in its journal, in order (grey: completed; red: waiting when the timeout "
                  "struck)", fontsize=7)
    ax.set_title("\n".join(textwrap.wrap(f"deadlocks.py {' '.join(run['argv'])}: {run['verdict']}", 110)),
                 fontsize=7.5)


FAULT_DRILL = Path(__file__).resolve().parent.parent / "chapters" / "figures" / "data" / "12_fault_drill.json"
FAULT_DRILL_ARGS = ["--kill-rank", "1", "--kill-at-step", "5", "--pg-timeout", "60"]


def measure_fault_drill(path=FAULT_DRILL) -> Path:
    """Run ``fault_drill.py`` under the real torchrun with one restart (rank 1 killed at step 5), as chapter 12's test
    does, and keep each step's record (its attempt and wall time), the death and the checkpoints' cadence."""
    import json
    import os
    import subprocess
    import tempfile

    from labkit import launch

    with tempfile.TemporaryDirectory() as folder:
        run_dir, metrics_file = Path(folder) / "run", Path(folder) / "metrics.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                   "--max-restarts=1", "scripts/12_hpc_operations/fault_drill.py", "--run-dir", str(run_dir),
                   *FAULT_DRILL_ARGS, "--metrics-out", str(metrics_file)]
        subprocess.run(command, check=True, capture_output=True, timeout=240, cwd=launch.REPO_ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
        records = [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]
        died = json.loads((run_dir / "failure.json").read_text())
        metrics = json.loads(metrics_file.read_text())
    kept = {"script": "scripts/12_hpc_operations/fault_drill.py", "argv": FAULT_DRILL_ARGS, "records": records,
            "died": died, "save_every": metrics["config"]["save_every"], "steps": metrics["config"]["steps"],
            "extra": metrics["extra"]}
    Path(path).write_text(json.dumps(kept, indent=1) + "\n")
    return Path(path)


def draw_fault_drill(fig) -> None:
    """Chapter 12: the fault drill on a timeline: each step as it finished, by attempt; the kill; torchrun's restart
    from the last checkpoint; the step trained twice (``FAULT_DRILL``'s data)."""
    import json

    run = json.loads(FAULT_DRILL.read_text())
    records, died = run["records"], run["died"]
    origin = min(r["time"] for r in records)
    ax = fig.subplots()
    for attempt in sorted({r["attempt"] for r in records}):
        mine = [r for r in records if r["attempt"] == attempt]
        ax.plot([r["time"] - origin for r in mine], [r["step"] for r in mine], marker="o", markersize=4,
                color=RANK_COLOURS[attempt], label=f"attempt {attempt}" + (" (after torchrun's restart)" if attempt
                                                                          else ""))
    ax.plot([died["time"] - origin], [died["step"]], marker="X", markersize=10, color="#c0392b",
            label=f"rank {died['rank']} killed at step {died['step']}")
    saved = [r for r in records if (r["step"] + 1) % run["save_every"] == 0]   # a checkpoint after this step
    ax.plot([r["time"] - origin for r in saved], [r["step"] for r in saved], linestyle="none", marker="s",
            markersize=9, markerfacecolor="none", markeredgecolor="black", label="checkpoint written after it")
    twice = run["extra"]["steps_trained_twice"]
    restart = run["extra"]["seconds_to_restart"]
    ax.set_xlabel(f"seconds since the first step (torchrun restarted the job {restart:.1f} s after the kill; the "
                  f"new attempt then loads the checkpoint)", fontsize=7)
    ax.set_ylabel("step", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=6.5, frameon=False, loc="lower right")
    ax.set_title(f"fault_drill.py {' '.join(run['argv'][:4])}: a checkpoint every {run['save_every']} steps; "
                 f"step{'s' if len(twice) > 1 else ''} {', '.join(map(str, twice))} trained twice", fontsize=8)


def training_memory_of(preset: str, batch: int = 8) -> dict:
    """Chapter 01's memory of one training step of a preset on the CPU, by part: predicted by the formulas
    (``memory.training_state_bytes``, ``memory.transformer_activation_bytes``) and measured off the tensors
    (``memory.ledger`` after an AdamW step, ``memory.saved_activation_bytes`` during the forward)."""
    import torch

    from distlab import data, memory, models

    cfg = models.preset(preset)
    model = models.build_transformer(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = data.split_inputs_targets(data.token_batch(0, batch, cfg.seq_len, cfg.vocab_size, seed=0))
    with memory.saved_activation_bytes(exclude=model.parameters()) as saved:
        loss = models.lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    measured = memory.ledger(model, optimizer)
    predicted = memory.training_state_bytes(cfg.num_params())
    return {"predicted": {"parameters": predicted.params, "gradients": predicted.grads,
                          "AdamW moments": predicted.optimizer,
                          "activations": memory.transformer_activation_bytes(cfg, batch)},
            "measured": {"parameters": measured.params, "gradients": measured.grads,
                         "AdamW moments": measured.optimizer, "activations": saved.bytes}}


def draw_training_memory(fig) -> None:
    """Chapter 01: where a training step's memory goes, predicted against measured, for two presets."""
    axes = fig.subplots(1, 2, gridspec_kw={"wspace": 0.08})
    colours = {"parameters": RANK_COLOURS[0], "gradients": RANK_COLOURS[1], "AdamW moments": RANK_COLOURS[2],
               "activations": RANK_COLOURS[3]}
    for ax, preset in zip(axes, ("tiny", "small")):
        parts = training_memory_of(preset)
        for row, kind in enumerate(("predicted", "measured")):
            left = 0.0
            for part, value in parts[kind].items():
                ax.barh(row, value / 2**20, left=left, color=colours[part], label=part if row == 0 else None)
                left += value / 2**20
            ax.text(left, row, f" {left:.2f} MiB", va="center", fontsize=7)
        ax.set_yticks([0, 1], ["predicted (formulas)", "measured (tensors)"] if preset == "tiny" else [],
                      fontsize=7)
        ax.set_xlabel("MiB", fontsize=7)
        ax.set_xlim(0, ax.get_xlim()[1] * 1.25)
        ax.tick_params(labelsize=7)
        ax.set_title(f"{preset} preset, batch 8, one AdamW step (fp32, CPU)", fontsize=8)
    axes[0].legend(fontsize=6.5, frameon=False, loc="upper center", bbox_to_anchor=(1.0, -0.25), ncol=4)


GPU_LADDER = Path(__file__).resolve().parent.parent / "chapters" / "figures" / "data" / "01_gpu_ladder.json"


def draw_gpu_ladder(fig) -> None:
    """Chapter 01: the ladder measured on one GPU (``make gpu-ladder``, kept in chapters/figures/data): each rung's MFU
    against the dense bf16 peak, and where the profiled rung's step went, kernel by kind."""
    import json

    ladder = json.loads(GPU_LADDER.read_text())
    rungs = [r for r in ladder["rungs"] if r.get("tokens_per_s")]
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.35, 1], "wspace": 0.9})
    names = [r["name"] for r in rungs][::-1]
    values = [100 * r["mfu_bf16_peak"] for r in rungs][::-1]
    colours = ["#4C72B0" if r["preset"] == "a100" else "#8172B3" for r in rungs][::-1]
    left.barh(names, values, color=colours)
    for y, (value, r) in enumerate(zip(values, rungs[::-1])):
        left.text(value, y, f" {value:.1f}%  {r['tokens_per_s']:,.0f} tok/s", va="center", fontsize=6.5)
    left.axvline(50, color="#999999", linestyle="--", linewidth=0.8)
    left.set_xlim(0, 75)
    left.set_xlabel("MFU, % of the dense bf16 peak (989 TFLOP/s)", fontsize=7)
    left.tick_params(labelsize=6.5)
    left.set_title(f"the ladder on one {ladder['machine']['gpus'][0]['name']} (torch {ladder['machine']['torch']})",
                   fontsize=7.5)
    kinds = ladder["profile"]["device_time_by_kind"]
    parts = sorted(kinds["seconds"].items(), key=lambda kv: -kv[1])
    right.barh([k.split(" (")[0] for k, _ in parts][::-1], [1e3 * v for _, v in parts][::-1], color="#DD8452")
    for y, (_, v) in enumerate(parts[::-1]):
        right.text(1e3 * v, y, f" {1e3 * v:.1f} ms", va="center", fontsize=6.5)
    right.set_xlim(0, 1e3 * parts[0][1] * 1.35)
    right.set_xlabel("ms of one step on the device", fontsize=7)
    right.tick_params(labelsize=6.5)
    right.set_title(f"where {ladder['profile']['name']}'s step goes ({1e3 * kinds['window_seconds']:.0f} ms, "
                    f"{kinds['kernels']:,} kernels)", fontsize=7.5)


def draw_walls(fig) -> None:
    """Chapter 02: the memory wall (16 bytes a parameter of training state against a GPU's memory, on one GPU and
    sharded over more) and the compute wall (days to train on 20 tokens a parameter at 40% MFU, on 1, 4 and 512
    A100s), by model size, from ``widgets``' functions (the chapter's tables)."""
    import numpy as np

    from distlab import memory
    from labkit import widgets

    sizes = np.logspace(8, 11.5, 60)
    left, right = fig.subplots(1, 2)
    per_param = memory.training_state_bytes(1, "mixed").total
    for gpus, colour in ((1, "black"), (4, RANK_COLOURS[0]), (64, RANK_COLOURS[2])):
        label = "one GPU (DDP: every GPU)" if gpus == 1 else f"sharded over {gpus} GPUs (FSDP)"
        left.plot(sizes, sizes * per_param / gpus / widgets.GIB, color=colour, label=label)
    for gib, name in ((40, "A100-40GB"), (80, "H100-80GB")):
        left.axhline(gib, color="grey", linestyle="--", linewidth=0.8)
        left.text(sizes[0], gib * 1.08, name, fontsize=6.5, color="grey")
    left.set_xscale("log"), left.set_yscale("log")
    left.set_xlabel("parameters", fontsize=7), left.set_ylabel("training state per GPU (GiB)", fontsize=7)
    left.set_title(f"the memory wall: {per_param} bytes a parameter", fontsize=8)
    left.legend(fontsize=6.5, frameon=False, loc="lower right")
    for gpus, colour in ((1, "black"), (4, RANK_COLOURS[0]), (512, RANK_COLOURS[2])):
        days = [widgets.training_days(n, 20 * n, gpus) for n in sizes]
        right.plot(sizes, days, color=colour, label=f"{gpus} A100{'s' if gpus > 1 else ''}")
    right.axhline(30, color="grey", linestyle="--", linewidth=0.8)
    right.text(sizes[0], 36, "a month", fontsize=6.5, color="grey")
    right.set_xscale("log"), right.set_yscale("log")
    right.set_xlabel("parameters", fontsize=7), right.set_ylabel("days (20 tokens a parameter, 40% MFU)", fontsize=7)
    right.set_title("the compute wall: 6 N D FLOPs", fontsize=8)
    right.legend(fontsize=6.5, frameon=False, loc="lower right")
    for ax in (left, right):
        ax.tick_params(labelsize=7)


def draw_tiles_and_halos(fig) -> None:
    """Chapter 10: a 16 x 16 field on a 2 x 2 grid of tiles (``domain.TileGrid``), rank 0's tile with the halo of
    radius 2 it receives from its neighbours (the diagonal tile's corner through the horizontal neighbour); and
    halo cells per tile cell as the ranks grow (``domain.surface_to_volume_rows``), bands against tiles."""
    import numpy as np
    from matplotlib.patches import Rectangle

    from distlab import domain

    grid, radius = domain.TileGrid(2, 2, 16, 16), 2
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
    owner = np.zeros((grid.height, grid.width), dtype=int)
    for rank in range(grid.size):
        rows, cols = grid.tile_slices(rank)
        owner[rows, cols] = rank
    from matplotlib.colors import ListedColormap
    left.imshow(owner, cmap=ListedColormap(RANK_COLOURS), alpha=0.35, vmin=-0.5, vmax=grid.size - 0.5)
    rows, cols = grid.tile_slices(0)
    left.add_patch(Rectangle((cols.start - 0.5, rows.start - 0.5), cols.stop - cols.start, rows.stop - rows.start,
                             fill=False, linewidth=2, edgecolor=RANK_COLOURS[0]))
    halo = Rectangle((cols.start - 0.5, rows.start - 0.5), cols.stop - cols.start + radius,
                     rows.stop - rows.start + radius, fill=False, linewidth=1.5, edgecolor="black", linestyle="--")
    left.add_patch(halo)
    for rank, (x, y) in {1: (11.5, 3.5), 2: (3.5, 11.5), 3: (11.5, 11.5)}.items():
        left.text(x, y, f"rank {rank}", ha="center", va="center", fontsize=8)
    left.text(3.5, 3.5, "rank 0", ha="center", va="center", fontsize=8, fontweight="bold")
    left.annotate(f"rank 0's halo ({radius} cells): from rank 1 (right),\nrank 2 (below), rank 3's corner through rank 1",
                  xy=(8.5, 8.5), xytext=(0, 19.5), fontsize=7, annotation_clip=False,
                  arrowprops={"arrowstyle": "->", "linewidth": 0.8})
    left.set_xticks([]), left.set_yticks([])
    left.set_title("a 16 x 16 field on 2 x 2 tiles", fontsize=8)

    counts = [2, 4, 8, 16, 32, 64, 80, 128]
    table = domain.surface_to_volume_rows(720, 1440, counts, 3)
    for split, label, colour in (("h", "bands (--split h)", RANK_COLOURS[1]), ("hw", "tiles (--split hw)",
                                                                                 RANK_COLOURS[0])):
        points = [(r["ranks"], 100 * r["ratio"]) for r in table if r["split"] == split]
        right.plot(*zip(*points), marker="o", color=colour, label=label)
    right.set_xscale("log", base=2)
    right.set_xticks(counts, [str(c) for c in counts])
    right.set_xlabel("ranks", fontsize=7)
    right.set_ylabel("halo cells per tile cell (%)", fontsize=7)
    right.set_title("720 x 1440 grid, radius 3: communication over computation", fontsize=8)
    right.legend(fontsize=7, frameon=False)
    right.tick_params(labelsize=7)


def expert_dispatch_of_step(step: int = 1, ranks: int = 4, seed: int = 0):
    """The dispatch of ``ep_from_scratch.py``'s defaults at ``step`` (8 experts, top-2, 32 tokens a rank on 4
    ranks), computed by the single-device layer with the script's weights and data: [ranks, ranks] rows."""
    import torch

    from distlab import data, moe

    cfg = moe.MoEConfig()
    torch.manual_seed(seed)
    layer = moe.MoE(cfg)
    x, _ = data.regression_batch(step, 8 * 16, cfg.dim, cfg.dim, seed=seed)
    with torch.no_grad():
        _, chosen, _ = moe.route(layer.router, x, cfg.top_k, cfg.scoring)
    keep = torch.ones_like(chosen, dtype=torch.bool)
    return moe.dispatch_matrix(chosen, keep, ranks, cfg.num_experts // ranks)


def draw_expert_dispatch(fig) -> None:
    """Chapter 13: who sends how many rows to whom in one dispatch, and what each rank then computes."""
    matrix = expert_dispatch_of_step()
    ranks = matrix.shape[0]
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.1, 1]})
    left.imshow(matrix.numpy(), cmap="Blues")   # a NumPy array: matplotlib asks torch 2.14 for copy=False
    for i in range(ranks):
        for j in range(ranks):
            left.text(j, i, int(matrix[i, j]), ha="center", va="center", fontsize=8,
                      color="black" if i != j else "#8a1c1c", fontweight="bold" if i == j else "normal")
    left.set_xticks(range(ranks), [f"rank {j}\n(experts {2 * j},{2 * j + 1})" for j in range(ranks)], fontsize=6.5)
    left.set_yticks(range(ranks), [f"rank {i}" for i in range(ranks)], fontsize=7)
    left.set_xlabel("to (the rank of the expert)", fontsize=7)
    left.set_ylabel("from (the rank of the token)", fontsize=7)
    left.set_title("rows dispatched (diagonal: stays on the rank)", fontsize=8)
    computed = matrix.sum(dim=0).tolist()
    mean = sum(computed) / ranks
    right.bar(range(ranks), computed, color=[RANK_COLOURS[r % len(RANK_COLOURS)] for r in range(ranks)])
    right.axhline(mean, color="black", linestyle="--", linewidth=1)
    right.text(ranks - 0.5, mean, " mean", va="bottom", ha="right", fontsize=7)
    right.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=7)
    right.set_ylabel("rows its experts compute", fontsize=7)
    right.set_title(f"the busiest rank: {max(computed) / mean:.2f} x the mean", fontsize=8)
    right.tick_params(axis="y", labelsize=7)
    fig.suptitle("one dispatch of ep_from_scratch.py (8 experts, top-2, 32 tokens a rank, step 1), from the "
                 "single-device routing", fontsize=9)


FIGURES = {
    "01_training_memory.png": (draw_training_memory, (9, 2.6)),
    "01_gpu_ladder.png": (draw_gpu_ladder, (10, 2.8)),
    "02_walls.png": (draw_walls, (9, 3.2)),
    "03_ring_allreduce.png": (draw_ring_allreduce, (10, 2.3)),
    "04_ddp_overlap.png": (draw_ddp_overlap, (9, 2.8)),
    "05_zero_stages.png": (draw_zero_stages, (8, 3.2)),
    "05_zero3_memory.png": (draw_zero3_memory, (9, 3.2)),
    "05_zero3_prefetch.png": (draw_zero3_prefetch, (9, 2.6)),
    "06_column_row_split.png": (draw_tensor_parallel_split, (9, 2.8)),
    "08_sequence_parallel_regions.png": (draw_sequence_parallel_regions, (11, 2.0)),
    "08_ring_attention_blocks.png": (draw_ring_attention_blocks, (8, 3.6)),
    "09_mesh_two_nodes.png": (draw_mesh_two_nodes, (9, 2.6)),
    "09_mesh_3d.png": (draw_mesh_3d, (9, 3.4)),
    "09_hybrid_step_timeline.png": (draw_hybrid_step_timeline, (9, 2.8)),
    "09_zero_with_pipeline.png": (draw_zero_with_pipeline, (9, 4.6)),
    "09_sizing_chart.png": (draw_sizing_chart, (8, 3.4)),
    "10_tiles_and_halos.png": (draw_tiles_and_halos, (9, 3.4)),
    "11_predicted_vs_published.png": (draw_predicted_vs_published, (9.5, 5)),
    "12_hang.png": (draw_hang, (9, 2.8)),
    "12_fault_drill.png": (draw_fault_drill, (8, 3.0)),
    "13_expert_dispatch.png": (draw_expert_dispatch, (9, 3.2)),
}


# ---- chapter 14: broken runs, as a user sees them (measured by labkit.broken_runs, kept in chapters/figures/data) --

BROKEN_DATA_PARALLEL = FIGURE_DATA / "14_data_parallel_losses.json"
BROKEN_BF16 = FIGURE_DATA / "14_bf16_reduction.json"
BROKEN_BUBBLE = FIGURE_DATA / "14_pipeline_bubble.json"
BROKEN_STRAGGLER = FIGURE_DATA / "14_straggler_vs_hang.json"
DATA_PARALLEL_CASES = ("same-samples-every-rank", "no-set-epoch", "accumulation-never-syncs")
BF16_WORLD_SIZES = (2, 4, 8)


def _write_measurement(path, kept: dict) -> Path:
    import json

    Path(path).write_text(json.dumps(kept, indent=1) + "\n")
    return Path(path)


def measure_data_parallel_losses(path=BROKEN_DATA_PARALLEL) -> Path:
    """Run train_ddp.py as chapter 14's registry does: the correct run, then each of the data and DDP cases; keep
    every rank's loss per step, the global loss and its distance from the single device trained beside it."""
    from labkit import broken_runs

    runs = {}
    for name in (None, *DATA_PARALLEL_CASES):
        run = broken_runs.case(name or DATA_PARALLEL_CASES[0])
        metrics = broken_runs.run_case(run.name, fixed=name is None, stream=False).metrics
        runs[name or "correct"] = {"argv": list(run.fixed_args if name is None else run.args),
                                   "rank_losses": metrics["extra"]["rank_losses"], "losses": metrics["losses"],
                                   "from_one_device": metrics["extra"]["diffs"]["baseline_loss"]}
    return _write_measurement(path, {"script": broken_runs.TRAIN_DDP, "runs": runs})


def draw_data_parallel_losses(fig) -> None:
    """Chapter 14: what the data and DDP cases look like in the losses per rank: the correct run, every rank on the
    same samples, accumulation that never synchronises, and a sampler whose epoch is never set."""
    import json

    runs = json.loads(BROKEN_DATA_PARALLEL.read_text())["runs"]
    one_device = runs["correct"]["losses"]   # the correct run equals one device (tested)
    axes = fig.subplots(1, 4, sharey=False)
    titles = {"correct": "correct: four ranks, four losses",
              "same-samples-every-rank": "same-samples-every-rank:\nfour ranks, one loss",
              "accumulation-never-syncs": "accumulation-never-syncs:\nthe ranks drift apart"}
    for ax, name in zip(axes[:3], ("correct", "same-samples-every-rank", "accumulation-never-syncs")):
        per_rank = list(zip(*runs[name]["rank_losses"]))
        steps = range(len(per_rank[0]))
        for rank, losses in enumerate(per_rank):
            ax.plot(steps, losses, marker="o", markersize=3, linewidth=1, color=RANK_COLOURS[rank],
                    label=f"rank {rank}")
        ax.plot(steps, one_device, color="black", linestyle="--", linewidth=1, label="one device")
        ax.set_title(titles[name], fontsize=7.5)
        ax.set_xlabel("step", fontsize=7)
        ax.tick_params(labelsize=6.5)
    axes[0].set_ylabel("loss", fontsize=7)
    axes[0].legend(fontsize=6, frameon=False)
    low = min(min(min(r) for r in runs[n]["rank_losses"]) for n in titles)
    high = max(max(max(r) for r in runs[n]["rank_losses"]) for n in titles)
    for ax in axes[:3]:
        ax.set_ylim(min(low, min(one_device)) - 0.05, high + 0.05)
    ax = axes[3]
    floor = 1e-8   # a distance of exactly 0 drawn at the floor (a log scale has no 0)
    for name, style in (("correct", dict(color="grey", linewidth=3, alpha=0.6)),
                        ("no-set-epoch", dict(color="#d62728", linewidth=1, linestyle="--"))):
        gaps = [max(gap, floor) for gap in runs[name]["from_one_device"]]
        ax.semilogy(range(len(gaps)), gaps, marker="o", markersize=3, label=name, **style)
    ax.axvline(3.5, color="grey", linewidth=0.8, linestyle=":")
    ax.text(3.45, 3e-3, "epoch 2 ", fontsize=6.5, color="grey", ha="right")
    ax.set_ylim(floor / 2, 1)
    ax.set_title("no-set-epoch: |loss - one device's|,\nfp32 rounding until the epoch turns", fontsize=7.5)
    ax.set_xlabel("step", fontsize=7)
    ax.tick_params(labelsize=6.5)
    ax.legend(fontsize=6, frameon=False, loc="upper left")
    fig.tight_layout()


def measure_bf16_reduction(path=BROKEN_BF16) -> Path:
    """Run train_fsdp.py with the gradients reduced in fp32 (the fix) and in bf16 (the case) on 2, 4 and 8 CPU
    ranks; keep each run's step-0 gradient distance from one device and its reduce-scatter bytes per step."""
    from labkit import broken_runs, launch

    run = broken_runs.case("bf16-gradient-reduction")
    rows = []
    for world in BF16_WORLD_SIZES:
        for reduce_dtype, args in (("fp32", run.fixed_args), ("bf16", run.args)):
            metrics = launch.run(run.script, nproc=world, args=list(args), stream=False, check=False).metrics
            checks = {c["name"]: c for c in metrics["checks"]}
            gradient = next(c for name, c in checks.items() if name.startswith("step-0 gradients"))
            scatter = next(c for name, c in checks.items() if name.startswith("reduce_scatter bytes per step"))
            rows.append({"world_size": world, "reduce_dtype": reduce_dtype, "argv": list(args),
                         "gradient_diff": gradient["value"], "gradient_passed": gradient["passed"],
                         "reduce_scatter_bytes": scatter["value"]})
    return _write_measurement(path, {"script": run.script, "rows": rows})


def draw_bf16_reduction(fig) -> None:
    """Chapter 14: the step-0 gradients' largest distance from one device, gradients reduced in fp32 or in bf16,
    on 2, 4 and 8 ranks (``BROKEN_BF16``'s data)."""
    import json

    rows = json.loads(BROKEN_BF16.read_text())["rows"]
    ax = fig.subplots()
    worlds = sorted({r["world_size"] for r in rows})
    for offset, (dtype, colour) in zip((-0.2, 0.2), (("fp32", "#1f77b4"), ("bf16", "#d62728"))):
        values = [next(r["gradient_diff"] for r in rows if r["world_size"] == w and r["reduce_dtype"] == dtype)
                  for w in worlds]
        bars = ax.bar([i + offset for i in range(len(worlds))], values, width=0.38, color=colour,
                      label=f"gradients reduced in {dtype}")
        for bar, value in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, value * 1.3, f"{value:.1e}", ha="center", fontsize=6.5)
    ax.set_yscale("log")
    ax.set_ylim(1e-9, 3e-2)
    ax.set_xticks(range(len(worlds)), [f"{w} ranks" for w in worlds], fontsize=7)
    ax.set_ylabel("largest |gradient - one device's|, step 0", fontsize=7)
    ax.tick_params(axis="y", labelsize=6.5)
    ax.legend(fontsize=6.5, frameon=False, loc="upper left", ncol=2)
    ax.set_title("train_fsdp.py, tiny model: a bf16 reduction sits four orders of magnitude above fp32 rounding",
                 fontsize=8)


def measure_pipeline_bubble(path=BROKEN_BUBBLE) -> Path:
    """Run pp_schedules.py as the registry's too-few-microbatches case does, broken (2 microbatches on 4 stages)
    and fixed (8); keep the measured timeline of the median step and the bubble, measured and by formula."""
    from labkit import broken_runs

    run = broken_runs.case("too-few-microbatches")
    runs = []
    for fixed in (False, True):
        metrics = broken_runs.run_case(run.name, fixed=fixed, stream=False).metrics
        runs.append({"argv": list(run.fixed_args if fixed else run.args),
                     "microbatches": metrics["extra"]["microbatches"], "stages": metrics["extra"]["ranks"],
                     "bubble": {k: metrics["extra"]["bubble"][k] for k in ("measured", "formula")},
                     "timeline": metrics["timeline"]})
    return _write_measurement(path, {"script": run.script, "runs": runs})


def draw_pipeline_bubble(fig) -> None:
    """Chapter 14: GPipe on 4 stages with 2 microbatches, then 8: the measured timelines on one time axis."""
    import json

    from distlab import gantt

    runs = json.loads(BROKEN_BUBBLE.read_text())["runs"]
    axes = fig.subplots(len(runs), 1)
    longest = max(max(e["end"] for e in r["timeline"]) - min(e["start"] for e in r["timeline"]) for r in runs)
    for ax, run in zip(axes, runs):
        gantt.plot_gantt(run["timeline"], ax=ax, time_unit="s",
                         title=f"M = {run['microbatches']} microbatches on {run['stages']} stages (formula "
                               f"{100 * run['bubble']['formula']:.0f}%), measured")
        ax.set_xlim(0, longest)
        ax.title.set_fontsize(8)
        ax.tick_params(labelsize=6.5)
        ax.xaxis.label.set_fontsize(7)
        ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()


def measure_straggler_vs_hang(path=BROKEN_STRAGGLER) -> Path:
    """Run the registry's slow-rank case (profile_step.py, one rank late every step) and its uneven-inputs hang
    (deadlocks.py); keep each rank's profiled time by kind, and the hang's journals and diagnosis."""
    from labkit import broken_runs

    slow = broken_runs.case("slow-rank")
    metrics = broken_runs.run_case(slow.name, stream=False).metrics
    ranks = [{"rank": r["rank"], "before_sync_seconds": r["before_sync_seconds"],
              **{k: r["kinds"][k] for k in ("compute", "communication", "overlapped", "idle", "window_seconds",
                                            "steps")}} for r in metrics["extra"]["ranks"]]
    hang = broken_runs.case("uneven-inputs")
    extra = broken_runs.run_case(hang.name, stream=False).metrics["extra"]
    kept = {"slow": {"script": slow.script, "argv": list(slow.args), "ranks": ranks},
            "hang": {"script": hang.script, "argv": list(hang.args), "cause": extra["cause"],
                     "verdict": extra["verdict"], "journals": extra["journals"]}}
    return _write_measurement(path, kept)


def draw_straggler_vs_hang(fig) -> None:
    """Chapter 14: a straggler (every rank's profiled steps by kind: the slow rank computing, the others waiting in
    communication, every step done) beside a hang (each rank's journal: three stuck, one finished)."""
    import json

    run = json.loads(BROKEN_STRAGGLER.read_text())
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.2]})
    ranks = run["slow"]["ranks"]
    bottom = [0.0] * len(ranks)
    for kind, colour in (("compute", "#4C72B0"), ("overlapped", "#8172B3"), ("communication", "#DD8452"),
                         ("idle", "#cccccc")):
        values = [1e3 * r[kind] / r["steps"] for r in ranks]
        left.bar([r["rank"] for r in ranks], values, bottom=bottom, color=colour, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    left.set_xticks([r["rank"] for r in ranks], [f"rank {r['rank']}" for r in ranks], fontsize=7)
    left.set_ylabel("ms a step, profiled", fontsize=7)
    left.tick_params(axis="y", labelsize=6.5)
    left.set_ylim(0, 1.3 * max(bottom))
    left.legend(fontsize=6, frameon=False, loc="upper center", ncol=4)
    left.set_title("slow-rank: every step completes, late;\nthe others wait in communication", fontsize=7.5)
    journals = {int(r): j for r, j in run["hang"]["journals"].items()}
    longest = max(len(j["calls"]) for j in journals.values())
    draw_journals(right, journals, lambda i, call: f"#{i + 1}",
                  lambda journal: "  finished: no batch left" if journal["state"] == "finished" else None)
    right.set_xlim(0, longest + 2.4)
    right.set_xticks([])
    right.set_xlabel("each rank's calls (grey: completed; red: waiting at the timeout)", fontsize=7)
    right.set_title("uneven-inputs: a hang; three ranks wait until the timeout,\none has left the loop", fontsize=7.5)
    fig.tight_layout()


FIGURES.update({
    "14_data_parallel_losses.png": (draw_data_parallel_losses, (11, 2.8)),
    "14_bf16_reduction.png": (draw_bf16_reduction, (7, 2.8)),
    "14_pipeline_bubble.png": (draw_pipeline_bubble, (9, 3.6)),
    "14_straggler_vs_hang.png": (draw_straggler_vs_hang, (9, 2.8)),
})


BROKEN_RESUMES = FIGURE_DATA / "14_resumes.json"


def measure_resumes(path=BROKEN_RESUMES) -> Path:
    """Run the registry's two resumes gone wrong, broken and fixed: checkpoint_resume.py's checkpoint of one shard
    (FSDP) and fault_drill.py's resume without the random state and the data position; keep each run's losses by
    step, where it resumed, and the failing check's value (the jump)."""
    from labkit import broken_runs

    def jump(metrics, prefix):
        return next(c["value"] for c in metrics["checks"] if c["name"].startswith(prefix))

    one_shard = broken_runs.case("checkpoint-one-shard")
    shard = {}
    for fixed in (False, True):
        metrics = broken_runs.run_case(one_shard.name, fixed=fixed, stream=False).metrics
        extra = metrics["extra"]
        shard["fixed" if fixed else "broken"] = {"argv": list(one_shard.fixed_args if fixed else one_shard.args),
                                                 "losses_by_step": extra["losses_by_step"]}
        shard.update(uninterrupted=extra["uninterrupted_losses"], earlier=extra["earlier_losses"],
                     first_step=extra["first_step"])
        if not fixed:
            shard["jump"] = jump(metrics, "losses = uninterrupted single-device run")
    rng_case = broken_runs.case("resume-without-rng")
    rng = {}
    for fixed in (False, True):
        metrics = broken_runs.run_case(rng_case.name, fixed=fixed, stream=False).metrics
        rng["fixed" if fixed else "broken"] = {"argv": list(rng_case.fixed_args if fixed else rng_case.args),
                                               "losses": metrics["losses"]}
        rng.update(died_at_step=metrics["extra"]["died_at_step"],
                   steps_trained_twice=metrics["extra"]["steps_trained_twice"])
        if not fixed:
            rng["jump"] = jump(metrics, "a step trained twice gives the same loss both times")
    return _write_measurement(path, {"checkpoint-one-shard": shard, "resume-without-rng": rng})


def draw_resumes(fig) -> None:
    """Chapter 14: two resumes gone wrong as their losses show them, beside the right resume: a checkpoint of one
    FSDP shard (the loss jumps at the resume) and a checkpoint without the random state and the data position
    (the losses leave one device's at the resume)."""
    import json

    run = json.loads(BROKEN_RESUMES.read_text())
    left, right = fig.subplots(1, 2)
    shard = run["checkpoint-one-shard"]
    steps = range(len(shard["uninterrupted"]))
    left.plot(steps, shard["uninterrupted"], color="grey", linewidth=3, alpha=0.6, label="one device, uninterrupted")
    left.plot([int(k) for k in shard["earlier"]], list(shard["earlier"].values()), marker="o", markersize=3,
              color="#1f77b4", label="before the interruption")
    for name, colour, style in (("fixed", "#2ca02c", "-"), ("broken", "#d62728", "--")):
        by_step = shard[name]["losses_by_step"]
        left.plot([int(k) for k in by_step], list(by_step.values()), marker="o", markersize=3, color=colour,
                  linestyle=style, label="resumed from DCP" if name == "fixed" else "resumed from rank 0's shard")
    left.axvline(shard["first_step"] - 0.5, color="grey", linewidth=0.8, linestyle=":")
    left.annotate(f"checkpoint after step {shard['first_step'] - 1}:\nstep {shard['first_step']} trained again",
                  xy=(shard["first_step"] - 0.45, 0.97), xycoords=("data", "axes fraction"), va="top", fontsize=6,
                  color="grey")
    left.set_title(f"checkpoint-one-shard: the loss jumps by {shard['jump']:.2f} at the resume", fontsize=7.5)
    rng = run["resume-without-rng"]
    for name, colour, style, label in (("fixed", "grey", "-", "resumed with the full state (= one device)"),
                                       ("broken", "#d62728", "--", "resumed without the RNG and data position")):
        losses = rng[name]["losses"]
        right.plot(range(len(losses)), losses, marker="o", markersize=3, color=colour, linestyle=style, label=label,
                   linewidth=3 if name == "fixed" else 1, alpha=0.6 if name == "fixed" else 1)
    resumed = min(rng["steps_trained_twice"])
    right.axvline(resumed - 0.5, color="grey", linewidth=0.8, linestyle=":")
    right.annotate(f"checkpoint after step {resumed - 1}:\nstep {resumed} trained again", xy=(resumed - 0.45, 0.97),
                   xycoords=("data", "axes fraction"), va="top", fontsize=6, color="grey")
    # the step's first training, before the kill: both runs' first attempts are the same run (the fixed run's loss)
    right.plot([resumed], [rng["fixed"]["losses"][resumed]], marker="o", markersize=6, markerfacecolor="none",
               markeredgecolor="black", linestyle="none", label=f"step {resumed}, first training (before the kill)")
    right.set_title(f"resume-without-rng: a step trained twice, {rng['jump']:.2f} apart", fontsize=7.5)
    from matplotlib.ticker import MaxNLocator

    for ax in (left, right):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step (dotted: the checkpoint the run resumed from)", fontsize=7)
        ax.tick_params(labelsize=6.5)
        ax.legend(fontsize=6, frameon=False, loc="lower left")
    left.set_ylabel("loss", fontsize=7)
    fig.tight_layout()


FIGURES["14_resumes.png"] = (draw_resumes, (9, 2.8))


def _gather_chapter_drawings() -> None:
    """Add each chapter's pictures of its mechanisms (``coursetools/drawings/chNN.py``) to ``FIGURES``."""
    import importlib
    import pkgutil

    from coursetools import drawings

    for module in sorted(m.name for m in pkgutil.iter_modules(drawings.__path__)):
        for name, entry in importlib.import_module(f"coursetools.drawings.{module}").FIGURES.items():
            if name in FIGURES:
                raise ValueError(f"two generators draw {name}")
            FIGURES[name] = entry


if __name__ != "__main__":   # run as a script, this file hands over to coursetools.figures (below)
    _gather_chapter_drawings()


def render(name: str, folder) -> Path:
    """Draw one figure of ``FIGURES`` into ``folder``; returns the file written."""
    from matplotlib.figure import Figure  # no pyplot: no backend is chosen, nothing global changes

    draw, size = FIGURES[name]
    fig = Figure(figsize=size)
    draw(fig)
    path = Path(folder) / name
    fig.savefig(path, dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", nargs="?", default="chapters/figures")
    parser.add_argument("names", nargs="*", help="figures to draw (default: all)")
    options = parser.parse_args(argv)
    folder = Path(options.folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in options.names or FIGURES:
        print(f"wrote {render(name, folder)}")
    return 0


if __name__ == "__main__":
    # run as coursetools.figures, the module the drawings import (run as __main__, this file would be a second copy)
    from coursetools import figures

    sys.exit(figures.main())
