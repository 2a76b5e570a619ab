# shellcheck shell=bash
# sites/hpe-slingshot-slurm.sh: an HPE Cray EX site under Slurm with NVIDIA GPUs on Slingshot-11 (Perlmutter-class:
# 4 x A100 a node, GPUs chosen by constraint and QOS rather than a partition). NCCL needs the aws-ofi-nccl plugin
# there (pbs/README.md, "NCCL on Slingshot"): put it on LD_LIBRARY_PATH or set DISTLAB_NCCL_PLUGIN_DIR. Fill in your
# site's constraint and QOS below, or pass -C and -q on the sbatch line.
DISTLAB_SITE=${DISTLAB_SITE:-hpe-slingshot-slurm}
: "${DISTLAB_SITE_DESCRIPTION=HPE Cray EX under Slurm: NVIDIA GPUs, Slingshot-11, aws-ofi-nccl}"
: "${DISTLAB_MODULES=}"
: "${DISTLAB_SITE_SCRATCH=}"
: "${DISTLAB_SITE_PARTITION=}" "${DISTLAB_SITE_QOS=}" "${DISTLAB_SITE_CONSTRAINT=}"
: "${DISTLAB_NETWORK=slingshot}"
: "${DISTLAB_GPU_VENDOR=nvidia}"
: "${DISTLAB_SITE_CORES_PER_NODE=64}"
: "${DISTLAB_SRUN_CPU_BIND=cores}"
: "${DISTLAB_SRUN_GPU_BIND=}"
# shellcheck source=sites/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
