"""torch.distributed.pipelining's schedules, run for real and timed: every forward and backward on every rank.

A small model of P x V equal stages (one Linear each) runs one schedule of ``torch.distributed.pipelining``
(GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV). A stopwatch wraps each
stage's forward_one_chunk, backward_one_chunk and backward_weight_one_chunk; the events of all ranks are
put on one clock (a barrier, then each rank subtracts its own t0) and gathered to rank 0, which draws the
measured Gantt chart (ASCII here, PNG with ``--plot FILE``) and writes it to the metrics ``timeline``.

With ``--stage-compute-ms T`` every stage pauses T ms in its forward and 2T in its backward (T for the
input gradient, T for the weight gradient, so zero-bubble schedules can split them), sleeping rather than
spinning so four ranks on two cores do not steal each other's time. Compute then dominates communication
and the pipeline behaves like the textbook one, so the script proves:

* the losses and gradients equal the single-device model's (the pauses are identities);
* each rank ran exactly the order of our own schedule (``distlab.schedules``: gpipe, 1f1b,
  interleaved_1f1b, zero_bubble, interleaved_zero_bubble, zbv, dual_pipe_v), not read from torch's own list
  (the last three restate torch's planners: for them this shows that torch ran what it plans);
* the activations each rank held at once, measured with saved-tensor hooks, peak where our schedule says
  (a zero-bubble pass keeps them until W, not I: ZB-H1's peaks tell the two apart, ZBV's and DualPipeV's
  do not);
* the measured bubble equals our simulation of the same order with the pass times, hand-off latency and
  dispatch time this run measured, within BUBBLE_TOLERANCE; the simulation with F = 1, B = 2 equals the formula
  (P-1)/(V*M+P-1) where there is one.

``--steps`` counts a first step that sets torch up, without pauses, and is not timed; of the others the
median is kept (a shared CPU has bad moments). The script also reports the hand-off latency it measured and
the bubble simulated with it, which explains most of what the formula does not.

    torchrun --standalone --nproc_per_node=4 scripts/07_pipeline_parallel/pp_schedules.py --schedule 1F1B
    torchrun --standalone --nproc_per_node=4 scripts/07_pipeline_parallel/pp_schedules.py \\
        --schedule ZBVZeroBubble --stage-compute-ms 20 --plot zbv.png
"""

import copy
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common_pipeline import (CHOICES, HeldActivations, check_pipeline_config, executed_order, expected_schedule,
                             gather_timeline, measured_costs, paired_forwards, record_actions, schedule_help,
                             stage_indices, torch_schedule)
from distlab import gantt, metrics, runtime, schedules

# Measured vs simulated bubble, absolute. The reference is our simulation of the same order with this run's
# own pass times, hand-off latency and dispatch time (the gaps between passes that waited for nothing): every
# hand-off costs a message and a wake-up (0.5-2 ms with 4 ranks on 2 cores), which F = 1, B = 2 does not
# charge (measured runs sit 2-4 points above that plain simulation, which is reported too). Each tolerance is
# below half the gap, at P = 4 and M = 8, between the schedule's simulated bubble and the nearest other one
# (27.3% GPipe and 1F1B, 15.8% interleaved, 11.1% ZB-H1 and DualPipeV, 5.9% ZBV), so that a schedule run, or
# modelled, as another fails: ZBV is 5.2 points from ZB-H1, DualPipeV 5.2 from the 5.9% it would simulate to
# if its paired forwards sent at once. (DualPipeV and ZB-H1 tie; the order check tells them apart.) On 2
# quiet cores the V schedules measured within 1.6 points; on cores shared with other jobs (load 7) ZBV drifts
# 3-4 points above: a timing test wants the machine to itself.
BUBBLE_TOLERANCE = {"Interleaved1F1B": 0.02, "InterleavedZeroBubble": 0.02, "ZBVZeroBubble": 0.025,
                    "DualPipeV": 0.02}
DEFAULT_BUBBLE_TOLERANCE = 0.05
LOSS_TOLERANCE = 1e-6
GRAD_TOLERANCE = 1e-6
# On a GPU these widen 10x: its kernels sum in other, partly nondeterministic orders (metrics.fp32_tolerance).


class Pause(torch.autograd.Function):
    """The identity, taking ``forward_s`` seconds forward and ``backward_s`` seconds backward: stands for compute."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        if forward_s:
            time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.backward_s:
            time.sleep(ctx.backward_s)
        return grad, None, None


class TimedStage(nn.Module):
    """One stage: tanh(Linear(x)). Forward takes T; its backward 2T, split so torch can run it in two parts:
    the pause on the output is on the path to the *input* gradient (torch's I), the pause on the weight
    only on the path to the *weight* gradient (W)."""

    def __init__(self, dim: int, compute_s: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.compute_s = compute_s

    def forward(self, x):
        weight = Pause.apply(self.linear.weight, 0.0, self.compute_s)          # W: weight gradient
        return Pause.apply(torch.tanh(F.linear(x, weight, self.linear.bias)), self.compute_s, self.compute_s)


def check_config(args, world_size):
    args.chunks = check_pipeline_config(args.schedule, world_size, args.microbatches, args.stages_per_rank)
    runtime.require(args.steps >= 1, f"--steps {args.steps}: need at least one step")
    runtime.require(args.batch % args.microbatches == 0 and args.batch >= args.microbatches,
                    f"--batch {args.batch} does not split into {args.microbatches} equal microbatches")
    runtime.require(args.stage_compute_ms >= 0, f"--stage-compute-ms {args.stage_compute_ms} is negative")


def batch(step, args):
    """The global batch of a step: the same on every rank, from the seed."""
    generator = torch.Generator().manual_seed(args.seed * 1000 + step)
    x = torch.randn(args.batch, args.dim, generator=generator)
    return x, torch.randn(args.batch, args.dim, generator=generator)


def main():
    p = runtime.parser(__doc__, steps=4)
    p.add_argument("--schedule", default="1F1B", help=f"torch's schedule: {schedule_help()}")
    p.add_argument("--microbatches", type=runtime.positive_int, default=8, help="M, microbatches per step")
    p.add_argument("--stages-per-rank", type=runtime.positive_int, default=None,
                   help="V, stages per rank (interleaved schedules; default: the schedule's own)")
    p.add_argument("--batch", type=runtime.positive_int, default=16, help="global batch, split into M microbatches")
    p.add_argument("--dim", type=runtime.positive_int, default=32, help="width of each stage's Linear")
    p.add_argument("--stage-compute-ms", type=runtime.nonnegative_float, default=20.0,
                   help="pause per stage: T ms forward, 2T backward (0: only the real, tiny compute; "
                        "the measured bubble is then not checked). --steps counts a first, untimed step")
    p.add_argument("--max-bubble", type=runtime.positive_float, default=None, metavar="FRACTION",
                   help="a throughput target: fail if the measured bubble (idle share of the timeline) is above it")
    p.add_argument("--plot", metavar="FILE", default=None, help="write the measured Gantt chart as a PNG")
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        ranks, chunks, microbatches = rt.world_size, args.chunks, args.microbatches
        num_stages = ranks * chunks
        report = metrics.Report(__file__, rt, config=vars(args))
        mine = stage_indices(args.schedule, rt.rank, ranks, chunks)
        rt.print(f"{args.schedule}: {ranks} ranks x {chunks} stage(s) each = {num_stages} stages, "
                 f"{microbatches} microbatches of {args.batch // microbatches}; pause {args.stage_compute_ms} ms "
                 f"forward, {2 * args.stage_compute_ms} ms backward per stage")
        rt.print("stages per rank: " + ", ".join(f"rank {r}: {stage_indices(args.schedule, r, ranks, chunks)}"
                                                 for r in range(ranks)))

        # The whole model, built alike on every rank (it is tiny): the single-device reference, and the
        # source of this rank's stages, which take their weights from it.
        torch.manual_seed(args.seed)
        reference = nn.Sequential(*[TimedStage(args.dim) for _ in range(num_stages)])
        from torch.distributed.pipelining import PipelineStage

        local_modules = {s: copy.deepcopy(reference[s]).to(rt.device) for s in mine}
        for module in local_modules.values():
            module.compute_s = args.stage_compute_ms / 1000
        stages = [PipelineStage(local_modules[s], s, num_stages, rt.device) for s in mine]
        events, held = [], HeldActivations()
        for stage in stages:
            record_actions(stage, events, rt.sync)
            held.watch(stage)
        schedule = torch_schedule(args.schedule, stages, microbatches, loss_fn=F.mse_loss)
        # What each rank should run: our own schedule, not torch's list (see expected_schedule).
        expected = expected_schedule(args.schedule, ranks, microbatches, chunks)
        first_here, last_here = 0 in mine, num_stages - 1 in mine

        pipeline_losses, step_seconds, step_timelines, held_peaks = [], [], [], []
        for step in range(args.steps):   # step 0 also sets up torch's buffers: it is not timed, nor paused
            x, target = batch(step, args)
            for module in local_modules.values():
                module.zero_grad(set_to_none=True)
                module.compute_s = args.stage_compute_ms / 1000 if step > 0 or args.steps == 1 else 0.0
            events.clear()
            held.reset()
            losses = [] if last_here else None
            inputs = (x.to(rt.device),) if first_here else ()                          # the first stage's rank
            outputs = dict(target=target.to(rt.device), losses=losses) if last_here else {}   # the last's
            rt.sync()
            dist.barrier()
            t0 = time.perf_counter()
            # return_outputs=False: else the last stage keeps every microbatch's output until the next step
            # (torch 2.13 pipelining/schedules.py:745, stage.py:907-908)
            schedule.step(*inputs, **outputs, return_outputs=False)
            rt.sync()                       # on a GPU, wait for the step's kernels before reading the clock
            step_seconds.append(time.perf_counter() - t0)
            if last_here:
                pipeline_losses.append(torch.stack(losses).mean().item())
            held_peaks.append(held.peak)
            if step > 0 or args.steps == 1:
                step_timelines.append(gather_timeline(events, t0, rt.rank, torch_kinds=True))
        # A shared CPU has outliers (another process takes a core for 100 ms): keep the median step (of an
        # even count, the lower middle one).
        step_bubbles = [schedules.bubble_fraction_from_timeline(t, ranks) for t in step_timelines]
        median = sorted(range(len(step_bubbles)), key=step_bubbles.__getitem__)[(len(step_bubbles) - 1) // 2]
        timeline, measured_bubble = step_timelines[median], step_bubbles[median]

        # The single-device reference: the same stages, in order, on each step's whole batch.
        reference_losses = []
        for step in range(args.steps):
            x, target = batch(step, args)
            reference.zero_grad(set_to_none=True)
            loss = F.mse_loss(reference(x), target)
            loss.backward()
            reference_losses.append(loss.item())
        grad_diff = max(metrics.max_abs_diff([p.grad.cpu() for p in local_modules[s].parameters()],
                                             [p.grad for p in reference[s].parameters()]) for s in mine)
        gathered = [None] * ranks
        dist.all_gather_object(gathered, {"losses": pipeline_losses, "grad_diff": grad_diff,
                                          "held_peak": max(held_peaks), "held_after": len(held.alive)})
        pipeline_losses = next(g["losses"] for g in gathered if g["losses"])
        report.losses = pipeline_losses
        report.timeline = timeline
        report.check_close("losses equal the single-device model's", pipeline_losses, reference_losses,
                           metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
        report.check("gradients equal the single-device model's (every stage)",
                     max(g["grad_diff"] for g in gathered) <= metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device),
                     max(g["grad_diff"] for g in gathered), metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device))

        # Did each rank run the order we expect?
        mismatched = [r for r in range(ranks) if executed_order(timeline, r) != expected.actions[r]]
        source = f"distlab.schedules.{expected.name}"
        # Activation memory: what each rank held at once, measured, against our schedule's count (W releases).
        predicted_peaks = schedules.peak_activations(expected)
        measured_peaks = {r: g["held_peak"] for r, g in enumerate(gathered)}
        report.check_equal("activations held at once (measured, per rank) = distlab.schedules.peak_activations",
                           measured_peaks, predicted_peaks)
        report.check("every activation freed by the end of the step (every rank)",
                     all(g["held_after"] == 0 for g in gathered), [g["held_after"] for g in gathered], 0)
        report.check(f"every rank ran the order of {source}", not mismatched,
                     f"ranks differing: {mismatched}" if mismatched else "all ranks", "every rank")
        listed = schedules.from_torch_pipeline_order(schedule.pipeline_order, microbatches) \
            if getattr(schedule, "pipeline_order", None) else None
        listed_ok = {r: listed is not None and listed.actions.get(r) == executed_order(timeline, r)
                     for r in range(ranks)}
        report.extra["torch_listed_order_matches_execution"] = listed_ok

        # Bubble: measured vs our simulation of the same order with the same costs (F = 1, B = 2, or B = W = 1).
        simulated = schedules.simulate(expected, schedules.Costs(forward=1.0, backward=2.0, weight_fraction=0.5))
        simulated_bubble = schedules.bubble_fraction_from_timeline(simulated, ranks)
        # The same order simulated with what this run measured: pass times and the cost of a hand-off.
        costs_measured = measured_costs(timeline, chunks, paired_forwards(expected))   # DualPipeV's pairs
        with_latency_bubble = schedules.bubble_fraction_from_timeline(schedules.simulate(expected, costs_measured),
                                                                      ranks)
        formula = schedules.bubble_fraction(ranks, microbatches, chunks) \
            if CHOICES[args.schedule].ours in ("gpipe", "1f1b", "interleaved_1f1b") else None
        report.extra.update(schedule=args.schedule, ranks=ranks, chunks=chunks, microbatches=microbatches,
                            stages_of_rank={r: stage_indices(args.schedule, r, ranks, chunks) for r in range(ranks)},
                            expected_order=expected.format(), simulated_timeline=schedules.to_dicts(simulated),
                            bubble={"measured": measured_bubble, "simulated": simulated_bubble, "formula": formula,
                                    "measured_per_step": step_bubbles,
                                    "simulated_with_measured_costs": with_latency_bubble},
                            measured_costs_s=vars(costs_measured), peak_activations=predicted_peaks,
                            measured_peak_activations=measured_peaks)
        report.throughput = {"step_seconds": step_seconds, "last_step_seconds": step_seconds[-1]}
        if formula is not None:
            report.check_close("simulated bubble equals the formula (P-1)/(V*M+P-1)", simulated_bubble, formula,
                               1e-9)
        if args.stage_compute_ms > 0:
            report.check_close("measured bubble equals the simulated one (this run's pass times and latency)",
                               measured_bubble, with_latency_bubble,
                               BUBBLE_TOLERANCE.get(args.schedule, DEFAULT_BUBBLE_TOLERANCE))
        if args.max_bubble is not None:   # too few microbatches for the stages: a correct run, a slow one
            report.check("measured bubble within the throughput target (--max-bubble)",
                         measured_bubble <= args.max_bubble, round(measured_bubble, 3), f"<= {args.max_bubble}")
            # The same target on a count, which no load can move: the idle share of the order every rank ran (checked
            # above against the timeline), its passes counted as F = 1, B = 2.
            report.check("counted bubble within the throughput target (--max-bubble): the order every rank ran, "
                         "in passes", not mismatched and simulated_bubble <= args.max_bubble,
                         round(simulated_bubble, 3), f"<= {args.max_bubble}")

        if rt.is_main:
            print(gantt.ascii_gantt(timeline, title=f"measured, {args.schedule} (median of {len(step_bubbles)} "
                                                    f"timed steps)", time_unit="s"))
            print(gantt.ascii_gantt(simulated, title=f"simulated, {expected.name} (F = 1, B = 2 cost units)"))
            print(f"bubble: measured {100 * measured_bubble:.1f}% (steps: "
                  + ", ".join(f"{100 * b:.1f}%" for b in step_bubbles) + f"), simulated {100 * simulated_bubble:.1f}%"
                  + (f", formula {100 * formula:.1f}%" if formula is not None else ""))
            print(f"simulated with this run's pass times, a hand-off latency of {1000 * costs_measured.send:.2f} ms "
                  f"and a dispatch time of {1000 * costs_measured.dispatch:.2f} ms: {100 * with_latency_bubble:.1f}%")
            if not all(listed_ok.values()):
                print("note: torch's pipeline_order differs from what ran on rank(s) "
                      f"{[r for r, ok in listed_ok.items() if not ok]} (it is a description; execution is right)")
            if args.plot:
                gantt.save_gantt_png(timeline, args.plot, title=f"measured {args.schedule}", time_unit="s")
                print(f"wrote {args.plot}")
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
