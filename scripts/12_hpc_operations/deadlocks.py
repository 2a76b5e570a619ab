"""The classic distributed hangs, one flag each, every one ending in seconds with a diagnosis instead of silence.

    --hang mismatched-collectives  rank 0 broadcasts where the others all-reduce
    --hang skipped-barrier         the last rank skips the step's closing barrier, which sits under an `if`
    --hang wrong-group             ranks 2 and 3 all-reduce "their pair" on the world group (group= forgotten)
    --hang few-microbatches        the first stage splits its batch with torch.chunk, which returns fewer pieces
                                   than asked when the batch does not split evenly; the last stage waits for more
    --hang unpaired-p2p            in each pair both ranks receive first: each waits for the other's send
    --hang uneven-inputs           data parallelism over shards of unequal length: the last rank runs out of batches
                                   first and leaves while the others wait in the next gradient all-reduce
                                   (--stop-at-fewest-batches: the ranks agree first on the shortest shard, the fix)
    --hang full-state-on-rank-0    after training, `if rank == 0:` gathers the FSDP2 model's full state dict to save
                                   it; the gather is a collective (an all-gather per weight) that no other rank joins
                                   (--gather-on-every-rank: every rank gathers, rank 0 alone saves, the fix)
    --hang rank-0-evaluation       rank 0 evaluates the model alone for longer than the process group's timeout while
                                   the others wait in the next step's all-reduce (--evaluate-on-every-rank: each rank
                                   evaluates its share and the sums are all-reduced, the fix)
    --hang none                    the same program, correct: it finishes

Each rank records every call it makes (what, on which group, to or from whom) in the job's key-value store,
before the call and when its work has completed: a flight recorder by hand (`distlab.hangs`). Every call is issued
with ``async_op=True`` and waited on with the process group's timeout (`--pg-timeout`, default 4 s), so "done"
means done on NCCL too, where a collective returns once queued; a call whose peers never come raises; every rank
then reads all the journals and prints the same diagnosis. Under NCCL the script also sets, before its process
group exists, ``TORCH_NCCL_BLOCKING_WAIT=1`` (the timeout raises in the rank's thread instead of the watchdog
tearing the process down) and PyTorch's own flight recorder (``TORCH_FR_BUFFER_SIZE``), whose buffer each rank
dumps into ``--trace-dir``/manual (the run folder, on scratch) when it gives up: read them with
``python -m torch.distributed.flight_recorder.fr_trace <trace-dir>/manual``. The checks: the hang ended within its time
bound (no silent hang) and the diagnosis names the cause the flag planted. The ranks' rendezvous waits longer than
``--pg-timeout``: the course's default (``runtime.DEFAULT_PG_TIMEOUT_S``), so that ranks starting seconds apart, as
on a cluster, meet before the timeout of seconds applies (``runtime.start``, ``rendezvous_timeout_s``).

Two scenarios pair different collectives (mismatched-collectives, wrong-group): on NCCL a barrier is an
all-reduce, and a rank's barrier met by another rank's all-reduce is undefined behaviour, not a clean hang. So on
NCCL run only skipped-barrier and unpaired-p2p (mismatched-collectives with --debug-detail). The skipped barrier
is the step's last collective; the rank that skips it has nothing left to call.

With `--debug-detail` (TORCH_DISTRIBUTED_DEBUG=DETAIL) PyTorch itself checks, before each collective, that all
ranks call the same one with the same shapes: a mismatched collective is reported at once, without waiting for
the timeout.

    torchrun --standalone --nproc_per_node=4 scripts/12_hpc_operations/deadlocks.py --hang skipped-barrier
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from distlab import hangs, metrics, runtime

EXPECTED_CAUSE = {"mismatched-collectives": "mismatched collectives", "skipped-barrier": "skipped collective",
                  "wrong-group": "wrong group", "few-microbatches": "too few messages",
                  "unpaired-p2p": "unpaired point-to-point", "uneven-inputs": "skipped collective", "full-state-on-rank-0": "skipped collective",
                  "rank-0-evaluation": "late rank", "none": "none"}
# how long the ranks wait for each other while the process group forms, before --pg-timeout applies
RENDEZVOUS_TIMEOUT_S = runtime.DEFAULT_PG_TIMEOUT_S
# the program's calls, in the order of its text (the diagnosis uses it to tell who went past whom)
ORDER = {"sync weights": 1, "pair all-reduce": 2, "microbatch": 3, "end of step": 4, "barrier before logging": 5,
         "count batches": 6, "gradient all-reduce": 7, "save full state": 8, "evaluate": 9, "evaluation sums": 10,
         "next step": 11}
# each hang's own fix, a flag that is meaningless under any other hang
FLAG_FIXES = {"stop_at_fewest_batches": "uneven-inputs", "gather_on_every_rank": "full-state-on-rank-0",
              "evaluate_on_every_rank": "rank-0-evaluation"}
# The functions of a learner's fix (--fix-from), each run on every rank in place of the code of one scenario.
FIXES = {"agreed_batches": "uneven-inputs", "sync": "mismatched-collectives", "save_model": "full-state-on-rank-0",
         "evaluation_share": "rank-0-evaluation"}


class Collectives:
    """What a learner's ``sync(rank, tensor, collectives)`` calls: the script's own journaled collectives."""

    def __init__(self, collective):
        self._collective = collective

    def all_reduce(self, tensor):
        self._collective("sync weights", "all_reduce")

    def broadcast(self, tensor, src=0):
        self._collective("sync weights", "broadcast", src=src)


def check_config(args, world_size):
    runtime.require(world_size == 4, f"the scenarios are written for 4 ranks (2 pairs), not {world_size}: launch "
                                     "with torchrun --standalone --nproc_per_node=4")
    runtime.require(args.microbatches >= 1 and args.batch >= 1, "--batch and --microbatches must be positive")
    for flag, hang in FLAG_FIXES.items():
        runtime.require(not getattr(args, flag) or args.hang == hang,
                        f"--{flag.replace('_', '-')} is {hang}'s fix; it changes nothing under --hang {args.hang}")
    runtime.require(args.eval_seconds is None or args.eval_seconds > 0,
                    f"--eval-seconds must be positive, not {args.eval_seconds}")
    fixes = runtime.learner_fixes(args.fix_from, tuple(FIXES))
    for name in fixes:
        runtime.require(args.hang == FIXES[name], f"--fix-from: {name}() replaces code of --hang {FIXES[name]} "
                                                  f"only, not of --hang {args.hang}")
    runtime.require(not (fixes and any(getattr(args, flag) for flag in FLAG_FIXES)),
                    "--fix-from replaces the script's own fix flags")


def program(args, rt, journal, pairs, fixes=None):
    """One step of a training program, with the bug that --hang plants (none: the correct program); ``fixes``: a
    learner's functions (FIXES), each run in place of its scenario's code."""
    rank, bug, fixes = rt.rank, args.hang, fixes or {}
    world = list(range(rt.world_size))
    t = torch.ones(4, device=rt.device)

    wait = datetime.timedelta(seconds=rt.pg_timeout_s)

    def collective(label, op, group=None, members=world, name="world", src=None):
        # async_op and wait: the journal marks a call done when its work is, not when NCCL has queued it
        with journal.call(label, op, name, members, order=ORDER[label]):
            if op == "broadcast":
                work = dist.broadcast(t, src=members[0] if src is None else src, group=group, async_op=True)
            elif op == "barrier":
                work = dist.barrier(group=group, async_op=True)
            else:
                work = dist.all_reduce(t, group=group, async_op=True)
            work.wait(wait)

    def p2p(op, tensor, peer):
        with journal.call("microbatch", op, peer=peer, order=ORDER["microbatch"]):
            (dist.isend if op == "send" else dist.irecv)(tensor, peer).wait(wait)

    if bug == "full-state-on-rank-0":
        return save_full_state(args, rt, journal, collective, fixes.get("save_model"))
    if bug == "rank-0-evaluation":
        return evaluate(args, rt, journal, collective, fixes.get("evaluation_share"))
    if bug == "uneven-inputs":
        # an epoch of data parallelism, one gradient all-reduce a batch, each rank over its own shard; the shards
        # are unequal (a dataset split by hand, not by DistributedSampler): the last rank's is one batch short
        shard = [10 * rank + b for b in range(args.batches - (rank == rt.world_size - 1))]   # its batches' ids
        batches = torch.full((1,), float(len(shard)), device=rt.device)
        if args.stop_at_fewest_batches:   # the fix: agree on the shortest shard, every rank trains that many
            with journal.call("count batches", "all_reduce", order=ORDER["count batches"]):
                dist.all_reduce(batches, op=dist.ReduceOp.MIN, async_op=True).wait(wait)
        elif "agreed_batches" in fixes:   # a learner's fix: every rank's count, then the learner's agreement
            counts = [torch.empty_like(batches) for _ in world]
            with journal.call("count batches", "all_gather", order=ORDER["count batches"]):
                dist.all_gather(counts, batches, async_op=True).wait(wait)
            batches.fill_(int(fixes["agreed_batches"]([int(c.item()) for c in counts])))
        trained = 0
        for i in range(int(batches.item())):
            if i == len(shard):   # out of data: the loop ends here, as a DataLoader's does
                break
            t.fill_(shard[i])   # stands for batch i's gradient (a rank never trains a batch it does not have)
            collective("gradient all-reduce", "all_reduce")
            trained += 1
        # the fix's evidence, compared over the ranks once all have finished
        return {"per_rank": {"shard": len(shard), "agreed": int(batches.item()), "trained": trained}}
    # sync weights: everyone all-reduces (rank 0 broadcasts instead, when mismatched; a learner's sync() decides).
    # Before it each rank's weights are its own (rank + 1), as after a local step; after it they must agree.
    t.fill_(rank + 1)
    if "sync" in fixes:
        fixes["sync"](rank, t, Collectives(collective))
    else:
        collective("sync weights", "broadcast" if bug == "mismatched-collectives" and rank == 0 else "all_reduce")
    synced = t.tolist()
    # each pair averages over its own group; ranks 2 and 3 forget group= when the bug is planted
    pair_index = rank // 2
    if bug == "wrong-group" and pair_index == 1:
        collective("pair all-reduce", "all_reduce")
    else:
        collective("pair all-reduce", "all_reduce", pairs[pair_index], [2 * pair_index, 2 * pair_index + 1],
                   f"pair{pair_index}")
    # a two-stage pipeline in each pair: the even rank sends its microbatches to the odd one
    first_stage, partner = rank % 2 == 0, rank + 1 if rank % 2 == 0 else rank - 1
    batch = torch.arange(args.batch * 4, dtype=torch.float32, device=rt.device).reshape(args.batch, 4)
    if bug == "unpaired-p2p":  # both receive first
        p2p("recv", torch.empty(4, device=rt.device), partner)
    elif first_stage:
        # torch.chunk(6 rows, 4) gives 3 chunks of 2; tensor_split would give 4 (2, 2, 1, 1)
        pieces = batch.chunk(args.microbatches) if bug == "few-microbatches" else batch.tensor_split(args.microbatches)
        for piece in pieces:
            p2p("send", piece.sum(0).contiguous(), partner)
    else:
        for _ in range(args.microbatches):
            p2p("recv", torch.empty(4, device=rt.device), partner)
    collective("end of step", "all_reduce")
    # a barrier under a condition, the step's last collective: the last rank skips it when the bug is planted
    if not (bug == "skipped-barrier" and rank == rt.world_size - 1):
        collective("barrier before logging", "barrier")
    return {"per_rank": {"weights after sync": synced}}


def save_full_state(args, rt, journal, collective, save_model=None):
    """The end of an FSDP2 run: save the whole model from rank 0. get_model_state_dict(full_state_dict=True)
    all-gathers every sharded weight (a collective), so every rank must call it; the bug calls it under
    `if rank == 0:`. ``save_model``: a learner's ``save_model(rank, gather_full_state, save)`` in place of that code.
    Returns the shapes rank 0 saved and the files each rank wrote (the fix's evidence)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)).to(rt.device)
    whole = {name: list(p.shape) for name, p in model.named_parameters()}
    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    collective("end of step", "all_reduce")   # the last training step's gradient all-reduce, all ranks
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)   # rank 0 keeps the result
    written = []   # the states this rank wrote, as shapes

    def gather_full_state():
        with journal.call("save full state", "all_gather", order=ORDER["save full state"]):
            return get_model_state_dict(model, options=options)

    def save(state):
        os.makedirs(args.trace_dir, exist_ok=True)
        torch.save(state, os.path.join(args.trace_dir, f"full_model.rank{rt.rank}.{len(written)}.pt"))
        written.append({name: list(t.shape) for name, t in state.items()})

    if save_model is not None:
        save_model(rt.rank, gather_full_state, save)
    elif args.gather_on_every_rank or rt.rank == 0:
        state = gather_full_state()
        if rt.rank == 0:
            save(state)
    return {"whole_shapes": whole, "saved_shapes": written[0] if rt.rank == 0 and written else None,
            "files_written": len(written)}


VALIDATION_BATCHES = 12   # rank-0-evaluation: the validation set, in batches of equal cost


def evaluate(args, rt, journal, collective, evaluation_share=None):
    """Between two steps, the model is evaluated on a validation set of VALIDATION_BATCHES batches that takes
    --eval-seconds of compute on one rank. The bug evaluates on rank 0 alone while the others go on to the next
    step's all-reduce; the fix gives each rank its share and all-reduces the counts and sums.
    ``evaluation_share``: a learner's ``evaluation_share(batches, rank, world_size)``, the batches a rank takes."""
    collective("end of step", "all_reduce")
    whole = args.eval_seconds if args.eval_seconds is not None else 1.5 * rt.pg_timeout_s
    if evaluation_share is not None:
        mine = [int(b) for b in evaluation_share(VALIDATION_BATCHES, rt.rank, rt.world_size)]
    elif args.evaluate_on_every_rank:
        mine = list(range(rt.rank, VALIDATION_BATCHES, rt.world_size))
    else:
        mine = list(range(VALIDATION_BATCHES)) if rt.rank == 0 else []
    shared = evaluation_share is not None or args.evaluate_on_every_rank
    share = whole * len(mine) / VALIDATION_BATCHES
    if mine:
        with journal.call("evaluate", "compute", group=f"rank {rt.rank}", members=[rt.rank], order=ORDER["evaluate"]):
            a = torch.randn(64, 64, device=rt.device)
            end = time.perf_counter() + share   # real work for that long (a forward pass over the batches)
            while time.perf_counter() < end:
                a = torch.tanh(a @ a)
    sums = None
    if shared:   # each batch's id stands for its loss: the sums tell whether every batch was counted once
        t = torch.tensor([len(mine), sum(mine), sum(b * b for b in mine)], dtype=torch.float64, device=rt.device)
        with journal.call("evaluation sums", "all_reduce", order=ORDER["evaluation sums"]):
            dist.all_reduce(t, async_op=True).wait(datetime.timedelta(seconds=rt.pg_timeout_s))
        sums = [int(v) for v in t.tolist()]
    collective("next step", "all_reduce")
    return {"evaluation_seconds": share, "evaluation_sums": sums,
            "per_rank": {"batches": len(mine), "seconds": share}}


CHECKED_FIXES = ("uneven-inputs", "mismatched-collectives", "rank-0-evaluation")   # _check_fix's hangs


def _check_fix(hang, ranks, report):
    """Rank 0's checks of what a fix must achieve, beyond ending without a hang: ``ranks``, each rank's record."""
    if hang == "uneven-inputs":
        shortest = min(r["shard"] for r in ranks)
        agreed = [r["agreed"] for r in ranks]
        report.check("the agreed number of batches is one every rank can train (at least 1, none a rank lacks)",
                     all(1 <= n <= shortest for n in agreed), agreed, f"1..{shortest}")
        trained = [r["trained"] for r in ranks]
        report.check("every batch that all ranks hold was trained, on every rank (batches each rank trained)",
                     trained == [shortest] * len(ranks), trained, [shortest] * len(ranks))
    elif hang == "mismatched-collectives":
        weights = [r["weights after sync"] for r in ranks]   # each rank's own before the sync
        report.check("the weights are the same on every rank after sync (each rank's, rank + 1 before)",
                     all(w == weights[0] for w in weights), [w[0] for w in weights], "one value")
    elif hang == "rank-0-evaluation":
        shares = [r["batches"] for r in ranks]   # a batch costs the same everywhere: the time goes with the count
        report.check("each rank evaluated an equal share (batches per rank, largest - smallest <= 1)",
                     max(shares) - min(shares) <= 1, shares, "within 1 batch")


def main():
    p = runtime.parser(__doc__, steps=None)
    p.add_argument("--hang", choices=list(EXPECTED_CAUSE), default="skipped-barrier", help="which bug to plant")
    p.add_argument("--batch", type=runtime.positive_int, default=6, help="rows of the first stage's batch")
    p.add_argument("--microbatches", type=runtime.positive_int, default=4, help="microbatches the pipeline stages agree on")
    p.add_argument("--batches", type=runtime.positive_int, default=3, help="batches in a rank's shard (uneven-inputs)")
    p.add_argument("--stop-at-fewest-batches", action="store_true",
                   help="uneven-inputs' fix: the ranks all-reduce (MIN) their batch counts first and all train that many")
    p.add_argument("--gather-on-every-rank", action="store_true",
                   help="full-state-on-rank-0's fix: every rank gathers the full state dict, rank 0 alone saves it")
    p.add_argument("--evaluate-on-every-rank", action="store_true",
                   help="rank-0-evaluation's fix: each rank evaluates its share, then the sums are all-reduced")
    p.add_argument("--eval-seconds", type=runtime.positive_float, default=None,
                   help="compute time of the whole evaluation on one rank (rank-0-evaluation; default 1.5 x "
                        "--pg-timeout: longer than the timeout on one rank, a quarter of it each on four)")
    runtime.add_fix_flag(p, "agreed_batches(batch_counts) (uneven-inputs: how many batches every rank trains, "
                            "from every rank's count), sync(rank, tensor, collectives) (mismatched-collectives: the "
                            "step's first synchronisation, calling collectives.all_reduce(t) or .broadcast(t, src)), "
                            "save_model(rank, gather_full_state, save) (full-state-on-rank-0: the end of the run), "
                            "evaluation_share(batches, rank, world_size) (rank-0-evaluation: the validation batches "
                            "a rank evaluates)")
    p.add_argument("--trace-dir", default=None,
                   help="where each rank dumps PyTorch's flight recorder when it gives up: manual/ holds the dump the "
                        "script asks for, watchdog/ NCCL's own (default: $DISTLAB_RUN_DIR/flight_recorder/<hang>, "
                        "else build/flight_recorder/<hang>: two hangs of one job never share a folder)")
    p.add_argument("--debug-detail", action="store_true",
                   help="TORCH_DISTRIBUTED_DEBUG=DETAIL: PyTorch checks every collective's type and shapes first")
    p.set_defaults(pg_timeout=4.0)
    args = p.parse_args()
    if args.debug_detail:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # read when the process group is created
    if args.trace_dir is None:
        args.trace_dir = os.path.join(os.environ.get("DISTLAB_RUN_DIR", "build"), "flight_recorder", args.hang)
    env = hangs.debug_env(args.trace_dir)
    os.environ.update(env)  # read when the process group is created, too

    # A job cancelled while its ranks hang (scancel, qdel) still leaves each rank's journal and flight recorder
    # in --trace-dir: SIGTERM is taken by a helper thread (before the process group's threads exist)
    ready = {}

    def leave_evidence():
        rt, journal = ready.get("rt"), ready.get("journal")
        if journal is not None:
            journal.finish("cancelled")
            hangs.dump_flight_recorder(args.trace_dir, rt.rank, rt.backend)
            print(f"[rank {rt.rank}] SIGTERM while waiting: journal and flight recorder written to {args.trace_dir}",
                  flush=True)
        os._exit(143)

    hangs.on_sigterm_leave_evidence(leave_evidence)
    # the ranks' rendezvous waits the course's default, not --pg-timeout: on a cluster the ranks start seconds apart
    # (imports from a shared file system, CUDA contexts), and a rank 4 s late would end the drill at init, not at the
    # planted hang
    with runtime.start(args, validate=lambda world: check_config(args, world),
                       rendezvous_timeout_s=RENDEZVOUS_TIMEOUT_S) as rt:
        hangs.prepare_trace_dir(env)  # NCCL's watchdog writes its own dump there on a timeout
        report = metrics.Report(__file__, rt, config=vars(args))
        store = dist.distributed_c10d._get_default_store()  # the rendezvous store: it outlives a broken group
        journal = hangs.CallJournal(store, rt.rank, prefix=f"deadlocks/{args.hang}",
                                    mirror=os.path.join(args.trace_dir, "journals", f"rank_{rt.rank}.json"))
        ready.update(rt=rt, journal=journal)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
        rt.print(f"planting: {args.hang}; process-group timeout {rt.pg_timeout_s:g} s")
        started = time.perf_counter()
        error, outcome = None, None
        try:
            outcome = program(args, rt, journal, pairs, runtime.learner_fixes(args.fix_from, tuple(FIXES)))
            if outcome and "files_written" in outcome:   # counted in the store, before this rank says finished
                store.add(f"deadlocks/{args.hang}/files_by_{'rank_0' if rt.rank == 0 else 'others'}",
                          outcome["files_written"])
            if outcome and "per_rank" in outcome:   # what each rank did, for rank 0's checks of the fix
                store.set(f"deadlocks/{args.hang}/per_rank/{rt.rank}", json.dumps(outcome["per_rank"]))
            journal.finish("finished")
        except Exception as exc:  # gloo/NCCL raise when the timeout expires (or at once under DETAIL)
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            journal.finish("timed out")
            print(f"[rank {rt.rank}] gave up after {time.perf_counter() - started:.1f} s: {error}", flush=True)

        # Wait until every rank has finished or given up (the store still works), then read all journals.
        prefix, deadline = f"deadlocks/{args.hang}", time.monotonic() + 3 * rt.pg_timeout_s + 10
        journals = hangs.read_journals(store, rt.world_size, prefix)
        while any(j["state"] == "running" for j in journals.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            journals = hangs.read_journals(store, rt.world_size, prefix)
        elapsed = time.perf_counter() - started
        finding = hangs.diagnose(journals)
        if finding["cause"] != "none":  # every rank's buffer, the finished ones' too: the analyzer wants them all
            dumped = hangs.dump_flight_recorder(args.trace_dir, rt.rank, rt.backend)
            store.add(f"{prefix}/dumped", 1)
            while int(store.add(f"{prefix}/dumped", 0)) < rt.world_size and time.monotonic() < deadline:
                time.sleep(0.05)
        recorded = hangs.flight_recorder_summary(args.trace_dir, rt.world_size) if finding["cause"] != "none" else {}

        rt.print(f"\nwhere every rank is (journal of its calls; * = the call it is stuck in):")
        for r, j in sorted(journals.items()):
            calls = ", ".join(f"{c['op']}({c['group'] if c['peer'] is None else 'peer ' + str(c['peer'])})"
                              f"{'' if c['done'] else '*'}" for c in j["calls"])
            rt.print(f"  rank {r} [{j['state']}]: {calls}")
        rt.print(f"\ndiagnosis: {finding['cause']}: {finding['verdict']}")
        if recorded:
            manual = os.path.join(args.trace_dir, hangs.MANUAL_DUMPS)
            rt.print(f"\nPyTorch's flight recorder, each rank's buffer dumped into {manual}/ (on NCCL, "
                     f"python -m torch.distributed.flight_recorder.fr_trace {manual} analyses them):")
            for r, line in recorded.items():
                rt.print(f"  rank {r}: {line}")

        bound = 2 * rt.pg_timeout_s + 5  # one timeout for the stuck call, one for a peer's next call, slack
        report.check("the run ended by itself: no silent hang", elapsed <= bound, round(elapsed, 1), f"<= {bound:g} s")
        fixed = args.fix_from or any(getattr(args, flag) for flag in FLAG_FIXES)
        expected = "none" if fixed else EXPECTED_CAUSE[args.hang]
        report.check("the diagnosis names the planted cause", finding["cause"] == expected, finding["cause"], expected)
        if args.hang == "full-state-on-rank-0" and finding["cause"] == "none":   # no hang: what was written
            written = [int(store.add(f"{prefix}/files_by_{who}", 0)) for who in ("rank_0", "others")]
            report.check("one file written, by rank 0 (files by rank 0, by the others)", written == [1, 0],
                         written, [1, 0])
            if rt.rank == 0:   # None when rank 0 saved nothing: the check fails, it is not skipped
                report.check("rank 0 saved every weight whole (the full state, not its shard)",
                             outcome["saved_shapes"] == outcome["whole_shapes"], outcome["saved_shapes"],
                             outcome["whole_shapes"])
        if args.hang == "rank-0-evaluation" and outcome and outcome["evaluation_sums"] is not None:
            every = list(range(VALIDATION_BATCHES))
            want = [len(every), sum(every), sum(b * b for b in every)]
            report.check("every validation batch evaluated once (count, sum and squares of the ids)",
                         outcome["evaluation_sums"] == want, outcome["evaluation_sums"], want)
        if finding["cause"] == "none" and rt.rank == 0 and args.hang in CHECKED_FIXES:   # what each rank did
            ranks = [json.loads(store.get(f"{prefix}/per_rank/{r}")) for r in range(rt.world_size)]
            _check_fix(args.hang, ranks, report)
        report.extra = {"cause": finding["cause"], "verdict": finding["verdict"], "seconds_to_diagnosis": elapsed,
                        "error": error, "journals": journals, "flight_recorder": recorded,
                        **({"outcome": outcome} if outcome else {})}
        code = report.finish(args.metrics_out)

        # The group may be broken (a timed-out gloo group cannot be used again), so no closing barrier: rank 0
        # serves the store in a plain launch, so it leaves last, once everyone has said goodbye through it.
        store.add(f"{prefix}/left", 1)
        if rt.rank == 0:
            while int(store.add(f"{prefix}/left", 0)) < rt.world_size and time.monotonic() < deadline + 10:
                time.sleep(0.05)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
