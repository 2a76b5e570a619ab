"""How many 4 x A100-40GB nodes a LLaMA-style model needs under TP inside a node and FSDP across nodes.

The sizing guide of chapter 09, computed from the course's memory model (``distlab.memory`` for the
training state, ``distlab.tensor_parallel.activation_bytes`` for what a tensor-parallel rank saves for
backward). Everything is a pure function of a model shape, a layout ``(dp, tp)`` and stated
:class:`Assumptions`; a later planner (chapter 11) grows from :func:`memory_per_gpu` and :func:`min_nodes`.

The accounting, per GPU of a ``dp x tp`` mesh (TP shards every matrix over ``tp``; FSDP shards what each TP
rank holds over ``dp``)::

    training state   16 B per parameter (bf16 compute, fp32 master weights, two fp32 AdamW moments, fp32
                     gradients: FSDP2 keeps fp32 shards and casts them to bf16 for its all-gathers),
                     matrices / (tp x dp), norm weights / dp
    FSDP unit        the largest unit's bf16 weights gathered, twice (the one computing and the one being
                     prefetched), and its fp32 gradients before the reduce-scatter, each this TP rank's share
    activations      with activation checkpointing: every block's bf16 input (replicated over TP without
                     sequence parallelism, / tp with it) + one block recomputed during backward + the head's
                     fp32 log-softmax over this rank's vocabulary shard; without checkpointing: every block's
                     saved tensors
    reserve          CUDA context, NCCL buffers, allocator fragmentation (a stated constant)

All of it is *derived* (a model, not a measurement): the chapter labels it so. The parts the course
measures on CPU ranks (state = ``memory.ledger``, activations = ``memory.saved_activation_bytes``) are
tested equal to the same formulas in chapters 05, 06 and 09.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from distlab import memory, models, tensor_parallel

GIB = memory.GIB
A100_40GB_BYTES = 40 * GIB  # "40 GB" on the box: 40 GiB of HBM2 (40,960 MiB in nvidia-smi)


@dataclass(frozen=True)
class LlamaShape:
    """A published LLaMA-style shape: untied embedding and output, RMSNorm, SwiGLU, grouped-query attention."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    source: str

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def block_params(self) -> int:
        """wq, wo (dim x dim), wk, wv (dim x kv_heads * head_dim), w1, w2, w3 (dim x ffn), two norm weights."""
        kv_dim = self.n_kv_heads * self.head_dim
        return 2 * self.dim * self.dim + 2 * self.dim * kv_dim + 3 * self.dim * self.ffn_hidden + 2 * self.dim

    def norm_params(self) -> int:
        """The norm weights (two per block and the final one): replicated over TP ranks."""
        return (2 * self.n_layers + 1) * self.dim

    def num_params(self) -> int:
        return 2 * self.vocab_size * self.dim + self.n_layers * self.block_params() + self.dim

    def config(self, seq_len: int) -> models.TransformerConfig:
        """The course's TransformerConfig of the same sizes (it has no grouped-query attention: the activation
        formula takes k and v's width, ``n_kv_heads x head_dim``, beside it)."""
        return models.TransformerConfig(vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
                                        n_heads=self.n_heads, ffn_hidden=self.ffn_hidden, seq_len=seq_len)


# Published shapes. LLaMA has no 1 B model: TinyLlama-1.1B is the LLaMA-2 architecture at that size.
LLAMA_SHAPES: dict[str, LlamaShape] = {
    "1B": LlamaShape("1B", 2048, 22, 32, 4, 5632, 32000, "TinyLlama-1.1B (LLaMA-2 architecture)"),
    "7B": LlamaShape("7B", 4096, 32, 32, 32, 11008, 32000, "LLaMA-2-7B"),
    "13B": LlamaShape("13B", 5120, 40, 40, 40, 13824, 32000, "LLaMA-2-13B"),
    "30B": LlamaShape("30B", 6656, 60, 52, 52, 17920, 32000, "LLaMA-1-30B (32.5 B parameters)"),
    "70B": LlamaShape("70B", 8192, 80, 64, 8, 28672, 32000, "LLaMA-2-70B"),
}

# The rule of thumb chapter 09 sets the computation beside: TP = 4 in a node, FSDP over this many nodes. It is the
# course's own round estimate, not a published rule: twice the fewest nodes memory allows (min_nodes), which is one
# node per 3.3 B to 4.1 B parameters (tests/unit/test_sizing.py checks the doubling).
RULE_OF_THUMB_NODES = {"7B": 2, "13B": 4, "30B": 8, "70B": 20}


@dataclass(frozen=True)
class Assumptions:
    """What the sizing takes as given. Every field is printed beside the table it produces."""

    seq_len: int = 4096                   # LLaMA-2's context length
    micro_batch: int = 1                  # sequences per TP group per forward
    activation_checkpointing: bool = True  # every block recomputed in backward
    sequence_parallel: bool = False       # Megatron SP: block inputs sharded over TP too
    gpus_per_node: int = 4
    gpu_bytes: float = A100_40GB_BYTES
    reserve_bytes: float = 4 * GIB        # CUDA context (~0.5), NCCL buffers of two groups, fragmentation
    activation_bytes_per_number: int = 2  # bf16 autocast: saved activations in bf16 (the head stays fp32)
    prefetched_units: int = 2             # FSDP units whose weights are gathered at once

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MemoryPerGPU:
    """Derived bytes on one GPU of a ``dp x tp`` layout, by part."""

    model: str
    dp: int
    tp: int
    state: memory.StateBytes
    fsdp_unit: float
    activations: float
    reserve: float
    gpu_bytes: float

    @property
    def total(self) -> float:
        return self.state.total + self.fsdp_unit + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def gib(self) -> dict:
        return {"state": self.state.total / GIB, "fsdp_unit": self.fsdp_unit / GIB,
                "activations": self.activations / GIB, "reserve": self.reserve / GIB, "total": self.total / GIB}


def _shape(model: str | LlamaShape) -> LlamaShape:
    if isinstance(model, LlamaShape):
        return model
    if model not in LLAMA_SHAPES:
        raise KeyError(f"unknown model {model!r}; choose from {list(LLAMA_SHAPES)}")
    return LLAMA_SHAPES[model]


def layout_problems(model: str | LlamaShape, dp: int, tp: int, assumptions: Assumptions = Assumptions()) -> list[str]:
    """Why ``dp x tp`` cannot run ``model`` (empty when it can): TP must split the heads, the KV heads and the
    widths, and stay inside one node."""
    shape = _shape(model)
    if dp < 1 or tp < 1:
        return [f"dp and tp must be at least 1, not dp={dp}, tp={tp}"]
    problems = tensor_parallel.tp_config_problems(shape.config(assumptions.seq_len), tp,
                                                  sequence_parallel=assumptions.sequence_parallel)
    if shape.n_kv_heads % tp:
        problems.append(f"{shape.n_kv_heads} key/value heads do not split over {tp} TP ranks")
    if tp > assumptions.gpus_per_node:
        problems.append(f"TP {tp} is larger than the {assumptions.gpus_per_node} GPUs of a node")
    return problems


def state_bytes_per_gpu(model: str | LlamaShape, dp: int, tp: int) -> memory.StateBytes:
    """Training state on one GPU: ``memory.zero_state_bytes`` (ZeRO-3 over dp) of this TP rank's parameters."""
    shape = _shape(model)
    sharded = shape.num_params() - shape.norm_params()
    per_tp_rank = sharded / tp + shape.norm_params()
    return memory.zero_state_bytes(per_tp_rank, dp, stage=3, precision="mixed")


def fsdp_unit_bytes(model: str | LlamaShape, tp: int, assumptions: Assumptions = Assumptions()) -> float:
    """Transient bytes of FSDP's gathered units: ``prefetched_units`` x bf16 weights + fp32 gradients of the
    largest unit (a block, or the root: embedding + output + final norm), this TP rank's share."""
    shape = _shape(model)
    root = 2 * shape.vocab_size * shape.dim + shape.dim
    largest = max(shape.block_params(), root) / tp
    return assumptions.prefetched_units * 2 * largest + 4 * largest


def activation_bytes_per_gpu(model: str | LlamaShape, tp: int, assumptions: Assumptions = Assumptions()) -> float:
    """Saved activations on one GPU at the peak (the start of backward), from ``tensor_parallel.activation_bytes``.

    That formula is the fp32 one measured on CPUs; the blocks are scaled to ``activation_bytes_per_number``
    (bf16 autocast saves bf16 tensors), the head's log-softmax stays fp32 (``lm_loss`` casts to fp32).
    """
    shape = _shape(model)
    a = assumptions
    per_rank = tensor_parallel.activation_bytes(shape.config(a.seq_len), a.micro_batch, a.seq_len, tp,
                                                sequence_parallel=a.sequence_parallel,
                                                kv_dim=shape.n_kv_heads * shape.head_dim)
    scale = a.activation_bytes_per_number / 4
    one_block = per_rank["per_layer"] * scale
    if not a.activation_checkpointing:
        return shape.n_layers * one_block + per_rank["head"]
    # checkpointed: each block keeps only its input (bf16, sharded over TP under SP), one block is live again
    block_input = a.micro_batch * a.seq_len * shape.dim * a.activation_bytes_per_number
    block_input /= tp if a.sequence_parallel else 1
    return shape.n_layers * block_input + one_block + per_rank["head"]


def memory_per_gpu(model: str | LlamaShape, dp: int, tp: int = 4,
                   assumptions: Assumptions = Assumptions()) -> MemoryPerGPU:
    """Derived bytes per GPU of ``model`` on a ``dp x tp`` mesh (TP inside a node, FSDP over dp)."""
    shape = _shape(model)
    return MemoryPerGPU(shape.name, dp, tp, state_bytes_per_gpu(shape, dp, tp),
                        fsdp_unit_bytes(shape, tp, assumptions), activation_bytes_per_gpu(shape, tp, assumptions),
                        assumptions.reserve_bytes, assumptions.gpu_bytes)


def min_nodes(model: str | LlamaShape, assumptions: Assumptions = Assumptions(), tp: int | None = None,
              max_nodes: int = 1024) -> int | None:
    """The fewest nodes on which ``model`` fits with TP = ``tp`` (default: a whole node) and FSDP over
    dp = nodes x GPUs per node / tp; None when the per-GPU parts that do not shrink with dp (activations,
    gathered units, reserve) already fill the GPU."""
    tp = tp or assumptions.gpus_per_node
    problems = layout_problems(model, 1, tp, assumptions)
    if problems:
        raise ValueError("; ".join(problems))
    for nodes in range(1, max_nodes + 1):
        dp = nodes * assumptions.gpus_per_node // tp
        if dp >= 1 and nodes * assumptions.gpus_per_node % tp == 0 and memory_per_gpu(model, dp, tp, assumptions).fits:
            return nodes
    return None


def sizing_table(assumptions: Assumptions = Assumptions(),
                 model_names: tuple[str, ...] = tuple(LLAMA_SHAPES)) -> list[dict]:
    """One row per model: parameters, the fewest nodes (TP = a node, FSDP = nodes), GiB per GPU there by part,
    the same without activation checkpointing, and the rule of thumb."""
    rows = []
    no_checkpointing = replace(assumptions, activation_checkpointing=False)
    for name in model_names:
        nodes = min_nodes(name, assumptions)
        # TP = a whole node, so dp = nodes
        per_gpu = memory_per_gpu(name, nodes, assumptions.gpus_per_node, assumptions) if nodes else None
        rows.append({"model": name, "source": LLAMA_SHAPES[name].source,
                     "params": LLAMA_SHAPES[name].num_params(),
                     "min_nodes": nodes, "gib_per_gpu": per_gpu.gib() if per_gpu else None,
                     "min_nodes_without_checkpointing": min_nodes(name, no_checkpointing),
                     "rule_of_thumb_nodes": RULE_OF_THUMB_NODES.get(name)})
    return rows


def sizing_table_markdown(assumptions: Assumptions = Assumptions()) -> str:
    """The chapter's sizing table, as markdown (the chapter pastes it; a test checks it is the same)."""
    lines = ["| model | parameters | fewest nodes (derived) | GiB per GPU there: state + FSDP units + "
             "activations + reserve (derived) | without checkpointing (derived) | rule of thumb |",
             "|---|---:|---:|---|---:|---:|"]
    for row in sizing_table(assumptions):
        g = row["gib_per_gpu"]
        parts = (f"{g['state']:.1f} + {g['fsdp_unit']:.1f} + {g['activations']:.1f} + {g['reserve']:.0f} "
                 f"= {g['total']:.1f}") if g else "does not fit"
        rule = row["rule_of_thumb_nodes"]
        # None: the activations alone fill the GPU, and FSDP over more nodes does not shrink them
        unchecked = row["min_nodes_without_checkpointing"] or "no number of nodes"
        lines.append(f"| {row['model']} | {row['params'] / 1e9:.2f} B | {row['min_nodes'] or 'none'} | {parts} | "
                     f"{unchecked} | {rule if rule else '-'} |")
    return "\n".join(lines)


def state_gib_per_gpu(num_params: float, gpus: int) -> float:
    """16 B per parameter (mixed-precision AdamW) sharded over every GPU of a dp x tp mesh, in GiB: the
    training state alone, for the notebook's exercise (``memory.zero_state_bytes`` at ZeRO-3)."""
    return memory.zero_state_bytes(num_params, gpus, 3, "mixed").total / GIB


def fewest_nodes_for_state(num_params: float, activation_gib: float, assumptions: Assumptions = Assumptions()) -> int:
    """The fewest nodes whose GPUs hold the sharded training state plus ``activation_gib`` per GPU
    (no reserve): the answer of the notebook's dp x tp exercise."""
    room = assumptions.gpu_bytes / GIB - activation_gib
    if room <= 0:
        raise ValueError(f"{activation_gib} GiB of activations leave no room on a "
                         f"{assumptions.gpu_bytes / GIB:g} GiB GPU")
    gpus = math.ceil(state_gib_per_gpu(num_params, 1) / room - 1e-12)
    return max(1, math.ceil(gpus / assumptions.gpus_per_node))


def largest_micro_batch(model: str | LlamaShape, nodes: int, assumptions: Assumptions = Assumptions(),
                        limit: int = 256) -> int:
    """The most sequences per micro-batch that fit on ``nodes`` nodes (TP = a node, FSDP = nodes): what the
    memory left over by the training state buys. 0 when not even one sequence fits."""
    best = 0
    for micro_batch in range(1, limit + 1):
        if not memory_per_gpu(model, nodes, assumptions.gpus_per_node,
                              replace(assumptions, micro_batch=micro_batch)).fits:
            break
        best = micro_batch
    return best


def block_communication(model: str | LlamaShape, dp: int, tp: int = 4, assumptions: Assumptions = Assumptions(),
                        peak_flops: float = 312e12) -> dict:
    """One transformer block, one training step of one micro-batch, on a ``dp x tp`` mesh: the collectives of
    each mesh dimension, the bytes each rank sends, and the seconds they take on their link, beside the
    block's compute (derived, no overlap assumed).

    TP (inside a node, NVLink, ``tensor_parallel.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S``): the rows of
    ``tensor_parallel.tp_comm_formula`` for one block, in bf16. FSDP (across nodes, one Slingshot NIC per
    GPU, ``SLINGSHOT11_NIC_BYTES_PER_S``): the block's bf16 weights (this TP rank's share) all-gathered
    before forward and again before backward, its fp32 gradients reduce-scattered once. Compute: 6 FLOPs
    per matrix parameter and token plus attention's 12 x seq x dim, split over tp, at ``peak_flops``
    (A100 bf16).
    """
    from distlab import comm

    shape = _shape(model)
    a = assumptions
    cfg = replace(shape.config(a.seq_len), n_layers=1)
    tp_rows = [r for r in tensor_parallel.tp_comm_formula(cfg, a.micro_batch, a.seq_len, tp,
                                                           sequence_parallel=a.sequence_parallel,
                                                           bytes_per_element=2)
               if r["where"] == "blocks"]
    shard = (shape.block_params() - 2 * shape.dim) / tp + 2 * shape.dim
    fsdp_rows = [{"phase": "forward and backward", "where": "block", "collective": "all_gather", "calls": 2,
                  "payload_bytes": 2 * 2 * shard},
                 {"phase": "backward", "where": "block", "collective": "reduce_scatter", "calls": 1,
                  "payload_bytes": 4 * shard}]
    links = {"tp": tensor_parallel.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S,
             "dp": tensor_parallel.SLINGSHOT11_NIC_BYTES_PER_S}
    result = {}
    for dimension, rows, size in (("tp", tp_rows, tp), ("dp", fsdp_rows, dp)):
        sent = sum(comm.bytes_sent_per_rank(r["collective"], r["payload_bytes"], size) for r in rows)
        result[dimension] = {"rows": rows, "calls": sum(r["calls"] for r in rows), "sent_bytes": sent,
                             "seconds": sent / links[dimension]}
    tokens = a.micro_batch * a.seq_len
    matmul_params = shape.block_params() - 2 * shape.dim
    flops = (6 * matmul_params + 12 * a.seq_len * shape.dim) * tokens / tp
    result["compute"] = {"flops": flops, "seconds": flops / peak_flops}
    return result


def micro_batch_to_hide_fsdp(model: str | LlamaShape, nodes: int, assumptions: Assumptions = Assumptions(),
                             limit: int = 256) -> int | None:
    """The fewest sequences per micro-batch for which one block's compute at peak takes at least as long as
    its FSDP traffic across nodes (TP = a node, FSDP = nodes), so that prefetching can hide it. FSDP moves
    the weights whatever the batch; compute grows with the tokens. None beyond ``limit``."""
    for micro_batch in range(1, limit + 1):
        block = block_communication(model, nodes, assumptions.gpus_per_node,
                                    replace(assumptions, micro_batch=micro_batch))
        if block["compute"]["seconds"] >= block["dp"]["seconds"]:
            return micro_batch
    return None


def min_nodes_to_hide_fsdp(model: str | LlamaShape, assumptions: Assumptions = Assumptions(),
                           max_nodes: int = 1024) -> int | None:
    """The fewest nodes on which a micro-batch large enough to hide FSDP's traffic (:func:`micro_batch_to_hide_fsdp`)
    still fits in memory (:func:`largest_micro_batch`). None beyond ``max_nodes``."""
    for nodes in range(1, max_nodes + 1):
        needed = micro_batch_to_hide_fsdp(model, nodes, assumptions)
        if needed is not None and largest_micro_batch(model, nodes, assumptions, limit=needed) >= needed:
            return nodes
    return None


def overlap_table_markdown(assumptions: Assumptions = Assumptions()) -> str:
    """The chapter's second table: what the rule of thumb's extra nodes buy (all derived)."""
    with_sp = replace(assumptions, sequence_parallel=True)
    lines = ["| model | rule of thumb | largest micro-batch there | micro-batch that hides FSDP there | "
             "fewest nodes where FSDP hides | the same with sequence parallelism |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, nodes in RULE_OF_THUMB_NODES.items():
        lines.append(f"| {name} | {nodes} | {largest_micro_batch(name, nodes, assumptions)} | "
                     f"{micro_batch_to_hide_fsdp(name, nodes, assumptions)} | "
                     f"{min_nodes_to_hide_fsdp(name, assumptions)} | {min_nodes_to_hide_fsdp(name, with_sp)} |")
    return "\n".join(lines)


def shapes_table_markdown() -> str:
    """The published shapes the guide uses, as markdown (the chapter pastes it; a test checks it)."""
    lines = ["| model | shape published as | hidden | layers | heads (key/value) | feed-forward | vocabulary | "
             "parameters |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for s in LLAMA_SHAPES.values():
        lines.append(f"| {s.name} | {s.source} | {s.dim:,} | {s.n_layers} | {s.n_heads} ({s.n_kv_heads}) | "
                     f"{s.ffn_hidden:,} | {s.vocab_size:,} | {s.num_params():,} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# HSDP against FSDP over every GPU (chapter 09): memory per GPU and the bytes that cross the nodes
# ------------------------------------------------------------------------------------------------


def hsdp_against_fsdp(model: str | LlamaShape, nodes: int, gpus_per_node: int = 4) -> dict:
    """Per GPU, for FSDP over all ``nodes x gpus_per_node`` GPUs against HSDP (shard inside a node, replicate
    across): the training state (16 bytes a parameter, ``memory.zero_state_bytes``) and the bytes that cross the
    network a step, per NIC (one NIC a GPU, as on Derecho). Derived, not measured (``train_fsdp.py --replicate``
    measures each group's ledger equal to the same formula on CPU ranks).

    FSDP's ring over all W = nodes x g ranks, laid out node by node, leaves each node on one edge a ring: of the
    (W - 1) / W x payload every rank sends, the rest stays on NVLink; NCCL spreads its rings over the node's g NICs,
    so each NIC carries (W - 1) / W x payload / g (bf16 all-gathers, forward and backward, and the fp32
    reduce-scatter: 8 bytes a parameter). HSDP's g replica groups each hold one rank a node, each on its own NIC:
    an all-reduce of the fp32 gradient shard (params / g), 2 (n - 1) / n of it a NIC. The ratio of the two is
    ((W - 1) / W) / ((n - 1) / n): never more than 2."""
    from distlab import comm

    params = _shape(model).num_params()
    world = nodes * gpus_per_node
    fsdp = comm.zero_step_bytes(params, 3, param_bytes=2, grad_bytes=4)
    payload = sum(fsdp.values())   # every collective's whole tensor: 2 + 2 + 4 bytes a parameter
    fsdp_nic = payload * (world - 1) / world / gpus_per_node if nodes > 1 else 0
    hsdp_nic = comm.bytes_sent_per_rank("all_reduce", params * 4 // gpus_per_node, nodes) if nodes > 1 else 0
    return {"nodes": nodes, "params": params,
            "fsdp_state_gib": memory.zero_state_bytes(params, world, 3).total / GIB,
            "hsdp_state_gib": memory.zero_state_bytes(params, gpus_per_node, 3).total / GIB,
            "fsdp_nic_gb": fsdp_nic / 1e9, "hsdp_nic_gb": hsdp_nic / 1e9,
            "saving": fsdp_nic / hsdp_nic if hsdp_nic else float("nan")}


def hsdp_table_markdown(cases=(("7B", 2), ("7B", 8), ("70B", 8), ("70B", 32))) -> str:
    lines = ["| model | nodes (4 GPUs each) | state per GPU: FSDP over all GPUs | HSDP, shard 4 | bytes over each NIC a "
             "step: FSDP | HSDP | FSDP / HSDP |", "|---|---:|---:|---:|---:|---:|---:|"]
    for model, nodes in cases:
        row = hsdp_against_fsdp(model, nodes)
        lines.append(f"| {model} | {nodes} | {row['fsdp_state_gib']:.1f} GiB | {row['hsdp_state_gib']:.1f} GiB | "
                     f"{row['fsdp_nic_gb']:.1f} GB | {row['hsdp_nic_gb']:.1f} GB | {row['saving']:.2f}x |")
    return "\n".join(lines)
