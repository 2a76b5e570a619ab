"""Test-only probe for the PBS jobs: joins the job like every course script, reports where each rank sits.

Every rank all-reduces its rank (the sum must be 0+1+...+(world-1)) and all-gathers what its launcher told
it: rank, local rank, local world size, launcher, MASTER_ADDR/MASTER_PORT and the host mpiexec placed it on.
Rank 0 writes all of that to the metrics file, where tests/pbs/test_pbs_jobs.py checks it.

    mpiexec -n 4 -ppn 2 -launcher fork -f hosts.txt python tests/pbs/job_probe.py --metrics-out m.json
"""

import os
import socket
import sys

import torch
import torch.distributed as dist

from distlab import metrics, runtime


def main():
    args = runtime.parser(__doc__, steps=None).parse_args()
    with runtime.start(args) as rt:
        report = metrics.Report(__file__, rt, config=vars(args))
        total = torch.tensor([float(rt.rank)])
        dist.all_reduce(total)
        expected = rt.world_size * (rt.world_size - 1) / 2
        report.check_close("all_reduce of ranks", total.item(), expected, tolerance=0.0)

        mine = {
            "rank": rt.rank,
            "local_rank": rt.local_rank,
            "local_world_size": rt.local_world_size,
            "launcher": rt.launcher,
            "device": str(rt.device),
            "master_addr": os.environ.get("MASTER_ADDR"),
            "master_port": os.environ.get("MASTER_PORT"),
            # the "node" Hydra placed this rank on (its hostfile entry); torchrun workers inherit their agent's
            # (Slurm: the node daemon's name, SLURMD_NODENAME, which tells apart the test cluster's nodes on one host)
            "node": (os.environ.get("PMI_HOSTNAME") or os.environ.get("PALS_NODEID") or os.environ.get("SLURMD_NODENAME")
                     or socket.gethostname()),
        }
        everyone = [None] * rt.world_size
        dist.all_gather_object(everyone, mine)
        report.check_equal("ranks gathered", sorted(r["rank"] for r in everyone), list(range(rt.world_size)))
        report.extra["ranks"] = everyone
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
