"""Measure how fast collectives move data: algorithm bandwidth and bus bandwidth, over message sizes.

For each collective and payload size S (bytes; the full tensor for all-reduce, the gathered output for
all-gather, the input for reduce-scatter: ``distlab.comm``'s convention, also nccl-tests'), the script
times ``--repeats`` blocks of ``--iters`` calls after ``--warmup`` calls, takes the slowest rank's mean time
per call in the fastest block as t, and reports

* **algorithm bandwidth** ``S / t``: how fast the collective finishes for its payload;
* **bus bandwidth** ``S / t x factor``, with factor = 2(n-1)/n for all-reduce and (n-1)/n for all-gather and
  reduce-scatter: the bytes each rank actually pushes through its link on a ring, per second. It is
  comparable across collectives and rank counts, and with a link's peak in one direction (NVLink's data sheets
  count both). The factors are ``distlab.comm.bus_bandwidth``'s, pinned by a unit test (tests/unit/test_comm.py)
  to nccl-tests' values; the ring all-reduce script (ring_allreduce.py) measures the 2(n-1)/n by counting the
  bytes it sends.

Only the calls are timed. The byte counter (``CommCounter``) sees one untimed call per size, never the timed
ones. On a GPU the clock is a pair of CUDA events on the stream, and the stream is held by a spin kernel
(``torch.cuda._sleep``) while Python enqueues the block, so the events time the collectives and not Python's
dispatch, which would dominate at small sizes; a check fails if the hold ended before the last call was enqueued.
On NCCL the script also asks NCCL which algorithm and protocol it chose for every call (``NCCL_DEBUG=INFO``,
``NCCL_DEBUG_SUBSYS=TUNING``, into a file, unless you set ``NCCL_DEBUG`` yourself) and stores them with each row.

nccl-tests (src/common.cu) averages differently: it times one loop of back-to-back calls (20 by default) with a host
clock, synchronises once, and averages that time over the ranks (its ``-a``: 1, the mean, by default; 3, the
slowest). Here t is the slowest rank's, as a collective ends when its last rank does, and the best of several blocks.

Defaults are small so a laptop CPU finishes in seconds; on GPUs ask for big messages:

    torchrun --standalone --nproc_per_node=4 scripts/03_communication/bandwidth.py
    torchrun --standalone --nproc_per_node=4 scripts/03_communication/bandwidth.py --max-bytes 1G --iters 20
"""

import os
import sys
import tempfile
import time
from collections import Counter

import torch
import torch.distributed as dist

from distlab import comm, metrics, runtime

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
NCCL_NAMES = {"all_reduce": "AllReduce", "all_gather": "AllGather", "reduce_scatter": "ReduceScatter"}
FLOAT_BYTES = 4
HOLD_CYCLES_PER_CALL = 400_000  # GPU clock cycles the stream waits per call enqueued: ~0.2 ms at 2 GHz, far more
                                # than Python takes to issue one collective


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536; K, M and G are powers of 1024."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)
    except (ValueError, OverflowError):  # OverflowError: "infK", "1e400K" (int of an infinite float)
        raise runtime.ConfigError(f"cannot read size {text!r}: use bytes or 4K, 16M, 1G") from None


def sizes(min_bytes: int, max_bytes: int, step: int, world: int) -> list[int]:
    """Payloads from min to max, multiplied by ``step`` each time, rounded so every rank gets a whole chunk."""
    quantum = FLOAT_BYTES * world
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(max(quantum, size // quantum * quantum))
        size *= step
    return out


def check_config(args, world_size):
    runtime.require(world_size >= 2, "a bandwidth needs at least 2 ranks: torchrun --standalone --nproc_per_node=4 ...")
    args.min_bytes, args.max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
    runtime.require(0 < args.min_bytes <= args.max_bytes,
                    f"--min-bytes {args.min_bytes} must be positive and at most --max-bytes {args.max_bytes}")
    runtime.require(args.step >= 2, f"--step {args.step}: sizes must grow by a factor of at least 2")
    runtime.require(args.iters >= 1 and args.repeats >= 1 and args.warmup >= 0,
                    "--iters and --repeats must be at least 1, --warmup at least 0")
    unknown = set(args.collectives) - set(COLLECTIVES)
    runtime.require(not unknown, f"unknown collective(s) {sorted(unknown)}: choose from {', '.join(COLLECTIVES)}")


def make_call(collective: str, payload_bytes: int, world: int, rank: int, device):
    """One collective of ``payload_bytes``: returns (run it once, run it once more and check the result)."""
    numel = payload_bytes // FLOAT_BYTES
    mine, total = float(rank + 1), world * (world + 1) / 2  # rank r puts in r + 1; the sum over ranks
    if collective == "all_reduce":
        buffer = torch.full((numel,), mine, device=device)

        def call():
            dist.all_reduce(buffer)  # in place: each timed call sums the previous sums, which is fine to time

        def check():
            buffer.fill_(mine)
            call()
            return torch.all(buffer == total).item()
    elif collective == "all_gather":
        source, output = torch.full((numel // world,), mine, device=device), torch.empty(numel, device=device)

        def call():
            dist.all_gather_single(output, source)

        def check():
            call()
            expected = torch.arange(1, world + 1, device=device).float().repeat_interleave(numel // world)
            return torch.equal(output, expected)
    else:
        source, output = torch.full((numel,), mine, device=device), torch.empty(numel // world, device=device)

        def call():
            dist.reduce_scatter_single(output, source)

        def check():
            call()
            return torch.all(output == total).item()
    return call, check


def timed_block(call, iters: int, device) -> tuple[float, bool]:
    """(mean seconds per call over ``iters`` back-to-back calls, whether only the calls were timed).

    On a GPU: CUDA events around the calls, with the stream held by a spin kernel while Python enqueues them, so
    the events see the collectives run back to back and none of Python's dispatch. The start event must still be
    pending once the last call is enqueued, or dispatch leaked into the time (the second value says so). On a CPU
    the calls run as they are issued: a host clock, dispatch included (gloo's calls take milliseconds anyway).
    """
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(iters):
            call()
        return (time.perf_counter() - started) / iters, True
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(HOLD_CYCLES_PER_CALL * iters)
    start.record()
    for _ in range(iters):
        call()
    held = not start.query()  # the spin still running: every call was queued before the first one ran
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, held


def ask_nccl_for_its_choices() -> str | None:
    """Make NCCL log the algorithm and protocol of every collective (rank 0 of a communicator logs them:
    src/enqueue.cc, "%s: %ld Bytes -> Algo %s proto %s") into a file of this process. Must run before NCCL starts.
    Returns the file, or None when the user set NCCL_DEBUG (their settings win) or there is no GPU."""
    if not torch.cuda.is_available() or "NCCL_DEBUG" in os.environ:
        return None
    path = os.path.join(tempfile.gettempdir(), f"distlab_nccl_tuning.{os.getpid()}.log")
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="TUNING", NCCL_DEBUG_FILE=path)
    return path


def read_new_lines(path: str | None, offset: int) -> tuple[str, int]:
    """What NCCL has written to ``path`` since ``offset`` (line-buffered), and the new offset."""
    if path is None or not os.path.exists(path):
        return "", offset
    with open(path) as log:
        log.seek(offset)
        text = log.read()
        return text, log.tell()


def nccl_choice_for(collective: str, size: int, world: int, nccl_lines: str) -> str | None:
    """"ALGORITHM/PROTOCOL" NCCL chose most often for the timed calls of ``size`` bytes in its log lines, or None.

    Only the timed calls' lines count, not the barriers' between blocks (a 4-byte AllReduce): NCCL names the
    collective and counts the whole buffer for an all-reduce, one rank's share for an all-gather or a
    reduce-scatter, so each collective is matched on its own byte count alone.
    """
    nbytes_logged = size if collective == "all_reduce" else size // world
    chosen = Counter(f"{algorithm}/{protocol}" for name, nbytes, algorithm, protocol
                     in comm.nccl_tuning_choices(nccl_lines)
                     if name == NCCL_NAMES[collective] and nbytes == nbytes_logged)
    return chosen.most_common(1)[0][0] if chosen else None


def main():
    p = runtime.parser(__doc__, steps=None)
    p.add_argument("--min-bytes", default="4K", help="smallest payload (bytes, or 4K, 1M, 1G)")
    p.add_argument("--max-bytes", default="1M", help="largest payload")
    p.add_argument("--step", type=runtime.positive_int, default=4, help="each size is this many times the previous one")
    p.add_argument("--iters", type=runtime.positive_int, default=5, help="timed calls per size")
    p.add_argument("--warmup", type=runtime.nonnegative_int, default=2, help="untimed calls per size first")
    p.add_argument("--repeats", type=runtime.positive_int, default=3,
                   help="timed blocks of --iters calls; the fastest block counts (the least disturbed)")
    p.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), help="which collectives to time")
    args = p.parse_args()
    nccl_log = ask_nccl_for_its_choices()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        report = metrics.Report(__file__, rt, config=vars(args))
        world = rt.world_size
        rows, log_offset, all_held = [], 0, True
        rt.print(f"{world} ranks on {rt.device} ({rt.backend}); t = slowest rank's mean of {args.iters} calls, "
                 f"best of {args.repeats} blocks")
        rt.print(f"{'collective':>14} {'payload':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        for collective in args.collectives:
            correct, counted_ok = True, True
            for size in sizes(args.min_bytes, args.max_bytes, args.step, world):
                call, check = make_call(collective, size, world, rt.rank, rt.device)
                with comm.CommCounter() as counter:  # one untimed call counted: the counter stays out of the clock
                    call()
                for _ in range(args.warmup):
                    call()
                _, log_offset = read_new_lines(nccl_log, log_offset)  # skip the lines of the calls above
                blocks = []
                for _ in range(args.repeats):
                    rt.sync()
                    dist.barrier()
                    rt.sync()
                    per_call, held = timed_block(call, args.iters, rt.device)
                    blocks.append(per_call)
                    all_held &= held
                nccl_lines, log_offset = read_new_lines(nccl_log, log_offset)
                seconds = torch.tensor(blocks)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a collective is as slow as its slowest rank
                seconds = seconds.min().item()  # the best block: the least disturbed by other processes
                algbw, busbw = comm.bus_bandwidth(collective, size, seconds, world)
                sent = comm.bytes_sent_per_rank(collective, size, world)  # the ring model's, not measured
                # NCCL's choice for the timed calls (rank 0 logs them; None on gloo or when NCCL_DEBUG was yours)
                nccl_choice = nccl_choice_for(collective, size, world, nccl_lines)
                rows.append({"collective": collective, "bytes": size, "seconds": seconds, "algbw": algbw,
                             "busbw": busbw, "sent_bytes_per_rank_derived": sent, "nccl_algorithm": nccl_choice})
                rt.print(f"{collective:>14} {size:>10,} {seconds * 1e6:>10.1f} "
                         f"{algbw / 1e9:>11.4g} {busbw / 1e9:>11.4g}" + (f"  {nccl_choice}" if nccl_choice else ""))
                report.add_comm(collective, counter.total(collective), size)
                counted_ok &= counter.total(collective) == size and counter.count() == 1
                correct &= bool(check())  # the benchmark's own sanity: one more call, its result checked
            report.check(f"{collective}: results correct at every size", correct)
            report.check(f"{collective}: bytes counted per call = payload at every size", counted_ok)
        if rt.device.type == "cuda":
            report.check("GPU clock: every block was enqueued while the stream was held (no dispatch timed)",
                         all_held)
        report.extra["bandwidth"] = rows
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
