"""Pipeline schedules as data: who runs which forward or backward, in which order, and what that costs.

A pipeline cuts the model into *stages*. Each rank holds one stage (or, interleaved, ``chunks`` stages) and
runs an ordered list of :class:`Action` s, each one microbatch through one stage:

- ``F``: forward.
- ``B``: the *full* backward, input gradient and weight gradient together (naive, GPipe, 1F1B, interleaved
  1F1B, and the middle of DualPipeV).
- ``I``: the *input* gradient alone, the part the previous stage waits for (zero-bubble schedules).
- ``W``: the weight gradient alone, after its ``I``. Nobody waits for it, so a schedule may run it late, in
  time the rank would otherwise sit idle.

The letters are torch's (``_ComputationType`` in torch/distributed/pipelining/schedules.py:54-66: F, I, W,
and B for FULL_BACKWARD), and an action prints as torch prints it: ``0I0`` is stage 0's input gradient of
microbatch 0.

:func:`simulate` turns the per-rank lists into a timeline under simple :class:`Costs`, and the bubble (the
idle share of ranks x time) falls out of it. The closed form :func:`bubble_fraction` says the same thing::

    bubble(GPipe) = bubble(1F1B) = (P - 1) / (M + P - 1)      # 1F1B saves memory, not time
    bubble(interleaved, V chunks) = (P - 1) / (V*M + P - 1)
    bubble(zero bubble H1, F = B = W) = (P - 1) / (3*M + P - 1), about a third of 1F1B's

The builders follow Megatron-LM and ``torch.distributed.pipelining``, one for each of torch's schedules
(:func:`interleaved_zero_bubble`, :func:`zbv` and :func:`dual_pipe_v` included); :func:`from_torch_pipeline_order` reads torch's own schedules into the same
form, so both can be compared, simulated and drawn (see ``distlab.gantt``).
"""

from __future__ import annotations

import gc
from collections import defaultdict
from dataclasses import dataclass, field

SCHEDULE_NAMES = ("naive", "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
KINDS = ("F", "B", "I", "W")        # forward, full backward, input gradient, weight gradient (torch's letters)


@dataclass(frozen=True, slots=True)
class Action:
    """One microbatch through one stage: ``kind`` is "F" (forward), "B" (full backward), "I" (input gradient
    alone) or "W" (weight gradient alone). Printed like torch prints its actions: stage, kind, microbatch
    (``4B1``, ``0I0``).
    """

    stage: int
    microbatch: int
    kind: str

    def __str__(self) -> str:   # torch prints UNSHARD and RESHARD (microbatch -1 here) without a microbatch
        return f"{self.stage}{self.kind}{self.microbatch if self.microbatch >= 0 else ''}"


@dataclass
class Schedule:
    """A complete pipeline schedule: for every rank, the actions it runs, in order.

    ``chunks`` is the number of stages per rank (V); there are ``num_ranks * chunks`` stages and stage s
    lives on rank ``stage_to_rank[s]``. ``split_backward`` says whether backwards may be split into I and
    W; each (stage, microbatch) then has F, I and W, or (DualPipeV mixes both) F and a full B.
    ``overlap_f_b[rank]`` holds the positions i where torch's OVERLAP_F_B pairs action i (a forward) with
    action i + 1 (a backward of another stage): torch runs the two one after the other and sends both
    results after the second (torch/distributed/pipelining/schedules.py:1502-1509 put the sends behind the
    pair, 2632-2636 run its halves in turn), so the forward's output leaves only when the backward is done.
    """

    name: str
    num_ranks: int
    num_microbatches: int
    chunks: int
    stage_to_rank: dict[int, int]
    actions: dict[int, list[Action]]
    split_backward: bool = False
    overlap_f_b: dict[int, set[int]] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of_rank(self, rank: int) -> list[int]:
        return sorted(s for s, r in self.stage_to_rank.items() if r == rank)

    def validate(self) -> None:
        """Raise ValueError unless every (stage, microbatch) has exactly one F and one full backward B, or (when
        the backward is split) one F, one I and one W, each on the rank that holds the stage."""
        kinds = KINDS if self.split_backward else ("F", "B")
        seen: dict[tuple[int, int], set[str]] = defaultdict(set)
        for rank, rank_actions in self.actions.items():
            for action in rank_actions:
                if action.kind not in kinds:
                    raise ValueError(f"{self.name}: rank {rank} has action {action} of kind {action.kind!r}; "
                                     f"this schedule allows only {', '.join(kinds)}.")
                if self.stage_to_rank.get(action.stage) != rank:
                    raise ValueError(f"{self.name}: rank {rank} runs {action}, but stage {action.stage} lives "
                                     f"on rank {self.stage_to_rank.get(action.stage)}.")
                if not 0 <= action.microbatch < self.num_microbatches:
                    raise ValueError(f"{self.name}: rank {rank} runs {action}, but microbatches are "
                                     f"0..{self.num_microbatches - 1}.")
                held = seen[action.stage, action.microbatch]
                if action.kind in held:
                    raise ValueError(f"{self.name}: {action} appears twice.")
                held.add(action.kind)
        for stage in range(self.num_stages):
            for microbatch in range(self.num_microbatches):
                held = seen.get((stage, microbatch), set())
                if held in ({"F", "B"}, {"F", "I", "W"}):
                    continue
                wanted = {"F", "I", "W"} if held & {"I", "W"} else {"F", "B"}
                missing = sorted(wanted - held, key=KINDS.index)
                if missing:
                    raise ValueError(f"{self.name}: {Action(stage, microbatch, missing[0])} is missing.")
                raise ValueError(f"{self.name}: stage {stage}, microbatch {microbatch} has a full backward B "
                                 f"and a split one (I and W).")

    def format(self) -> str:
        """The per-rank order as text, one line per rank: ``rank 0: 0F0 0F1 0B0 ...``."""
        return "\n".join(f"rank {rank}: " + " ".join(str(a) for a in self.actions[rank])
                         for rank in sorted(self.actions))


# ----------------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------------

def _check_sizes(num_ranks: int, num_microbatches: int, chunks: int = 1) -> None:
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}.")


def _one_stage_per_rank(name: str, num_ranks: int, num_microbatches: int,
                        actions: dict[int, list[Action]], split_backward: bool = False) -> Schedule:
    return Schedule(name, num_ranks, num_microbatches, 1, {r: r for r in range(num_ranks)}, actions,
                    split_backward)


def naive(num_ranks: int, num_microbatches: int) -> Schedule:
    """One microbatch in flight at a time: it goes forward through every stage and back before the next
    starts. Every rank but one is always idle: bubble (P - 1) / P."""
    _check_sizes(num_ranks, num_microbatches)
    actions = {rank: [a for m in range(num_microbatches) for a in (Action(rank, m, "F"), Action(rank, m, "B"))]
               for rank in range(num_ranks)}
    return _one_stage_per_rank("naive", num_ranks, num_microbatches, actions)


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs all M forwards, then all M backwards (in microbatch order, as torch does).
    Holds the activations of all M microbatches at once."""
    _check_sizes(num_ranks, num_microbatches)
    actions = {rank: [Action(rank, m, "F") for m in range(num_microbatches)]
               + [Action(rank, m, "B") for m in range(num_microbatches)]
               for rank in range(num_ranks)}
    return _one_stage_per_rank("gpipe", num_ranks, num_microbatches, actions)


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron's default): rank r runs P - 1 - r warm-up forwards, then alternates one
    forward and one backward, then drains the remaining backwards.

    Same bubble as GPipe; what it saves is memory: rank r holds at most P - r microbatches, not M.
    """
    _check_sizes(num_ranks, num_microbatches)
    actions = {}
    for rank in range(num_ranks):
        warmup = min(num_ranks - 1 - rank, num_microbatches)
        order = [Action(rank, m, "F") for m in range(warmup)]
        for i in range(num_microbatches - warmup):      # steady state: one forward, one backward
            order += [Action(rank, warmup + i, "F"), Action(rank, i, "B")]
        order += [Action(rank, m, "B") for m in range(num_microbatches - warmup, num_microbatches)]
        actions[rank] = order
    return _one_stage_per_rank("1f1b", num_ranks, num_microbatches, actions)


def interleaved_warmup(rank: int, num_ranks: int, num_microbatches: int, chunks: int,
                       per_round: int | None = None) -> int:
    """Forwards rank ``rank`` runs before its first backward in interleaved 1F1B (Megatron and torch).
    ``per_round``: the microbatches a chunk takes in a row (P unless given; torch's ``_get_warmup_ops``)."""
    # The last rank must first push a round of microbatches through each of its first V - 1 chunks; every
    # hop further from the last rank adds 2: one forward there and one backward back.
    group = per_round or num_ranks
    return min((chunks - 1) * group + 2 * (num_ranks - 1 - rank), chunks * num_microbatches)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, chunks: int = 2, torch_rounds: bool = False
                     ) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021; ``ScheduleInterleaved1F1B`` in torch).

    The model is cut into P * V stages; stage s lives on rank s % P, so rank r holds stages r, r + P, ...
    Each rank walks its chunks in groups of P microbatches (depth first) and runs 1F1B over the V * M
    (chunk, microbatch) pairs. Each chunk is 1/V of the rank's layers, so the warm-up and drain shrink V-fold:
    bubble (P - 1) / (V*M + P - 1), for V times more point-to-point messages and a little more memory.

    Requires M % P == 0, like Megatron. With V = 1 it is a valid schedule but not plain 1F1B: its
    warm-up is 2 (P - 1 - r) forwards, as in torch. ``torch_rounds``: torch's wider rule instead
    (schedules.py:2934-2943): any M that is a multiple of max(1, M // P) rounds, a chunk taking
    N = M / rounds microbatches in a row (P when P divides M).
    """
    _check_sizes(num_ranks, num_microbatches, chunks)
    if torch_rounds:
        rounds = max(1, num_microbatches // num_ranks)
        if num_microbatches % rounds != 0:
            raise ValueError(f"interleaved_1f1b needs num_microbatches ({num_microbatches}) to be a multiple of "
                             f"its {rounds} rounds (max(1, M // P)), as torch does.")
        group = num_microbatches // rounds               # microbatches per round
    elif num_microbatches % num_ranks != 0:
        raise ValueError(f"interleaved_1f1b needs num_microbatches ({num_microbatches}) to be a multiple of "
                         f"num_ranks ({num_ranks}).")
    else:
        group = num_ranks
    total = chunks * num_microbatches                    # (chunk, microbatch) pairs per rank

    def pair(step: int, backward: bool) -> tuple[int, int]:
        # Steps go through a round of microbatches of one chunk, then the same ones of the next chunk, ...;
        # after all V chunks, the next round. Backward walks the chunks from the last one.
        chunk = (step // group) % chunks
        if backward:
            chunk = chunks - 1 - chunk
        microbatch = (step // (group * chunks)) * group + step % group
        return chunk, microbatch

    actions = {}
    for rank in range(num_ranks):
        def act(step: int, kind: str) -> Action:
            chunk, microbatch = pair(step, backward=kind == "B")
            return Action(chunk * num_ranks + rank, microbatch, kind)

        warmup = interleaved_warmup(rank, num_ranks, num_microbatches, chunks, group)
        order = [act(k, "F") for k in range(warmup)]
        for i in range(total - warmup):
            order += [act(warmup + i, "F"), act(i, "B")]
        order += [act(k, "B") for k in range(total - warmup, total)]
        actions[rank] = order
    stage_to_rank = {s: s % num_ranks for s in range(num_ranks * chunks)}
    return Schedule("interleaved_1f1b", num_ranks, num_microbatches, chunks, stage_to_rank, actions)


def zero_bubble_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """Zero bubble H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism").

    The backward is split: I (input gradient) is what the previous stage waits for, W (weight gradient)
    waits for nobody. The order is 1F1B's with I in place of the full backward, and rank r keeps up to r
    W's pending, running each later, where 1F1B's rank r would wait. Warm-up is 1F1B's (P - 1 - r
    forwards), so at most P microbatches are held on any rank: 1F1B's rank 0 peak, which later ranks now
    reach too. With F = I = W the bubble is (P - 1) / (3M + P - 1), about a third of 1F1B's. torch's
    ``ScheduleInterleavedZeroBubble`` with one stage per rank produces this exact order.
    """
    _check_sizes(num_ranks, num_microbatches)
    actions = {}
    for rank in range(num_ranks):
        pending_weight_limit = rank                       # later ranks defer more W: they wait longer
        warmup = min(num_ranks - 1 - rank, num_microbatches)
        order = [Action(rank, m, "F") for m in range(warmup)]
        next_backward = next_weight = 0

        def backward_then_maybe_weight() -> None:
            nonlocal next_backward, next_weight
            order.append(Action(rank, next_backward, "I"))
            next_backward += 1
            if next_backward - next_weight > pending_weight_limit:
                order.append(Action(rank, next_weight, "W"))
                next_weight += 1

        for i in range(num_microbatches - warmup):
            order.append(Action(rank, warmup + i, "F"))
            backward_then_maybe_weight()
        while next_backward < num_microbatches:
            backward_then_maybe_weight()
        order += [Action(rank, m, "W") for m in range(next_weight, num_microbatches)]
        actions[rank] = order
    return _one_stage_per_rank("zero_bubble", num_ranks, num_microbatches, actions, split_backward=True)


def interleaved_zero_bubble(num_ranks: int, num_microbatches: int, chunks: int = 2) -> Schedule:
    """torch's ``ScheduleInterleavedZeroBubble``: interleaved 1F1B's walk over V chunks per rank (stage s on
    rank s % P), with the backward split into I and W and rank r deferring r weight gradients, as ZB-H1 does.

    Its warm-up is (V - 1) G + (P - 1 - r) forwards, one per hop from the last rank instead of interleaved
    1F1B's two, where G = M / max(1, M // P) is torch's microbatches per round (M a multiple of
    max(1, M // P), as torch asks: schedules.py:3046-3053). With V = 1 it is :func:`zero_bubble_h1`.
    """
    _check_sizes(num_ranks, num_microbatches, chunks)
    rounds = max(1, num_microbatches // num_ranks)
    if num_microbatches % rounds != 0:
        raise ValueError(f"interleaved_zero_bubble needs num_microbatches ({num_microbatches}) to be a multiple of "
                         f"its {rounds} rounds (max(1, M // P)).")
    group = num_microbatches // rounds                   # microbatches per round
    total = chunks * num_microbatches                    # (chunk, microbatch) pairs per rank
    actions = {}
    for rank in range(num_ranks):
        warmup = min((chunks - 1) * group + (num_ranks - 1 - rank), total)

        def forward_stage(step: int) -> int:
            return (step // group) % chunks * num_ranks + rank

        def backward_stage(step: int) -> int:
            return (chunks - 1 - (step - warmup) // group % chunks) * num_ranks + rank

        order: list[Action] = []
        counters: dict[tuple[str, int], int] = defaultdict(int)     # (kind, stage) -> next microbatch
        backward_steps: list[int] = []

        def add(kind: str, stage: int) -> None:
            order.append(Action(stage, counters[kind, stage], kind))
            counters[kind, stage] += 1

        for step in range(total + warmup):
            if step < total:
                add("F", forward_stage(step))
            if step >= warmup:
                add("I", backward_stage(step))
                backward_steps.append(step)
                if step - warmup >= rank:                # rank r keeps r weight gradients pending
                    add("W", backward_stage(backward_steps[counters["W", -1]]))
                    counters["W", -1] += 1
        for step in backward_steps[counters["W", -1]:]:
            add("W", backward_stage(step))
        actions[rank] = order
    stage_to_rank = {s: s % num_ranks for s in range(num_ranks * chunks)}
    return Schedule("interleaved_zero_bubble", num_ranks, num_microbatches, chunks, stage_to_rank, actions,
                    split_backward=True)


def _v_stages(num_ranks: int, rank: int) -> tuple[int, int]:
    """The two stages rank ``rank`` holds in a V: r on the way down, 2P - 1 - r on the way back up."""
    return rank, 2 * num_ranks - 1 - rank


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZBV (Qi et al., "Zero Bubble Pipeline Parallelism", section 6; torch's ``ScheduleZBVZeroBubble``).

    Two stages per rank in a V (rank r holds stages r and 2P - 1 - r), every backward split into I and W.
    Rank r warms up with 2(P - r) - 1 forwards down the V, then r forwards alternating up and down, then
    P - r rounds of F, I, W on its up stage; the steady state runs F, I, W on the down stage and then on the
    up stage; the cool-down runs the last I's and, after them, the W's still owed. With F = I = W and
    M >= 2P - 1 a rank idles only at the start and the end of the V.

    Any M works, as in torch: the order is planned for max(2P - 1, M) microbatches and the actions of the
    padding microbatches are dropped (torch/distributed/pipelining/schedules.py:3269-3271 and 3378-3389;
    torch checks no minimum for ZBV, only for DualPipeV).
    """
    _check_sizes(num_ranks, num_microbatches)
    planned = max(2 * num_ranks - 1, num_microbatches)
    actions = {}
    for rank in range(num_ranks):
        down, up = _v_stages(num_ranks, rank)
        order: list[Action] = []
        forwards, backwards = {down: 0, up: 0}, {down: 0, up: 0}

        def forward(stage: int) -> None:
            order.append(Action(stage, forwards[stage], "F"))
            forwards[stage] += 1

        def input_grad(stage: int, with_weight: bool) -> None:
            order.append(Action(stage, backwards[stage], "I"))
            if with_weight:                                  # W right behind its I
                order.append(Action(stage, backwards[stage], "W"))
            backwards[stage] += 1

        for _ in range(2 * (num_ranks - rank) - 1):          # warm-up: down the V
            forward(down)
        for _ in range(rank):
            forward(up)
            forward(down)
        for _ in range(num_ranks - rank):
            forward(up)
            input_grad(up, with_weight=True)
        while forwards[up] < forwards[down] or forwards[down] < planned:    # steady state
            if forwards[down] < planned:
                forward(down)
            input_grad(down, with_weight=True)
            forward(up)
            input_grad(up, with_weight=True)
        weights_done = dict(backwards)                       # cool-down: the last I's first, W's after
        for _ in range(rank):
            input_grad(down, with_weight=False)
            input_grad(up, with_weight=False)
        for _ in range(num_ranks - rank):
            input_grad(down, with_weight=False)
            order.append(Action(down, weights_done[down], "W"))
            weights_done[down] += 1
        order += [Action(up, m, "W") for m in range(weights_done[up], backwards[up])]
        order += [Action(down, m, "W") for m in range(weights_done[down], backwards[down])]
        actions[rank] = [a for a in order if a.microbatch < num_microbatches]   # drop the padding
    return Schedule("zbv", num_ranks, num_microbatches, 2,
                    {s: r for r in range(num_ranks) for s in _v_stages(num_ranks, r)}, actions,
                    split_backward=True)


def dual_pipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe folded into a V; torch's ``ScheduleDualPipeV``), as torch runs it.

    Two stages per rank in a V, like ZBV. Its middle pairs a forward of one stage with a *full* backward
    (B) of the other: torch lists each pair as one OVERLAP_F_B action and, unless the user registers a
    function for it, runs its two halves one after the other (schedules.py:2632-2636) and sends the
    forward's output only after the backward (1502-1509): the pair is F then B here, its position kept in
    ``overlap_f_b`` so that :func:`simulate` holds the forward's output back as torch does. Only the ends
    split backwards into I and W, to fill the warm-up and the drain.
    Needs M >= 2P, as torch does (schedules.py:3439-3443).
    """
    _check_sizes(num_ranks, num_microbatches)
    if num_microbatches < 2 * num_ranks:
        raise ValueError(f"dual_pipe_v needs at least as many microbatches as stages: {num_microbatches} < "
                         f"{2 * num_ranks}.")
    actions, overlap_f_b = {}, {}
    for rank in range(num_ranks):
        down, up = _v_stages(num_ranks, rank)
        order: list[Action] = []
        forwards, backwards = {down: 0, up: 0}, {down: 0, up: 0}
        pending_weights: list[Action] = []                   # W's owed by split backwards, oldest first
        pairs: set[int] = set()                              # positions of the paired forwards

        def forward(stage: int) -> None:
            order.append(Action(stage, forwards[stage], "F"))
            forwards[stage] += 1

        def backward(stage: int, split: bool) -> None:
            microbatch = backwards[stage]
            backwards[stage] += 1
            if split:
                order.append(Action(stage, microbatch, "I"))
                pending_weights.append(Action(stage, microbatch, "W"))
            else:
                order.append(Action(stage, microbatch, "B"))

        def weight_if_pending() -> None:
            if pending_weights:
                order.append(pending_weights.pop(0))

        def pair(forward_stage: int, backward_stage: int) -> None:     # torch's OVERLAP_F_B
            pairs.add(len(order))
            forward(forward_stage)
            backward(backward_stage, split=False)

        for _ in range(2 * (num_ranks - rank - 1)):          # 1: forwards down the V
            forward(down)
        for _ in range(rank + 1):                            # 2: down and up
            forward(down)
            forward(up)
        for _ in range(num_ranks - rank - 1):                # 3: zero bubble on the up stage
            backward(up, split=True)
            weight_if_pending()
            forward(up)
        for i in range(num_microbatches - 2 * num_ranks + rank + 1):   # 4: the pairs (F, then a full B)
            if i == 0 and rank == num_ranks - 1:             # torch leaves this one pair apart
                forward(down)
                backward(up, split=False)
            else:
                pair(down, up)
            pair(up, down)
        for _ in range(num_ranks - rank - 1):                # 5
            backward(up, split=False)
            pair(up, down)
        split = False                                        # 6: halfway through, backwards split again
        for i in range(rank + 1):
            if i == (rank + 1) // 2 and rank % 2 == 1:
                split = True
            backward(up, split)
            if i == (rank + 1) // 2 and rank % 2 == 0:
                split = True
            backward(down, split)
        for _ in range(num_ranks - rank - 1):                # 7
            weight_if_pending()
            backward(down, split)
        for _ in range(rank + 1):                            # 8: the W's still owed
            weight_if_pending()
        actions[rank], overlap_f_b[rank] = order, pairs
    return Schedule("dual_pipe_v", num_ranks, num_microbatches, 2,
                    {s: r for r in range(num_ranks) for s in _v_stages(num_ranks, r)}, actions,
                    split_backward=True, overlap_f_b=overlap_f_b)


def build(name: str, num_ranks: int, num_microbatches: int, chunks: int = 1) -> Schedule:
    """Build a schedule by name: "naive", "gpipe", "1f1b", "interleaved_1f1b" or "zero_bubble".

    ``chunks`` (stages per rank) applies to "interleaved_1f1b" only; the others need chunks=1.
    """
    builders = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "zero_bubble": zero_bubble_h1}
    if name == "interleaved_1f1b":
        return interleaved_1f1b(num_ranks, num_microbatches, chunks)
    if name not in builders:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}.")
    if chunks != 1:
        raise ValueError(f"schedule {name!r} holds one stage per rank; chunks={chunks} needs interleaved_1f1b.")
    return builders[name](num_ranks, num_microbatches)


# ----------------------------------------------------------------------------------------------------------
# Simulation
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Costs:
    """Time of one microbatch through one rank's share of the model (all its layers, whatever ``chunks``).

    With V chunks per rank each action does 1/V of that work, so it takes 1/V of the time; the same Costs
    compare schedules fairly. ``backward`` is the full backward (about twice the forward in a transformer).
    A split backward gives ``weight_fraction`` of it to W and the rest to I: by default F = 1, B = 2 (full
    backward), and split F = 1, I = 1, W = 1, the zero-bubble paper's setting.
    ``send`` is the latency of one activation or gradient message between two ranks (not scaled by V).
    ``dispatch`` is the time a rank spends between two of its own actions even when their inputs are there
    (a real runtime posts messages and keeps its books): idle time, not work.
    """

    forward: float = 1.0
    backward: float = 2.0
    weight_fraction: float = 0.5
    send: float = 0.0
    dispatch: float = 0.0

    def __post_init__(self):
        if min(self.forward, self.backward, self.send, self.dispatch) < 0:
            raise ValueError(f"costs must not be negative, got {self}.")
        if not 0.0 <= self.weight_fraction <= 1.0:
            raise ValueError(f"weight_fraction must be between 0 and 1, got {self.weight_fraction}.")

    def durations(self, chunks: int = 1) -> dict[str, float]:
        """Duration of one F, B (full backward), I and W action on one of ``chunks`` stages per rank."""
        weight = self.backward * self.weight_fraction
        durations = {"F": self.forward, "B": self.backward, "I": self.backward - weight, "W": weight}
        return {kind: value / chunks for kind, value in durations.items()}


@dataclass(slots=True)
class TimelineEvent:
    """One action as it ran (or would run): the ``timeline`` entry of the metrics file."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        return {"rank": self.rank, "stage": self.stage, "microbatch": self.microbatch, "kind": self.kind,
                "start": self.start, "end": self.end}

    @classmethod
    def from_dict(cls, entry: dict) -> TimelineEvent:
        return cls(int(entry["rank"]), int(entry["stage"]), int(entry["microbatch"]), str(entry["kind"]),
                   float(entry["start"]), float(entry["end"]))


def to_dicts(events) -> list[dict]:
    """Events as plain dicts, ready for JSON."""
    return [event.to_dict() for event in events]


def from_dicts(entries) -> list[TimelineEvent]:
    """Events from a metrics file's ``timeline`` (dicts); TimelineEvents pass through unchanged."""
    return [entry if isinstance(entry, TimelineEvent) else TimelineEvent.from_dict(entry) for entry in entries]


def simulate(schedule: Schedule, costs: Costs | None = None) -> list[TimelineEvent]:
    """Run the schedule on paper: each rank does its actions in order, one at a time, as soon as their inputs
    have arrived. Returns the events sorted by rank, then time.

    Dependencies (a message from another rank adds ``costs.send``):
    F(s, m) needs F(s-1, m); a backward B(s, m) or I(s, m) needs its own F(s, m) and the input gradient of
    stage s+1, sent when B(s+1, m) or I(s+1, m) ends (the last stage needs only its F); W(s, m) needs I(s, m).
    A full B sends its gradient only when all of it, weight gradient included, is done: that is what a
    split I saves. An order that can never finish raises ValueError naming the stuck ranks, and so
    does a malformed one (an action twice, on the wrong rank, or missing).

    Event driven, no clock: a rank advances until its next action needs a result not computed yet, then
    parks on that result; finishing an action wakes the ranks parked on it. Each action is handled once.
    """
    # Half a million small events would wake Python's cycle collector again and again (doubling the run
    # time); they hold no cycles, so it sleeps while they are made.
    collector_was_on = gc.isenabled()
    gc.disable()
    try:
        return _simulate(schedule, costs or Costs())
    finally:
        if collector_was_on:
            gc.enable()


def _simulate(schedule: Schedule, costs: Costs) -> list[TimelineEvent]:
    durations = costs.durations(schedule.chunks)
    send, dispatch = costs.send, costs.dispatch
    num_stages, num_microbatches = schedule.num_stages, schedule.num_microbatches
    last_stage = num_stages - 1
    rank_of_stage = [schedule.stage_to_rank[s] for s in range(num_stages)]

    # finish_time[slot]: when action (kind, stage, microbatch) ended, -1 until it has run. One flat list,
    # F slots first, then the input gradient (made by B or I), then W: slot = kind_offset + stage * M + m.
    slots_per_kind = num_stages * num_microbatches
    backward_offset, weight_offset = slots_per_kind, 2 * slots_per_kind
    finish_time = [-1.0] * (3 * slots_per_kind)
    parked: list[list[int] | None] = [None] * (3 * slots_per_kind)    # slot -> ranks waiting for it
    position = {rank: 0 for rank in schedule.actions}                   # index of each rank's next action
    rank_free_at = {rank: 0.0 for rank in schedule.actions}
    timeline: dict[int, list[TimelineEvent]] = {rank: [] for rank in schedule.actions}
    runnable = list(schedule.actions)
    waiting_on: dict[int, int] = {}                                      # rank -> slot it last parked on
    # A forward paired with the next action (torch's OVERLAP_F_B) publishes its output when that one ends.
    paired = {rank: schedule.overlap_f_b.get(rank, ()) for rank in schedule.actions}
    held_back: dict[int, int] = {}                                       # rank -> slot of its paired forward

    def malformed(rank: int, action: Action, why: str) -> ValueError:
        return ValueError(f"{schedule.name}: rank {rank} runs {action}, {why}.")

    while runnable:
        rank = runnable.pop()
        rank_actions, events = schedule.actions[rank], timeline[rank]
        i, now = position[rank], rank_free_at[rank]
        while i < len(rank_actions):
            action = rank_actions[i]
            stage, microbatch, kind = action.stage, action.microbatch, action.kind
            if not (0 <= stage <= last_stage and rank_of_stage[stage] == rank):
                raise malformed(rank, action, f"but stage {stage} does not live on rank {rank}")
            if not 0 <= microbatch < num_microbatches:
                raise malformed(rank, action, f"but microbatches are 0..{num_microbatches - 1}")
            own_forward = stage * num_microbatches + microbatch
            start, waiting_for = (now + dispatch if i else now), -1
            if kind == "F":
                if stage > 0:                                   # input from the previous stage
                    ready = finish_time[own_forward - num_microbatches]
                    if ready < 0:
                        waiting_for = own_forward - num_microbatches
                    else:
                        if rank_of_stage[stage - 1] != rank:
                            ready += send
                        start = ready if ready > start else start
                slot, duration = own_forward, durations["F"]
            elif kind == "B" or (kind == "I" and schedule.split_backward):
                ready = finish_time[own_forward]                # its own forward (same rank, no message)
                if ready < 0:
                    waiting_for = own_forward
                else:
                    start = ready if ready > start else start
                    if stage < last_stage:                      # gradient from the next stage
                        next_backward = backward_offset + own_forward + num_microbatches
                        ready = finish_time[next_backward]
                        if ready < 0:
                            waiting_for = next_backward
                        else:
                            if rank_of_stage[stage + 1] != rank:
                                ready += send
                            start = ready if ready > start else start
                slot, duration = backward_offset + own_forward, durations[kind]
            elif kind == "W" and schedule.split_backward:
                ready = finish_time[backward_offset + own_forward]
                if ready < 0:
                    waiting_for = backward_offset + own_forward
                else:
                    start = ready if ready > start else start
                slot, duration = weight_offset + own_forward, durations["W"]
            else:
                raise malformed(rank, action, f"but kind {kind!r} is not one of this schedule's "
                                              f"{'F, B, I, W' if schedule.split_backward else 'F, B'}")
            if waiting_for >= 0:
                waiting_on[rank] = waiting_for
                if parked[waiting_for] is None:
                    parked[waiting_for] = []
                parked[waiting_for].append(rank)
                break
            if finish_time[slot] >= 0:
                raise malformed(rank, action, "but that action has already run")
            now = start + duration
            events.append(TimelineEvent(rank, stage, microbatch, kind, start, now))
            published = [slot]
            if i in paired[rank]:                       # its output leaves with the next action's
                published, held_back[rank] = [], slot   # (a duplicate of it is left to validate())
            elif rank in held_back:
                published.append(held_back.pop(rank))
            for done in published:
                finish_time[done] = now
                if parked[done] is not None:
                    runnable.extend(parked[done])
                    parked[done] = None
            i += 1
        position[rank], rank_free_at[rank] = i, now

    stuck = [rank for rank in schedule.actions if position[rank] < len(schedule.actions[rank])]
    if stuck:
        schedule.validate()     # an action nobody lists is a clearer error than the deadlock it causes

        def action_in(slot: int) -> Action:
            kind, rest = divmod(slot, slots_per_kind)
            stage, microbatch = divmod(rest, num_microbatches)
            if kind == 1:           # the input gradient: the B or the I that the stage's rank lists
                listed = {a.kind for a in schedule.actions[rank_of_stage[stage]]
                          if (a.stage, a.microbatch) == (stage, microbatch)}
                return Action(stage, microbatch, "I" if "I" in listed else "B")
            return Action(stage, microbatch, "FBW"[kind])

        details = "; ".join(f"rank {r} at {schedule.actions[r][position[r]]} (its action {position[r]}) "
                            f"waits for {action_in(waiting_on[r])}" for r in stuck)
        raise ValueError(f"{schedule.name} deadlocks: {details}.")
    if schedule.split_backward or sum(position.values()) != 2 * slots_per_kind:
        schedule.validate()     # each ran once; is every (stage, microbatch) there, and not B and I at once?
    return [event for rank in sorted(timeline) for event in timeline[rank]]


# ----------------------------------------------------------------------------------------------------------
# Bubble and memory
# ----------------------------------------------------------------------------------------------------------

def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of a pipeline of P = ``stages`` ranks: (P - 1) / (V*M + P - 1), V = ``chunks``.

    With V = 1 this is GPipe and 1F1B alike: 1F1B reorders the same work to hold fewer activations, it does
    not shorten the fill and drain. Interleaving (V > 1) shrinks both V-fold. Assumes no send latency and
    the same forward/backward costs on every stage.
    """
    for label, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}.")
    return (stages - 1) / (chunks * microbatches + stages - 1)


def _busy_intervals(events) -> dict[int, list[tuple[float, float]]]:
    """Per rank, the merged intervals during which it ran something (overlaps counted once)."""
    by_rank: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        by_rank[event.rank].append((event.start, event.end))
    merged = {}
    for rank, intervals in by_rank.items():
        intervals.sort()
        out = [list(intervals[0])]
        for start, end in intervals[1:]:
            if start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], end)
            else:
                out.append([start, end])
        merged[rank] = [(a, b) for a, b in out]
    return merged


def bubble_fraction_from_timeline(events, num_ranks: int | None = None) -> float:
    """Measured bubble: idle time / (ranks x makespan), makespan from the first start to the last end.

    ``events`` are TimelineEvents or metrics dicts, simulated or measured (seconds). ``num_ranks`` defaults
    to the number of ranks that appear in the events.
    """
    events = from_dicts(events)
    if not events:
        raise ValueError("the timeline is empty; there is no bubble to measure.")
    first, last = min(e.start for e in events), max(e.end for e in events)
    makespan = last - first
    busy_by_rank = _busy_intervals(events)
    ranks = num_ranks or len(busy_by_rank)
    if makespan <= 0:
        return 0.0
    busy = sum(end - start for intervals in busy_by_rank.values() for start, end in intervals)
    return (ranks * makespan - busy) / (ranks * makespan)


# torch 2.13's _add_unshard_reshard (torch/distributed/pipelining/schedules.py:1285-1365): how many of a rank's
# stages its multi-stage runtime keeps unsharded at once under FSDP (max_active_stages)
FSDP_ACTIVE_STAGES = 3


def add_unshard_reshard(rank_actions: list[Action], active_stages: int = FSDP_ACTIVE_STAGES) -> list[Action]:
    """A rank's actions with the UNSHARD and RESHARD steps torch's multi-stage runtime (``ScheduleInterleaved1F1B``
    and the other ``_PipelineScheduleRuntime`` schedules) adds for FSDP stages, as Actions of kind "UNSHARD" and
    "RESHARD" (microbatch -1; printed ``8UNSHARD-1``). Before each action it unshards the next ``active_stages``
    distinct stages the rank will compute (in that order) that are not unsharded yet, after resharding every
    unsharded stage not among them; at the end it reshards the rest. So a rank with more chunks than that
    re-gathers each chunk many times a step, whatever ``reshard_after_forward`` says: the runtime calls
    ``unshard()`` and ``reshard()`` on every FSDP module of the stage (schedules.py:2489-2516). torch evicts in its
    set's order; here in the order of unsharding (the same steps, the RESHARDs of one step maybe reordered)."""
    # The next distinct stages from each action on, found in one backward walk: from action i, its own stage, then
    # those from i + 1 without it (one more kept than needed, for the one that drops out).
    upcoming_at: list[list[int]] = [[]] * len(rank_actions)
    after: list[int] = []
    for i in range(len(rank_actions) - 1, -1, -1):
        stage = rank_actions[i].stage
        after = ([stage] + [s for s in after if s != stage])[:active_stages + 1]
        upcoming_at[i] = after[:active_stages]
    active: list[int] = []
    lowered: list[Action] = []
    for action, upcoming in zip(rank_actions, upcoming_at):
        for stage in [s for s in active if s not in upcoming]:
            active.remove(stage)
            lowered.append(Action(stage, -1, "RESHARD"))
        for stage in upcoming:
            if stage not in active:
                active.append(stage)
                lowered.append(Action(stage, -1, "UNSHARD"))
        lowered.append(action)
    lowered += [Action(stage, -1, "RESHARD") for stage in active]
    return lowered


def fsdp_all_gathers(rank_actions: list[Action], reshard_after_forward: bool, runtime: bool) -> dict[int, int]:
    """How many times each of a rank's stages all-gathers its FSDP weights in one step (each FSDP unit of the
    stage issues that many all-gathers), walking the order as torch 2.13 runs it:

    * a forward or a backward gathers when the weights are sharded (FSDPParamGroup.unshard is a no-op when they
      are unsharded: fsdp/_fully_shard/_fsdp_param_group.py:372-376);
    * a forward then frees them unless ``reshard_after_forward`` is False (post_forward calls reshard(), which
      returns early only then: _fsdp_param_group.py:557-565, 499-509);
    * a backward keeps them: the pipeline stage sets ``set_reshard_after_backward(False)`` before every backward
      (pipelining/stage.py:844-847), until REDUCE_GRAD reshards after the last (stage.py:1174-1186);
    * ``runtime``: the multi-stage runtime's UNSHARD gathers and its RESHARD frees (:func:`add_unshard_reshard`);
      the single-stage schedules (GPipe, 1F1B: ``PipelineScheduleSingle``) add neither.

    So a single stage gathers once a step with ``reshard_after_forward=False``, and M + 1 times with True (each
    forward that follows a forward, and each backward that follows a forward)."""
    gathered: dict[int, bool] = defaultdict(bool)
    gathers: dict[int, int] = defaultdict(int)
    for action in (add_unshard_reshard(rank_actions) if runtime else rank_actions):
        if action.kind == "RESHARD":
            gathered[action.stage] = False
            continue
        if not gathered[action.stage]:
            gathers[action.stage] += 1
            gathered[action.stage] = True
        if action.kind == "F" and reshard_after_forward:
            gathered[action.stage] = False
    return dict(gathers)


def peak_activations(schedule: Schedule, release_on_input_grad: bool = False) -> dict[int, int]:
    """Per rank, the most (stage, microbatch) activations held at once, walking the rank's order.

    An activation is held from its F until its backward is done: until the full backward B, or, when the
    backward is split, until W (W still needs the saved inputs; torch keeps the graph alive from I to W), or
    until I with ``release_on_input_grad=True``. Results: GPipe M; 1F1B min(P - r, M); zero bubble H1
    min(P, M) on every rank (its warm-up is 1F1B's, the deferred W's make up the rest): 1F1B's peak, which
    only rank 0 reached, now on every rank. Interleaved counts (chunk, microbatch)
    pairs, each 1/V of a rank's layers: min((V-1)P + 2(P-1-r) + 1, V*M), i.e. P + (P-1)/V stage-equivalents
    on rank 0, a little more than 1F1B's P.
    """
    release_kinds = ("B", "I") if release_on_input_grad else ("B", "W")
    peaks = {}
    for rank, rank_actions in schedule.actions.items():
        held = peak = 0
        for action in rank_actions:
            if action.kind == "F":
                held += 1
                peak = max(peak, held)
            elif action.kind in release_kinds:
                held -= 1
        peaks[rank] = peak
    return peaks


# ----------------------------------------------------------------------------------------------------------
# torch.distributed.pipelining
# ----------------------------------------------------------------------------------------------------------

def from_torch_pipeline_order(pipeline_order: dict, num_microbatches: int | None = None,
                              name: str = "torch") -> Schedule:
    """Read ``schedule.pipeline_order`` of a ``torch.distributed.pipelining`` schedule as a :class:`Schedule`.

    ``pipeline_order`` is ``{rank: [action or None]}``; None (a bubble in torch's time grid) and non-compute
    actions (sends, receives, REDUCE_GRAD, ...) are dropped, and an overlapped F/B pair (OVERLAP_F_B) becomes
    its two sub-actions in order, as torch runs them when no overlap function is registered
    (torch/distributed/pipelining/schedules.py:2632-2636). F, B (full backward), I and W keep torch's letters.
    Stage to rank placement is read off the order. This reads a private torch API, so tests pin what it
    returns: e.g. torch 2.13's Schedule1F1B lists the last rank's forwards off by one, and validate() then
    fails.
    """
    from torch.distributed.pipelining.schedules import _ComputationType   # lazy: the module is torch-free

    kind_of = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B",
               _ComputationType.BACKWARD_INPUT: "I", _ComputationType.BACKWARD_WEIGHT: "W"}

    def compute_actions(torch_action):
        if torch_action is None:
            return
        if getattr(torch_action, "sub_actions", None):
            for sub_action in torch_action.sub_actions:
                yield from compute_actions(sub_action)
        elif torch_action.computation_type in kind_of:
            yield Action(torch_action.stage_index, torch_action.microbatch_index,
                         kind_of[torch_action.computation_type])

    actions: dict[int, list[Action]] = {}
    overlap_f_b: dict[int, set[int]] = {}
    for rank, order in sorted(pipeline_order.items()):
        actions[rank], overlap_f_b[rank] = [], set()
        for item in order:
            if getattr(item, "computation_type", None) == _ComputationType.OVERLAP_F_B:
                overlap_f_b[rank].add(len(actions[rank]))
            actions[rank].extend(compute_actions(item))
    stage_to_rank: dict[int, int] = {}
    for rank, rank_actions in actions.items():
        for action in rank_actions:
            stage_to_rank.setdefault(action.stage, rank)
    stage_to_rank = dict(sorted(stage_to_rank.items()))
    num_ranks = len(actions)
    if num_microbatches is None:
        num_microbatches = 1 + max(a.microbatch for acts in actions.values() for a in acts)
    split_backward = any(a.kind in ("I", "W") for acts in actions.values() for a in acts)
    return Schedule(name, num_ranks, num_microbatches, max(1, len(stage_to_rank) // num_ranks),
                    stage_to_rank, actions, split_backward,
                    {rank: pairs for rank, pairs in overlap_f_b.items() if pairs})
