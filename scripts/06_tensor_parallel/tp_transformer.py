"""Tensor parallelism of the shared LLaMA-style transformer with DTensor: a declarative plan, and proof.

Every rank holds 1/tp of every weight matrix (heads of attention, columns of the feed-forward, a slice of
the vocabulary) and the whole batch; `parallelize_module` applies the plan of
`distlab.tensor_parallel.transformer_tp_plan`, and `loss_parallel` computes the cross-entropy on logits
that stay split over the vocabulary. The script proves that

* losses over the training steps, and the gradients of the first step, equal the single-device model's;
* the parameters each rank holds are 1/tp of the matrices plus the (replicated) norm weights;
* the collectives of one training step, measured, equal the formula: 2 all-reduces of B x S x H per block
  forward and 2 backward, one for the embedding, one for the output projection, three small ones for the loss.

``--compile`` compiles each block after the plan is applied, as torchtitan does (chapter 01's ladder switch), and
proves the same: its collectives are read off the profiler (a step's totals), since the per-module counter's
dispatch mode would turn the compiler off.

    torchrun --standalone --nproc_per_node=4 scripts/06_tensor_parallel/tp_transformer.py
    torchrun --standalone --nproc_per_node=4 scripts/06_tensor_parallel/tp_transformer.py --preset a100
    torchrun --standalone --nproc_per_node=4 scripts/06_tensor_parallel/tp_transformer.py --compile
"""

import contextlib
import sys
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from distlab import comm, data, memory, metrics, models, profiling, runtime, speed, tensor_parallel


def check_config(args, world_size):
    runtime.require(world_size >= 2, "tensor parallelism needs at least 2 ranks: launch with "
                                     "torchrun --standalone --nproc_per_node=4")
    tp = args.tp or world_size
    runtime.require(tp == world_size, f"--tp {tp} must equal the number of ranks ({world_size}): this chapter "
                                      "runs tensor parallelism alone (chapter 09 combines it with data parallelism)")
    cfg = tensor_parallel.model_from_args(args)
    problems = tensor_parallel.tp_config_problems(cfg, tp, batch=args.batch, seq_len=args.seq_len)
    runtime.require(not problems, "; ".join(problems))


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=4)
    p.add_argument("--tp", type=runtime.positive_int, default=None, help="tensor-parallel degree (default: the number of ranks)")
    p.add_argument("--plan", choices=["regions", "per-linear"], default="regions",
                   help="regions: one DTensor input per attention/feed-forward region (2 backward all-reduces per "
                        "block); per-linear: without PrepareModuleInput (5)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block after the plan is applied, as torchtitan does (chapter 01's ladder)")
    tensor_parallel.add_model_flags(p)  # --batch --seq-len --dim --heads --ffn-hidden --lr
    args = p.parse_args()
    cfg = tensor_parallel.model_from_args(args)

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        report = metrics.Report(__file__, rt, config={**vars(args), "tp": rt.world_size, "model": cfg.to_dict()})
        tolerance = {kind: metrics.fp32_tolerance(value, rt.device)   # against one device; 10x on a GPU
                     for kind, value in tensor_parallel.TOLERANCE[args.preset].items()}
        rt.print(f"TP over {rt.world_size} ranks, per rank: {cfg.n_heads // rt.world_size} of {cfg.n_heads} heads, "
                 f"{cfg.ffn_hidden // rt.world_size} feed-forward columns, "
                 f"{cfg.vocab_size // rt.world_size} vocabulary rows")

        # 1. The single-device reference, first, so its memory is free before the TP model is built.
        reference = models.train_reference(cfg, seed=args.seed, lr=args.lr, steps=args.steps, batch=args.batch,
                                           seq_len=args.seq_len, device=rt.device)
        reference_losses, reference_grads = reference["losses"], reference["first_grads"]
        del reference
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()

        # 2. The same model, split by the plan. Same seed: every rank starts from the same full weights
        #    and parallelize_module keeps its own slice of each.
        mesh = init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("tp",))
        model = models.build_transformer(cfg, args.seed, rt.device)
        tensor_parallel.parallelize_transformer(model, mesh, region_inputs=args.plan == "regions")
        if args.compile:
            # The first block's input is the embedding's to_local() output: a view made inside a custom autograd
            # Function (torch 2.13 distributed/tensor/_api.py:112). As a compiled block's input, backward skipped
            # that Function: the embedding's Redistribute.backward got a plain tensor and failed ("'Tensor' object
            # has no attribute '_local_tensor'"; measured with aot_eager and inductor, the eager backend passes).
            # A copy of the embedding's output is an ordinary tensor, and the step equals one device again.
            model.tok_embeddings.register_forward_hook(lambda module, inputs, output: output.clone())
            for block in model.layers.values():
                block.compile()
        optimizer = models.adamw_for_mixed_parameters(model.parameters(), args.lr)  # sharded weights, plain norms

        # 3. Train. Every TP rank sees the whole batch: TP splits the model, not the data.
        counter = comm.ModuleCommCounter()
        watcher = profiling.one_step(rt.device) if args.compile else None   # no dispatch mode: dynamo still compiles
        started = None
        for step in range(args.steps):
            if step == 1:
                rt.sync()
                started = time.perf_counter()  # step 0 pays one-off costs (DTensor's sharding caches)
            inputs, targets = data.split_inputs_targets(
                data.token_batch(step, args.batch, args.seq_len, cfg.vocab_size, args.seed).to(rt.device))
            counting = (watcher if args.compile else counter) if step == 0 else contextlib.nullcontext()
            with counting, loss_parallel():
                logits = model(inputs)  # a DTensor, split over the vocabulary
                loss = models.lm_loss(logits, targets)
                loss.backward()
                if step == 0 and args.compile:
                    watcher.step()
            if step == 0:
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

        # 4. Parameters per rank: measured off the local shards, against the formula.
        held = memory.ledger(model).params
        expected = tensor_parallel.tp_param_count_per_rank(cfg, rt.world_size)
        report.check_equal("parameter bytes per rank = matrices / tp + norms", held, expected["total"] * 4)
        report.memory = {"param_bytes_per_rank": held, "param_bytes_formula": expected["total"] * 4,
                         "param_bytes_single_device": cfg.num_params() * 4,
                         **metrics.memory_snapshot(rt.device)}

        # 5. The communication ledger of step 0: measured, against the formula. Compiled blocks: the step's totals
        #    per collective, read off the profiler (it does not know modules or phases).
        formula = tensor_parallel.tp_comm_formula(cfg, args.batch, args.seq_len, rt.world_size,
                                                  region_inputs=args.plan == "regions")
        if args.compile:
            speed.check_blocks_compiled(report)
            measured = [{"collective": c["collective"], "calls": 1, "payload_bytes": c["payload_bytes"]}
                        for c in profiling.collective_calls(profiling.trace_of(watcher))]
            ledger = tensor_parallel.join_comm_rows(tensor_parallel.step_totals(measured),
                                                    tensor_parallel.step_totals(formula), rt.world_size)
        else:
            ledger = tensor_parallel.join_comm_rows(tensor_parallel.measured_comm_rows(counter.calls), formula,
                                                    rt.world_size)
        rt.print(f"\ncommunication of one training step (B x S x H = {args.batch} x {args.seq_len} x {cfg.dim}):")
        rt.print(f"  {'phase':9s} {'where':10s} {'collective':12s} {'calls':>5s} {'measured':>12s} "
                 f"{'formula':>12s}   sent per rank (derived: ring model x measured)")
        for row in ledger:
            rt.print(f"  {row['phase']:9s} {row['where']:10s} {row['collective']:12s} {row['measured_calls']:5d} "
                     f"{row['measured_bytes']:12,d} {row['analytic_bytes']:12,d}   {row['sent_bytes_per_rank_derived']:,.0f}")
            report.add_comm(row["collective"], row["measured_bytes"], row["analytic_bytes"], phase=row["phase"],
                            where=row["where"], measured_calls=row["measured_calls"],
                            analytic_calls=row["analytic_calls"],
                            sent_bytes_per_rank_derived=row["sent_bytes_per_rank_derived"])
        mismatched = [f"{r['phase']}/{r['where']}/{r['collective']}" for r in ledger
                      if (r["measured_bytes"], r["measured_calls"]) != (r["analytic_bytes"], r["analytic_calls"])]
        report.check("communication of one step = formula (calls and bytes of every collective)", not mismatched,
                     mismatched or len(ledger), "every row equal")

        report.throughput = metrics.throughput(args.batch * args.seq_len, elapsed, args.steps - 1, cfg=cfg,
                                               seq_len=args.seq_len, device=rt.device, dtype="fp32",
                                               num_devices=rt.world_size)
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
