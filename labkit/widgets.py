"""Interactive explorers for the notebooks, over pure functions that are tested without a browser.

Chapter 02's "does it fit?" explorer asks two questions of a model size and a cluster:

* **memory**: does the training state (weights, gradients, AdamW state: 16 bytes per parameter in mixed
  precision, ``distlab.memory``) fit on each GPU, replicated (DDP) or sharded (ZeRO-1/2/3, FSDP)?
* **compute**: how long do ``6 N D`` FLOPs take (N parameters, D tokens) on those GPUs at a given MFU?

Everything that decides an answer is a plain function here (``fit``, ``min_gpus_to_fit``,
``largest_model_that_fits``, ``training_days``, ``explorer_html``); ``does_it_fit_explorer()`` only wires
ipywidgets to them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from distlab import memory, metrics

GB = 1e9  # 10^9 bytes: bandwidths, bytes on the wire, "7B parameters" (chapters/00_conventions.md)
GIB = memory.GIB  # 2^30 bytes: memory capacity and memory use. An A100 "40GB" has 40 GiB (40,960 MiB).

# Memory as sold, counted in GiB as the cards report it (an A100-40GB shows 40,960 MiB); the names keep the
# vendors' spelling. Peak FLOP/s come from distlab.metrics.peak_flops.
GPUS = {"A100-40GB": 40 * GIB, "A100-80GB": 80 * GIB, "H100-80GB": 80 * GIB, "H200-141GB": 141 * GIB}

# The explorer's model sizes: every size the chapter's tables use, so it can start exactly at one of them.
EXPLORER_SIZES_B = (0.1, 0.125, 0.35, 0.5, 1, 1.3, 2, 3, 7, 8, 13, 20, 30, 34, 40, 65, 70, 100, 175, 405, 1000)

MODEL_SIZES = {"1B": 1e9, "7B": 7e9, "13B": 13e9, "70B": 70e9}

STRATEGIES = {0: "replicated (DDP)", 1: "ZeRO-1 (optimizer sharded)", 2: "ZeRO-2 (+ gradients sharded)",
              3: "ZeRO-3 / FSDP (everything sharded)"}

TRAINING_BYTES_PER_PARAM = 16  # mixed-precision AdamW: 2 weights + 2 grads + 4 master + 8 moments


def bytes_per_param(zero_stage: int) -> tuple[float, float]:
    """(replicated, sharded) bytes per parameter of the training state under ZeRO stage 0..3.

    Each GPU holds ``replicated + sharded / gpus`` bytes per parameter. Read off
    ``memory.zero_state_bytes`` (stage 0: (16, 0); 1: (4, 12); 2: (2, 14); 3: (0, 16)).
    """
    one = memory.zero_state_bytes(1, 1, zero_stage).total
    two = memory.zero_state_bytes(1, 2, zero_stage).total
    sharded = 2 * (one - two)
    return one - sharded, sharded


def state_bytes_per_gpu(num_params: float, gpus: int = 1, zero_stage: int = 0) -> float:
    """Training-state bytes on each GPU (mixed-precision AdamW), ``memory.zero_state_bytes``' total."""
    return memory.zero_state_bytes(num_params, gpus, zero_stage).total


@dataclass(frozen=True)
class Fit:
    """One answer of the explorer: what each GPU must hold, and whether it can."""

    num_params: float
    gpus: int
    zero_stage: int
    gpu_bytes: float
    state_bytes: float  # per GPU
    activation_bytes: float  # per GPU, as given
    fits: bool

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def fraction_used(self) -> float:
        return self.total_bytes / self.gpu_bytes


def fit(num_params: float, gpus: int = 1, gpu_bytes: float = GPUS["A100-40GB"], zero_stage: int = 0,
        activation_bytes: float = 0.0) -> Fit:
    """Does training a ``num_params`` model fit on ``gpus`` GPUs of ``gpu_bytes`` each?"""
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, not {gpus}")
    state = state_bytes_per_gpu(num_params, gpus, zero_stage)
    return Fit(num_params, gpus, zero_stage, gpu_bytes, state, activation_bytes,
               state + activation_bytes <= gpu_bytes)


def min_gpus_to_fit(num_params: float, gpu_bytes: float = GPUS["A100-40GB"], zero_stage: int = 3,
                    activation_bytes: float = 0.0) -> int | None:
    """The fewest GPUs on which the model's training state fits; None when no number of GPUs is enough.

    Replicated state (DDP, stage 0) does not shrink with more GPUs; the replicated part of ZeRO-1/2 does not
    either, so a model too big for it fits on no number of GPUs.
    """
    replicated, sharded = bytes_per_param(zero_stage)
    room = gpu_bytes - activation_bytes - replicated * num_params
    if room < 0 or (room == 0 and sharded > 0):
        return None
    if sharded == 0:
        return 1
    return max(1, math.ceil(sharded * num_params / room - 1e-9))


def largest_model_that_fits(gpus: int = 1, gpu_bytes: float = GPUS["A100-40GB"], zero_stage: int = 0,
                            activation_bytes: float = 0.0) -> float:
    """The most parameters whose training state (plus ``activation_bytes`` per GPU) fits on ``gpus`` GPUs."""
    replicated, sharded = bytes_per_param(zero_stage)
    return max(0.0, gpu_bytes - activation_bytes) / (replicated + sharded / gpus)


def training_flops(num_params: float, tokens: float) -> float:
    """``6 N D``: 2 FLOPs per multiply-add x 3 (forward, backward for inputs, backward for weights)."""
    return 6 * num_params * tokens


def training_days(num_params: float, tokens: float, gpus: int = 1, gpu: str = "A100-40GB", mfu: float = 0.4,
                  dtype: str = "bf16") -> float:
    """Days to train on ``tokens`` tokens when each GPU sustains ``mfu`` of its peak FLOP/s."""
    peak = metrics.peak_flops(gpu, dtype)
    if peak is None:
        raise ValueError(f"no peak FLOP/s known for {gpu!r}")
    return training_flops(num_params, tokens) / (gpus * peak * mfu) / 86400


def fit_table(gpu: str = "A100-40GB", gpus: int = 1, zero_stage: int = 0, models: dict | None = None,
              tokens_per_param: float = 20, mfu: float = 0.4) -> list[dict]:
    """One row per model size: state per GPU, fits?, the fewest GPUs with full sharding, days to train.

    ``tokens_per_param = 20`` is the compute-optimal ("Chinchilla") budget: D = 20 N.
    """
    rows = []
    for name, num_params in (models or MODEL_SIZES).items():
        answer = fit(num_params, gpus, GPUS[gpu], zero_stage)
        rows.append({"model": name, "params": num_params, "state_gib_per_gpu": answer.state_bytes / GIB,
                     "fits": answer.fits,
                     "min_gpus_fully_sharded": min_gpus_to_fit(num_params, GPUS[gpu], 3),
                     "tokens": tokens_per_param * num_params,
                     "days": training_days(num_params, tokens_per_param * num_params, gpus, gpu, mfu)})
    return rows


def _bar(fraction: float, colour: str) -> str:
    width = min(fraction, 1.0) * 100
    return (f'<div style="background:#eee;width:320px;height:14px;display:inline-block">'
            f'<div style="background:{colour};width:{width:.1f}%;height:14px"></div></div>')


def explorer_html(num_params: float, gpus: int, gpu: str, zero_stage: int, activation_gib: float = 0.0,
                  tokens: float | None = None, mfu: float = 0.4) -> str:
    """The explorer's answer as HTML: memory per GPU against capacity, the verdict, and the days to train."""
    gpu_bytes = GPUS[gpu]
    answer = fit(num_params, gpus, gpu_bytes, zero_stage, activation_gib * GIB)
    verdict = "fits" if answer.fits else "does NOT fit"
    colour = "#4c9a2a" if answer.fits else "#c0392b"
    lines = [f"<b>{num_params / 1e9:.3g} B parameters on {gpus} x {gpu}, {STRATEGIES[zero_stage]}</b>",
             f"state per GPU {answer.state_bytes / GIB:,.1f} GiB + activations {activation_gib:,.1f} GiB "
             f"= {answer.total_bytes / GIB:,.1f} GiB of {gpu_bytes / GIB:,.0f} GiB: "
             f'<b style="color:{colour}">{verdict}</b> ({answer.fraction_used:.0%})',
             _bar(answer.fraction_used, colour)]
    needed = min_gpus_to_fit(num_params, gpu_bytes, zero_stage, activation_gib * GIB)
    lines.append(f"fewest GPUs for this strategy: {needed:,}" if needed is not None
                 else "no number of GPUs is enough for this strategy: shard more (a higher ZeRO stage)")
    tokens = tokens if tokens is not None else 20 * num_params
    days = training_days(num_params, tokens, gpus, gpu, mfu)
    lines.append(f"compute: 6 x N x D = {training_flops(num_params, tokens):.3g} FLOPs for {tokens / 1e9:,.0f} B "
                 f"tokens at {mfu:.0%} MFU: <b>{days:,.1f} days</b> on {gpus} GPU(s)")
    return "<br>".join(lines)


# The course's website (``make site``) runs the notebooks with no one to move a slider: there each widget shows its
# first view as a static page, with this note (the build sets the variable; JupyterLab never does).
STATIC_ENV = "DISTLAB_STATIC_WIDGETS"
STATIC_NOTE = ("An interactive widget: in JupyterLab (<code>make lab</code>) its controls change the view. Here, "
               "on the website, is its first view, for the values this cell passes.")


def static_pages() -> bool:
    """True while the notebooks run for the website (no kernel will be there to drive a widget)."""
    return os.environ.get(STATIC_ENV) == "1"


def static_view(html_text: str):
    """A widget's first view as HTML, under :data:`STATIC_NOTE` (what the website shows instead of the widget)."""
    from IPython.display import HTML

    return HTML(f'<p class="distlab-static-widget"><em>{STATIC_NOTE}</em></p>{html_text}')


def does_it_fit_explorer(num_params: float = 7e9, gpus: int = 4, gpu: str = "A100-40GB", zero_stage: int = 0):
    """The interactive explorer (ipywidgets): sliders over ``explorer_html``. Returns the widget box (on the
    website, :func:`static_view` of its first view)."""
    if static_pages():
        return static_view(explorer_html(num_params, gpus, gpu, zero_stage, 0.0, mfu=0.4))
    import ipywidgets as w

    # A slider over the listed sizes, not a log slider: 10^(k/20) cannot land on 7 (it showed 7.08e9).
    sizes = sorted(set(EXPLORER_SIZES_B) | {num_params / 1e9})
    size = w.SelectionSlider(options=sizes, value=num_params / 1e9, description="params (B)")
    count = w.SelectionSlider(options=[2**i for i in range(0, 14)], value=gpus, description="GPUs")
    kind = w.Dropdown(options=list(GPUS), value=gpu, description="GPU")
    stage = w.Dropdown(options=[(label, s) for s, label in STRATEGIES.items()], value=zero_stage,
                       description="strategy")
    activations = w.FloatSlider(value=0.0, min=0.0, max=40.0, step=0.5, description="act. GiB/GPU")
    utilisation = w.FloatSlider(value=0.4, min=0.05, max=0.8, step=0.05, description="MFU")
    out = w.HTML()

    def update(_=None):
        out.value = explorer_html(size.value * 1e9, count.value, kind.value, stage.value, activations.value,
                                  mfu=utilisation.value)

    for control in (size, count, kind, stage, activations, utilisation):
        control.observe(update, names="value")
    update()
    box = w.VBox([w.HBox([size, count, kind]), w.HBox([stage, activations, utilisation]), out])
    box.update = update  # so a test (or a notebook cell) can refresh it after setting values
    box.controls = {"params": size, "gpus": count, "gpu": kind, "strategy": stage, "activations": activations,
                    "mfu": utilisation}
    box.output = out
    return box


# --------------------------------------------------------------------------------------------------------
# Chapter 07: the pipeline schedule explorer
# --------------------------------------------------------------------------------------------------------

PIPELINE_SCHEDULES = {"naive": "naive (one microbatch at a time)", "gpipe": "GPipe", "1f1b": "1F1B",
                      "interleaved_1f1b": "interleaved 1F1B", "zero_bubble": "zero bubble (ZB-H1)"}


def pipeline_summary(name: str, ranks: int, microbatches: int, chunks: int = 1) -> dict:
    """Everything the schedule explorer shows for one setting, computed by ``distlab.schedules`` (pure).

    ``chunks`` (V) applies to interleaved 1F1B only and is ignored by the other schedules (reported as 1).
    A setting the schedule cannot run (interleaved with M not a multiple of P) comes back with ``error``
    set and nothing else. Costs are the library's defaults: F = 1, B = 2 (zero bubble: B = W = 1) per
    microbatch through a rank's layers, so every schedule does the same work and makespans compare.
    """
    from distlab import schedules

    chunks = chunks if name == "interleaved_1f1b" else 1
    summary = {"name": name, "label": PIPELINE_SCHEDULES.get(name, name), "ranks": ranks,
               "microbatches": microbatches, "chunks": chunks, "error": None}
    try:
        schedule = schedules.build(name, ranks, microbatches, chunks)
    except ValueError as error:
        summary["error"] = str(error)
        return summary
    timeline = schedules.simulate(schedule)
    peaks = schedules.peak_activations(schedule)
    formula = None
    if name in ("gpipe", "1f1b", "interleaved_1f1b"):
        formula = schedules.bubble_fraction(ranks, microbatches, chunks)
    elif name == "naive":
        formula = (ranks - 1) / ranks
    summary.update(
        schedule=schedule, timeline=timeline,
        bubble=schedules.bubble_fraction_from_timeline(timeline, ranks), formula=formula,
        one_f_one_b_bubble=schedules.bubble_fraction(ranks, microbatches),
        makespan=max(e.end for e in timeline) - min(e.start for e in timeline),
        ideal_makespan=3.0 * microbatches,  # one rank's own work: M x (F + B), nothing idle
        peak_activations=peaks,
        # in units of one microbatch through all of a rank's layers (an interleaved chunk is 1/V of them)
        peak_activation_layers={rank: count / chunks for rank, count in peaks.items()},
    )
    return summary


def pipeline_explorer_html(name: str, ranks: int, microbatches: int, chunks: int = 1, width: int = 100) -> str:
    """The explorer's answer as HTML: the simulated Gantt chart (ASCII), the bubble against its formula, the
    step time against the ideal, and the activations each rank holds at its peak."""
    import html

    from distlab import gantt

    s = pipeline_summary(name, ranks, microbatches, chunks)
    title = f"<b>{s['label']}: P = {ranks} ranks, M = {microbatches} microbatches" + (
        f", V = {s['chunks']} stages per rank" if name == "interleaved_1f1b" else "") + "</b>"
    if s["error"]:
        return f'{title}<br><b style="color:#c0392b">cannot run:</b> {html.escape(s["error"])}'
    chart = gantt.ascii_gantt(s["timeline"], width=width)
    lines = [title, f"<pre style='line-height:1.15'>{html.escape(chart)}</pre>"]
    bubble = f"bubble <b>{100 * s['bubble']:.1f}%</b> (simulated)"
    if s["formula"] is not None:
        shape = "(P-1)/P" if name == "naive" else "(P-1)/(V·M+P-1)" if name == "interleaved_1f1b" \
            else "(P-1)/(M+P-1)"
        bubble += f"; formula {shape} = {100 * s['formula']:.1f}%"
    if name not in ("gpipe", "1f1b"):
        bubble += f"; GPipe and 1F1B: {100 * s['one_f_one_b_bubble']:.1f}%"
    lines.append(bubble)
    lines.append(f"step time {s['makespan']:g} units of one forward (F = 1, B = 2 per rank's layers) against "
                 f"{s['ideal_makespan']:g} with no bubble")
    peaks = s["peak_activation_layers"]
    lines.append("activations held at the peak, in microbatches through a rank's layers: "
                 + ", ".join(f"rank {r}: {peaks[r]:g}" for r in sorted(peaks)))
    return "<br>".join(lines)


def pipeline_explorer(name: str = "1f1b", ranks: int = 4, microbatches: int = 8, chunks: int = 2):
    """The interactive schedule explorer (ipywidgets): schedule, P, M and V over ``pipeline_explorer_html`` (on
    the website, :func:`static_view` of its first view)."""
    if static_pages():
        return static_view(pipeline_explorer_html(name, ranks, microbatches, chunks))
    import ipywidgets as w

    schedule = w.Dropdown(options=[(label, key) for key, label in PIPELINE_SCHEDULES.items()], value=name,
                          description="schedule")
    ranks_slider = w.IntSlider(value=ranks, min=2, max=16, description="P (ranks)")
    microbatches_slider = w.IntSlider(value=microbatches, min=1, max=64, description="M (microbatches)")
    chunks_slider = w.IntSlider(value=chunks, min=1, max=4, description="V (interleaved)")
    out = w.HTML()

    def update(_=None):
        chunks_slider.disabled = schedule.value != "interleaved_1f1b"
        out.value = pipeline_explorer_html(schedule.value, ranks_slider.value, microbatches_slider.value,
                                           chunks_slider.value)

    for control in (schedule, ranks_slider, microbatches_slider, chunks_slider):
        control.observe(update, names="value")
    update()
    box = w.VBox([w.HBox([schedule, ranks_slider]), w.HBox([microbatches_slider, chunks_slider]), out])
    box.update = update
    box.controls = {"schedule": schedule, "ranks": ranks_slider, "microbatches": microbatches_slider,
                    "chunks": chunks_slider}
    box.output = out
    return box
