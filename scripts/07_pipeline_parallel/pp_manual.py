"""Pipeline parallelism by hand: the transformer cut into stages, activations sent forward and gradients
sent back with send/recv, microbatch by microbatch, in the order of one of our schedules.

Rank r holds stage r: a contiguous block of the transformer's layers (the first stage also the token
embeddings, the last the final norm and output projection). The global batch is cut into M microbatches,
and rank r runs the actions ``distlab.schedules.build(--schedule, P, M).actions[r]`` lists, one by one:

* ``F m``: receive microbatch m's activation from rank r-1 (stage 0 reads the tokens), run the stage, keep
  its input and output for the backward, send the output to rank r+1 (the last stage computes the loss);
* ``B m``: receive the gradient of the loss with respect to that output from rank r+1 (the last stage
  starts from its loss), backpropagate through the stage, send the gradient of the input to rank r-1.

Each microbatch's loss is divided by M, so the gradients that accumulate over the M backwards are the
gradient of the whole batch's mean loss. The script proves it: the losses and every parameter's
gradient equal the single-device model's on the same global batch, step after step of AdamW.

The sends of an action wait in an outbox and leave with the next action's receive, as one
``batch_isend_irecv`` (the last ones at the end of the step). On NCCL a send and a receive between two ranks
that are not posted together can wait forever: in 1F1B's steady state rank r sends an activation to r+1
while r+1 sends a gradient to r, and both would wait for a receiver. Posted together, they meet. Waiting
for the receive is the pipeline bubble you see in the Gantt chart it prints.

It also proves what ran: the order each rank computed, read from the clock, equals the textbook order of
the schedule written out below (not the list the loop walked), and the activations held at once, measured
as the bytes autograd saved for backward and still alive, peak at what the schedule predicts (1F1B: P - r).

    torchrun --standalone --nproc_per_node=4 scripts/07_pipeline_parallel/pp_manual.py --schedule 1f1b
"""

import sys
import time

import torch
import torch.distributed as dist

from common_pipeline import (add_training_flags, executed_order, gather_timeline, layers_of_stage,
                             resolve_training_flags, transformer_stage)
from distlab import data, gantt, metrics, models, runtime, schedules

HAND_SCHEDULES = ("naive", "gpipe", "1f1b")   # one stage per rank, full backward: what this loop runs
# fp32: the microbatches' gradients are summed in another order than one big batch's (measured ~1e-8 on
# losses and gradients); AdamW keeps the copies within ~1e-7 over a few steps.
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5
# On a GPU these widen 10x: its kernels sum in other, partly nondeterministic orders (metrics.fp32_tolerance).


def check_config(args, world_size):
    runtime.require(args.schedule in HAND_SCHEDULES,
                    f"unknown schedule {args.schedule!r} for this script; choose one of {', '.join(HAND_SCHEDULES)}")
    runtime.require(args.steps >= 1, f"--steps {args.steps}: need at least one step")
    runtime.require(args.microbatches >= 1, f"--microbatches {args.microbatches}: need at least one")
    runtime.require(args.batch % args.microbatches == 0 and args.batch >= args.microbatches,
                    f"--batch {args.batch} does not split into {args.microbatches} equal microbatches")
    runtime.require(args.layers >= world_size, f"{world_size} stages but only {args.layers} layers: every stage "
                                               f"needs at least one layer (--layers)")


def textbook_order(schedule: str, stages: int, microbatches: int, stage: int) -> list[str]:
    """What the literature says stage ``stage`` runs, written out by hand (not with distlab.schedules, whose
    order the loop follows): naive F0 B0 F1 B1 ...; GPipe every forward, then every backward; 1F1B (Megatron)
    P - 1 - r warm-up forwards, then one forward and one backward in turn, then the remaining backwards."""
    if schedule == "naive":
        return [f"{kind}{m}" for m in range(microbatches) for kind in "FB"]
    if schedule == "gpipe":
        return [f"F{m}" for m in range(microbatches)] + [f"B{m}" for m in range(microbatches)]
    warm_up = min(stages - 1 - stage, microbatches)
    order = [f"F{m}" for m in range(warm_up)]
    for m in range(microbatches - warm_up):
        order += [f"F{warm_up + m}", f"B{m}"]
    return order + [f"B{m}" for m in range(microbatches - warm_up, microbatches)]


class SavedActivations:
    """Bytes autograd saved for backward and still alive, and their peak: the activations a stage holds.

    Parameters are left out (autograd saves them too, but they are there anyway). A saved tensor counts
    from the forward that saves it until autograd frees it, at the end of its backward."""

    def __init__(self, parameters):
        self.parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self.alive = self.peak = 0

    def pack(self, tensor):
        if tensor.untyped_storage().data_ptr() in self.parameter_storages:
            return tensor
        return _Held(tensor, self)

    @staticmethod
    def unpack(saved):
        return saved.tensor if isinstance(saved, _Held) else saved

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    def __init__(self, tensor, ledger):
        self.tensor, self.ledger, self.nbytes = tensor, ledger, tensor.numel() * tensor.element_size()
        ledger.alive += self.nbytes
        ledger.peak = max(ledger.peak, ledger.alive)

    def __del__(self):                      # autograd let go of it: the activation is freed
        self.ledger.alive -= self.nbytes


class StageRunner:
    """Runs one stage's F and B actions for one step, with the sends and receives around them."""

    def __init__(self, stage_module, rank, world_size, microbatches, hidden_shape, device):
        self.module, self.rank, self.world = stage_module, rank, world_size
        self.first, self.last = rank == 0, rank == world_size - 1
        self.microbatches, self.hidden_shape, self.device = microbatches, hidden_shape, device
        self.inputs, self.outputs, self.losses = {}, {}, {}
        self.outbox = []                    # sends not posted yet: they leave with the next receive
        self.saved = SavedActivations(stage_module.parameters())

    def post(self, receive=None):
        """Post the waiting sends and this receive (a P2POp, or None) as one batch, and wait for all of them."""
        operations = self.outbox + ([receive] if receive is not None else [])
        self.outbox = []
        if operations:
            for request in dist.batch_isend_irecv(operations):
                request.wait()

    def receive_input(self, m, tokens):
        """Microbatch m's input: the tokens on the first stage, else the previous stage's output (we wait)."""
        if self.first:
            self.post()                     # nothing to receive: our waiting sends leave now
            return tokens[m]
        x = torch.empty(self.hidden_shape, device=self.device)
        self.post(dist.P2POp(dist.irecv, x, self.rank - 1))
        return x.requires_grad_(True)          # we will need d(loss)/d(x), to send back

    def forward(self, m, x, targets):
        with self.saved.hooks():               # count what autograd keeps for this microbatch's backward
            out = self.module(x)
            if self.last:
                self.losses[m] = models.lm_loss(out, targets[m]) / self.microbatches
        self.inputs[m] = x
        if not self.last:
            self.outputs[m] = out
            self.outbox.append(dist.P2POp(dist.isend, out.detach(), self.rank + 1))

    def receive_output_grad(self, m):
        """d(loss)/d(our output) of microbatch m, from the next stage (we wait); the last stage has its loss."""
        if self.last:
            self.post()
            return None
        grad = torch.empty(self.hidden_shape, device=self.device)
        self.post(dist.P2POp(dist.irecv, grad, self.rank + 1))
        return grad

    def backward(self, m, grad):
        if self.last:
            self.losses[m].backward()
        else:
            torch.autograd.backward(self.outputs.pop(m), grad)
        x = self.inputs.pop(m)
        if not self.first:
            self.outbox.append(dist.P2POp(dist.isend, x.grad, self.rank - 1))

    def finish_step(self):
        self.post()                             # the last sends of the step
        loss = sum(self.losses[m].item() for m in sorted(self.losses)) if self.last else None
        self.losses.clear()
        return loss


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=3)
    p.add_argument("--schedule", default="1f1b", help=f"the order each rank runs: {', '.join(HAND_SCHEDULES)}")
    p.add_argument("--microbatches", type=runtime.positive_int, default=8, help="M, microbatches per step")
    add_training_flags(p)  # --batch --layers --lr --reference
    args = p.parse_args()
    cfg = resolve_training_flags(args)
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        rank, world, microbatches = rt.rank, rt.world_size, args.microbatches
        report = metrics.Report(__file__, rt, config={**vars(args), "model": cfg.to_dict()})
        schedule = schedules.build(args.schedule, world, microbatches)
        rt.print(f"{args.schedule} by hand: {world} stages, layers "
                 + ", ".join(f"{layers_of_stage(cfg.n_layers, world, s)}" for s in range(world))
                 + f"; {microbatches} microbatches of {args.batch // microbatches} sequences")
        rt.print(f"rank 0 runs: {' '.join(map(str, schedule.actions[0]))}")

        with_reference = args.reference
        full = models.build_transformer(cfg, seed=args.seed)      # every rank, same weights, on the CPU
        stage = transformer_stage(full, rank, world).to(rt.device)
        optimizer = torch.optim.AdamW(stage.parameters(), lr=args.lr)
        reference = reference_optimizer = None
        if with_reference:                                         # the single-device model, beside the stage
            reference = full.to(rt.device)
            reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
        names = [n for n, _ in stage.named_parameters()]
        runner = StageRunner(stage, rank, world, microbatches,
                             (args.batch // microbatches, cfg.seq_len, cfg.dim), rt.device)

        losses, reference_losses, grad_diffs, events = [], [], [], []
        bytes_per_microbatch = None
        for step in range(args.steps):
            tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed).to(rt.device)
            inputs, targets = data.split_inputs_targets(tokens)
            input_mbs, target_mbs = inputs.chunk(microbatches), targets.chunk(microbatches)
            events.clear()
            dist.barrier()
            t0 = time.perf_counter()
            for action in schedule.actions[rank]:       # the schedule, as data, is the program
                m = action.microbatch
                if action.kind == "F":
                    x = runner.receive_input(m, input_mbs)  # waiting here is the bubble: not timed as work
                    rt.sync()                           # on NCCL the wait held the stream, not us: let it land
                    start = time.perf_counter()
                    runner.forward(m, x, target_mbs)
                    if bytes_per_microbatch is None:    # the first forward, alone in the stage
                        bytes_per_microbatch = runner.saved.alive
                else:
                    grad = runner.receive_output_grad(m)
                    rt.sync()
                    start = time.perf_counter()
                    runner.backward(m, grad)
                rt.sync()                               # on a GPU, wait for the kernels: time the work, not its launch
                events.append((rank, m, action.kind, start, time.perf_counter()))
            losses.append(runner.finish_step())

            if reference is not None:
                reference_loss = models.lm_loss(reference(inputs), targets)   # the whole batch, one device
                reference_loss.backward()
                reference_losses.append(reference_loss.item())
                reference_params = dict(reference.named_parameters())
                grad_diffs.append(metrics.max_abs_diff([p.grad for p in stage.parameters()],
                                                       [reference_params[n].grad for n in names]))
                reference_optimizer.step()
                reference_optimizer.zero_grad(set_to_none=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        timeline = gather_timeline(events, t0, rank)

        gathered = [None] * world
        # Measured: one microbatch's saved bytes (the first forward's, alone in the stage) and the peak.
        peak_microbatches = runner.saved.peak / bytes_per_microbatch
        dist.all_gather_object(gathered, {"losses": losses, "grad_diff": max(grad_diffs, default=None),
                                          "names": names, "rank": rank, "bytes_per_microbatch": bytes_per_microbatch,
                                          "peak_microbatches": round(peak_microbatches, 6)})
        losses = gathered[-1]["losses"]
        report.losses = losses
        report.timeline = timeline
        stage_names = [n for g in gathered for n in g["names"]]
        report.check("each parameter lives on exactly one stage, under its own name",
                     sorted(stage_names) == sorted(n for n, _ in full.named_parameters()),
                     f"{len(stage_names)} names", "the full model's names")
        if with_reference:
            report.check_close("losses equal the single-device model's", losses, reference_losses,
                               metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
            worst = max(g["grad_diff"] for g in gathered)
            report.check("gradients equal the single-device model's (every stage, every step)",
                         worst <= metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device), worst,
                         metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device))
        ran = {r: [f"{a.kind}{a.microbatch}" for a in executed_order(timeline, r)] for r in range(world)}
        report.check("every rank ran the textbook order (read from the clock)", all(
            ran[r] == textbook_order(args.schedule, world, microbatches, r) for r in range(world)),
            " ".join(ran[0]), "textbook order, every rank")
        measured_peaks = {int(g["rank"]): g["peak_microbatches"] for g in gathered}
        predicted = schedules.peak_activations(schedule)
        report.check_equal("activations held at once (measured, in microbatches) = schedule's prediction",
                           measured_peaks, predicted)
        report.extra.update(schedule=args.schedule, order=schedule.format(),
                            layers_of_stage={s: layers_of_stage(cfg.n_layers, world, s) for s in range(world)},
                            peak_activations=predicted, measured_peak_activations=measured_peaks,
                            saved_bytes_per_microbatch={int(g["rank"]): g["bytes_per_microbatch"] for g in gathered})
        rt.print(gantt.ascii_gantt(timeline, title=f"{args.schedule} by hand, last step (measured)", time_unit="s"))
        rt.print(f"losses: {' '.join(f'{x:.4f}' for x in losses)}" + (
            f" (single device: {' '.join(f'{x:.4f}' for x in reference_losses)})" if with_reference else ""))
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
