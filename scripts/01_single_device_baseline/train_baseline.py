"""The reference training loop: the course's transformer trained on one device.

Every later chapter splits this loop over several devices and proves itself against it: same model
(``distlab.models``), same data (``distlab.data``), same optimizer, same losses. This script also
measures where the memory goes (parameters, gradients, AdamW state, saved activations) and how fast it
trains (tokens/s, model FLOPs per token, and MFU on a GPU), and proves itself:

* the loss falls (the model learns the synthetic rule);
* the same seed gives the same losses (the first steps are trained a second time, from scratch);
* measured training state = 16 bytes/parameter, measured saved activations = the formula (fp32);
* on a GPU, the allocator's peak = the peak predicted phase by phase (``memory.predict_step_peak``) within 2%,
  where it is 6 GiB or more (``memory.PEAK_CHECK_MIN_BYTES``; the ``a100`` preset).

    python scripts/01_single_device_baseline/train_baseline.py
    torchrun --standalone --nproc_per_node=4 scripts/01_single_device_baseline/train_baseline.py

The single-GPU ladder's switches change how a step runs, never what it computes (chapter 01, ``make gpu-ladder``):
``--attention`` (which SDPA kernel), ``--fused-adamw``, ``--compile`` (each block; the script checks a graph was
captured), ``--activation-checkpointing``, and ``--profile-out FILE`` (where one more step's GPU time went).

Under torchrun every rank trains the same full replica on the same full batch (nothing is split) and the
script checks that all replicas agree: four devices doing one device's work, which is what chapter 04's
data parallelism fixes.
"""

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab import data, memory, metrics, models, profiling, runtime, speed

REPRODUCE_STEPS = 3  # steps trained a second time, from scratch, to prove the run is reproducible
# On a GPU the saved-activation formula (counted on a CPU) is checked within 1%: see the check. One d-sized tensor
# per block more or less is ~4% of the total for both presets (memory.transformer_activation_bytes).
ACTIVATION_TOLERANCE_GPU = 0.01


def check_config(args, world_size):
    runtime.require(args.steps >= 2, f"--steps {args.steps}: at least 2 steps are needed to see the loss fall")
    runtime.require(args.batch is None or args.batch >= 1, f"--batch {args.batch}: need at least 1 sequence")
    runtime.require(args.lr > 0, f"--lr {args.lr}: the learning rate must be positive")


def apply_speed_switches(model, args):
    """The single-GPU ladder's switches (chapter 01, "From 24% to ..."): each changes how the step runs, none what
    it computes. Activation checkpointing wraps each block (recompute its forward in backward); --compile compiles
    each block, as torchtitan does (one compiled graph serves all blocks: they share their code)."""
    for name, block in list(model.layers.items()):
        if args.activation_checkpointing:
            block = speed.CheckpointedBlock(block)
        if args.compile:
            block.compile()
        model.layers[name] = block
    return model


def train(cfg, args, rt, precision, steps, measure=None):
    """The whole loop: build, then per step forward, loss, backward, AdamW. Returns losses and step times.

    With ``measure`` (a dict), step 0 also reads the saved activations and the training state into it, and with
    ``--profile-out`` one more step, not timed, runs under the profiler (its trace: ``measure["trace"]``)."""
    model = apply_speed_switches(models.build_transformer(cfg, seed=args.seed, device=rt.device), args)
    # fused: one kernel updates every parameter (no foreach temporaries); the default is foreach on a GPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=args.fused_adamw or None)
    autocast = torch.autocast(rt.device_type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def train_step(step, record=False):
        """One training step; with ``record``, what autograd saves for backward (read off the tensors in the
        forward) and the training state (after the optimizer's step: parameters, gradients, moments) go to
        ``measure``."""
        tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed).to(rt.device)
        inputs, targets = data.split_inputs_targets(tokens)
        saving = memory.saved_activation_bytes(exclude=model.parameters()) if record else contextlib.nullcontext()
        # the attention kernel's choice holds through backward too: a checkpointed block runs its forward again
        # there, and a recompute on another kernel saves other tensors (torch.utils.checkpoint refuses it)
        with speed.attention_backend(args.attention):
            with saving as saved, autocast:
                loss = models.lm_loss(model(inputs), targets)
            loss.backward()
        optimizer.step()
        if record:
            measure.update(activations=saved.bytes, state=memory.ledger(model, optimizer),
                           num_params=models.count_params(model))
        optimizer.zero_grad(set_to_none=True)
        return loss

    losses, seconds = [], []
    for step in range(steps):
        rt.sync()
        started = time.perf_counter()
        loss = train_step(step, record=measure is not None and step == 0)
        losses.append(loss.item())  # .item() waits for the device: the step time below is real
        seconds.append(time.perf_counter() - started)
    if measure is not None and args.profile_out:
        with profiling.one_step(rt.device) as prof:
            train_step(steps).item()
            prof.step()
        measure["trace"] = profiling.trace_of(prof)
    return losses, seconds


def main():
    p = runtime.parser(__doc__, presets=("tiny", "small", "a100", "llama3_8b_slice"), steps=20)
    p.add_argument("--batch", type=runtime.positive_int, default=None,
                   help="sequences per step (default: 8 for tiny and small, 4 for a100, 1 for llama3_8b_slice)")
    runtime.add_lr_flag(p)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 autocast on a GPU, fp32 on a CPU")
    ladder = p.add_argument_group("the ladder's switches (chapter 01: how a step runs, not what it computes)")
    ladder.add_argument("--attention", choices=sorted(speed.ATTENTION_BACKENDS), default="auto",
                        help="the kernel scaled_dot_product_attention may use (auto: PyTorch's choice; math: the "
                             "unfused one; flash and cudnn need a GPU and bf16)")
    ladder.add_argument("--fused-adamw", action="store_true", help="AdamW in one fused kernel (fused=True)")
    ladder.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    ladder.add_argument("--activation-checkpointing", action="store_true",
                        help="keep only each block's input; recompute its forward in backward")
    ladder.add_argument("--profile-out", metavar="FILE", default=None,
                        help="profile one more step (not timed) and write where the GPU's time went (JSON)")
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        cfg = models.preset(args.preset)
        args.batch = args.batch or {"a100": 4, "llama3_8b_slice": 1}.get(args.preset, 8)
        precision = args.precision if args.precision != "auto" else ("bf16" if rt.device_type == "cuda" else "fp32")
        problem = speed.attention_backend_problem(args.attention, rt.device_type, precision)
        runtime.require(problem is None, problem)
        report = metrics.Report(__file__, rt, config={**vars(args), "precision": precision,
                                                      "model": cfg.to_dict()})
        num_params = cfg.num_params()
        switches = [name for name, on in (("attention " + args.attention, args.attention != "auto"),
                                          ("fused AdamW", args.fused_adamw), ("compiled blocks", args.compile),
                                          ("activation checkpointing", args.activation_checkpointing)) if on]
        rt.print(f"{args.preset} transformer: {num_params:,} parameters, batch {args.batch} x {cfg.seq_len} tokens, "
                 f"{precision}, {rt.device}" + "".join(f", {s}" for s in switches))
        if rt.world_size > 1:
            rt.print(f"{rt.world_size} ranks: every rank trains the same full replica on the same batch "
                     f"(nothing is split yet: that is chapter 04)")

        measured = {}
        losses, seconds = train(cfg, args, rt, precision, args.steps, measure=measured)
        for step, loss in enumerate(losses):
            if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
                rt.print(f"step {step:4d}  loss {loss:.4f}  ({seconds[step] * 1e3:.1f} ms)")
        report.losses = losses
        # the allocator's figures of the run the phase model predicts, read before the second run: on an H100 (torch
        # 2.11) each compiled run left about 5 GB allocated after its model was deleted (cause not established), and
        # the second run's peak sat that much above the first's (BENCHMARKS.md, the ladder)
        device_memory = metrics.memory_snapshot(rt.device)
        if rt.device_type == "cuda":
            torch.cuda.empty_cache()
        again, _ = train(cfg, args, rt, precision, min(REPRODUCE_STEPS, args.steps))

        # ---- throughput: tokens/s over the steps after the first (which pays for one-off set-up) ----
        peak_dtype = "bf16" if precision == "bf16" else (
            "tf32" if rt.device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32 else "fp32")
        report.throughput = metrics.throughput(args.batch * cfg.seq_len, sum(seconds[1:]), len(seconds) - 1,
                                               cfg=cfg, device=rt.device, dtype=peak_dtype)
        tokens_per_s, flops_per_token, mfu, name = (report.throughput[k] for k in
                                                     ("tokens_per_s", "flops_per_token", "mfu", "device_name"))
        rt.print(f"throughput: {tokens_per_s:,.0f} tokens/s x {flops_per_token:,.0f} FLOPs/token "
                 f"= {tokens_per_s * flops_per_token / 1e9:.2f} GFLOP/s achieved")
        if mfu is None:
            rt.print(f"MFU: not reported on {name}: no known peak FLOP/s for it (MFU is a GPU figure)")
        else:
            rt.print(f"MFU: {mfu:.1%} of {name}'s {metrics.peak_flops(name, peak_dtype) / 1e12:.0f} TFLOP/s "
                     f"({peak_dtype} peak)")

        if args.profile_out and rt.device_type == "cuda":   # where one step's device time went, kernel by kind
            breakdown = profiling.device_time_by_kind(measured.pop("trace"))
            report.extra["device_time_by_kind"] = breakdown
            if rt.rank == 0:   # one writer: under torchrun every rank profiles its own replica, to the same path
                Path(args.profile_out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.profile_out).write_text(json.dumps(breakdown, indent=1))
            rt.print(f"one profiled step: {breakdown['window_seconds'] * 1e3:.1f} ms on the device, "
                     f"{breakdown['kernels']} kernels; " + ", ".join(
                         f"{kind} {sec * 1e3:.1f} ms" for kind, sec in sorted(breakdown["seconds"].items(),
                                                                             key=lambda kv: -kv[1])))
            rt.print("attention ran in: " + (", ".join(breakdown["attention_kernels"]) or "no attention kernel"))
        elif args.profile_out:
            rt.print("--profile-out: the breakdown is of GPU kernels; a CPU run has none (nothing written)")

        # ---- memory: measured from the tensors, predicted from the formulas ----
        state = measured["state"]
        predicted_state = memory.training_state_bytes(num_params, "fp32")  # autocast keeps fp32 weights
        predicted_activations = memory.transformer_activation_bytes(cfg, args.batch)
        # the peak, by phase: not everything is alive at once (distlab.memory.predict_step_peak). AdamW takes its
        # foreach path on a GPU (4 B a parameter more in the step), its for-loop on a CPU
        phases = memory.predict_step_peak(state, measured["activations"], args.batch, cfg.seq_len, cfg.vocab_size,
                                          foreach=rt.device_type == "cuda" and not args.fused_adamw)
        report.memory = {"measured_state": state.as_dict(), "predicted_state": predicted_state.as_dict(),
                         "measured_activations": measured["activations"],
                         "predicted_activations": predicted_activations, "predicted_peak": phases.as_dict(),
                         "device": device_memory}
        rt.print(f"memory: params {state.params:,} B, grads {state.grads:,} B, AdamW {state.optimizer:,} B, "
                 f"saved activations {measured['activations']:,} B")
        rt.print(f"predicted peak {phases.peak:,} B, in the {phases.peak_phase} phase ("
                 + ", ".join(f"{name} {phases.total(name):,} B" for name in phases.phases) + ")")

        # ---- the checks ----
        exact = 0.0 if rt.device_type == "cpu" else 2e-2  # GPU kernels (and bf16) need not be bitwise repeatable
        first, last = losses[0], sum(losses[-3:]) / len(losses[-3:])
        report.check("loss falls (mean of last 3 steps < 90% of the first)", last < 0.9 * first,
                     round(last / first, 4), "< 0.9")
        report.check_close(f"same seed, same losses (first {len(again)} steps trained again)",
                           losses[:len(again)], again, tolerance=exact)
        report.check_equal("parameter count = formula (TransformerConfig.num_params)",
                           measured["num_params"], num_params)
        report.check_equal("training state measured = 16 bytes/param (fp32 weights, grads, AdamW moments)",
                           state.total, predicted_state.total)
        if args.activation_checkpointing or args.compile:
            rt.print("saved activations: the formula counts what eager PyTorch saves; checkpointed or compiled "
                     "blocks save less (measured above), so it is not checked")
        elif precision == "fp32" and rt.device_type == "cpu":
            report.check_equal("saved activations measured = formula (memory.transformer_activation_bytes)",
                               measured["activations"], predicted_activations)
        elif precision == "fp32":
            # CUDA's attention kernels save a little more than the CPU's: a log-sum-exp padded to a multiple of
            # 32 positions per head, and the dropout RNG's seed and offset. Relative tolerance 1% (not measured
            # in CI, which has no GPU): a tensor missing from or added to the formula moves it by ~4%.
            relative = abs(measured["activations"] - predicted_activations) / predicted_activations
            report.check_close("saved activations measured = formula within 1% (CUDA kernels save extras)",
                               relative, 0.0, ACTIVATION_TOLERANCE_GPU)
        else:
            rt.print("saved activations: the formula is the fp32 one; under bf16 autocast only the measurement "
                     "is reported")
        if rt.device_type == "cuda" and args.activation_checkpointing:
            rt.print(f"peak memory: max_memory_allocated {device_memory['peak_allocated_bytes']:,} B; not checked "
                     f"under activation checkpointing (backward rebuilds one block's activations: the phase model "
                     f"does not count them)")
        elif rt.device_type == "cuda":   # the allocator's peak against the phase model (CPU: tests/unit/test_memory.py),
            # from memory.PEAK_CHECK_MIN_BYTES predicted: below, cuBLAS's workspaces alone exceed the margin
            memory.check_allocator_peak(report, phases.peak, device_memory["peak_allocated_bytes"], say=rt.print)
        if args.compile:   # compiled code runs silently eager when something disables dynamo
            speed.check_blocks_compiled(report)
        if rt.world_size > 1:
            every_rank = [None] * rt.world_size
            dist.all_gather_object(every_rank, losses)
            report.check_close(f"all {rt.world_size} replicas trained identically", every_rank,
                               [losses] * rt.world_size, tolerance=exact)
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
