"""Data parallelism divides the compute of a step, not its memory: counted on every rank.

Each of N ranks holds a full replica of the transformer and takes 1/N of the global batch (its rows).
The script counts the FLOPs every rank really executes in forward + backward (``FlopCounterMode``, with
the attention kernel's FLOPs registered for the CPU kernel too) and reads the bytes of every rank's
parameters, gradients and AdamW state off the tensors. It proves:

* this rank's FLOPs = 6 x (matmul weights) x its tokens + 14 x layers x dim x seq_len x its tokens, exactly
  (12 when attention runs unfused; a fused kernel's backward recomputes QK^T), and the course's model-FLOPs formula
  ``metrics.transformer_flops_per_token`` (6 N + 12 L d T, what MFU counts) within 2%;
* the ranks' FLOPs add up to one device's FLOPs for the whole batch: each rank does 1/N of the work;
* every rank holds the whole training state, 16 bytes per parameter: memory is not divided at all;
* the mean of the ranks' losses is the single-device loss of the global batch.

    torchrun --standalone --nproc_per_node=4 scripts/02_why_distributed/compute_and_memory_per_rank.py
"""

import sys

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from distlab import data, memory, metrics, models, runtime


def check_config(args, world_size):
    runtime.require(args.batch >= 1, f"--batch {args.batch}: need at least 1 sequence")
    runtime.require(args.batch % world_size == 0,
                    f"--batch {args.batch} does not split over {world_size} ranks (each rank takes batch / ranks rows)")


def _cpu_attention_forward(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, query, key, value)


# torch's FLOP counter knows the GPU attention kernels; the CPU one is registered here with the same formula.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def exact_flops_per_token(cfg, fused_attention: bool = True) -> int:
    """Every matmul of a step, per token: 6 x each weight (the embedding lookup and the norms multiply
    nothing), plus attention's products, per layer: QK^T and AV forward (4 d T) and their gradients backward
    (8 d T). A fused (flash) attention kernel does not store the T x T scores; its backward recomputes QK^T
    (2 d T more). Those are hardware FLOPs; model FLOPs (MFU) count 12 d T."""
    matmul_weights = cfg.num_params() - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim
    attention = 4 + 8 + (2 if fused_attention else 0)
    return 6 * matmul_weights + attention * cfg.n_layers * cfg.dim * cfg.seq_len


def main():
    p = runtime.parser(__doc__, presets=("tiny", "small"), steps=None)
    p.add_argument("--batch", type=runtime.positive_int, default=8, help="global batch (sequences), split over the ranks")
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        cfg = models.preset(args.preset)
        report = metrics.Report(__file__, rt, config={**vars(args), "model": cfg.to_dict()})
        model = models.build_transformer(cfg, seed=args.seed, device=rt.device)  # a full replica per rank
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batch = data.token_batch(0, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed)
        inputs, targets = data.split_inputs_targets(data.shard_rows(batch, rt.rank, rt.world_size).to(rt.device))
        my_tokens = inputs.numel()

        with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
            loss = models.lm_loss(model(inputs), targets)
            loss.backward()
        optimizer.step()
        my_flops = counter.get_total_flops()
        fused = any("attention" in str(op) for op in counter.get_flop_counts()["Global"])
        state = memory.ledger(model, optimizer)

        # What every rank did, gathered: FLOPs, state bytes, losses.
        every = torch.tensor([float(my_flops), float(state.total), loss.item()], dtype=torch.float64)
        gathered = [torch.zeros_like(every) for _ in range(rt.world_size)]
        dist.all_gather(gathered, every)
        flops_per_rank = [int(g[0]) for g in gathered]
        state_per_rank = [int(g[1]) for g in gathered]
        loss_per_rank = [g[2].item() for g in gathered]
        report.losses = [sum(loss_per_rank) / rt.world_size]

        global_tokens = args.batch * cfg.seq_len
        one_device_flops = exact_flops_per_token(cfg, fused) * global_tokens
        full_state = memory.training_state_bytes(cfg.num_params(), "fp32").total
        sharded_state = full_state / rt.world_size

        rt.print(f"{args.preset} transformer, {cfg.num_params():,} parameters; global batch {args.batch} x "
                 f"{cfg.seq_len} tokens over {rt.world_size} rank(s)")
        rt.print(f"{'rank':>4} {'tokens':>8} {'GFLOP':>10} {'state MB':>10}")
        for rank in range(rt.world_size):
            rt.print(f"{rank:>4} {global_tokens // rt.world_size:>8} {flops_per_rank[rank] / 1e9:>10.4f} "
                     f"{state_per_rank[rank] / 1e6:>10.3f}")
        rt.print(f"one device, whole batch: {one_device_flops / 1e9:.4f} GFLOP, {full_state / 1e6:.3f} MB of state")
        rt.print(f"compute per rank is 1/{rt.world_size} of it; memory per rank is all of it "
                 f"(sharded it would be {sharded_state / 1e6:.3f} MB: chapter 05)")

        report.check_equal(f"this rank's FLOPs counted = 6 x matmul weights + {14 if fused else 12} L d T, per token",
                           my_flops, exact_flops_per_token(cfg, fused) * my_tokens)
        formula = metrics.transformer_flops_per_token(cfg) * my_tokens
        report.check("model FLOPs 6N + 12LdT (metrics.transformer_flops_per_token) within 2% of the count",
                     abs(formula - my_flops) / my_flops < 0.02, round(abs(formula - my_flops) / my_flops, 5), 0.02)
        report.check_equal("FLOPs of all ranks add up to one device's FLOPs for the global batch",
                           sum(flops_per_rank), one_device_flops)
        report.check_equal("every rank holds the full training state (16 bytes/param): memory is not divided",
                           state_per_rank, [full_state] * rt.world_size)

        reference = models.build_transformer(cfg, seed=args.seed)  # one device, the whole batch
        full_inputs, full_targets = data.split_inputs_targets(batch)
        with torch.no_grad():
            reference_loss = models.lm_loss(reference(full_inputs), full_targets).item()
        # fp32, measured ~1e-7 apart on a CPU; the reference runs on the CPU while the ranks may run on GPUs,
        # whose kernels sum in other orders: 10x wider there (metrics.fp32_tolerance).
        report.check_close("mean of the ranks' losses = single-device loss of the global batch",
                           report.losses[0], reference_loss, tolerance=metrics.fp32_tolerance(1e-5, rt.device))
        report.throughput = {"flops_per_rank": flops_per_rank, "one_device_flops": one_device_flops,
                             "flops_per_token": metrics.transformer_flops_per_token(cfg)}
        report.memory = {"state_bytes_per_rank": state_per_rank, "full_state_bytes": full_state,
                         "fully_sharded_state_bytes": sharded_state, "device": metrics.memory_snapshot(rt.device)}
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
