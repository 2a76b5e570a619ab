# shellcheck shell=bash
# sites/derecho.sh: NCAR's Derecho (PBS Pro, HPE Cray EX, 4 x A100 40 GB and 64 cores a GPU node, Slingshot-11);
# the default profile under PBS. The modules: ncarenv and conda, not cuda (PyTorch brings its own CUDA runtime and
# NCCL, and the module's older libraries ahead on LD_LIBRARY_PATH break the import: pbs/README.md, "Software").
DISTLAB_SITE=${DISTLAB_SITE:-derecho}
: "${DISTLAB_SITE_DESCRIPTION=NCAR Derecho: PBS Pro, 4 x A100 a node, Slingshot-11}"
: "${DISTLAB_MODULES=ncarenv conda}"
: "${DISTLAB_SITE_SCRATCH=/glade/derecho/scratch/${USER:-$(id -un)}}"
: "${DISTLAB_SITE_PARTITION=}" "${DISTLAB_SITE_QOS=}" "${DISTLAB_SITE_CONSTRAINT=}"
: "${DISTLAB_NETWORK=auto}"
: "${DISTLAB_GPU_VENDOR=nvidia}"
: "${DISTLAB_GPUS_PER_NODE:=4}"
: "${DISTLAB_SITE_CORES_PER_NODE=64}"
: "${DISTLAB_SRUN_CPU_BIND=}" "${DISTLAB_SRUN_GPU_BIND=}"
# shellcheck source=sites/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
