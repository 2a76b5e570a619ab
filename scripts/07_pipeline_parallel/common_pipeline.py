"""What the chapter's pipeline scripts share: torch's schedules by name, where each stage lives, the
transformer cut into stages, and a stopwatch on every forward and backward a stage runs.

Not in ``distlab`` because nothing outside chapter 07 needs it; ``distlab.schedules`` holds the part that
is pure (schedules as data, simulation, bubble maths) and this file the part that touches torch.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections import Counter
from dataclasses import dataclass

import torch

import torch.distributed as dist

from distlab import models, runtime, schedules


# ---- torch's schedules, by the names torch.distributed.pipelining.get_schedule_class takes ------------------

@dataclass(frozen=True)
class PipelineChoice:
    name: str                     # torch's name
    multi_stage: bool             # the schedule takes a list of stages (PipelineScheduleMulti)
    v_shape: bool                 # stages r and 2P-1-r on rank r (ZBV, DualPipeV); else r, r+P, r+2P, ...
    default_stages_per_rank: int  # V
    fixed_stages_per_rank: bool   # V cannot change
    ours: str | None              # the distlab.schedules builder that gives the same order, if any
    needs: str                    # microbatch requirement, in words (for --help and errors)


CHOICES = {c.name: c for c in (
    PipelineChoice("GPipe", False, False, 1, True, "gpipe", "any M"),
    PipelineChoice("1F1B", False, False, 1, True, "1f1b", "M >= P"),
    # torch asks the interleaved schedules for M a multiple of its rounds, max(1, M // P) (schedules.py:2935-2942,
    # 3046-3053). Interleaved1F1B keeps Megatron's stricter rule, M a multiple of P: our builder walks groups
    # of P microbatches, and the bubble formula assumes them.
    PipelineChoice("Interleaved1F1B", True, False, 2, False, "interleaved_1f1b", "M a multiple of P"),
    PipelineChoice("InterleavedZeroBubble", True, False, 1, False, "zero_bubble", "M a multiple of max(1, M // P)"),
    # torch plans ZBV for max(2P - 1, M) microbatches and drops the padding: it refuses no M
    # (torch/distributed/pipelining/schedules.py:3269-3271, 3378-3389); DualPipeV refuses M < 2P (3439-3443).
    PipelineChoice("ZBVZeroBubble", True, True, 2, True, "zbv", "any M"),
    PipelineChoice("DualPipeV", True, True, 2, True, "dual_pipe_v", "M >= 2P"),
)}


def schedule_help() -> str:
    return "; ".join(f"{c.name} ({c.needs}" + (", V=2 in a V" if c.v_shape else
                                                f", V={c.default_stages_per_rank} by default"
                                                if not c.fixed_stages_per_rank else "") + ")"
                     for c in CHOICES.values())


def check_pipeline_config(schedule: str, ranks: int, microbatches: int, stages_per_rank: int | None) -> int:
    """Refuse (ConfigError: one line, exit 2) what would fail or hang inside torch; return V."""
    runtime.require(schedule in CHOICES, f"unknown schedule {schedule!r}; choose one of {', '.join(CHOICES)}")
    choice = CHOICES[schedule]
    runtime.require(microbatches >= 1, f"--microbatches {microbatches}: need at least one microbatch")
    chunks = stages_per_rank or choice.default_stages_per_rank
    runtime.require(chunks >= 1, f"--stages-per-rank {chunks}: need at least one stage per rank")
    if choice.v_shape:
        # The V: rank r holds stages r and 2P-1-r, so activations go down the ranks and back up. Any other
        # count of stages per rank has no V to follow (and a wrong placement hangs inside torch).
        runtime.require(chunks == 2, f"{schedule} places exactly 2 stages per rank in a V (stages r and 2P-1-r); "
                                     f"--stages-per-rank {chunks} does not fit")
    elif choice.fixed_stages_per_rank:
        runtime.require(chunks == 1, f"{schedule} holds one stage per rank; --stages-per-rank {chunks} needs "
                                     f"Interleaved1F1B or InterleavedZeroBubble")
    stages = ranks * chunks
    if choice.needs == "M >= P":
        runtime.require(microbatches >= ranks, f"{schedule} needs at least as many microbatches as stages: "
                                               f"--microbatches {microbatches} < {ranks} stages")
    elif choice.needs == "M >= 2P":
        runtime.require(microbatches >= stages, f"{schedule} needs at least as many microbatches as stages: "
                                                f"--microbatches {microbatches} < {stages} stages")
    elif choice.needs == "M a multiple of max(1, M // P)":
        rounds = max(1, microbatches // ranks)
        runtime.require(microbatches % rounds == 0, f"{schedule} walks the microbatches in {rounds} rounds "
                                                    f"(max(1, M // P), as torch does): --microbatches {microbatches} "
                                                    f"is not a multiple of {rounds}")
    elif choice.needs == "M a multiple of P":
        runtime.require(microbatches % ranks == 0, f"{schedule} walks the microbatches in rounds of P = {ranks}: "
                                                   f"--microbatches {microbatches} is not a multiple of {ranks}")
    return chunks


def stage_indices(schedule: str, rank: int, ranks: int, chunks: int) -> list[int]:
    """The stages rank ``rank`` holds: r, r+P, r+2P, ... (loop), or r and 2P-1-r (V)."""
    if CHOICES[schedule].v_shape:
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(chunks)]


def torch_schedule(schedule: str, stages: list, microbatches: int, loss_fn):
    """torch's schedule object for this rank's stages (a single-stage class gets the one stage)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    cls = get_schedule_class(schedule)
    if CHOICES[schedule].multi_stage:
        return cls(stages, microbatches, loss_fn=loss_fn)
    return cls(stages[0], microbatches, loss_fn=loss_fn)


def expected_schedule(schedule: str, ranks: int, microbatches: int, chunks: int) -> schedules.Schedule:
    """What each rank should run, as distlab data: our own builder, not torch's ``pipeline_order`` (which torch
    executes by construction: comparing what ran with it would prove nothing). gpipe, 1f1b, interleaved_1f1b
    and zero_bubble_h1 follow Megatron and the papers; interleaved_zero_bubble, zbv and dual_pipe_v restate
    torch's own planners (``_calculate_single_rank_operations``), so for those the check shows only that torch
    ran what it plans."""
    ours = CHOICES[schedule].ours
    if ours == "zero_bubble":
        return (schedules.zero_bubble_h1(ranks, microbatches) if chunks == 1
                else schedules.interleaved_zero_bubble(ranks, microbatches, chunks))
    if ours == "zbv":
        return schedules.zbv(ranks, microbatches)
    if ours == "dual_pipe_v":
        return schedules.dual_pipe_v(ranks, microbatches)
    return schedules.build(ours, ranks, microbatches, chunks if ours == "interleaved_1f1b" else 1)


# ---- the stopwatch: one event per forward, backward and weight-gradient pass ----------------------------------

def record_actions(stage, events: list, sync=None, clock=time.perf_counter) -> None:
    """Wrap the stage's three compute entry points so each call appends (stage, microbatch, kind, start, end,
    full backward?) to ``events``.

    The schedule waits for incoming activations and gradients *before* it calls these, so waiting is not
    counted as work: it shows up as idle time, which is what the bubble is. In a schedule that splits the
    backward, ``backward_one_chunk(full_backward=False)`` is the input gradient (torch's I) and
    ``backward_weight_one_chunk`` the weight gradient (W).

    ``sync`` (``rt.sync`` on a GPU) runs before the clock starts *and* before it stops. Before it stops, so
    that the pass is timed, not its launch. Before it starts, because on NCCL the schedule's
    ``work.wait()`` for this pass's input makes the GPU stream wait, not the host
    (torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp:286-312, 350-355): the host reaches
    this wrapper before the input has arrived, and without the sync the wait would be timed as work and the
    bubble would come out low. ``clock`` is for tests.
    """
    def timed(method, kind):
        def wrapper(chunk_id, *args, **kwargs):
            if sync is not None:
                sync()          # on a GPU, let the input arrive (and earlier work finish) first
            start = clock()
            result = method(chunk_id, *args, **kwargs)
            if sync is not None:
                sync()          # on a GPU, wait for the kernels: time the work, not its launch
            full = kind == "B" and kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            events.append((stage.stage_index, chunk_id, kind, start, clock(), bool(full)))
            return result
        return wrapper

    stage.forward_one_chunk = timed(stage.forward_one_chunk, "F")
    stage.backward_one_chunk = timed(stage.backward_one_chunk, "B")
    stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, "W")


def gather_timeline(events: list, t0: float, rank: int, torch_kinds: bool = False) -> list[dict]:
    """Every rank's events on one clock, on every rank: each rank subtracts its own t0, read just after a
    common barrier (so clocks of different nodes need not agree), then all_gather_object.

    With ``torch_kinds`` each backward is named as torch names it: B for a full backward, I for the input
    gradient alone (``distlab.schedules``' letters). Without, every backward is a B (chapter 09's scripts).
    """
    mine = []
    for stage, microbatch, kind, start, end, *full in events:
        if torch_kinds and kind == "B" and full and not full[0]:
            kind = "I"
        mine.append(schedules.TimelineEvent(rank, stage, microbatch, kind, start - t0, end - t0).to_dict())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted((e for rank_events in everyone for e in rank_events), key=lambda e: (e["rank"], e["start"]))


def _sent_at(timeline: list[dict], held: frozenset) -> dict[int, float]:
    """When each pass's output left its rank: at its end, or, for a forward in ``held`` ((stage, microbatch)
    of DualPipeV's paired forwards: torch sends their output behind the pair, schedules.py:1502-1509), at the
    end of the next pass on its rank, the pair's backward."""
    sent = {id(e): e["end"] for e in timeline}
    for rank in {e["rank"] for e in timeline}:
        ordered = sorted((e for e in timeline if e["rank"] == rank), key=lambda e: e["start"])
        for a, b in zip(ordered, ordered[1:]):
            if a["kind"] == "F" and (a["stage"], a["microbatch"]) in held:
                sent[id(a)] = b["end"]
    return sent


def paired_forwards(schedule: schedules.Schedule) -> frozenset:
    """(stage, microbatch) of every forward that torch's OVERLAP_F_B pairs with the backward after it."""
    return frozenset((schedule.actions[rank][i].stage, schedule.actions[rank][i].microbatch)
                     for rank, positions in schedule.overlap_f_b.items() for i in positions)


def handoff_latency(timeline: list[dict], held: frozenset = frozenset()) -> float:
    """Median time from a pass's output leaving one rank to the pass that waited for it starting on another.

    Only hand-offs the receiver actually waited for count (it was idle when the output left): that is the
    cost of one message plus waking the receiver, which the bubble formula does not charge. 0 if none waited.
    A paired forward's output leaves when its pair ends (``held``: see :func:`paired_forwards`).
    """
    by_key = {(e["stage"], e["microbatch"], "B" if e["kind"] == "I" else e["kind"]): e for e in timeline}
    last_stage = max(e["stage"] for e in timeline)
    sent = _sent_at(timeline, held)
    previous_end = {}
    for rank in {e["rank"] for e in timeline}:
        ordered = sorted((e for e in timeline if e["rank"] == rank), key=lambda e: e["start"])
        previous_end.update({id(b): a["end"] for a, b in zip(ordered, ordered[1:])})
    waits = []
    for e in timeline:
        if e["kind"] == "F" and e["stage"] > 0:
            source = by_key.get((e["stage"] - 1, e["microbatch"], "F"))
        elif e["kind"] in ("B", "I") and e["stage"] < last_stage:    # the gradient: the next stage's B or I
            source = by_key.get((e["stage"] + 1, e["microbatch"], "B"))
        else:
            continue
        if source is None or source["rank"] == e["rank"]:
            continue
        if previous_end.get(id(e), float("-inf")) <= sent[id(source)] <= e["start"]:   # the receiver was waiting
            waits.append(e["start"] - sent[id(source)])
    waits.sort()
    return waits[len(waits) // 2] if waits else 0.0


def dispatch_time(timeline: list[dict], held: frozenset = frozenset()) -> float:
    """Median gap between two consecutive passes of one rank when the second did not wait for a message (its
    input from another rank had left before the first ended): the runtime's own time per action, idle."""
    by_key = {(e["stage"], e["microbatch"], "B" if e["kind"] == "I" else e["kind"]): e for e in timeline}
    last_stage = max(e["stage"] for e in timeline)
    sent = _sent_at(timeline, held)
    gaps = []
    for rank in {e["rank"] for e in timeline}:
        ordered = sorted((e for e in timeline if e["rank"] == rank), key=lambda e: e["start"])
        for before, after in zip(ordered, ordered[1:]):
            if after["kind"] == "F" and after["stage"] > 0:
                source = by_key.get((after["stage"] - 1, after["microbatch"], "F"))
            elif after["kind"] in ("B", "I") and after["stage"] < last_stage:
                source = by_key.get((after["stage"] + 1, after["microbatch"], "B"))
            else:
                source = None
            if source is None or source["rank"] == rank or sent[id(source)] <= before["end"]:
                gaps.append(after["start"] - before["end"])
    gaps.sort()
    return max(0.0, gaps[len(gaps) // 2]) if gaps else 0.0


def measured_costs(timeline: list[dict], chunks: int, held: frozenset = frozenset()) -> schedules.Costs:
    """Costs for the simulator from a measured run: median pass times (per rank's layers, so x V), the
    median hand-off latency as the send cost and the median gap between passes that waited for nothing as
    the dispatch cost. The full backward is the median B, or I + W where every backward was split. ``held``:
    the paired forwards, whose output leaves with their pair (:func:`paired_forwards`)."""
    def median(kind):
        values = sorted(e["end"] - e["start"] for e in timeline if e["kind"] == kind and e["end"] > e["start"])
        return values[len(values) // 2] if values else 0.0

    forward, full, input_grad, weight = median("F"), median("B"), median("I"), median("W")
    split = input_grad + weight
    return schedules.Costs(forward=forward * chunks, backward=(full or split) * chunks,
                           weight_fraction=weight / split if split > 0 else 0.5, send=handoff_latency(timeline, held),
                           dispatch=dispatch_time(timeline, held))


class HeldActivations:
    """Measured: the (stage, microbatch) pairs whose activations autograd still holds on this rank, and the
    most held at once. A pair is held from the forward that saves tensors for backward until autograd frees
    the last of them: after the full backward, or, when the backward is split, after W (torch keeps the
    graph from I to W). Counted with saved-tensor hooks around each forward, not read off the schedule, so a
    release at the wrong step (at I instead of W) shows."""

    def __init__(self):
        self.alive: Counter = Counter()         # (stage, microbatch) -> saved tensors still alive
        self.peak = 0

    def watch(self, stage) -> None:
        """Count what autograd saves during each of the stage's forwards."""
        forward = stage.forward_one_chunk

        def counted(chunk_id, *args, **kwargs):
            key = (stage.stage_index, chunk_id)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, key, self), _Saved.unpack):
                return forward(chunk_id, *args, **kwargs)

        stage.forward_one_chunk = counted

    def reset(self) -> None:
        self.peak = len(self.alive)


class _Saved:
    def __init__(self, tensor, key, ledger: HeldActivations):
        # detach(): the same storage, without the tensor's grad_fn. A tensor saved as its own node's output
        # (tanh saves its result) would otherwise hold that node, which holds this object: a cycle that only
        # the garbage collector frees, so the hook itself would keep activations alive.
        self.tensor, self.key, self.ledger = tensor.detach(), key, ledger
        ledger.alive[key] += 1
        ledger.peak = max(ledger.peak, len(ledger.alive))

    @staticmethod
    def unpack(saved):
        return saved.tensor

    def __del__(self):                          # autograd let go of it
        self.ledger.alive[self.key] -= 1
        if self.ledger.alive[self.key] == 0:
            del self.ledger.alive[self.key]


def executed_order(timeline: list[dict], rank: int) -> list[schedules.Action]:
    """The actions rank ``rank`` actually ran, in the order they started."""
    return [schedules.Action(e["stage"], e["microbatch"], e["kind"])
            for e in sorted((e for e in timeline if e["rank"] == rank), key=lambda e: e["start"])]


# ---- the course's transformer, cut into pipeline stages -------------------------------------------------------

def layers_of_stage(num_layers: int, num_stages: int, stage: int) -> list[int]:
    """Contiguous blocks of layers, as even as possible (the first stages take one more when it does not divide)."""
    base, extra = divmod(num_layers, num_stages)
    first = stage * base + min(stage, extra)
    return list(range(first, first + base + (1 if stage < extra else 0)))


def transformer_stage(model, stage: int, num_stages: int):
    """A copy of ``model`` that keeps only what stage ``stage`` runs, under the same parameter names.

    The first stage keeps the token embeddings, the last the final norm and output projection; every stage
    keeps its own ``layers[i]`` with i unchanged (the ModuleDict is keyed by name, not position), so
    ``stage.state_dict()`` keys match the full model's and a checkpoint needs no renaming.
    """
    keep = {str(i) for i in layers_of_stage(len(model.layers), num_stages, stage)}
    dropped = [block for name, block in model.layers.items() if name not in keep]
    if stage != 0:
        dropped.append(model.tok_embeddings)
    if stage != num_stages - 1:
        dropped += [model.norm, model.output]
    # copy only what this stage keeps: deepcopy's memo hands back None for each dropped module instead of copying it
    # (a 96-block model's stage of 6 blocks copies 6, not 96), and the Nones are removed below
    part = copy.deepcopy(model, memo={id(module): None for module in dropped})
    for name in list(part.layers):
        if name not in keep:
            del part.layers[name]
    return part


def add_training_flags(parser) -> None:
    """--batch, --layers, --lr, --reference: the flags of the scripts that train the transformer in a pipeline."""
    parser.add_argument("--batch", type=runtime.positive_int, default=16, help="global batch (sequences), split into M microbatches")
    parser.add_argument("--layers", type=runtime.positive_int, default=None,
                        help="transformer blocks, at least one per stage (default: 8 for tiny, whose 2 would not "
                             "fill 4 stages; the preset's otherwise)")
    runtime.add_lr_flag(parser)
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                        help="train the single-device model too and compare (default: on for tiny; off for a100, "
                             "whose whole model would not fit beside a stage)")


def resolve_training_flags(args):
    """Fill in the defaults that depend on the preset (``args.layers``, ``args.reference``); return the config."""
    if args.layers is None:
        args.layers = 8 if args.preset == "tiny" else models.preset(args.preset).n_layers
    if args.reference is None:
        args.reference = args.preset == "tiny"
    return models.preset(args.preset, n_layers=args.layers)
