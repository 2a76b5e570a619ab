"""A layout evaluated: :func:`evaluate` returns a :class:`Plan` (memory, communication, bubble, step time, MFU)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from distlab import schedules
from distlab.planner.communication import bytes_sent, comm_per_step, crosses_nodes
from distlab.planner.memory import memory_per_gpu
from distlab.planner.spec import GIB, Cluster, Layout, ModelSpec, Options, layout_problems, microbatches


@dataclass
class Plan:
    """A layout evaluated: memory per GPU by part, communication per dimension, time. All derived."""

    layout: Layout
    memory_per_gpu_bytes: dict
    gpu_bytes: float
    comm_bytes_per_gpu: dict
    comm_seconds: dict
    bubble: dict
    step_seconds: float
    compute_seconds: float
    mfu: float
    tokens_per_second: float
    problems: list = field(default_factory=list)
    worst_stage: int = 0

    @property
    def fits(self) -> bool:
        return not self.problems and self.memory_per_gpu_bytes["total"] <= self.gpu_bytes

    @property
    def reason(self) -> str:
        if self.problems:
            return "; ".join(self.problems)
        if not self.fits:
            parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.memory_per_gpu_bytes.items() if k != "total")
            return (f"needs {self.memory_per_gpu_bytes['total'] / GIB:.1f} GiB per GPU ({parts}) "
                    f"> {self.gpu_bytes / GIB:.0f} GiB")
        return "fits"

    def to_dict(self) -> dict:
        return {"layout": asdict(self.layout), "label": self.layout.label(), "fits": self.fits,
                "reason": self.reason, "memory_per_gpu_bytes": self.memory_per_gpu_bytes,
                "gpu_bytes": self.gpu_bytes, "comm_bytes_per_gpu": self.comm_bytes_per_gpu,
                "comm_seconds": self.comm_seconds, "bubble": self.bubble, "step_seconds": self.step_seconds,
                "compute_seconds": self.compute_seconds, "mfu": self.mfu,
                "tokens_per_second": self.tokens_per_second, "worst_stage": self.worst_stage}


def rejected(layout: Layout, cluster: Cluster, problems: list[str]) -> Plan:
    """A layout that is not evaluated, with its reasons."""
    return Plan(layout, {"total": float("nan")}, cluster.gpu_bytes, {}, {}, {}, float("inf"), float("inf"),
                0.0, 0.0, problems)


def evaluate(model: ModelSpec, cluster: Cluster, layout: Layout, options: Options = Options(),
             gpus: int | None = None) -> Plan:
    """One layout: memory per GPU (the stage that needs most), communication, bubble, time, MFU; derived."""
    problems = layout_problems(model, cluster, layout, gpus, options)
    if problems:
        return rejected(layout, cluster, problems)
    memories = {s: memory_per_gpu(model, layout, s, options) for s in {0, layout.pp - 1}}
    worst = max(memories, key=lambda s: memories[s]["total"])
    sizes = {"tp": layout.tp, "dp": layout.dp * layout.cp, "pp": layout.pp, "cp": layout.cp}
    # communication and its time: the busier of the first and last stage
    comm_by_stage = {s: comm_per_step(model, layout, s, options) for s in {0, layout.pp - 1}}
    seconds_by_stage = {}
    for s, per_dimension in comm_by_stage.items():
        seconds_by_stage[s] = {}
        for dimension, collectives in per_dimension.items():
            link = cluster.inter_node_bytes_per_s if crosses_nodes(layout, dimension, cluster) \
                else cluster.intra_node_bytes_per_s
            seconds_by_stage[s][dimension] = bytes_sent(dimension, collectives, sizes[dimension]) / link
    busiest = max(seconds_by_stage, key=lambda s: sum(seconds_by_stage[s].values()))
    comm_seconds = seconds_by_stage[busiest]
    comm_bytes = {d: {"payload": c, "sent": bytes_sent(d, c, sizes[d])} for d, c in comm_by_stage[busiest].items()}

    # compute: model FLOPs per GPU per step, recomputation adds one forward (2 of the 6), at an assumed efficiency
    tokens = model.global_batch * model.seq_len
    model_flops_per_gpu = model.flops_per_token() * tokens / layout.gpus
    hardware_flops = model_flops_per_gpu * (8 / 6 if options.activation_checkpointing else 1)
    compute = hardware_flops / (cluster.peak_flops * options.compute_efficiency)
    num_micro = microbatches(model, layout)
    chunks = options.chunks if options.schedule == "interleaved_1f1b" else 1
    share = schedules.bubble_fraction(layout.pp, num_micro, chunks)
    bubble = {"of_step": share, "of_ideal": (layout.pp - 1) / (chunks * num_micro),
              "seconds": compute * share / (1 - share)}
    # what does not overlap: TP's collectives sit between matmuls (all exposed); DP's hide behind compute up
    # to the compute's length; PP's sends delay the fill and the drain only (2 (P-1) transfers of one
    # microbatch); CP's ring hides behind attention (12 L h s of the flops per token)
    exposed = comm_seconds.get("tp", 0.0)
    exposed += max(0.0, comm_seconds.get("dp", 0.0) - compute)
    if layout.pp > 1:
        exposed += comm_seconds["pp"] / (2 * num_micro) * 2 * (layout.pp - 1)
    if layout.cp > 1:
        attention_share = 12 * model.layers * model.hidden * model.seq_len / model.flops_per_token()
        exposed += max(0.0, comm_seconds["cp"] - compute * attention_share)
    step = compute + bubble["seconds"] + exposed
    mfu = model_flops_per_gpu / (step * cluster.peak_flops)
    return Plan(layout, memories[worst], cluster.gpu_bytes, comm_bytes, comm_seconds, bubble, step, compute, mfu,
                tokens / step, [], worst)
