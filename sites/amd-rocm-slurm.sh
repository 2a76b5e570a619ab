# shellcheck shell=bash
# sites/amd-rocm-slurm.sh: AMD Instinct nodes under Slurm on Slingshot-11 (Frontier, LUMI-G, Setonix-class: 4 x MI250X,
# each two GCDs that PyTorch sees as two GPUs, so 8 a node; 56 cores a node left to jobs where the site keeps one
# core a CCD for the system). PyTorch's ROCm wheels (pip install torch --index-url
# https://download.pytorch.org/whl/rocm<X.Y>, the version pytorch.org's selector names) talk through RCCL, which loads aws-ofi-rccl's librccl-net.so from
# LD_LIBRARY_PATH (RCCL's src/net.cc): put it there or set DISTLAB_NCCL_PLUGIN_DIR. Untested by the course: it has no
# AMD GPU (sites/README.md).
DISTLAB_SITE=${DISTLAB_SITE:-amd-rocm-slurm}
: "${DISTLAB_SITE_DESCRIPTION=AMD Instinct under Slurm: 8 GCDs a node, RCCL, aws-ofi-rccl, Slingshot-11}"
: "${DISTLAB_MODULES=}"
: "${DISTLAB_SITE_SCRATCH=}"
: "${DISTLAB_SITE_PARTITION=}" "${DISTLAB_SITE_QOS=}" "${DISTLAB_SITE_CONSTRAINT=}"
: "${DISTLAB_NETWORK=slingshot}"
: "${DISTLAB_GPU_VENDOR=amd}"
: "${DISTLAB_GPUS_PER_NODE:=8}"
: "${DISTLAB_SITE_CORES_PER_NODE=56}"
: "${DISTLAB_SRUN_CPU_BIND=cores}"
: "${DISTLAB_SRUN_GPU_BIND=}"
# shellcheck source=sites/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
