"""The planner in the notebook (chapter 11): memory bars per GPU against the GPU's line, the ranked table, the
prediction beside a measured run, and an ipywidgets explorer over ``distlab.planner``.

Every function but :func:`planner_explorer` is pure (no widgets, no display): the tests call them headless.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab import models, planner

GIB = planner.GIB
PARTS = ("params", "grads", "optimizer", "activations", "temporary", "reserve")
COLOURS = {"params": "#1f77b4", "grads": "#ff7f0e", "optimizer": "#2ca02c", "activations": "#d62728",
           "temporary": "#9467bd", "reserve": "#7f7f7f"}


def memory_parts_gib(plan: planner.Plan) -> dict:
    """GiB per GPU of each part of a valid plan (derived)."""
    return {part: plan.memory_per_gpu_bytes[part] / GIB for part in PARTS}


def draw_memory_bars(plans, ax=None, title: str = ""):
    """One stacked horizontal bar per plan (its parts in GiB), and the GPU's memory as a vertical line."""
    import matplotlib.pyplot as plt

    plans = [p for p in plans if not p.problems]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.45 * len(plans) + 1.2))
    for row, plan in enumerate(plans):
        left = 0.0
        for part, gib in memory_parts_gib(plan).items():
            ax.barh(row, gib, left=left, color=COLOURS[part], label=part if row == 0 else None)
            left += gib
    if plans:
        ax.axvline(plans[0].gpu_bytes / GIB, color="black", linestyle="--", label="GPU memory")
    ax.set_yticks(range(len(plans)), [p.layout.label() for p in plans])
    ax.invert_yaxis()
    ax.set_xlabel("GiB per GPU (derived)")
    ax.set_title(title)
    # outside the axes, to the right: inside, it covered the ends of the longest bars
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
    if ax.figure is not None:
        ax.figure.tight_layout()
    return ax


def ranked_table_markdown(plans, top: int = 10) -> str:
    """The search's best ``top`` layouts that fit, as markdown."""
    lines = ["| # | layout | GiB per GPU | step s | tokens/s | MFU | bubble |", "|---:|---|---:|---:|---:|---:|---:|"]
    for i, plan in enumerate([p for p in plans if p.fits][:top], 1):
        lines.append(f"| {i} | {plan.layout.label()} | {plan.memory_per_gpu_bytes['total'] / GIB:.1f} | "
                     f"{plan.step_seconds:.3g} | {plan.tokens_per_second:,.0f} | {plan.mfu:.1%} | "
                     f"{plan.bubble['of_step']:.1%} |")
    return "\n".join(lines)


SEQUENCE_LENGTHS = ("preset", 8192, 32768, 131072)


def with_sequence_length(spec: planner.ModelSpec, seq_len) -> planner.ModelSpec:
    """``spec`` at ``seq_len`` tokens a sequence ("preset": unchanged), with the tokens of a step kept (fewer,
    longer sequences, as LLaMA 3's 128K stage kept its 16M tokens a step)."""
    if seq_len == "preset" or seq_len == spec.seq_len:
        return spec
    tokens = spec.global_batch * spec.seq_len
    return planner.replace(spec, seq_len=seq_len, global_batch=max(1, tokens // seq_len))


def explorer_view(model: str, cluster: str, gpus: int, zero_stage=None, activation_checkpointing=None,
                  sequence_parallel=None, top: int = 6, seq_len="preset") -> tuple[list, str]:
    """What the explorer shows for one setting: the plans to draw (the best ``top`` that fit, or the closest
    that do not) and a markdown text (the ranked table, or why nothing fits). ``activation_checkpointing`` and
    ``sequence_parallel`` None: the search chooses (as ``planner.Options``)."""
    options = planner.Options(zero_stage=zero_stage, activation_checkpointing=activation_checkpointing,
                              sequence_parallel=sequence_parallel)
    spec, machine = with_sequence_length(planner.MODELS[model], seq_len), planner.CLUSTERS[cluster]
    problems = [] if gpus >= 1 else [f"GPUs must be at least 1, not {gpus}"]
    plans = planner.search(spec, machine, gpus, options) if not problems else []
    fitting = [p for p in plans if p.fits]
    if fitting:
        return fitting[:top], ranked_table_markdown(plans, top)
    valid = sorted((p for p in plans if not p.problems), key=lambda p: p.memory_per_gpu_bytes["total"])
    reason = problems[0] if problems else (f"nothing fits on {gpus} x {cluster}; the closest: {valid[0].reason}"
                                           if valid else f"no valid layout of {gpus} GPUs")
    return valid[:top], f"**{reason}**"


def planner_explorer(model: str = "70b", cluster: str = "h100-80gb", gpus: int = 64):
    """ipywidgets: model, cluster, GPUs and options in; memory bars per GPU and the ranked table out."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import Markdown, display

    def show(model, cluster, gpus, seq_len, zero, checkpointing, sequence_parallel):
        plans, text = explorer_view(model, cluster, gpus, None if zero == "search" else int(zero),
                                    None if checkpointing == "search" else checkpointing,
                                    {"auto": None, "on": True, "off": False}[sequence_parallel], seq_len=seq_len)
        if plans:
            draw_memory_bars(plans, title=f"{model} on {gpus} x {cluster}, {seq_len} tokens a sequence")
            plt.show()
        display(Markdown(text))

    from labkit import widgets as course_widgets

    if course_widgets.static_pages():   # the website: the first view, no controls
        display(course_widgets.static_view(""))
        show(model, cluster, gpus, SEQUENCE_LENGTHS[0], "search", "search", "auto")
        return None
    # each control opens on the value this call asked for (a bare list would open on its first option)
    return widgets.interact(show, model=widgets.Dropdown(options=list(planner.MODELS), value=model),
                            cluster=widgets.Dropdown(options=list(planner.CLUSTERS), value=cluster),
                            gpus=widgets.IntText(value=gpus, description="GPUs"), seq_len=list(SEQUENCE_LENGTHS),
                            zero=["search", "0", "1", "2", "3"],
                            checkpointing=["search", "full", "selective", "none"],
                            sequence_parallel=["auto", "on", "off"])


# ---- the prediction beside a measured run (fsdp_tp_hybrid.py of chapter 09) ------------------------------


def predicted_vs_measured(run_metrics: dict, dp: int, tp: int) -> list[dict]:
    """Rows ``{what, predicted, measured}``: one rank's parameters, gradients and optimizer state, and each mesh
    dimension's bytes per collective, for a ``fsdp_tp_hybrid.py`` run, beside the planner's prediction for the
    same model and layout (the planner never reads the measurement)."""
    config = run_metrics["config"]
    cfg = models.preset(config["preset"], seq_len=config["seq_len"])
    spec = planner.from_config(cfg, micro_batch=config["batch"] // dp, global_batch=config["batch"])
    layout = planner.Layout(tp=tp, dp=dp, zero_stage=3)
    options = planner.Options(zero_stage=3, precision="fp32", activation_checkpointing=False, reserve_bytes=0,
                              reshard_after_forward=config.get("reshard_after_forward", True),
                              sequence_parallel=config.get("sequence_parallel", False))
    state = planner.state_bytes(spec, layout, 0, options)
    measured = run_metrics["memory"]["measured"]
    rows = [{"what": f"{part} bytes per rank", "predicted": int(getattr(state, part)), "measured": measured[part]}
            for part in ("params", "grads", "optimizer")]
    predicted_comm = planner.comm_per_step(spec, layout, 0, options)
    for dimension in ("tp", "dp"):
        measured_comm = {}
        for row in run_metrics["comm"]:
            if row.get("dimension") == dimension:
                measured_comm[row["collective"]] = measured_comm.get(row["collective"], 0) + row["measured_bytes"]
        for collective in sorted(set(measured_comm) | set(predicted_comm[dimension])):
            rows.append({"what": f"{dimension} {collective} bytes per step",
                         "predicted": int(predicted_comm[dimension].get(collective, 0)),
                         "measured": measured_comm.get(collective, 0)})
    return rows


def rows_markdown(rows) -> str:
    lines = ["| | planner (derived) | measured | equal |", "|---|---:|---:|---|"]
    for r in rows:
        equal = "yes" if r["predicted"] == r["measured"] else "NO"
        lines.append(f"| {r['what']} | {r['predicted']:,} | {r['measured']:,} | {equal} |")
    return "\n".join(lines)


# ---- the exercises' verdicts -------------------------------------------------------------------------------


@dataclass
class Verdict:
    ok: bool | None  # None: not answered yet
    message: str


def layout_verdict(layout, model: str = "70b", cluster: str = "h100-80gb", gpus: int = 64,
                   within: float = 0.9) -> Verdict:
    """Is ``layout`` (a planner.Layout) a good answer: valid, fits, and within ``within`` of the best
    throughput the search finds? The message says what the planner thinks of it either way."""
    if layout is None:
        return Verdict(None, "")
    if not isinstance(layout, planner.Layout):
        return Verdict(False, f"write the answer as planner.Layout(tp=..., pp=..., dp=..., zero_stage=...), "
                              f"not {type(layout).__name__}")
    spec, machine = planner.MODELS[model], planner.CLUSTERS[cluster]
    plan = planner.tune(spec, machine, layout, planner.Options(), gpus)
    best = planner.search(spec, machine, gpus)[0]
    if not plan.fits:
        return Verdict(False, f"{layout.label()} {plan.reason if plan.problems else 'does not fit: ' + plan.reason}")
    share = plan.tokens_per_second / best.tokens_per_second
    # one decimal, so that a share just under the bar (89.8 %) never reads as the bar itself; the best layout is
    # named only to a layout that reaches the bar, never to one that must look further
    if share >= within:
        return Verdict(True, f"{layout.label()} fits; it reaches {share:.1%} of the best layout's throughput "
                             f"({best.layout.label()})")
    return Verdict(False, f"{layout.label()} fits; it reaches {share:.1%} of the best layout's throughput; aim for "
                          f"{within:.0%}")
