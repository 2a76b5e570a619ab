"""Megatron sequence parallelism: tensor parallelism that also splits the activations between its regions.

Under plain tensor parallelism (chapter 06) every rank holds the whole B x S x H activation wherever the
model is not split: the residual stream, the norms, their saved inputs. Sequence parallelism splits those
along the sequence: the norms run on S/tp positions each, an all-gather rebuilds the full sequence where a
tensor-parallel region (attention, feed-forward) begins, and a reduce-scatter (instead of an all-reduce)
ends it, leaving each rank the sum for its own positions only. The script proves that

* losses and step-0 gradients equal the single-device model's (the norms' weight gradients, now partial
  sums over sequence shards, are all-reduced after backward);
* the activation bytes autograd saves per rank, measured, equal the formula for one device, for TP and for
  TP + SP (`distlab.tensor_parallel.activation_bytes`), and SP saves less;
* the collectives of one step equal the formula, and each all-reduce of TP became an all-gather plus a
  reduce-scatter: the same bytes on the wire per rank.

    torchrun --standalone --nproc_per_node=4 scripts/08_sequence_parallel/sp_transformer.py
    torchrun --standalone --nproc_per_node=4 scripts/08_sequence_parallel/sp_transformer.py --preset a100
"""

import sys
import time

import torch
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from distlab import comm, data, memory, metrics, models, runtime, tensor_parallel


def check_config(args, world_size):
    runtime.require(world_size >= 2, "sequence parallelism needs at least 2 ranks: launch with "
                                     "torchrun --standalone --nproc_per_node=4")
    cfg = tensor_parallel.model_from_args(args)
    problems = tensor_parallel.tp_config_problems(cfg, world_size, batch=args.batch, seq_len=args.seq_len,
                                                  sequence_parallel=True)
    runtime.require(not problems, "; ".join(problems))


def batch_of(step, args, cfg, device):
    tokens = data.token_batch(step, args.batch, args.seq_len, cfg.vocab_size, args.seed).to(device)
    inputs, targets = data.split_inputs_targets(tokens)
    # The loss saves the targets: a storage of their own, so they count as saved whatever the batch size.
    return tokens, inputs, targets.clone()


def measured_step(model, tokens, inputs, targets, device):
    """Forward, loss and backward once, measuring what autograd saves and which collectives run."""
    not_activations = [*model.parameters(), *model.buffers(), tokens]  # weights, rotary tables, the batch
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with comm.ModuleCommCounter() as counter, loss_parallel():
        with memory.saved_activation_bytes(exclude=not_activations) as saved:
            loss = models.lm_loss(model(inputs), targets)
        loss.backward()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return loss, saved.bytes, counter, peak


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=4)
    tensor_parallel.add_model_flags(p)  # --batch --seq-len --dim --heads --ffn-hidden --lr
    args = p.parse_args()
    cfg = tensor_parallel.model_from_args(args)

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        tp = rt.world_size
        report = metrics.Report(__file__, rt, config={**vars(args), "tp": tp, "model": cfg.to_dict()})
        tolerance = {kind: metrics.fp32_tolerance(value, rt.device)   # against one device; 10x on a GPU
                     for kind, value in tensor_parallel.TOLERANCE[args.preset].items()}
        # Memory formulas hold exactly for the CPU's attention kernel; a GPU kernel may save a little more.
        memory_tolerance = 0.0 if rt.device.type == "cpu" else 0.02
        mesh = init_device_mesh(rt.device.type, (tp,), mesh_dim_names=("tp",))

        # 1. Single device: losses, step-0 gradients, saved activations.
        model = models.build_transformer(cfg, args.seed, rt.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        reference_losses, reference_saved = [], None
        for step in range(args.steps):
            tokens, inputs, targets = batch_of(step, args, cfg, rt.device)
            loss, saved, _, reference_peak = measured_step(model, tokens, inputs, targets, rt.device)
            if step == 0:
                reference_saved = saved
                reference_grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            reference_losses.append(loss.item())
        del model, optimizer
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()

        # 2. Plain tensor parallelism, one step: its saved activations and collectives, for comparison.
        model = tensor_parallel.parallelize_transformer(models.build_transformer(cfg, args.seed, rt.device), mesh)
        tokens, inputs, targets = batch_of(0, args, cfg, rt.device)
        _, tp_saved, tp_counter, tp_peak = measured_step(model, tokens, inputs, targets, rt.device)
        del model

        # 2b. The same with every block checkpointed (recomputed in backward), twice: with torch's default, whose
        # recomputation stops as soon as the last tensor backward needs is back (before the block's last
        # collective), and without that early stop (as Megatron's recompute re-runs the whole block). Chapter 11's
        # planner counts both; the gradients do not change.
        ckpt_calls = {}
        for early_stop in (True, False):
            model = tensor_parallel.parallelize_transformer(models.build_transformer(cfg, args.seed, rt.device), mesh)
            for block in model.layers.values():
                checkpoint(block)  # keep the block's input, recompute the rest in backward (as chapters 05, 12 do)
            with set_checkpoint_early_stop(early_stop):
                _, _, counter, _ = measured_step(model, tokens, inputs, targets, rt.device)
            ckpt_calls[early_stop] = counter.calls
            difference = tensor_parallel.max_gradient_difference(model, reference_grads)
            report.check(f"step-0 gradients with every block checkpointed (early stop {early_stop}) equal "
                         "single-device", difference <= tolerance["grad"], difference, tolerance["grad"])
            del model

        # 3. Tensor + sequence parallelism: train, and measure step 0.
        model = tensor_parallel.parallelize_transformer(models.build_transformer(cfg, args.seed, rt.device), mesh,
                                                        sequence_parallel=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        started = None
        for step in range(args.steps):
            if step == 1:
                rt.sync()
                started = time.perf_counter()
            tokens, inputs, targets = batch_of(step, args, cfg, rt.device)
            loss, saved, counter, sp_peak = measured_step(model, tokens, inputs, targets, rt.device)
            # The norm weights saw only this rank's positions: their gradients are partial sums. Finish them.
            with comm.CommCounter() as norm_grads_comm:
                tensor_parallel.reduce_partial_gradients(model)
            if step == 0:
                sp_saved, sp_first_peak = saved, sp_peak
                sp_measured = (tensor_parallel.measured_comm_rows(counter.calls)
                               + tensor_parallel.measured_comm_rows(norm_grads_comm.calls, phase="after backward",
                                                                    where="norm weights"))
                difference = tensor_parallel.max_gradient_difference(model, reference_grads)
                report.check("step-0 gradients equal single-device (every parameter)",
                             difference <= tolerance["grad"], difference, tolerance["grad"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            report.losses.append(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())
            rt.print(f"step {step}: loss {report.losses[-1]:.6f}   single device {reference_losses[step]:.6f}")
        rt.sync()
        elapsed = time.perf_counter() - started if started else float("nan")
        report.check_close("losses equal single-device", report.losses, reference_losses,
                           tolerance=tolerance["loss"])

        # 4. Activation memory per rank: measured against the formula, three ways.
        rt.print(f"\nactivations saved for backward, per rank (B x S x H = {args.batch} x {args.seq_len} x {cfg.dim}, "
                 f"{cfg.n_layers} layers):")
        report.memory = {"activation_bytes": {}, **metrics.memory_snapshot(rt.device)}
        for label, measured, ranks, sequence_parallel in (("single device", reference_saved, 1, False),
                                                          (f"TP {tp}", tp_saved, tp, False),
                                                          (f"TP {tp} + SP", sp_saved, tp, True)):
            formula = tensor_parallel.activation_bytes(cfg, args.batch, args.seq_len, ranks,
                                                       sequence_parallel=sequence_parallel)
            relative = abs(measured - formula["total"]) / formula["total"]
            rt.print(f"  {label:14s} measured {measured:14,d}   formula {formula['total']:14,d}")
            report.memory["activation_bytes"][label] = {"measured": measured, **formula}
            report.check(f"saved activations, {label}: measured = formula (relative difference)",
                         relative <= memory_tolerance, relative, memory_tolerance)
        report.check("sequence parallelism saves activation memory (TP + SP < TP)", sp_saved < tp_saved,
                     sp_saved / tp_saved, "< 1")
        if rt.device.type == "cuda":
            report.memory["peak_allocated_step0"] = {"single device": reference_peak, f"TP {tp}": tp_peak,
                                                     f"TP {tp} + SP": sp_first_peak}

        # 5. Communication of one step: measured against the formula; SP's bytes against TP's.
        sp_ledger = tensor_parallel.join_comm_rows(
            sp_measured,
            tensor_parallel.tp_comm_formula(cfg, args.batch, args.seq_len, tp, sequence_parallel=True), tp)
        tp_ledger = tensor_parallel.join_comm_rows(
            tensor_parallel.measured_comm_rows(tp_counter.calls),
            tensor_parallel.tp_comm_formula(cfg, args.batch, args.seq_len, tp), tp)
        rt.print(f"\ncommunication of one training step, TP + SP:")
        rt.print(f"  {'phase':14s} {'where':12s} {'collective':14s} {'calls':>5s} {'measured':>12s} {'formula':>12s}"
                 f"   sent per rank (derived: ring model x measured)")
        for row in sp_ledger:
            rt.print(f"  {row['phase']:14s} {row['where']:12s} {row['collective']:14s} {row['measured_calls']:5d} "
                     f"{row['measured_bytes']:12,d} {row['analytic_bytes']:12,d}   {row['sent_bytes_per_rank_derived']:,.0f}")
            report.add_comm(row["collective"], row["measured_bytes"], row["analytic_bytes"], phase=row["phase"],
                            where=row["where"], measured_calls=row["measured_calls"],
                            analytic_calls=row["analytic_calls"],
                            sent_bytes_per_rank_derived=row["sent_bytes_per_rank_derived"],
                            plan="tp+sp")
        for row in tp_ledger:
            report.add_comm(row["collective"], row["measured_bytes"], row["analytic_bytes"], phase=row["phase"],
                            where=row["where"], measured_calls=row["measured_calls"],
                            analytic_calls=row["analytic_calls"],
                            sent_bytes_per_rank_derived=row["sent_bytes_per_rank_derived"],
                            plan="tp")
        # checkpointed: each collective's bytes = the formula's, plus the blocks' forward collectives once more
        # (without early stop), or all but each block's last one (torch's default early stop)
        for early_stop, calls in ckpt_calls.items():
            per_block_again = (1 if early_stop else 2) / 2  # of the 2 forward all-reduces of a block
            recomputed = {}
            for row in tensor_parallel.tp_comm_formula(cfg, args.batch, args.seq_len, tp):
                again = per_block_again if row["where"] == "blocks" and row["phase"] == "forward" else 0
                recomputed[row["collective"]] = recomputed.get(row["collective"], 0) + row["payload_bytes"] * (1 + again)
            measured_ckpt = {}
            for row in tensor_parallel.measured_comm_rows(calls):
                measured_ckpt[row["collective"]] = measured_ckpt.get(row["collective"], 0) + row["payload_bytes"]
            label = "tp+checkpointing" + ("" if early_stop else " without early stop")
            for collective, measured_bytes in measured_ckpt.items():
                report.add_comm(collective, measured_bytes, recomputed.get(collective, 0), plan=label)
            report.check(f"communication of one checkpointed TP step (early stop {early_stop}) = formula + the "
                         f"blocks' forward collectives {'but the last ' if early_stop else ''}again",
                         measured_ckpt == recomputed, measured_ckpt, recomputed)
        mismatched = [f"{r['phase']}/{r['where']}/{r['collective']}" for r in sp_ledger + tp_ledger
                      if (r["measured_bytes"], r["measured_calls"]) != (r["analytic_bytes"], r["analytic_calls"])]
        report.check("communication of one step = formula, TP and TP + SP (calls and bytes)", not mismatched,
                     mismatched or len(sp_ledger) + len(tp_ledger), "every row equal")

        def activation_traffic(ledger):  # bytes each rank sends for the B x S x H activations (derived)
            return sum(r["sent_bytes_per_rank_derived"] for r in ledger if r["where"] not in ("loss", "norm weights"))

        sp_traffic, tp_traffic = activation_traffic(sp_ledger), activation_traffic(tp_ledger)
        rt.print(f"\nactivation traffic sent per rank in one step: TP {tp_traffic:,.0f} bytes, "
                 f"TP + SP {sp_traffic:,.0f} bytes")
        report.check_equal("SP sends the same activation bytes per rank as TP (all-gather + reduce-scatter "
                           "= all-reduce)", sp_traffic, tp_traffic)
        report.extra["activation_traffic_per_rank"] = {"tp": tp_traffic, "tp+sp": sp_traffic}

        report.throughput = metrics.throughput(args.batch * args.seq_len, elapsed, args.steps - 1, cfg=cfg,
                                               seq_len=args.seq_len, device=rt.device, dtype="fp32",
                                               num_devices=tp)
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
