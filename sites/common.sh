# shellcheck shell=bash
# sites/common.sh: sourced last by every profile. On the login node (no job yet) it hands the profile's partition,
# QOS and constraint to sbatch through SBATCH_PARTITION, SBATCH_QOS and SBATCH_CONSTRAINT, which sbatch reads and its
# command line overrides (Slurm's sbatch manual, "INPUT ENVIRONMENT VARIABLES"); a value already set wins. Inside a
# job nothing is exported: the job has its partition already.
if [[ -z ${SLURM_JOB_ID:-}${PBS_JOBID:-} ]]; then
    [[ -z ${DISTLAB_SITE_PARTITION:-} || -n ${SBATCH_PARTITION:-} ]] || export SBATCH_PARTITION=$DISTLAB_SITE_PARTITION
    [[ -z ${DISTLAB_SITE_QOS:-} || -n ${SBATCH_QOS:-} ]] || export SBATCH_QOS=$DISTLAB_SITE_QOS
    [[ -z ${DISTLAB_SITE_CONSTRAINT:-} || -n ${SBATCH_CONSTRAINT:-} ]] || export SBATCH_CONSTRAINT=$DISTLAB_SITE_CONSTRAINT
    export DISTLAB_SITE
fi
