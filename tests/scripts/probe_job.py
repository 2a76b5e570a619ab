"""A test-only job: reports what distlab.runtime saw, all-reduces, and can be told to fail or hang."""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab import comm, metrics, runtime


def main():
    p = runtime.parser(__doc__, steps=None)
    p.add_argument("--fail-rank", type=int, default=-1, help="this rank raises an exception")
    p.add_argument("--sleep", type=float, default=0.0, help="rank 0 sleeps this long before the collective")
    p.add_argument("--bad-config", action="store_true")
    p.add_argument("--fail-check", action="store_true", help="record a failing check (exit code 1)")
    p.add_argument("--raise-after", action="store_true", help="raise after the run has finished cleanly")
    p.add_argument("--pid-folder", default=None, help="each rank writes its process id to a file named by its rank here")
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: runtime.require(not args.bad_config, "probe told to fail")) as rt:
        report = metrics.Report(__file__, rt, vars(args))
        if args.pid_folder:
            Path(args.pid_folder, str(rt.rank)).write_text(str(os.getpid()))
        if rt.rank == args.fail_rank:
            raise RuntimeError(f"probe failure on rank {rt.rank}")
        if rt.rank == 0 and args.sleep:
            time.sleep(args.sleep)
        value = torch.tensor([float(rt.rank)])
        dist.all_reduce(value)
        report.check_equal("all-reduce of ranks", value.item(), float(sum(range(rt.world_size))))
        # torch's pipelining sends with P2POp(dist.isend, ...) + batch_isend_irecv: it must work while counted
        right, left = (rt.rank + 1) % rt.world_size, (rt.rank - 1) % rt.world_size
        send, receive = torch.full((4,), float(rt.rank)), torch.zeros(4)
        with comm.CommCounter() as counter:
            ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, receive, left)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        report.check_equal("ring by batch_isend_irecv", receive.tolist(), [float(left)] * 4)
        report.check_equal("isend bytes counted", counter.total("send"), 16)
        report.check("originals restored", dist.isend is dist.distributed_c10d.isend)
        ranks = [None] * rt.world_size
        dist.all_gather_object(ranks, (rt.rank, rt.local_rank, rt.launcher))
        report.extra["ranks"] = ranks
        if args.fail_check:
            report.check("a check told to fail", False)
        rt.print(f"probe ok: world {rt.world_size}")
        code = report.finish(args.metrics_out)
    if args.raise_after:
        raise RuntimeError("raised after the run")
    sys.exit(code)


if __name__ == "__main__":
    main()
