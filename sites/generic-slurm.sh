# shellcheck shell=bash
# sites/generic-slurm.sh: any Slurm site (the default profile under Slurm). Nothing site-specific is assumed: no
# modules, the scratch folder from $SCRATCH (or DISTLAB_SCRATCH), the partition from the command line (-p) or
# SBATCH_PARTITION, the network settings only where the node has Slingshot interfaces. See sites/README.md.
DISTLAB_SITE=${DISTLAB_SITE:-generic-slurm}
: "${DISTLAB_SITE_DESCRIPTION=any Slurm site: no modules, \$SCRATCH, the partition from -p or SBATCH_PARTITION}"
: "${DISTLAB_MODULES=}"
: "${DISTLAB_SITE_SCRATCH=}"
: "${DISTLAB_SITE_PARTITION=}" "${DISTLAB_SITE_QOS=}" "${DISTLAB_SITE_CONSTRAINT=}"
: "${DISTLAB_NETWORK=auto}"
: "${DISTLAB_GPU_VENDOR=nvidia}"
: "${DISTLAB_SITE_CORES_PER_NODE=}"
# srun --cpu-bind=cores: each task's OpenMP threads on the task's own cores (a no-op without task/affinity)
: "${DISTLAB_SRUN_CPU_BIND=cores}"
# no --gpu-bind: every task sees its node's GPUs and takes its local rank's (the rank map checks no two share one)
: "${DISTLAB_SRUN_GPU_BIND=}"
# shellcheck source=sites/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
