"""DistributedDataParallel: the data parallelism of ddp_from_scratch.py, as PyTorch ships it.

What DDP adds to the two collectives written by hand:

* **buckets and overlap**: gradients are grouped into buckets of ``--bucket-mb``; a bucket is all-reduced as
  soon as backward has produced all of its gradients, while backward goes on computing the rest;
* **gradient_as_bucket_view**: gradients live inside the bucket buffers instead of beside them (one copy
  of the gradients less);
* **no_sync**: gradient accumulation over ``--accumulation`` micro-batches all-reduces once, on the last;
* **DistributedSampler** hands each rank its own disjoint share of the dataset, reshuffled every epoch.

A comm hook records every bucket DDP all-reduces, which parameters it holds, when its all-reduce was
launched and when it finished, against backward's start, its last gradient and its return: the overlap,
measured. The script checks that every bucket's all-reduce ran inside backward and that communication
began before backward had finished computing (with several buckets), that the bytes all-reduced per
optimizer step equal the parameter bytes, that micro-steps inside ``no_sync`` send nothing, and that the
replicas stay identical; with ``--compare`` it also trains the
single-device baseline (rank 0) and the from-scratch version (ddp_from_scratch.py) in lockstep and
checks that all three agree at every step.

    torchrun --standalone --nproc_per_node=4 scripts/04_data_parallel/train_ddp.py --compare
    torchrun --standalone --nproc_per_node=4 scripts/04_data_parallel/train_ddp.py --bucket-mb 0.1 --accumulation 2
"""

import argparse
import contextlib
import math
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_from_scratch import (GRAD_TOLERANCE, LOSS_TOLERANCE, average_gradients, broadcast_parameters,
                              param_tolerance, replicas_identical)
from distlab import comm, data, metrics, models, runtime

NAN_STEP = 2   # --planted-bug nan-from-one-rank: the step whose micro-batch on one rank has every target masked
# --planted-bug token-out-of-vocabulary: the step, and the rank (the last, on fewer ranks), whose first sequence holds
# one token id equal to the vocabulary's size, one past the embedding's last row
BAD_TOKEN_STEP, BAD_TOKEN_RANK = 1, 3


class WithOneBadToken(torch.utils.data.Dataset):
    """``dataset`` with one sample's token at ``position`` replaced by ``token``: a record written with another
    vocabulary than the model's (a tokenizer's added token), which one rank draws at one step."""

    def __init__(self, dataset, index: int, position: int, token: int):
        self.dataset, self.index, self.position, self.token = dataset, index, position, token

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> torch.Tensor:
        sample = self.dataset[index]
        if index == self.index:
            sample = sample.clone()
            sample[self.position] = self.token
        return sample


def bad_token_index(samplers, rank, step, per_rank_step, steps_per_epoch) -> int:
    """The dataset index of the first sequence ``rank`` draws at ``step`` (its sampler's order, ``per_rank_step``
    sequences a step: micro-batch x accumulation)."""
    epoch, within = divmod(step, steps_per_epoch)
    sampler = samplers[rank]
    sampler.set_epoch(epoch)
    return list(sampler)[within * per_rank_step]


def in_vocabulary(tokens, vocab_size):
    """Which sequences of ``tokens`` (sequences x positions) hold only ids the embedding has: 0 to vocab_size - 1."""
    return ((tokens >= 0) & (tokens < vocab_size)).all(dim=1)


def masked_mean_loss(logits, targets, mask):
    """The mean cross-entropy over the tokens ``mask`` keeps, as a sum divided by their count. With no token kept
    the loss is 0/0, and so is its gradient (1/0 times 0): backward's all-reduce hands the nan to every rank."""
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1),
                                                  reduction="none")
    mask = mask.flatten().float()
    return (per_token * mask).sum() / mask.sum()


def kept_targets(tokens, every=False):
    """--uneven-lengths: which targets a sequence keeps, its first L of its S (``tokens``: S + 1 tokens, S targets;
    L = 1 + its first token mod S: 1 to S, read from the tokens so that every rank and the one-device reference
    agree). Padding, or a prompt whose tokens carry no loss, gives real batches such uneven counts. ``every``
    (--keep-every-target): all S, through the same masked loss."""
    width = tokens.shape[1] - 1
    lengths = torch.full_like(tokens[:, 0], width) if every else 1 + tokens[:, 0] % width
    return torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]


def token_losses(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1),
                                             reduction="none").view(targets.shape)


def step_token_loss(per_token, mask, step_tokens, world_size):
    """A micro-batch's share of the step's mean over every kept token of the global batch: its tokens' sum over the
    step's count (all ranks, all micro-batches), times N, since DDP's all-reduce then averages the ranks."""
    return (per_token * mask).sum() * world_size / step_tokens


# The recipe's per-rank batch was tuned on this many ranks: --planted-bug global-batch-grows keeps it on any number.
TUNED_WORLD = 2

# The functions of a learner's fix this script runs (--fix-from), each in place of its own code there.
FIXES = ("rank_sampler", "epoch_indices", "synchronises", "without_gradient", "token_loss", "micro_batch_size",
         "first_nonfinite", "tokens_in_vocabulary")
# A learner's reading of what the run prints, not code that trains, and a learner's guard against bad data: each
# may run beside --planted-bug (the guard is judged with the fault planted: without it every id is in range).
READINGS = ("first_nonfinite", "tokens_in_vocabulary")


def check_config(args, world_size):
    runtime.require(args.steps >= 1, f"--steps {args.steps}: need at least one step")
    runtime.require(args.accumulation >= 1, f"--accumulation {args.accumulation}: need at least 1 micro-step")
    runtime.require(args.bucket_mb > 0, f"--bucket-mb {args.bucket_mb}: a bucket must hold something")
    runtime.require(not (args.uneven_lengths and args.keep_every_target),
                    "--uneven-lengths and --keep-every-target: choose one (uneven lengths, or every target kept)")
    runtime.require(args.planted_bug != "token-mean-per-micro-batch" or args.uneven_lengths or args.keep_every_target,
                    "--planted-bug token-mean-per-micro-batch plants its mistake in the masked loss: add "
                    "--uneven-lengths (or --keep-every-target); without either no token is masked")
    runtime.require(args.planted_bug != "token-out-of-vocabulary" or args.steps > BAD_TOKEN_STEP,
                    f"--planted-bug token-out-of-vocabulary puts its token in step {BAD_TOKEN_STEP}'s batch: give "
                    f"--steps {BAD_TOKEN_STEP + 1} or more")
    runtime.require(not (args.compare and args.precision == "bf16"),
                    "--compare checks fp32 equality: use --precision fp32 (or auto) with it")
    if args.batch is not None:
        runtime.require(args.batch % (world_size * args.accumulation) == 0,
                        f"--batch {args.batch} does not split into {world_size} ranks x {args.accumulation} "
                        f"accumulation steps (the global batch must be a multiple of {world_size * args.accumulation})")
        if args.samples is not None:
            runtime.require(args.samples % args.batch == 0,
                            f"--samples {args.samples} is not a whole number of global batches of {args.batch}")


class BucketLog:
    """What DDP's reducer did during backward, measured: when backward began, when each gradient became
    ready, when each bucket's all-reduce was launched and when it finished, and when backward returned.

    The comm hook launches the all-reduce as DDP does by default and returns its future with a callback
    that stamps the finish. Stamps come from ``metrics.DeviceClock``: CUDA events on a GPU (when the
    kernels ran, not when they were queued), the CPU clock otherwise.
    """

    def __init__(self, model, device, wait: bool = False):
        self.names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}   # what DDP reduces
        self.device, self.wait = device, wait
        self.start_micro_step()
        for name, param in model.named_parameters():
            if param.requires_grad:   # a frozen parameter (left out of DDP) has no gradient to wait for
                param.register_post_accumulate_grad_hook(
                    lambda p, name=name: self.grad_ready.append((name, self.clock.mark())))

    def start_micro_step(self):
        self.clock = metrics.DeviceClock(self.device)
        self.buckets, self.grad_ready, self.backward_marks = [], [], {}

    def mark_backward(self, moment):
        """``"start"`` just before ``loss.backward()``; ``"end"`` when it returned (DDP waited for every bucket)."""
        self.backward_marks[moment] = self.clock.mark()

    def hook(self, state, bucket):
        """A DDP comm hook: note the bucket, all-reduce it as DDP does by default, stamp when that finishes."""
        buffer = bucket.buffer()
        entry = {"index": bucket.index(), "bytes": buffer.numel() * buffer.element_size(),
                 "numel": buffer.numel(), "params": [self.names[id(p)] for p in bucket.parameters()],
                 "launch": self.clock.mark(), "storage": buffer.untyped_storage().data_ptr()}
        self.buckets.append(entry)

        def finished(future):
            entry["end"] = self.clock.mark()   # the averaged bucket is ready
            return future.value()

        future = allreduce_hook(state, bucket)
        if self.wait:            # the planted mistake: wait for the all-reduce inside the hook, so backward stalls
            future.wait()        # until each bucket is done and nothing overlaps (the bytes and results are right)
        return future.then(finished)

    def bytes(self) -> int:
        return sum(b["bytes"] for b in self.buckets)

    def overlap(self) -> dict:
        """This micro-step in seconds since its start (call after a device sync): backward's start, its last
        gradient (the end of its computing), its return, and each bucket's all-reduce, launch to finish, with
        the part of it that ran while backward was still computing."""
        t = self.clock.seconds
        last_gradient = max(t(mark) for _, mark in self.grad_ready)
        buckets = []
        for b in self.buckets:
            launch, end = t(b["launch"]), t(b["end"])
            buckets.append({"index": b["index"], "bytes": b["bytes"], "launch": launch, "end": end,
                            "hidden_seconds": max(0.0, min(end, last_gradient) - launch)})
        busy = sum(b["end"] - b["launch"] for b in buckets)
        ready = [t(mark) for _, mark in self.grad_ready]
        in_flight = sum(any(b["launch"] < r < b["end"] for b in buckets) for r in ready)
        return {"backward_start": t(self.backward_marks["start"]), "last_gradient": last_gradient,
                "grads_ready_while_in_flight": in_flight,
                "backward_end": t(self.backward_marks["end"]), "buckets": buckets,
                "hidden_fraction": sum(b["hidden_seconds"] for b in buckets) / busy if busy > 0 else 0.0}

    def timeline(self) -> list[dict]:
        """Every gradient's ready time and every bucket's launch and finish, in seconds (after a device sync)."""
        t = self.clock.seconds
        bucket_of = {name: b["index"] for b in self.buckets for name in b["params"]}
        events = [{"kind": "grad_ready", "param": name, "bucket": bucket_of.get(name), "t": t(mark)}
                  for name, mark in self.grad_ready]
        events += [{"kind": "all_reduce", "bucket": b["index"], "bytes": b["bytes"], "t": t(b["launch"]),
                    "end": t(b["end"])} for b in self.buckets]
        return sorted(events, key=lambda e: e["t"])


def samplers_for(dataset, world_size, args):
    """One DistributedSampler per rank, built without a process group (what each rank builds for itself)."""
    return [DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=args.shuffle, seed=args.seed)
            for r in range(world_size)]


def global_batch_indices(samplers, step, per_rank, steps_per_epoch):
    """The dataset indices every rank trains on at ``step``, rank 0's first: the single device's global batch."""
    epoch, within = divmod(step, steps_per_epoch)
    indices = []
    for sampler in samplers:
        sampler.set_epoch(epoch)
        indices += list(sampler)[within * per_rank:(within + 1) * per_rank]
    return indices


@record   # an uncaught exception goes to TORCHELASTIC_ERROR_FILE too: torchrun's summary then shows its traceback
def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=10)
    p.add_argument("--batch", type=runtime.positive_int, default=None,
                   help="global batch, sequences per optimizer step (default: 8; 16 for a100)")
    p.add_argument("--accumulation", type=runtime.positive_int, default=1,
                   help="micro-batches per optimizer step; all but the last run under no_sync()")
    p.add_argument("--bucket-mb", type=runtime.positive_float, default=25.0, help="DDP bucket_cap_mb (DDP's default: 25)")
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="let gradients live inside DDP's bucket buffers (saves one copy of the gradients)")
    p.add_argument("--samples", type=runtime.positive_int, default=None,
                   help="dataset size for DistributedSampler (default: 4 global batches, so epochs turn over)")
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                   help="DistributedSampler reshuffles every epoch (set_epoch)")
    runtime.add_lr_flag(p)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: fp32 with --compare, else bf16 autocast on a GPU, fp32 on a CPU")
    p.add_argument("--planted-bug", choices=["waiting-hook", "no-set-epoch", "same-samples-every-rank",
                                             "accumulation-never-syncs", "nan-from-one-rank", "unused-parameter",
                                             "token-mean-per-micro-batch", "global-batch-grows",
                                             "token-out-of-vocabulary"],
                   default=None,
                   help="a mistake the checks must catch: a comm hook that waits for its all-reduce (no overlap); "
                        "a loop that never calls set_epoch (the same order every epoch); every rank's sampler "
                        "built as rank 0's (all ranks read the same samples); no_sync() around every micro-batch, "
                        "the last too (the gradients are never all-reduced); one rank's micro-batch at step "
                        f"{NAN_STEP} with every target masked (a mean over no token: nan, then all-reduced); a "
                        "parameter the forward never uses (an extra head), wrapped by DDP as it is; with "
                        "--uneven-lengths, each micro-batch's loss the mean over its own tokens (not the step's); the "
                        f"per-rank batch the recipe had on {TUNED_WORLD} ranks kept on any number (the global batch "
                        f"grows with the world); one sequence that rank {BAD_TOKEN_RANK} (the last, on fewer ranks) "
                        f"draws at step {BAD_TOKEN_STEP} holding one token id equal to the vocabulary's size (its "
                        "embedding lookup raises on that rank alone)")
    p.add_argument("--uneven-lengths", action="store_true",
                   help="each sequence keeps a loss on its first 1 to S of its S targets only (S: the preset's "
                        "sequence length; padding, prompts): the step's loss is the mean over every kept token of the "
                        "global batch")
    p.add_argument("--keep-every-target", action="store_true",
                   help="the masked loss of --uneven-lengths with every target kept: each micro-batch holds as many "
                        "tokens, the check of token-mean-per-micro-batch")
    runtime.add_fix_flag(p, "rank_sampler(dataset, rank, world_size) (the training sampler), epoch_indices(sampler, "
                            "epoch) (the indices the loader draws in an epoch), synchronises(micro_step, "
                            "accumulation) (whether a micro-batch runs outside no_sync()), without_gradient(grads) (a "
                            "model with an extra head: the names of the parameters to leave out of what DDP reduces, "
                            "from each one's gradient after a local backward, None where none came), token_loss("
                            "per_token, mask, step_tokens, world_size) (with --uneven-lengths: the loss a micro-batch "
                            "backpropagates, from its per-token losses, its mask of kept targets and the count kept in "
                            "the whole step), micro_batch_size(global_batch, world_size, accumulation) (the sequences "
                            "of one micro-batch on one rank), first_nonfinite(rank_losses) (a reading of the "
                            "run's losses per rank, step by step: the (step, rank) where the first non-finite loss "
                            "began, None if none; checked against where --planted-bug nan-from-one-rank put it), "
                            "tokens_in_vocabulary(tokens, vocab_size) (which sequences of a micro-batch, sequences x "
                            "positions, the model may take: a bool a sequence; every rank still runs the step, a "
                            "sequence left out carrying no loss, and one device leaves out the same)")
    p.add_argument("--compare", action="store_true",
                   help="also train the single-device baseline (rank 0) and ddp_from_scratch's version in "
                        "lockstep, and check all three agree every step (tiny models)")
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        fixes = runtime.learner_fixes(args.fix_from, FIXES)   # chapter 14's lab: the learner's code, run below
        rt.require(not (set(fixes) - set(READINGS) and args.planted_bug),
                   "--fix-from replaces the code --planted-bug breaks (first_nonfinite, a reading, and "
                   "tokens_in_vocabulary, a guard against bad data, alone run beside it)")
        screened = "tokens_in_vocabulary" in fixes   # the learner's guard: which sequences the model may take
        cfg = models.preset(args.preset)
        world, accumulation = rt.world_size, args.accumulation
        # A guarded run takes the masked loss too: a sequence the guard leaves out carries no target, and the step's
        # mean is over the tokens kept on every rank (what one device, leaving out the same, takes)
        masked_lengths = args.uneven_lengths or args.keep_every_target or screened
        every = args.keep_every_target or (screened and not args.uneven_lengths)
        args.batch = args.batch or (16 if args.preset == "a100" else 8)
        args.samples = args.samples or 4 * args.batch
        check_config(args, world)  # again, with the defaults filled in
        micro_batch = args.batch // (world * accumulation)
        if args.planted_bug == "global-batch-grows":   # the mistake: the per-rank batch of the recipe's run on
            micro_batch = args.batch // (TUNED_WORLD * accumulation)   # TUNED_WORLD ranks, kept on any number
        if "micro_batch_size" in fixes:   # the learner's: the sequences of one micro-batch on this rank
            micro_batch = int(fixes["micro_batch_size"](args.batch, world, accumulation))
        rt.require(micro_batch >= 1 and args.samples % (micro_batch * world * accumulation) == 0,
                   f"a micro-batch of {micro_batch} sequences: the {args.samples} samples must make whole steps of "
                   f"{world} ranks x {accumulation} micro-batches of at least one sequence")
        step_samples = micro_batch * world * accumulation   # the global batch this run trains on, every step
        precision = args.precision if args.precision != "auto" else (
            "bf16" if rt.device_type == "cuda" and not args.compare else "fp32")
        report = metrics.Report(__file__, rt, config={**vars(args), "precision": precision, "model": cfg.to_dict()})
        rt.print(f"{args.preset} transformer: {cfg.num_params():,} parameters; global batch {step_samples} = "
                 f"{world} ranks x {accumulation} micro-steps x {micro_batch} sequences; buckets of "
                 f"{args.bucket_mb} MB; gradient_as_bucket_view={args.gradient_as_bucket_view}; {precision}")

        # ---- data: each rank its own shard of the dataset, through DistributedSampler ----
        dataset = data.SyntheticTokens(args.samples, cfg.seq_len, cfg.vocab_size, seed=args.seed)
        bad_rank = min(BAD_TOKEN_RANK, world - 1)   # --planted-bug token-out-of-vocabulary: the rank that draws it
        if args.planted_bug == "token-out-of-vocabulary":   # the mistake: one record holds an id the model has no
            # row for (a tokenizer's added token, the model sized by the base vocabulary): the sequence rank
            # bad_rank draws first at step BAD_TOKEN_STEP, at the middle of the sequence (an input and a target)
            index = bad_token_index(samplers_for(dataset, world, args), bad_rank, BAD_TOKEN_STEP,
                                    micro_batch * accumulation, args.samples // step_samples)
            dataset = WithOneBadToken(dataset, index, cfg.seq_len // 2, cfg.vocab_size)
        sampler_rank = rt.rank
        if args.planted_bug == "same-samples-every-rank":   # the mistake: every rank asks for rank 0's share, as a
            sampler_rank = 0                                 # loader with no sampler and one seed everywhere does
        if "rank_sampler" in fixes:
            sampler = fixes["rank_sampler"](dataset, rt.rank, world)
        else:
            sampler = DistributedSampler(dataset, num_replicas=world, rank=sampler_rank, shuffle=args.shuffle,
                                         seed=args.seed)
        loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler)
        steps_per_epoch = args.samples // args.batch   # the recipe's: the one device trains on its global batch
        all_samplers = samplers_for(dataset, world, args)
        covered = []
        for epoch in range(2):
            shards = []
            for s in all_samplers:
                s.set_epoch(epoch)
                shards.append(set(s))
            covered.append(set().union(*shards) == set(range(args.samples)) and sum(map(len, shards)) == args.samples)
        report.check("DistributedSampler: the ranks' shards are disjoint and cover the dataset (epochs 0, 1)",
                     all(covered))

        # ---- the model: DDP broadcasts rank 0's weights when it wraps (each rank built different ones) ----
        model = models.build_transformer(cfg, seed=args.seed + rt.rank, device=rt.device)
        if args.planted_bug == "unused-parameter" or "without_gradient" in fixes:   # a head the forward never
            model.unused_head = torch.nn.Linear(cfg.dim, 2, device=rt.device)   # calls (find_unused_parameters=False)
        if "without_gradient" in fixes:   # the learner's: what to leave out of DDP, read from one local backward
            probe = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(args.seed))
            models.lm_loss(model(probe.to(rt.device)), probe.to(rt.device)).backward()
            left_out = set(fixes["without_gradient"]({name: p.grad for name, p in model.named_parameters()}))
            for name, param in model.named_parameters():
                param.grad = None
                param.requires_grad_(name not in left_out)   # DDP reduces only the parameters that require grad
        trained = [param for param in model.parameters() if param.requires_grad]   # compared with the references
        ddp = DDP(model, device_ids=[rt.device] if rt.device_type == "cuda" else None,
                  bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=args.gradient_as_bucket_view)
        report.check("replicas identical once DDP wrapped them (it broadcasts rank 0's weights)",
                     replicas_identical(model))
        log = BucketLog(model, rt.device, wait=args.planted_bug == "waiting-hook")
        ddp.register_comm_hook(state=None, hook=log.hook)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        autocast = torch.autocast(rt.device_type, dtype=torch.bfloat16, enabled=precision == "bf16")

        # ---- with --compare: the single-device baseline (rank 0) and the from-scratch version, in lockstep ----
        baseline = scratch = None
        if args.compare:
            if rt.rank == 0:
                baseline = models.build_transformer(cfg, seed=args.seed, device=rt.device)
                baseline_optimizer = torch.optim.AdamW(baseline.parameters(), lr=args.lr)
            scratch = models.build_transformer(cfg, seed=args.seed + rt.rank, device=rt.device)
            broadcast_parameters(scratch)
            scratch_optimizer = torch.optim.AdamW(scratch.parameters(), lr=args.lr)
        diffs = {"baseline_loss": [], "baseline_grad": [], "baseline_param": [], "scratch_loss": [],
                 "scratch_grad": [], "scratch_param": []}

        param_bytes = sum(p.numel() * p.element_size() for p in trained)   # what DDP reduces
        step_bytes, micro_step_bytes, buckets_per_step, seconds, overlaps = [], [], [], [], []
        views_ok = []
        batches = iter(())
        epoch = -1
        rank_losses = []    # per step, each rank's loss on its own micro-batches
        nan_rank = min(2, world - 1)   # --planted-bug nan-from-one-rank: the rank whose batch is masked
        epoch_orders = []   # the sample indices this rank's training sampler gave, epoch by epoch (measured)
        guard = {"wrong": 0, "left_out": 0}   # the learner's guard's verdicts on this rank's micro-batches

        def guarded(tokens, own=False):
            """A micro-batch (sequences x S + 1 tokens) as the model takes it, and its targets that carry a loss
            (None when no target is masked). With the learner's tokens_in_vocabulary, a sequence it leaves out is
            given token 0 throughout and keeps no target. ``own``: one of this rank's micro-batches, whose verdicts
            are counted against the truth (in_vocabulary)."""
            if not screened:
                return tokens, (kept_targets(tokens, every) if masked_lengths else None)
            verdict = fixes["tokens_in_vocabulary"](tokens.clone(), cfg.vocab_size)
            ok = torch.as_tensor(verdict)
            rt.require(ok.shape == (len(tokens),) and ok.dtype in (torch.bool, torch.int64, torch.int32),
                       f"tokens_in_vocabulary returned {type(verdict).__name__} of shape {tuple(ok.shape)}: give one "
                       f"bool a sequence, shape ({len(tokens)},)")
            ok = ok.to(torch.bool)
            if own:
                guard["wrong"] += int((ok != in_vocabulary(tokens, cfg.vocab_size)).sum())
                guard["left_out"] += int((~ok).sum())
            tokens = torch.where(ok[:, None], tokens, torch.zeros_like(tokens))
            return tokens, kept_targets(tokens, every) & ok[:, None]

        for step in range(args.steps):
            micro_batches = []
            for _ in range(accumulation):
                tokens = next(batches, None)
                if tokens is None:  # a new epoch: a new shuffle, the same on every rank
                    epoch += 1
                    if "epoch_indices" in fixes:   # the learner's: the indices this rank draws in this epoch
                        order = [int(i) for i in fixes["epoch_indices"](sampler, epoch)]
                        epoch_orders.append(order)
                        batches = iter(DataLoader(dataset, batch_size=micro_batch, sampler=order))
                    else:
                        if args.planted_bug != "no-set-epoch" and hasattr(sampler, "set_epoch"):
                            sampler.set_epoch(epoch)
                        epoch_orders.append(list(sampler))   # what the loader is about to draw from
                        batches = iter(loader)
                    tokens = next(batches)
                micro_batches.append(tokens)

            micro_batches = [guarded(tokens, own=True) for tokens in micro_batches]   # (tokens, kept targets)
            step_tokens = None
            if masked_lengths:   # the kept targets of the whole step, every rank's micro-batches together
                step_tokens = torch.tensor(float(sum(kept.sum() for _, kept in micro_batches)), device=rt.device)
                dist.all_reduce(step_tokens)
            rt.sync()
            started = time.perf_counter()
            step_loss = torch.zeros((), device=rt.device)
            sent = []
            for i, (tokens, kept) in enumerate(micro_batches):
                inputs, targets = data.split_inputs_targets(tokens.to(rt.device))
                last = i == accumulation - 1
                if "synchronises" in fixes:   # the learner's: whether this micro-batch all-reduces
                    last = bool(fixes["synchronises"](i, accumulation))
                if args.planted_bug == "accumulation-never-syncs":   # the mistake: the last micro-batch under
                    last = False                                    # no_sync() too, so nothing is ever all-reduced
                log.start_micro_step()
                # Not the last micro-batch: accumulate locally, all-reduce nothing.
                masked = args.planted_bug == "nan-from-one-rank" and (step, rt.rank, i) == (NAN_STEP, nan_rank, 0)
                with contextlib.nullcontext() if last else ddp.no_sync():
                    with autocast:
                        try:
                            outputs = ddp(inputs)
                        except RuntimeError as error:   # unused-parameter: DDP refuses the next forward while a
                            # gradient of the last is still unreduced (reducer.cpp, ensure_prior_reduction_finished):
                            # torch's first two sentences and the line naming the parameters, as every rank prints
                            text = str(error)
                            indices = [line.strip() for line in text.splitlines() if line.startswith("Parameter ind")]
                            refused = ". ".join(text.split(". ")[:2]) + ". " + " ".join(indices)
                            report.check("every step's forward ran", False, f"step {step}: {refused}", "no error")
                            report.extra["micro_step_bytes"] = micro_step_bytes   # what each earlier step sent
                            sys.exit(report.finish(args.metrics_out))   # every rank stops here, with this line
                        if masked:   # the mistake: a micro-batch whose every target is masked (a prompt-only
                            # sample, say), its loss a sum over the unmasked tokens divided by their count: 0/0
                            loss = masked_mean_loss(outputs, targets, torch.zeros_like(targets)) / accumulation
                        elif masked_lengths:
                            kept = kept.to(rt.device)
                            if args.planted_bug == "token-mean-per-micro-batch":   # the mistake: each micro-batch's
                                # mean over its own tokens, as if all held as many: short ones weigh too much
                                loss = masked_mean_loss(outputs, targets, kept) / accumulation
                            else:
                                loss = fixes.get("token_loss", step_token_loss)(
                                    token_losses(outputs, targets), kept, step_tokens, world)
                        else:
                            loss = models.lm_loss(outputs, targets) / accumulation
                    log.mark_backward("start")
                    loss.backward()
                    log.mark_backward("end")
                sent.append(log.bytes())
                step_loss += loss.detach()
            rt.sync()
            seconds.append(time.perf_counter() - started)
            overlaps.append(log.overlap())       # the last micro-step's, the one that all-reduced
            bucket_storages = {b["storage"] for b in log.buckets}
            views_ok.append(all((p.grad.untyped_storage().data_ptr() in bucket_storages)
                                == args.gradient_as_bucket_view for p in model.parameters() if p.grad is not None))
            micro_step_bytes.append(sent)
            step_bytes.append(sum(sent))
            buckets_per_step.append(len(log.buckets))

            if args.compare:
                # the from-scratch version: same micro-batches, accumulate, then average by hand once
                scratch_step_loss = torch.zeros((), device=rt.device)
                for tokens, kept in micro_batches:
                    inputs, targets = data.split_inputs_targets(tokens.to(rt.device))
                    with autocast:
                        if masked_lengths:   # by hand: the step's mean over its kept tokens, then the average
                            scratch_loss = step_token_loss(token_losses(scratch(inputs), targets),
                                                           kept.to(rt.device), step_tokens, world)
                        else:
                            scratch_loss = models.lm_loss(scratch(inputs), targets) / accumulation
                    scratch_loss.backward()
                    scratch_step_loss += scratch_loss.detach()
                average_gradients(scratch)
                diffs["scratch_grad"].append(metrics.max_abs_diff([p.grad for p in trained],
                                                                  [p.grad for p in scratch.parameters()]))
                if baseline is not None:
                    # the single device: the whole global batch (every rank's samples) in one step
                    indices = global_batch_indices(all_samplers, step, args.batch // world, steps_per_epoch)
                    tokens, kept = guarded(torch.stack([dataset[i] for i in indices]))   # as the ranks took them
                    inputs, targets = data.split_inputs_targets(tokens.to(rt.device))
                    with autocast:
                        if masked_lengths:   # one device: the mean over every kept token of the global batch
                            baseline_loss = masked_mean_loss(baseline(inputs), targets, kept.to(rt.device))
                        else:
                            baseline_loss = models.lm_loss(baseline(inputs), targets)
                    baseline_loss.backward()
                    diffs["baseline_grad"].append(metrics.max_abs_diff([p.grad for p in trained],
                                                                       [p.grad for p in baseline.parameters()]))
                    baseline_optimizer.step()
                    baseline_optimizer.zero_grad(set_to_none=True)

            started = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rt.sync()
            seconds[-1] += time.perf_counter() - started

            each_rank = [torch.zeros_like(step_loss) for _ in range(world)]
            dist.all_gather(each_rank, step_loss)      # every rank's own loss: what a user can print per rank
            rank_losses.append([loss.item() for loss in each_rank])
            global_loss = sum(rank_losses[-1]) / world
            report.losses.append(global_loss)
            line = f"step {step:3d}  loss {global_loss:.6f}  all-reduced {sent} B in {len(log.buckets)} bucket(s)"
            if args.compare:
                scratch_optimizer.step()
                scratch_optimizer.zero_grad(set_to_none=True)
                dist.all_reduce(scratch_step_loss)
                diffs["scratch_loss"].append(abs(global_loss - scratch_step_loss.item() / world))
                diffs["scratch_param"].append(metrics.max_abs_diff(trained,
                                                                   list(scratch.parameters())))
                if baseline is not None:
                    diffs["baseline_loss"].append(abs(global_loss - baseline_loss.item()))
                    diffs["baseline_param"].append(metrics.max_abs_diff(trained,
                                                                        list(baseline.parameters())))
                    line += f"  | single-device {baseline_loss.item():.6f}"
            rt.print(line)

        # ---- communication: measured (comm hook) = analytic ----
        ring_sent = comm.bytes_sent_per_rank("all_reduce", step_bytes[-1], world)  # ring model x measured payload
        report.add_comm("all_reduce", step_bytes[-1], param_bytes, sent_bytes_per_rank_derived=ring_sent,
                        buckets=buckets_per_step[-1])
        rt.print(f"all-reduced per optimizer step: {step_bytes[-1]:,} B = parameter bytes {param_bytes:,} B; on a "
                 f"ring each rank sends 2(N-1)/N of it = {ring_sent:,.0f} B (derived: the ring model)")
        rt.print("buckets (last step, in the order they were all-reduced): "
                 + ", ".join(f"#{b['index']}: {b['bytes']:,} B, {len(b['params'])} params" for b in log.buckets))
        report.check("bytes all-reduced per optimizer step = parameter bytes (comm hook, every step)",
                     all(b == param_bytes for b in step_bytes), step_bytes[-1], f"== {param_bytes}")
        in_buckets = [n for b in log.buckets for n in b["params"]]
        report.check("buckets hold every parameter exactly once",
                     sorted(in_buckets) == sorted(log.names.values()), len(in_buckets), f"== {len(log.names)}")
        if accumulation > 1:
            report.check("micro-steps inside no_sync() all-reduce nothing (every step)",
                         all(all(b == 0 for b in sent[:-1]) for sent in micro_step_bytes),
                         [sent[:-1] for sent in micro_step_bytes][-1], "== 0")
        # The training sampler itself, not a copy: every rank's first epoch together is the dataset, each sample once;
        # and with shuffling the order must change when the epoch does (a loop that never calls set_epoch repeats it).
        firsts = [None] * world
        dist.all_gather_object(firsts, epoch_orders[0])
        report.check("the training samplers' first epoch: disjoint shards covering the dataset (gathered from every "
                     "rank)", sorted(i for order in firsts for i in order) == list(range(args.samples)))
        if args.shuffle and len(epoch_orders) > 1:
            report.check("the training sampler's order changed with the epoch (set_epoch was called)",
                         epoch_orders[0] != epoch_orders[1], len(epoch_orders), "2 epochs or more")
        # Overlap, measured on the last step (buckets rebuilt in gradient-ready order after step 0).
        overlap = overlaps[-1]
        within = all(overlap["backward_start"] <= b["launch"] <= b["end"] <= overlap["backward_end"]
                     for b in overlap["buckets"])
        report.check("every bucket's all-reduce ran inside backward (launched after it began, finished before "
                     "it returned)", within, len(overlap["buckets"]), "every bucket")
        if len(overlap["buckets"]) > 1:
            first_launch = min(b["launch"] for b in overlap["buckets"])
            report.check("communication began while backward was still computing (first bucket launched before "
                         "the last gradient was ready)", first_launch < overlap["last_gradient"],
                         overlap["last_gradient"] - first_launch, "> 0 s")
            # Launching early is not overlapping: a hook that waits for its all-reduce launches early too. Overlap
            # means backward went on computing while a bucket was on the wire: a gradient became ready meanwhile.
            # On some rank: the slowest one can find the others already waiting, so its every all-reduce ends at
            # once (seen on 4 ranks sharing 2 busy cores: rank 2 counted 0, the job overlapped). A waiting hook
            # makes every rank count 0.
            by_rank = [torch.zeros(1, dtype=torch.int64, device=rt.device) for _ in range(rt.world_size)]
            dist.all_gather(by_rank, torch.tensor([overlap["grads_ready_while_in_flight"]], device=rt.device))
            overlap["grads_ready_while_in_flight_by_rank"] = [int(t.item()) for t in by_rank]
            report.check("backward computed while a bucket was being all-reduced (a gradient became ready while "
                         "one was in flight)", max(overlap["grads_ready_while_in_flight_by_rank"]) > 0,
                         overlap["grads_ready_while_in_flight_by_rank"], "> 0 gradients on some rank")
        rt.print(f"overlap (last step): {len(overlap['buckets'])} bucket(s); "
                 f"{100 * overlap['hidden_fraction']:.0f}% of the all-reduce time ran while backward computed")
        report.check(f"gradients {'are' if args.gradient_as_bucket_view else 'are not'} views of the bucket "
                     f"buffers (gradient_as_bucket_view={args.gradient_as_bucket_view})", all(views_ok))

        if args.compare:
            loss_tolerance = metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device)   # 10x on a GPU: see metrics
            grad_tolerance = metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device)
            report.check_close("DDP loss = from-scratch loss (every step)", metrics.worst(diffs["scratch_loss"]), 0.0,
                               loss_tolerance)
            report.check_close("DDP gradients = from-scratch gradients (every step)", metrics.worst(diffs["scratch_grad"]),
                               0.0, grad_tolerance)
            report.check_close("DDP parameters = from-scratch parameters (every step)", metrics.worst(diffs["scratch_param"]),
                               0.0, param_tolerance(args.lr))
            if rt.rank == 0:
                report.check_close("DDP loss = single-device loss (every step)", metrics.worst(diffs["baseline_loss"]), 0.0,
                                   loss_tolerance)
                report.check_close("DDP gradients = single-device gradients (every step)",
                                   metrics.worst(diffs["baseline_grad"]), 0.0, grad_tolerance)
                report.check_close("DDP parameters = single-device parameters (every step)",
                                   metrics.worst(diffs["baseline_param"]), 0.0, param_tolerance(args.lr))
            report.extra["diffs"] = diffs
        report.check("every step's forward ran", True, f"{args.steps} steps", "no error")   # else it stopped above
        report.check("sequences per optimizer step = the global batch asked for (--batch)", step_samples == args.batch,
                     step_samples, f"== {args.batch}")
        report.check("replicas identical after training", replicas_identical(model))
        if screened:   # the learner's guard, against the truth: every sequence with an id outside the vocabulary
            # left out (else the embedding raises), and no other (each one left out is data lost)
            counts = torch.tensor([guard["wrong"], guard["left_out"]], device=rt.device)
            dist.all_reduce(counts)
            wrong, left_out = (int(c) for c in counts.tolist())
            report.check("the sequences kept out of the model's input and the loss are those that hold an id outside "
                         "the vocabulary (every rank, every step)", wrong == 0, f"{left_out} left out, {wrong} wrongly",
                         "0 wrongly")
        finite = [all(map(math.isfinite, losses)) for losses in rank_losses]
        report.check("every rank's loss is finite (every step)", all(finite),
                     finite.index(False) if False in finite else "all", "all")

        if "first_nonfinite" in fixes:   # the learner's reading of each rank's own loss, as any user prints it
            planted = None   # where the run's first non-finite loss began: the fault's own place, if planted
            if args.planted_bug == "nan-from-one-rank" and args.steps > NAN_STEP:
                planted = [NAN_STEP, nan_rank]
            found = fixes["first_nonfinite"]([list(losses) for losses in rank_losses])
            found = list(found) if isinstance(found, (tuple, list)) else found
            report.check("first_nonfinite() names the step and the rank where the first non-finite loss began",
                         found == planted, repr(found)[:80], "the step and rank the run's losses show")
        report.extra.update({
            "buckets": [{k: v for k, v in b.items() if k not in ("storage", "launch", "end")} for b in log.buckets],
            "overlap": overlap,
            "buckets_per_step": buckets_per_step,
            "micro_step_bytes": micro_step_bytes,
            "backward_timeline": log.timeline(),
            "param_bytes": param_bytes,
            "rank_losses": rank_losses,
        })
        timed = seconds[1:] or seconds   # the first step pays one-off costs (buckets, allocator): left out
        report.throughput = metrics.throughput(step_samples * cfg.seq_len, sum(timed), len(timed), cfg=cfg,
                                               device=rt.device, dtype=precision, num_devices=rt.world_size)
        report.memory = {"device": metrics.memory_snapshot(rt.device)}
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
