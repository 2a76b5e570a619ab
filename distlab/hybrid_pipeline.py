"""Pipelines combined with data and tensor parallelism (chapter 09): what must divide what, and the bytes.

Pure functions, no process group, each equal to a measurement in ``scripts/09_hybrid_parallel``:

* :func:`pipeline_split_problems`: every reason a (pp, dp) split of layers and batch cannot run;
* :func:`stage_param_count`: parameters of one pipeline stage of the shared transformer, whole or as one TP
  rank holds them (matrices / tp, norm weights replicated);
* :func:`dp_gradient_sync_bytes`: what the data-parallel dimension sends per step, when gradients are
  synchronised once per step (what torch's schedules do) or after every microbatch (the naive way);
* :func:`pp_send_bytes`: activations and their gradients one rank sends to its pipeline neighbours per step;
* :func:`tp_stage_comm_bytes`: the TP collectives of one stage per step;
* :func:`comm_dimension`: which mesh dimension a measured collective belongs to;
* :func:`merge_config_file`: ``--config FILE.json`` under the command line (flags override the file).

The grid itself (coordinates, groups, mesh-shape validation) is :mod:`distlab.hybrid`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def pipeline_split_problems(*, layers: int, pp: int, stages_per_rank: int, batch: int, dp: int,
                            microbatches: int) -> list[str]:
    """Every reason the layers do not cut into pp x V equal stages, or the batch into dp x M equal microbatches."""
    problems = []
    stages = pp * stages_per_rank
    if stages >= 1 and layers % stages:
        problems.append(f"{layers} layers do not split into pp x stages-per-rank = {pp} x {stages_per_rank} = "
                        f"{stages} equal stages (--layers)")
    if dp >= 1 and microbatches >= 1 and (batch % (dp * microbatches) or batch < dp * microbatches):
        problems.append(f"--batch {batch} does not split over dp x microbatches = {dp} x {microbatches} = "
                        f"{dp * microbatches} equal microbatches")
    return problems


def stage_param_count(cfg, stage: int, num_stages: int, tp: int = 1) -> dict:
    """Parameters of stage ``stage`` (of ``num_stages`` equal ones) of :class:`distlab.models.Transformer`.

    Returns ``{"matrices", "norms", "total"}`` as one TP rank of ``tp`` holds them: every matrix (embedding,
    attention, feed-forward, output projection) split ``tp`` ways, the RMSNorm weights replicated.
    The first stage holds the embedding, the last the final norm and the output projection.
    """
    layers = cfg.n_layers // num_stages
    matrices = layers * (4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_hidden)
    norms = layers * 2 * cfg.dim
    if stage == 0:
        matrices += cfg.vocab_size * cfg.dim
    if stage == num_stages - 1:
        matrices += cfg.vocab_size * cfg.dim
        norms += cfg.dim
    return {"matrices": matrices // tp, "norms": norms, "total": matrices // tp + norms}


def dp_gradient_sync_bytes(stage_params: int, microbatches: int, dp_mode: str, every_microbatch: bool,
                           bytes_per_element: int = 4, reduce_bytes_per_element: int | None = None) -> dict[str, int]:
    """Payload bytes per step of the data-parallel collectives of a stage of ``stage_params`` parameters.

    * DDP: all-reduce the gradients; once per step, or once per microbatch when every backward syncs.
    * FSDP2 with the stage's parameters kept gathered for the whole step (``reshard_after_forward=False``, as
      torchtitan does under PP: resharding would all-gather again for every microbatch): one all-gather of the
      parameters per step, and a reduce-scatter of the gradients once per step or once per microbatch.

    The gradient bytes are the point: a ZeRO-2/FSDP stage that reduce-scatters after every microbatch sends
    M times what it needs to. ``bytes_per_element`` is a gathered weight's number (2 under bf16),
    ``reduce_bytes_per_element`` a reduced gradient's (FSDP's ``reduce_dtype``; by default the same).
    """
    grads = stage_params * (reduce_bytes_per_element or bytes_per_element) * (microbatches if every_microbatch else 1)
    if dp_mode == "ddp":
        return {"all_reduce": grads}
    if dp_mode == "fsdp":
        return {"all_gather": stage_params * bytes_per_element, "reduce_scatter": grads}
    raise ValueError(f"dp_mode must be 'ddp' or 'fsdp', not {dp_mode!r}")


def gradient_sync_timing_problems(dp_mode: str, backwards: list[tuple], reduce_grads: list[tuple],
                                  bucket_launches: list[tuple], gradient_collectives: int) -> list[str]:
    """Where in a pipeline step each stage's data-parallel gradient sync ran, against torch 2.13's rule
    (``torch/distributed/pipelining/stage.py``: ``backward_maybe_with_nosync``, ``perform_reduce_grad``):

    * DDP: every backward but the stage's last runs under ``no_sync()``; the last runs with the reducer armed, so
      every bucket's all-reduce is launched *during* the stage's last backward (overlapped with it);
    * FSDP2: every backward runs with ``set_requires_gradient_sync(False)``; the reduce-scatters are issued in
      the schedule's REDUCE_GRAD action, which starts *after* the stage's last backward (nothing of the stage's
      backward is left to hide them behind).

    ``backwards``: (stage, start, end) of each backward pass (B, or W where the backward is split);
    ``reduce_grads``: (stage, start, end, [collectives issued]) of each REDUCE_GRAD; ``bucket_launches``:
    (stage, time) of each DDP bucket; ``gradient_collectives``: the step's all-reduces (DDP) or reduce-scatters
    (FSDP), counted at the calls (not from ``bucket_launches``), all of which must be accounted for; none at
    all is a problem too. Returns what disagrees (empty: as torch runs it).
    """
    problems = []
    if gradient_collectives == 0 and dp_mode in ("ddp", "fsdp"):
        problems.append(f"no {'all-reduce' if dp_mode == 'ddp' else 'reduce-scatter'} of the gradients issued in "
                        f"the step")
    last = {}
    for stage, start, end in backwards:
        if stage not in last or end > last[stage][1]:
            last[stage] = (start, end)
    if dp_mode == "ddp":
        for stage, at in bucket_launches:
            if stage not in last:
                problems.append(f"stage {stage}: a bucket launched, but the stage ran no backward")
            elif not last[stage][0] <= at <= last[stage][1]:
                problems.append(f"stage {stage}: a bucket launched at {at:.6f} s, outside its last backward "
                                f"[{last[stage][0]:.6f}, {last[stage][1]:.6f}]")
        missing = sorted(set(last) - {stage for stage, _ in bucket_launches})
        if missing:
            problems.append(f"stages {missing}: no bucket launched in the step")
        if len(bucket_launches) != gradient_collectives:
            problems.append(f"{len(bucket_launches)} bucket launches timed, {gradient_collectives} all-reduces issued")
    elif dp_mode == "fsdp":
        seen = {}
        for stage, start, end, issued in reduce_grads:
            seen[stage] = seen.get(stage, 0) + 1
            if stage in last and start < last[stage][1]:
                problems.append(f"stage {stage}: REDUCE_GRAD started at {start:.6f} s, before its last backward "
                                f"ended ({last[stage][1]:.6f})")
        if sorted(seen) != sorted(last) or any(n != 1 for n in seen.values()):
            problems.append(f"REDUCE_GRAD per stage {seen}, backwards on stages {sorted(last)}: one each expected")
        inside = sum(c == "reduce_scatter" for *_, issued in reduce_grads for c in issued)
        if inside != gradient_collectives:
            problems.append(f"{inside} of the step's {gradient_collectives} reduce-scatters issued inside REDUCE_GRAD")
    else:
        raise ValueError(f"dp_mode must be 'ddp' or 'fsdp', not {dp_mode!r}")
    return problems


def pp_send_bytes(stages_of_rank: list[int], num_stages: int, microbatches: int, microbatch_rows: int,
                  seq_len: int, dim: int, bytes_per_element: int = 4) -> int:
    """Bytes one rank sends to its pipeline neighbours in a step: for each of its stages, the activations of
    every microbatch forward (unless it is the last stage) and their gradients backward (unless it is the
    first: nothing needs the gradient of token ids). One activation is microbatch x sequence x hidden.
    A neighbour stage on the same rank (the middle of a V: stages r and 2P-1-r meet on rank P-1) gets its
    tensor without a message."""
    activation = microbatch_rows * seq_len * dim * bytes_per_element
    mine = set(stages_of_rank)
    sends = sum((stage != num_stages - 1 and stage + 1 not in mine) + (stage != 0 and stage - 1 not in mine)
                for stage in stages_of_rank)
    return sends * microbatches * activation


def tp_stage_comm_bytes(cfg, layers: int, first: bool, last: bool, microbatches: int, microbatch_rows: int,
                        seq_len: int, bytes_per_element: int = 4) -> dict[str, int]:
    """Payload bytes per step of the TP collectives of one pipeline stage (the plan of
    :func:`distlab.tensor_parallel.transformer_tp_plan`, with the head's logits gathered: see hybrid_3d.py).

    Per microbatch, each block all-reduces microbatch x sequence x hidden twice forward (after wo, after w2) and
    twice backward (the input gradients of the attention and feed-forward regions); the vocabulary-split
    embedding adds one forward all-reduce; the head all-gathers the logits (x vocabulary) forward and
    all-reduces its input gradient backward.
    """
    activation = microbatch_rows * seq_len * cfg.dim * bytes_per_element
    all_reduce = 4 * layers * activation + (activation if first else 0) + (activation if last else 0)
    all_gather = microbatch_rows * seq_len * cfg.vocab_size * bytes_per_element if last else 0
    return {"all_reduce": microbatches * all_reduce, "all_gather": microbatches * all_gather}


def comm_dimension(call) -> str:
    """The mesh dimension a :class:`distlab.comm.CollectiveCall` belongs to, in a (pp, dp, tp) run:

    * point-to-point sends are the pipeline's (``pp``);
    * DTensor's functional collectives are tensor parallelism's (``tp``): the plan issues them;
    * the other collectives are FSDP2's all-gathers and reduce-scatters over ``dp`` (FSDP2 calls
      torch.distributed directly, even on a 2-D mesh where each of its parameters is a TP shard).
    """
    if call.collective == "send":
        return "pp"
    return "tp" if call.source == "functional" else "dp"


def bytes_by_dimension(calls) -> dict[str, dict[str, int]]:
    """``{dimension: {collective: payload bytes}}`` of measured calls (see :func:`comm_dimension`). A call on a
    group of one rank moves nothing (FSDP over one rank, which a bf16 run uses for its mixed precision alone)."""
    summary: dict[str, dict[str, int]] = {}
    for call in calls:
        if call.group_size == 1:
            continue
        per_dim = summary.setdefault(comm_dimension(call), {})
        per_dim[call.collective] = per_dim.get(call.collective, 0) + call.payload_bytes
    return summary


# --------------------------------------------------------------------------------------------------
# --config FILE.json under the command line
# --------------------------------------------------------------------------------------------------


def merge_config_file(parser: argparse.ArgumentParser, argv: list[str] | None = None,
                      script: str | None = None) -> tuple[argparse.Namespace, str | None]:
    """Parse ``argv`` with the settings of ``--config FILE.json`` as defaults: flags given override the file.

    The file is one JSON object of flag names (``"dp_mode"`` or ``"dp-mode"``) to values, plus optional
    ``"script"`` (the script it is meant for: refused by another) and ``"description"``. Returns the
    arguments and a problem (one sentence) or None; the caller reports the problem as a config error on every
    rank, so a bad file stops the job like any bad flag.
    """
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if not path:
        return args, None
    try:
        settings = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return args, f"--config {path}: no such file"
    except json.JSONDecodeError as error:
        return args, f"--config {path} is not valid JSON ({error.msg}, line {error.lineno})"
    if not isinstance(settings, dict):
        return args, f"--config {path} must hold one JSON object of flag names and values"
    meant_for = settings.pop("script", None)
    settings.pop("description", None)
    if script and meant_for and Path(meant_for).name != Path(script).name:
        return args, f"--config {path} is for {meant_for}, not {Path(script).name}"
    known = {action.dest for action in parser._actions} - {"help", "config"}
    settings = {key.replace("-", "_"): value for key, value in settings.items()}
    unknown = sorted(set(settings) - known)
    if unknown:
        return args, f"--config {path}: unknown setting(s) {', '.join(unknown)}"
    parser.set_defaults(**settings)
    return parser.parse_args(argv), None


def clip_grad_norm_(parameters, max_norm: float, pp_group=None, norm_type: float = 2.0):
    """Clip the gradients of a model split over pp x dp x tp by their *total* norm, as one device would.

    Each rank holds DTensor gradients (sharded over dp and tp, on one mesh or another) of its own stages. torch's
    ``get_total_norm`` gives this rank's stages' norm, a DTensor reduced over dp and tp by ``full_tensor()``,
    one per mesh the gradients live on; the stages' norms, raised to ``norm_type``, are summed over the pp group;
    ``clip_grads_with_norm_`` then scales every gradient by ``max_norm / total`` (when that is below 1). The same
    steps torchtitan takes. Returns the total norm (a plain tensor, the same on every rank).

    The infinity norm is the largest |gradient|: no power to sum (``norm ** inf`` is inf or 0, and its
    ``1 / inf``-th root 1 whatever the gradients), but the largest over the meshes and a MAX all-reduce over pp,
    as torch's own ``_get_total_norm`` takes the inf-norm (the max) of the per-device norms (torch 2.13,
    ``nn/utils/clip_grad.py:105``) and DTensor reduces a partial inf-norm with "max"
    (``distributed/tensor/_ops/_math_ops.py:590``)."""
    import math

    import torch
    import torch.distributed as dist

    infinite = math.isinf(norm_type)
    parameters = [p for p in parameters if p.grad is not None]
    by_mesh: dict = {}
    for p in parameters:  # DTensors of different meshes cannot share one foreach call: one group a mesh
        by_mesh.setdefault(id(getattr(p.grad, "device_mesh", None)), []).append(p)
    total = None
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if infinite:
            total = norm if total is None else torch.maximum(total, norm)
        else:
            total = norm ** norm_type if total is None else total + norm ** norm_type
    if total is None:
        total = torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=pp_group)
    if not infinite:
        total = total ** (1.0 / norm_type)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total
