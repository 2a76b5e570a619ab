"""Profile a few training steps of DDP or FSDP2 with torch.profiler, and read the trace: where did time go?

The course transformer trains under ``--strategy ddp`` (chapter 04: DistributedDataParallel, gradients
all-reduced in buckets during backward) or ``--strategy fsdp`` (chapter 05: ``fully_shard`` per block,
parameters all-gathered before use, gradients reduce-scattered). ``torch.profiler`` watches the steps with a
schedule: ``--wait`` steps ignored (step 0, whose gradients DDP all-reduces in one bucket once backward ends; step
1's forward builds the capped buckets), ``--warmup`` steps traced and thrown away (the profiler's own start-up cost), ``--active`` steps kept. Each rank writes a Chrome trace (open it in https://ui.perfetto.dev or
chrome://tracing) and reads it back (``distlab.profiling``) to say:

* time per kind over the active steps: computing only, communicating only (exposed), both (overlapped),
  neither (idle: Python between operators, the data, a sleep). Waiting for a late peer is communication: a
  gloo event lasts until the slowest rank arrives, and an NCCL kernel spins until then;
* how much of the communication ran while backward was computing: the backward overlap, measured from the
  trace's intervals, not drawn.

On a CPU the trace shows each gloo collective as a ``gloo:<collective>`` event on one of gloo's worker
threads (the main thread only records the enqueue, ``c10d::allreduce_``); FSDP2's reduce-scatters appear as
``gloo:all_reduce``. On a GPU the NCCL kernels are the communication.

Checks: every rank's trace exists and parses; the trace's active steps, which the four kinds partition by
construction, span the wall time measured with the script's own clock; the collectives in the trace, step by step, equal those one more
(unprofiled) step issues as counted by ``distlab.comm.CommCounter`` (under DDP, step 0's one all-reduce instead,
and step 1's two broadcasts of the bucket rebuild besides); the losses equal the single-device
baseline's (tiny preset); with several buckets or units, some communication overlapped backward's compute.

    torchrun --standalone --nproc_per_node=4 scripts/12_hpc_operations/profile_step.py --strategy ddp
    torchrun --standalone --nproc_per_node=4 scripts/12_hpc_operations/profile_step.py --strategy fsdp
"""

import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "05_fully_sharded"))
from common_fully_sharded import LOSS_TOLERANCE, Baseline  # noqa: E402 - chapter 05's reference
from train_fsdp import apply_fsdp  # noqa: E402 - chapter 05's sharding, not a copy

from distlab import comm, data, metrics, models, profiling, runtime  # noqa: E402

# The kinds come from the trace, the wall time from time.perf_counter around the same steps: they differ by
# what happens between the profiler's step marks and the clock's reads (inside prof.step(): a few ms, more
# on a loaded machine where another process may run in between).
KINDS_TOLERANCE_FRACTION = 0.10
KINDS_TOLERANCE_SECONDS = 0.010
# A straggler: under DDP nothing makes the ranks wait for each other before backward's first all-reduce, so each
# rank's data + forward time is its own; one rank later than the rest by more than this, step after step, holds
# every other rank in that all-reduce. --planted-bug slow-rank gives rank SLOW_RANK SLOW_RANK_SECONDS of extra
# compute a step (matrix products: real work, compute in its trace, not a sleep that shows as idle).
# The tolerance is half that delay: a CPU shared by 4 ranks and another test worker deschedules a rank for up to
# about 0.1 s (0.106 s seen with 28 processes on 2 cores: the check failed a correct run), the planted delay stays
# twice over it.
STRAGGLER_TOLERANCE_S = 0.15
SLOW_RANK, SLOW_RANK_SECONDS = 1, 0.3
# DDP's step 0 has one bucket: "when the parameters are not in the real execution order, we don't do bucketing, thus
# only one ALL-REDUCE is inserted after all the gradients of the whole graph are computed ... we only disable
# bucketing for the first iteration" (torch 2.13 nn/parallel/distributed.py:1401-1407; its bucket limit is
# sys.maxsize when no bucket_cap_mb_list is given and static_graph or not find_unused_parameters:
# _BucketCapacityConfig.compute_bucket_size_limits, :146-154). At the
# start of step 1's forward DDP builds the capped buckets in the order step 0's gradients became ready (_pre_forward:
# reducer._rebuild_buckets()), and rank 0 broadcasts the new layout: the indices, then the bucket sizes (c10d
# reducer.cpp, Reducer::sync_bucket_indices). Measured on gloo (tests/scripts/test_12_profiling.py, --wait 0): one
# all-reduce in step 0, two gloo:broadcast events in step 1's forward.
DDP_FIRST_STEP, DDP_FIRST_STEP_COLLECTIVES = 0, {"all_reduce": 1}
DDP_REBUILD_STEP, DDP_REBUILD_COLLECTIVES = 1, {"broadcast": 2}


def extra_work(seconds: float, device, sync) -> None:
    """The planted straggler's extra work: matrix products on its own device for ``seconds`` of its clock, as a
    rank given more work (or a slower device) computes longer. Large products, so the trace counts the time as
    compute: the tiny model's own forward passes would leave half of it idle, Python between small operators."""
    size = 4096 if device.type == "cuda" else 512
    matrix = torch.randn(size, size, device=device)
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        torch.mm(matrix, matrix)
        sync()


def check_config(args, world_size):
    runtime.require(args.wait >= 0 and args.warmup >= 0, "--wait and --warmup cannot be negative")
    runtime.require(args.active >= 1, f"--active {args.active}: the profiler must keep at least one step")
    runtime.require(args.batch % world_size == 0, f"--batch {args.batch} does not split over {world_size} ranks")
    runtime.require(args.bucket_mb is None or args.bucket_mb > 0,
                    f"--bucket-mb {args.bucket_mb}: a bucket must hold something")
    runtime.require(args.planted_bug != "slow-rank" or (args.strategy == "ddp" and world_size > SLOW_RANK),
                    f"--planted-bug slow-rank: rank {SLOW_RANK} is slowed and the straggler check runs under "
                    f"--strategy ddp, on {SLOW_RANK + 1} ranks or more (not {args.strategy} on {world_size})")
    fixes = runtime.learner_fixes(args.fix_from, ("straggler",))
    runtime.require(not fixes or args.strategy == "ddp", "--fix-from: the straggler check runs under --strategy ddp")


def parallelize(model, args, rt):
    """Chapter 04's DDP or chapter 05's FSDP2 around the same model."""
    if args.strategy == "fsdp":
        return apply_fsdp(model)
    # bucket_cap_mb=None is DDP's default: 25 MiB buckets after a first one of 1 MiB. Passing 25 explicitly would
    # make the first bucket 25 MiB too (torch 2.13 nn/parallel/distributed.py, _BucketCapacityConfig.create: the 1 MiB
    # first bucket only when bucket_cap_mb is None, :106-110).
    ddp = DDP(model, device_ids=[rt.device] if rt.device_type == "cuda" else None, bucket_cap_mb=args.bucket_mb,
              forward_sync_buffers=False)  # the rotary tables never change: no broadcast each step
    # DDP's default all-reduce, as a Python comm hook: the same collective, now visible to CommCounter
    ddp.register_comm_hook(state=None, hook=allreduce_hook)
    return ddp


def expected_in_trace(issued: dict, device_type: str, strategy: str = "fsdp", step: int | None = None) -> Counter:
    """The collectives a step issued (CommCounter's names) as the trace names them: gloo runs FSDP2's flat
    reduce-scatter as an all-reduce (``gloo:all_reduce``); NCCL has a kernel of its own for each. Under DDP,
    step 0 all-reduces one bucket, and step 1 also holds the broadcasts of DDP's bucket rebuild."""
    if strategy == "ddp" and step == DDP_FIRST_STEP:
        return Counter(DDP_FIRST_STEP_COLLECTIVES)
    renamed = {"reduce_scatter": "all_reduce"} if device_type == "cpu" else {}
    expected = Counter()
    for collective, calls in issued.items():
        expected[renamed.get(collective, collective)] += calls
    if strategy == "ddp" and step == DDP_REBUILD_STEP:
        expected.update(DDP_REBUILD_COLLECTIVES)
    return expected


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=None)
    p.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="which chapter's training to profile")
    p.add_argument("--wait", type=runtime.nonnegative_int, default=1,
                   help="steps the profiler skips (step 0: DDP's one bucket, before step 1 builds the capped ones)")
    p.add_argument("--warmup", type=runtime.nonnegative_int, default=1, help="steps traced, then thrown away (profiler start-up)")
    p.add_argument("--active", type=runtime.positive_int, default=2, help="steps traced and kept")
    p.add_argument("--batch", type=runtime.positive_int, default=8, help="global batch, sequences per step")
    p.add_argument("--bucket-mb", type=runtime.positive_float, default=None,
                   help="DDP bucket_cap_mb (default: 0.1 on tiny, 4 buckets of its small model to see overlap in; "
                        "DDP's own default on a100, 1 MiB first then 25 MiB, the buckets a real job has)")
    runtime.add_lr_flag(p)
    p.add_argument("--trace-dir", default="build/profile_step", help="where each rank writes its Chrome trace")
    p.add_argument("--planted-bug", choices=["slow-rank"], default=None,
                   help=f"a fault the checks must catch: rank {SLOW_RANK} computes {SLOW_RANK_SECONDS} s more before each "
                        "step's forward (a straggler: the job runs, every other rank waits for it)")
    runtime.add_fix_flag(p, "straggler(ranks) (the rank the others wait for, from the profiled steps' rows of "
                            "extra.ranks): after the profiled steps its extra work is removed, as draining its node "
                            "would, and the straggler check is made on --active more steps")
    args = p.parse_args()
    if args.bucket_mb is None and args.preset == "tiny":  # 0.1 MB on the a100 model: one bucket a parameter
        args.bucket_mb = 0.1  # (a100 keeps None: DDP's own default)
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        cfg = models.preset(args.preset)
        report = metrics.Report(__file__, rt, config={**vars(args), "model": cfg.to_dict()})
        profiled_steps = args.wait + args.warmup + args.active
        rt.print(f"{args.preset} transformer, {cfg.num_params():,} parameters, {args.strategy} on {rt.world_size} "
                 f"ranks; profiler schedule: wait {args.wait}, warmup {args.warmup}, active {args.active}")

        model = parallelize(models.build_transformer(cfg, seed=args.seed, device=rt.device), args, rt)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        # the single-device answer: the same model from the same seed, on the whole global batch (tiny only:
        # an a100-sized copy would not fit beside the replica)
        baseline = Baseline(cfg, args.seed, args.lr, rt.device) if args.preset == "tiny" else None

        before_sync = []   # per step, this rank's data + forward seconds (before any collective, under DDP)
        slowed = {SLOW_RANK} if args.planted_bug == "slow-rank" else set()   # the ranks given extra work
        fixes = runtime.learner_fixes(args.fix_from, ("straggler",))

        def train_step(step):
            started = time.perf_counter()
            tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed).to(rt.device)
            inputs, targets = data.split_inputs_targets(data.shard_rows(tokens, rt.rank, rt.world_size))
            if rt.rank in slowed:   # the planted fault: one rank computes more every step, late to every all-reduce
                extra_work(SLOW_RANK_SECONDS, rt.device, rt.sync)
            loss = models.lm_loss(model(inputs), targets)
            before_sync.append(time.perf_counter() - started)
            with record_function(profiling.BACKWARD_LABEL):  # labels backward's span in the trace
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rt.sync()  # a step's GPU work ends inside its profiler step
            return loss.detach()

        trace_path = Path(args.trace_dir) / f"{args.strategy}_rank{rt.rank}.json"
        trace_path.parent.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device_type == "cuda" else [])
        local_losses, wall_seconds = [], 0.0
        with profile(activities=activities,
                     schedule=schedule(wait=args.wait, warmup=args.warmup, active=args.active, repeat=1),
                     on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_path))) as prof:
            for step in range(profiled_steps):
                if step == args.wait + args.warmup:  # the first active step begins: the script's own clock
                    started = time.perf_counter()
                local_losses.append(train_step(step))
                if step == profiled_steps - 1:       # the last one ends (its prof.step() writes the trace)
                    wall_seconds = time.perf_counter() - started
                prof.step()

        # One more step, not profiled, with the collectives counted in Python (independent of the trace).
        with comm.CommCounter() as counter:
            local_losses.append(train_step(profiled_steps))
        issued = {c: v["calls"] for c, v in counter.by_collective().items()}

        # ---- read the trace back ----
        trace = profiling.load_trace(trace_path)
        kinds = profiling.time_per_kind(trace, rt.device_type)
        overlap = profiling.backward_overlap(trace, rt.device_type)
        steps = profiling.step_spans(profiling.complete_events(trace))
        in_trace = profiling.communication_events(trace, rt.device_type)
        per_step = [Counter(c["collective"] for c in in_trace if start <= c["start"] < end) for start, end in steps]
        mine = {"rank": rt.rank, "trace": str(trace_path), "events": len(trace["traceEvents"]), "kinds": kinds,
                "wall_seconds": wall_seconds, "overlap": overlap, "trace_collectives_per_step": per_step,
                "issued": issued, "before_sync_seconds": sorted(before_sync)[len(before_sync) // 2]}
        everyone = [None] * rt.world_size
        dist.all_gather_object(everyone, mine)
        arrivals = [row["before_sync_seconds"] for row in everyone]
        if fixes:   # chapter 14's lab: the rank the learner's straggler() names loses its extra work, then more steps
            named = fixes["straggler"]([dict(row) for row in everyone])
            rt.print(f"straggler(ranks) = {named!r}: that rank's extra work removed; {args.active} more step(s)")
            slowed.discard(named)
            before_sync.clear()
            for step in range(len(local_losses), len(local_losses) + args.active):
                local_losses.append(train_step(step))
            arrivals = [None] * rt.world_size
            dist.all_gather_object(arrivals, sorted(before_sync)[len(before_sync) // 2])

        if baseline is not None:  # after the profiled steps, so that its work is in no trace
            for step in range(len(local_losses)):
                baseline.step(data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed)
                              .to(rt.device))
        losses = torch.stack(local_losses).to(rt.device)
        dist.all_reduce(losses)  # each rank's mean over equal shards: the global mean is their average
        report.losses = (losses / rt.world_size).tolist()

        # ---- what rank 0 prints: its own time per kind, and every rank's overlap ----
        window = kinds["window_seconds"]
        rt.print(f"\ntrace: {trace_path} (each rank its own file; open in https://ui.perfetto.dev)")
        rt.print(f"time per kind (rank 0, {args.active} active step(s), {1e3 * wall_seconds:.1f} ms on the "
                 f"script's clock, {1e3 * window:.1f} ms in the trace):")
        for kind, meaning in (("compute", "computing only"), ("communication", "communicating only (exposed)"),
                              ("overlapped", "computing and communicating"), ("idle", "neither")):
            rt.print(f"  {kind:<14}{1e3 * kinds[kind]:8.2f} ms  {100 * kinds[kind] / window:5.1f}%  {meaning}")
        rt.print(f"collectives per step in the trace: {dict(per_step[-1])}; issued (CommCounter): {issued}")
        for row in everyone:
            o = row["overlap"]
            rt.print(f"rank {row['rank']}: {1e3 * o['communication_seconds']:.2f} ms of communication, "
                     f"{100 * o['hidden_fraction']:.0f}% of it while backward computed, "
                     f"{100 * o['during_backward_fraction']:.0f}% inside backward's span")

        # ---- checks ----
        report.check("every rank's Chrome trace exists and parses (events in each)",
                     all(row["events"] > 0 for row in everyone), [row["events"] for row in everyone], "> 0")
        report.check("the profiler kept the active steps (ProfilerStep# spans in every trace)",
                     all(len(row["trace_collectives_per_step"]) == args.active for row in everyone),
                     [len(row["trace_collectives_per_step"]) for row in everyone], f"== {args.active}")
        gaps = [abs(sum(row["kinds"][k] for k in profiling.KINDS) - row["wall_seconds"]) for row in everyone]
        bound = max(KINDS_TOLERANCE_FRACTION * row["wall_seconds"] for row in everyone) + KINDS_TOLERANCE_SECONDS
        # The four kinds partition the trace's step spans by construction (distlab.profiling, unit-tested on
        # hand-made traces); what this checks is that those spans cover the time the script's own clock measured.
        report.check("the trace's active steps (compute + communication + overlapped + idle) span the wall time "
                     "the script's clock measured, every rank", max(gaps) <= bound, max(gaps), bound)
        rt.print("trace - clock, per rank: " + ", ".join(f"{1e3 * g:.1f} ms" for g in gaps))
        first_active = args.wait + args.warmup
        expected = [[expected_in_trace(row["issued"], rt.device_type, args.strategy, first_active + i)
                     for i in range(args.active)] for row in everyone]
        wrong = [(row["rank"], first_active + i, dict(seen), dict(want)) for row, wants in zip(everyone, expected)
                 for i, (seen, want) in enumerate(zip(row["trace_collectives_per_step"], wants)) if seen != want]
        report.check("collectives in the trace, every active step = what a step issues (CommCounter, counted in "
                     "an unprofiled step; DDP's step 0 has one bucket, its step 1 adds the rebuild's broadcasts), "
                     "every rank", not wrong,
                     "; ".join(f"rank {r} step {s}: {seen}" for r, s, seen, _ in wrong[:2]) or dict(expected[0][-1]),
                     "; ".join(f"{want}" for *_, want in wrong[:2]) or "the same")
        # DDP launches each bucket's all-reduce from backward's gradient hooks and goes on computing: with two
        # buckets or more, some communication overlaps backward. FSDP2 overlaps through CUDA streams; on a CPU
        # the trace shows no operator running while any of its collectives ran (measured, reported below).
        # On a GPU every rank overlaps. On a CPU shared by 4 ranks (and maybe other jobs) a rank can be
        # descheduled until its backward has ended, so there the claim is for the job: some rank overlapped.
        # One rank issues no collective (FSDP over one GPU gathers nothing: seen on an H200): nothing to overlap.
        hidden = [row["overlap"]["hidden_fraction"] for row in everyone]
        if rt.world_size == 1:
            rt.print("one rank: no collective, so no overlap to check")
        elif rt.device_type == "cuda":
            report.check("some communication ran while backward computed (trace intervals), every rank",
                         min(hidden) > 0, min(hidden), "> 0")
        elif args.strategy == "ddp" and sum(issued.values()) > 1:
            report.check("some communication ran while backward computed (trace intervals), on some rank",
                         max(hidden) > 0, max(hidden), "> 0")
        if args.strategy == "ddp" and rt.world_size > 1:   # FSDP's forward gathers: its ranks wait there already
            rt.print("data + forward per rank (median step): " + ", ".join(f"{1e3 * a:.0f} ms" for a in arrivals))
            report.check("no straggler: every rank reaches backward's all-reduces with the others (median data + "
                         "forward time, slowest - fastest rank)", max(arrivals) - min(arrivals) <= STRAGGLER_TOLERANCE_S,
                         round(max(arrivals) - min(arrivals), 3), f"<= {STRAGGLER_TOLERANCE_S} s")
        if baseline is not None:
            report.check_close("losses = single-device baseline (every step)", report.losses, baseline.losses,
                               metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
        else:
            rt.print("no single-device comparison at this size (the reference would not fit beside the replica)")

        report.extra = {"strategy": args.strategy, "ranks": everyone,
                        "timeline": profiling.timeline(trace, rt.device_type) if rt.rank == 0 else []}
        report.throughput = metrics.throughput(args.batch * cfg.seq_len, wall_seconds, args.active, cfg=cfg,
                                               device=rt.device, dtype="fp32", num_devices=rt.world_size)
        report.memory = {"device": metrics.memory_snapshot(rt.device)}
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
