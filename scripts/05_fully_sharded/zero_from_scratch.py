"""ZeRO stages 1 and 2 by hand: shard the optimizer state (and the gradients) over the data-parallel ranks.

In data parallelism every rank keeps a full copy of the AdamW moments (8 bytes per parameter in fp32) and
takes the same step as every other rank: N identical copies of the same work. ZeRO splits each parameter
into N flat slices; rank r keeps the optimizer state of slice r only and updates only that slice:

* **stage 1**: all-reduce the gradients as DDP does, step the own slice, then **all-gather** the slices so
  every rank has every updated parameter again;
* **stage 2**: also shard the gradients: a **reduce-scatter** (the first half of an all-reduce) hands each
  rank the sum of its slice only, as soon as backward has produced each gradient, and the full gradient
  is freed at once.

The script trains DDP (the chapter-04 model) in lockstep and checks that ZeRO gives the same losses and
parameters every step, as does the single-device baseline; that per-rank memory (read off the tensors)
equals the ZeRO table (distlab.memory.zero_state_bytes); and that the bytes of each collective equal the
formula (distlab.comm.zero_step_bytes): stage 2 moves exactly DDP's bytes, stage 1 half as many again.

    torchrun --standalone --nproc_per_node=4 scripts/05_fully_sharded/zero_from_scratch.py --stage 2
"""

import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common_fully_sharded import GRAD_TOLERANCE, LOSS_TOLERANCE, Baseline, param_tolerance
from distlab import comm, data, memory, metrics, models, runtime


def check_config(args, world_size):
    runtime.require(args.steps >= 2, f"--steps {args.steps}: need at least 2 steps (memory is read at step 2)")
    if args.batch is not None:
        runtime.require(args.batch % world_size == 0,
                        f"--batch {args.batch} does not split over {world_size} ranks")


class ZeroAdamW:
    """AdamW whose state is sharded: rank r owns slice r of every (flattened) trainable parameter.

    ``self.shards[i]`` is a view of this rank's slice of parameter i: the optimizer updates it in place, so
    the update lands in the model's own weight. Slices are ceil(numel / N) long; the last ones may be
    shorter or empty, and the collectives pad to N equal slices.

    Any model: a frozen parameter (``requires_grad=False``) has no gradient, so it is left out (never reduced,
    never stepped); a tied weight is one parameter (``model.parameters()`` lists it once): one slice, one
    gradient; ``groups`` (AdamW's parameter groups, on the model's parameters) keep their learning rate and
    weight decay, each parameter's slice in its own parameter's group.
    """

    def __init__(self, model, stage: int, lr: float, groups: list[dict] | None = None):
        self.stage, self.rank, self.world = stage, dist.get_rank(), dist.get_world_size()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.slice_len = [math.ceil(p.numel() / self.world) for p in self.params]
        self.bounds = [(min(self.rank * k, p.numel()), min((self.rank + 1) * k, p.numel()))
                       for p, k in zip(self.params, self.slice_len)]
        self.shards = [torch.nn.Parameter(p.detach().view(-1)[lo:hi]) for p, (lo, hi) in zip(self.params, self.bounds)]
        shard_of = {id(p): shard for p, shard in zip(self.params, self.shards)}
        groups = groups or [{"params": self.params}]
        self.optimizer = torch.optim.AdamW([{**g, "params": [shard_of[id(p)] for p in g["params"]]} for g in groups],
                                           lr=lr)  # moments exist for the own slices only
        if stage == 2:
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._reduce_scatter(i))

    def _padded(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        return F.pad(flat, (0, self.slice_len[i] * self.world - flat.numel()))

    # stage 2: runs inside backward, the moment parameter i's gradient is complete
    @torch.no_grad()
    def _reduce_scatter(self, i: int) -> None:
        p, shard = self.params[i], self.shards[i]
        mine = torch.empty(self.slice_len[i], dtype=p.grad.dtype, device=p.grad.device)
        dist.reduce_scatter_single(mine, self._padded(i, p.grad.view(-1)), op=dist.ReduceOp.SUM)
        mine = mine[:shard.numel()].div_(self.world)  # the mean over ranks, of this rank's slice only
        shard.grad = mine if shard.grad is None else shard.grad + mine
        p.grad = None  # the full gradient is gone: only 1/N of the gradients stays on this rank

    # stage 1: after backward, the whole gradient is averaged on every rank, as in DDP
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        if self.stage != 1:
            return
        for p, shard, (lo, hi) in zip(self.params, self.shards, self.bounds):
            if p.grad is None:      # not used this step: on every rank alike (the same model, the same graph)
                continue
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(self.world)
            shard.grad = p.grad.view(-1)[lo:hi]  # this rank's slice (a view: no copy)

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()  # updates this rank's slices, in place in the model's weights
        for i, (p, shard) in enumerate(zip(self.params, self.shards)):
            k = self.slice_len[i]
            gathered = torch.empty(k * self.world, dtype=p.dtype, device=p.device)
            dist.all_gather_single(gathered, F.pad(shard.detach(), (0, k - shard.numel())))  # N equal slices
            p.view(-1).copy_(gathered[:p.numel()])  # every rank now holds every updated slice

    def slices_of(self, tensors) -> list[torch.Tensor]:
        """This rank's slice of each of ``tensors`` (one per trainable parameter, full size): what its shards hold."""
        return [t.reshape(-1)[lo:hi] for t, (lo, hi) in zip(tensors, self.bounds)]

    def zero_grad(self) -> None:
        for p, shard in zip(self.params, self.shards):
            p.grad, shard.grad = None, None

    def state_bytes(self, model) -> memory.StateBytes:
        """This rank's parameters, gradients (full or sharded) and optimizer moments, read off the tensors."""
        grads = [p.grad for p in self.params] + [s.grad for s in self.shards]
        moments = [v for state in self.optimizer.state.values() for v in state.values() if v.dim() > 0]
        return memory.StateBytes(metrics.tensor_bytes(list(model.parameters())), metrics.tensor_bytes(grads),
                                 metrics.tensor_bytes(moments))


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=5)
    p.add_argument("--stage", type=runtime.positive_int, choices=[1, 2], default=2,
                   help="1: shard the optimizer state; 2: also reduce-scatter and shard the gradients")
    p.add_argument("--batch", type=runtime.positive_int, default=None, help="global batch, sequences per step (default: 8; 16 for a100)")
    p.add_argument("--any-model", action="store_true",
                   help="head tied to the embedding, the first block and every norm frozen, a head bias of 127 "
                        "(no rank count but 1 divides it), two parameter groups (weight decay, learning rate)")
    runtime.add_lr_flag(p)
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        cfg = models.preset(args.preset, **({"vocab_size": 127} if args.any_model else {}))
        world = rt.world_size
        args.batch = args.batch or (16 if args.preset == "a100" else 8)
        compare = args.preset == "tiny"  # a100: neither DDP nor a single device fits beside the ZeRO model
        report = metrics.Report(__file__, rt, config={**vars(args), "model": cfg.to_dict()})
        def build():
            model = models.build_transformer(cfg, seed=args.seed, device=rt.device)
            return models.make_any_model(model) if args.any_model else model

        def groups(model):
            return models.parameter_groups(model, args.lr, any_model=args.any_model)

        model = build()
        num_params = sum(q.numel() for q in model.parameters())   # a tied weight once
        trainable = sum(q.numel() for q in model.parameters() if q.requires_grad)
        rt.print(f"ZeRO-{args.stage} by hand on {world} ranks: {args.preset} transformer, {num_params:,} parameters"
                 + (f" ({trainable:,} trainable)" if trainable != num_params else "") + f", global batch {args.batch}, fp32")
        zero = ZeroAdamW(model, args.stage, args.lr, groups(model))
        if compare:
            ddp_model = build()
            ddp = DDP(ddp_model)
            ddp_optimizer = torch.optim.AdamW(groups(ddp_model), lr=args.lr)
            baseline = Baseline(cfg, args.seed, args.lr, rt.device, model=build(), groups=groups) \
                if rt.rank == 0 else None
        diffs = {"ddp_loss": [], "ddp_param": [], "ddp_grad": [], "baseline_loss": [], "baseline_param": [],
                 "baseline_grad": []}

        measured_comm, seconds, state = [], [], None
        for step in range(args.steps):
            tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed)
            inputs, targets = data.split_inputs_targets(data.shard_rows(tokens, rt.rank, world).to(rt.device))
            rt.sync()
            started = time.perf_counter()
            with comm.CommCounter() as counter:
                loss = models.lm_loss(model(inputs), targets)
                loss.backward()           # stage 2: gradients are reduce-scattered in here, one by one
                zero.reduce_gradients()   # stage 1: all-reduced here
                zero.step()               # own slices updated, then all-gathered
            if step == 1:  # every kind of state exists now (AdamW creates its moments at the first step)
                state = zero.state_bytes(model)
            grad_slices = [shard.grad.detach().clone() for shard in zero.shards]  # this rank's averaged slices
            zero.zero_grad()
            rt.sync()
            seconds.append(time.perf_counter() - started)
            measured_comm.append(counter.by_collective())
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            report.losses.append(global_loss.item() / world)
            line = f"step {step:3d}  loss {report.losses[-1]:.6f}"

            if compare:  # DDP on the same shards of the same batch; the single device on the whole batch
                ddp_loss = models.lm_loss(ddp(inputs), targets)
                ddp_loss.backward()
                # Gradients, not only losses and parameters: AdamW would hide a missing division by N.
                diffs["ddp_grad"].append(metrics.max_abs_diff(grad_slices, zero.slices_of(
                    [q.grad for q in ddp_model.parameters() if q.requires_grad])))
                ddp_optimizer.step()
                ddp_optimizer.zero_grad(set_to_none=True)
                ddp_loss = ddp_loss.detach()
                dist.all_reduce(ddp_loss)
                diffs["ddp_loss"].append(abs(report.losses[-1] - ddp_loss.item() / world))
                diffs["ddp_param"].append(metrics.max_abs_diff(list(model.parameters()), list(ddp_model.parameters())))
                line += f"  DDP {ddp_loss.item() / world:.6f}"
                if baseline is not None:
                    baseline.step(tokens.to(rt.device))
                    diffs["baseline_grad"].append(metrics.max_abs_diff(grad_slices, zero.slices_of(
                        [g for g in baseline.grads if g is not None])))
                    diffs["baseline_loss"].append(abs(report.losses[-1] - baseline.losses[-1]))
                    diffs["baseline_param"].append(metrics.max_abs_diff(list(model.parameters()),
                                                                        list(baseline.model.parameters())))
                    line += f"  single-device {baseline.losses[-1]:.6f}"
            rt.print(line)

        # ---- communication: measured = formula ----
        padded_params = sum(k * world for k in zero.slice_len)  # = trainable when every size divides by N
        analytic = comm.zero_step_bytes(trainable, args.stage)  # a frozen parameter is never sent
        padding_bytes = 4 * (padded_params - trainable)        # what the sharded collectives add for padding
        for collective, expected in analytic.items():
            per_step = [m.get(collective, {}).get("payload_bytes", 0) for m in measured_comm]
            report.add_comm(collective, per_step[-1], expected,  # ring model x measured payload: derived
                            sent_bytes_per_rank_derived=comm.bytes_sent_per_rank(collective, per_step[-1], world))
            report.check(f"{collective} bytes per step = formula (every step)",
                         all(0 <= got - expected <= padding_bytes for got in per_step), per_step[-1],
                         f"== {expected}" + (f" + padding <= {padding_bytes}" if padding_bytes else ""))
        # Measured: the payloads this run handed to its collectives, against DDP's all-reduce of every gradient
        # (its formula; chapter 04 measures it). Stage 1 hands over twice DDP's bytes: an all-reduce and an all-gather.
        payload = sum(row["measured_bytes"] for row in report.comm)
        ddp_payload = sum(comm.zero_step_bytes(num_params, 0).values())
        rt.print(f"payload bytes per step (measured): ZeRO-{args.stage} {payload:,}, DDP's all-reduce {ddp_payload:,} "
                 f"({payload / ddp_payload:.2f}x)")
        report.extra["payload_bytes_per_step"] = {"zero_measured": payload, "ddp_formula": ddp_payload}
        # Derived, not measured: the ring model applied to the payloads measured above (ZeRO) and to DDP's formula.
        sent = sum(row["sent_bytes_per_rank_derived"] for row in report.comm)
        ddp_sent = comm.step_bytes_sent_per_rank(comm.zero_step_bytes(num_params, 0), world)
        rt.print(f"bytes each rank sends per step (derived: ring model): ZeRO-{args.stage} {sent:,.0f}, "
                 f"DDP {ddp_sent:,.0f} " + (f"({sent / ddp_sent:.2f}x)" if ddp_sent else "(one rank sends nothing)"))
        report.extra["sent_bytes_per_rank_derived"] = {"zero": sent, "ddp": ddp_sent}

        # ---- memory: measured on this rank = the ZeRO table ----
        table = memory.zero_state_bytes(trainable, world, args.stage, precision="fp32")
        frozen_bytes = 4 * (num_params - trainable)           # frozen weights: held whole, no gradient, no moments
        table = memory.StateBytes(table.params + frozen_bytes, table.grads, table.optimizer)
        report.memory = {"measured": state.as_dict(), "analytic": table.as_dict(),
                         "ddp": memory.zero_state_bytes(num_params, world, 0, precision="fp32").as_dict(),
                         "device": metrics.memory_snapshot(rt.device)}
        rt.print(f"rank {rt.rank} state: params {state.params:,} B, grads {state.grads:,} B, "
                 f"AdamW moments {state.optimizer:,} B (DDP: {4 * num_params:,} / {4 * num_params:,} / "
                 f"{8 * num_params:,} B)")
        exact = padding_bytes == 0
        for part in ("params", "grads", "optimizer"):
            got, want = getattr(state, part), getattr(table, part)
            if exact:
                report.check_equal(f"{part} bytes on this rank = ZeRO-{args.stage} table", got, int(want))
            else:  # uneven slices: the last rank's slices are shorter, the others' padded
                report.check_close(f"{part} bytes on this rank = ZeRO-{args.stage} table (within padding)", got,
                                   want, tolerance=2 * padding_bytes)

        if compare:
            # the worst rank's gradient slices: every rank's shard is checked, rank 0 reports
            worst_grad = torch.tensor(max(diffs["ddp_grad"]), dtype=torch.float64, device=rt.device)
            dist.all_reduce(worst_grad, op=dist.ReduceOp.MAX)
            report.check_close("gradient shards = DDP's averaged gradients, sliced (every rank, every step)",
                               worst_grad.item(), 0.0, metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device))
            report.check_close("loss = DDP loss (every step)", max(diffs["ddp_loss"]), 0.0,
                               metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
            report.check_close("parameters = DDP parameters (every step)", max(diffs["ddp_param"]), 0.0,
                               param_tolerance(args.lr))
            if rt.rank == 0:
                report.check_close("rank 0's gradient shards = the single-device gradients, sliced (every step)",
                                   max(diffs["baseline_grad"]), 0.0, metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device))
                report.check_close("loss = single-device loss (every step)", max(diffs["baseline_loss"]), 0.0,
                                   metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
                report.check_close("parameters = single-device parameters (every step)",
                                   max(diffs["baseline_param"]), 0.0, param_tolerance(args.lr))
            report.extra["diffs"] = diffs
        else:
            rt.print("a100 preset: no DDP or single-device model fits beside this one; comparisons are tiny-only")
        timed = seconds[1:] or seconds   # the first step pays one-off costs: left out
        report.throughput = metrics.throughput(args.batch * cfg.seq_len, sum(timed), len(timed), cfg=cfg,
                                               device=rt.device, dtype="fp32", num_devices=rt.world_size)
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
