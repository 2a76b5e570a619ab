# shellcheck shell=bash
# sites/generic-pbs.sh: any PBS Pro or OpenPBS site. No modules, the scratch folder from $SCRATCH (or
# DISTLAB_SCRATCH), the queue from qsub -q, the network settings only where the node has Slingshot interfaces.
DISTLAB_SITE=${DISTLAB_SITE:-generic-pbs}
: "${DISTLAB_SITE_DESCRIPTION=any PBS site: no modules, \$SCRATCH, the queue from qsub -q}"
: "${DISTLAB_MODULES=}"
: "${DISTLAB_SITE_SCRATCH=}"
: "${DISTLAB_SITE_PARTITION=}" "${DISTLAB_SITE_QOS=}" "${DISTLAB_SITE_CONSTRAINT=}"
: "${DISTLAB_NETWORK=auto}"
: "${DISTLAB_GPU_VENDOR=nvidia}"
: "${DISTLAB_SITE_CORES_PER_NODE=}"
: "${DISTLAB_SRUN_CPU_BIND=}" "${DISTLAB_SRUN_GPU_BIND=}"
# shellcheck source=sites/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
