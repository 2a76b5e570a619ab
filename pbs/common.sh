# shellcheck shell=bash
# pbs/common.sh: the PBS part of the course's jobs; what every scheduler shares is jobs/common.sh, sourced first.
# A job sources it, then launches scripts:
#
#     cd "${PBS_O_WORKDIR:-.}" && { [[ -f pbs/common.sh ]] || cd ..; } || exit 2
#     source pbs/common.sh || exit 2
#     distlab_launch scripts/04_data_parallel/train_ddp.py --preset "$DISTLAB_PRESET" --device "$DISTLAB_DEVICE" \
#         --metrics-out "$DISTLAB_RUN_DIR/train_ddp.json"
#     distlab_finish
#
# Sourcing it: loads modules, activates the conda environment, sets NCCL/libfabric (and gloo) for Slingshot,
# reads the job's nodes from $PBS_NODEFILE, exports MASTER_ADDR/MASTER_PORT and makes a run directory on
# scratch (never over an earlier run's files). DISTLAB_FUNCTIONS_ONLY=1 defines the functions and does
# nothing else (the unit tests of its rules call them one by one).
# distlab_launch starts one script on every GPU of the job, with mpiexec (default) or with one torchrun
# agent per node. Every setting is an environment variable with a default (qsub -v NAME=value);
# pbs/README.md lists them. Anything wrong stops the job at once with one line "distlab: error: ...".
# What differs from Slurm (slurm/common.sh): the node file, mpiexec (Cray PALS or MPICH Hydra), no warning before
# the walltime (the scripts stop themselves at DISTLAB_DEADLINE), qsub/qdel for chains.

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    echo "pbs/common.sh is sourced by the jobs in pbs/, not run: see pbs/README.md" >&2
    exit 2
fi
# the settings this job was given (qsub -v), named before any default is filled in: a chain hands them on to its next
# job, since qsub hands a job only its -v variables (Slurm's chains hand on the environment, --export=ALL)
DISTLAB_GIVEN=$(compgen -e DISTLAB_ | tr '\n' ' ')
# the site profile when none is named (sites/README.md): the course's own cluster, Derecho (generic-pbs elsewhere)
DISTLAB_DEFAULT_SITE=derecho
# shellcheck source=jobs/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../jobs/common.sh" || exit 2

DISTLAB_SCHEDULER=pbs
DISTLAB_JOB_ID=${PBS_JOBID:-}
# a rerun job (qrerun, a node lost): PBS sets no variable with its run count (OpenPBS src/resmom/start_exec.c:161-174
# lists what it sets), so it is read from qstat -f (run_count: OpenPBS src/include/pbs_ifl.h:183) at setup
DISTLAB_NODE_CORES=${NCPUS:-} # the chunk's ncpus
# the job's time limit as PBS names it: the walltime resource (Resource_List.walltime), whose MoM kills a job with
# "=>> PBS: job killed: walltime N exceeded limit M" (OpenPBS src/resmom/mom_main.c:6023-6037, 8831)
DISTLAB_LIMIT_NAME=walltime
DISTLAB_LAUNCHER=${DISTLAB_LAUNCHER:-mpiexec}          # mpiexec | torchrun
DISTLAB_MPIEXEC=${DISTLAB_MPIEXEC:-mpiexec}            # the mpiexec binary
DISTLAB_MPIEXEC_FLAVOR=${DISTLAB_MPIEXEC_FLAVOR:-auto} # auto | pals (Cray) | hydra (MPICH, Intel MPI)
DISTLAB_MPIEXEC_ARGS=${DISTLAB_MPIEXEC_ARGS:-}         # extra mpiexec flags, e.g. "-launcher fork"
DISTLAB_CPU_BIND=${DISTLAB_CPU_BIND:-none}             # PALS --cpu-bind (none, depth, core, ...)
DISTLAB_DEPTH=${DISTLAB_DEPTH:-}                       # PALS --depth (cores per rank); implies --cpu-bind depth
DISTLAB_QSTAT=${DISTLAB_QSTAT:-qstat}                  # PBS's commands (the unit tests put stand-ins here)
DISTLAB_QSUB=${DISTLAB_QSUB:-qsub}
DISTLAB_QDEL=${DISTLAB_QDEL:-qdel}
case $DISTLAB_LAUNCHER in
mpiexec | torchrun) ;;
*) distlab_die "DISTLAB_LAUNCHER=$DISTLAB_LAUNCHER: use mpiexec or torchrun" ;;
esac

# distlab_job_file NAME: the job file of this scheduler for a job's name (a chain submits its own file again)
distlab_job_file() { echo "$DISTLAB_ROOT/pbs/$1.pbs"; }

export DISTLAB_CANCEL_COMMAND="qdel" # what cancels a job (the JupyterLab job says it)
export DISTLAB_DEFAULT_LOGIN_HOST="derecho.hpc.ucar.edu" # where users ssh to (JupyterLab tunnel)
distlab_cancel_job() { "$DISTLAB_QDEL" "$1"; }

# ---------------------------------------------------------------------------------------------------
# Walltime and chained jobs
# ---------------------------------------------------------------------------------------------------
distlab_qstat_field() {
    # NAME: its value in `qstat -f $PBS_JOBID`, whose long values PBS folds onto lines that begin with a tab
    [[ -n ${PBS_JOBID:-} ]] || return 0
    "$DISTLAB_QSTAT" -f "$PBS_JOBID" 2>/dev/null | awk -v name="$1" '
        /^\t/ { line = line substr($0, 2); next }
        { if (line != "") print line; line = $0 }
        END { if (line != "") print line }' | sed -n "s/^ *${1//./\\.} = //p" | head -n 1
}

# distlab_kill_delay: when PBS's SIGKILL follows its TERM, for the TERM trap's line (jobs/common.sh, distlab_on_sigterm,
# reads DISTLAB_KILL_DELAY): the kill_delay of the queue the job runs in (PBS_QUEUE; `qstat -Qf` lists it where the
# queue sets one, else it is 10 s: OpenPBS src/server/req_runjob.c:948, 991-994), then the MoM's next poll
# (coursetools.jobs, pbs_kill_delay)
distlab_kill_delay() {
    local delay=""
    if [[ -n ${PBS_QUEUE:-} ]]; then
        delay=$("$DISTLAB_QSTAT" -Qf "$PBS_QUEUE" 2>/dev/null | sed -n 's/^ *kill_delay = \([0-9][0-9]*\)$/\1/p' | head -n 1)
    fi
    DISTLAB_KILL_DELAY=$(distlab_jobs pbs-kill-delay "$delay") || DISTLAB_KILL_DELAY="when PBS sends it (the queue's kill_delay)"
}

distlab_deadline() {
    # PBS gives no warning before the walltime: once it has passed, the first node's MoM sends SIGTERM to the job's
    # processes there at its next poll (a rank gets it only inside the job shell's session or through mpiexec, not
    # checked under Cray PALS) and SIGKILL the queue's
    # kill_delay later (10 s unless the queue sets another; `qstat -Qf` shows it), too
    # little for a step and a checkpoint of a real model. So the scripts stop themselves: DISTLAB_DEADLINE (seconds
    # since the epoch) = the job's start + its walltime - DISTLAB_WALLTIME_MARGIN. The start is qstat's stime, set
    # when the server runs the job (OpenPBS src/server/req_runjob.c:1188); without it, now less the walltime used so
    # far, which the MoM samples only every 10-120 s (OpenPBS src/include/mom_func.h:413-414) and so runs behind.
    local walltime used start
    distlab_kill_delay # a qdel's SIGKILL comes with or without a walltime
    walltime=${PBS_WALLTIME:-$(distlab_qstat_field Resource_List.walltime)}
    [[ -n $walltime ]] || return 0 # not a PBS job: no deadline
    walltime=$(distlab_seconds "$walltime") || distlab_die "cannot read the job's walltime '$walltime'"
    start=$(distlab_qstat_field stime)
    if [[ -z $start ]] || ! start=$(date -d "$start" +%s 2>/dev/null); then
        used=$(distlab_seconds "$(distlab_qstat_field resources_used.walltime)") || used=0
        start=$(($(date +%s) - used))
    fi
    # the job's end: a SIGTERM at or after it is the walltime's (distlab_on_sigterm names it so)
    export DISTLAB_JOB_END=$((start + walltime))
    [[ -z ${DISTLAB_DEADLINE:-} ]] || return 0 # given by hand
    ((walltime > DISTLAB_WALLTIME_MARGIN)) || distlab_die "the walltime (${walltime}s) is not longer than DISTLAB_WALLTIME_MARGIN (${DISTLAB_WALLTIME_MARGIN}s)"
    DISTLAB_DEADLINE=$((start + walltime - DISTLAB_WALLTIME_MARGIN))
    export DISTLAB_DEADLINE
    distlab_log "deadline: scripts stop, checkpoint written, by $(date -d "@$DISTLAB_DEADLINE" +%T 2>/dev/null || echo "$DISTLAB_DEADLINE") (walltime ${walltime}s less a margin of ${DISTLAB_WALLTIME_MARGIN}s)"
}

distlab_chain_next() {
    # JOB_FILE NAME=VALUE...: submit the job that continues this one, starting when this one ends however it ends
    # (afterany: a job stopped at its walltime did not end "ok"), with this job's own resources: the same
    # select line, walltime and queue, so a 2-node chain does not go on as a 1-node one, and the settings it was
    # given (-v): its DISTLAB_* ones, TORCH_ELASTIC_SHUTDOWN_TIMEOUT and NCCL_DEBUG. Other -v variables are not
    # carried. Prints its id.
    local select walltime queue
    select=$(distlab_qstat_field Resource_List.select)
    walltime=$(distlab_qstat_field Resource_List.walltime)
    # The queue the user submitted to (PBS_O_QUEUE), not the one the job runs in (PBS_QUEUE): a routing queue
    # (Derecho's main routes to gpu/cpu, develop to gpudev/cpudev) may be the only one that takes submissions,
    # and a successor refused by qsub never runs. OpenPBS: the server sets PBS_O_QUEUE when the job is queued, to
    # the queue it was submitted to (src/server/req_quejob.c:862); the MoM sets PBS_QUEUE to the queue the job
    # is in when it starts (src/resmom/start_exec.c:3503). Without PBS_O_QUEUE, no -q: the server's default queue.
    queue=${PBS_O_QUEUE:-}
    local -a args=(-W "depend=afterany:$PBS_JOBID")
    [[ -z ${PBS_ACCOUNT:-} ]] || args+=(-A "$PBS_ACCOUNT")
    [[ -z $queue ]] || args+=(-q "$queue")
    [[ -z $select ]] || args+=(-l "select=$select")
    [[ -z $walltime ]] || args+=(-l "walltime=$walltime")
    # the settings this job was given, as this job read them (a chain with -v DISTLAB_CONDA_ENV=... or
    # DISTLAB_DRILL_STEPS=... must not go on with the defaults), less what is this job's own (its run folder,
    # deadline, nodes, rendezvous) and what the caller names
    local -a carried=()
    local name
    for name in $DISTLAB_GIVEN; do
        case $name in
        DISTLAB_RUN_DIR | DISTLAB_JOB_RUN_DIR | DISTLAB_DEADLINE | DISTLAB_NODES | DISTLAB_NNODES | DISTLAB_MASTER_ADDR | DISTLAB_MASTER_PORT | \
            DISTLAB_FUNCTIONS_ONLY | DISTLAB_GIVEN | DISTLAB_NCCL_DEBUG_GIVEN) continue ;;
        esac
        [[ " ${*:2} " == *" $name="* ]] || carried+=("$name=${!name-}")
    done
    # and the two settings of torch and NCCL the user may give a chain (qsub -v), when given: this job's own values (the
    # margin, NCCL's WARN default on Slingshot) stay behind, as the successor makes its own (jobs/common.sh)
    local given=${DISTLAB_SHUTDOWN_TIMEOUT_GIVEN:-}
    [[ -z $given || " ${*:2} " == *" TORCH_ELASTIC_SHUTDOWN_TIMEOUT="* ]] || carried+=("TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$given")
    given=${DISTLAB_NCCL_DEBUG_GIVEN-${NCCL_DEBUG:-}}
    [[ -z $given || " ${*:2} " == *" NCCL_DEBUG="* ]] || carried+=("NCCL_DEBUG=$given")
    # qsub -v splits its list at every comma outside quotes: a value's commas become colons (distlab_jobs chain-vars)
    local variables
    variables=$(distlab_jobs chain-vars "${carried[@]}" "${@:2}") || return 2
    "$DISTLAB_QSUB" "${args[@]}" -v "$variables" "$1"
}

# ---------------------------------------------------------------------------------------------------
# Nodes: PBS writes one line per MPI process (mpiprocs) per node into $PBS_NODEFILE, in node order.
# ---------------------------------------------------------------------------------------------------
distlab_discover_nodes() {
    [[ -n ${PBS_NODEFILE:-} ]] || distlab_die "PBS_NODEFILE is not set: submit the job with qsub (see pbs/README.md), or export PBS_NODEFILE=<file with one host per line> to try it elsewhere"
    [[ -r $PBS_NODEFILE ]] || distlab_die "PBS_NODEFILE=$PBS_NODEFILE cannot be read"
    local -a hosts
    mapfile -t hosts < <(awk 'NF && !seen[$1]++ { print $1 }' "$PBS_NODEFILE")
    ((${#hosts[@]} > 0)) || distlab_die "PBS_NODEFILE=$PBS_NODEFILE lists no hosts"
    export DISTLAB_NODES="${hosts[*]}" DISTLAB_NNODES=${#hosts[@]}
    # Rank 0 runs on the first node; every rank reads MASTER_ADDR/MASTER_PORT (distlab.runtime, torchrun).
    export MASTER_ADDR=${DISTLAB_MASTER_ADDR:-${hosts[0]}}
    export MASTER_PORT=${DISTLAB_MASTER_PORT:-$(distlab_port_from_job_id "${PBS_JOBID:-distlab}")}
    distlab_restart_count
}

# distlab_restart_count: DISTLAB_RESTART_COUNT, the times this job was rerun: run_count less one, as the server adds one
# each time it sends the job to run (OpenPBS src/server/req_runjob.c:1065)
distlab_restart_count() {
    [[ -z ${DISTLAB_RESTART_COUNT:-} ]] || return 0
    local runs
    runs=$(distlab_qstat_field run_count)
    DISTLAB_RESTART_COUNT=0
    [[ ! $runs =~ ^[0-9]+$ ]] || ((runs <= 1)) || DISTLAB_RESTART_COUNT=$((runs - 1))
}

# ---------------------------------------------------------------------------------------------------
# mpiexec: Cray PALS (Derecho) and MPICH's Hydra spell their options differently
# ---------------------------------------------------------------------------------------------------
distlab_detect_mpiexec() {
    local path version
    path=$(command -v "$DISTLAB_MPIEXEC") || distlab_die "mpiexec not found ($DISTLAB_MPIEXEC): load your MPI module or set DISTLAB_MPIEXEC"
    case $DISTLAB_MPIEXEC_FLAVOR in
    pals | hydra) return 0 ;;
    auto) ;;
    *) distlab_die "DISTLAB_MPIEXEC_FLAVOR=$DISTLAB_MPIEXEC_FLAVOR: use auto, pals or hydra" ;;
    esac
    version=$("$DISTLAB_MPIEXEC" --version 2>&1 </dev/null | head -n 20)
    case "$path $version" in
    *HYDRA* | *"Intel(R) MPI"*) DISTLAB_MPIEXEC_FLAVOR=hydra ;;
    *"Open MPI"* | *OpenRTE*) distlab_die "$path is Open MPI's mpiexec: use Cray PALS or MPICH (DISTLAB_MPIEXEC), or DISTLAB_LAUNCHER=torchrun with Cray PALS/MPICH" ;;
    *pals* | *PALS*) DISTLAB_MPIEXEC_FLAVOR=pals ;;
    *)
        DISTLAB_MPIEXEC_FLAVOR=pals
        distlab_log "could not tell which mpiexec $path is: assuming Cray PALS (set DISTLAB_MPIEXEC_FLAVOR=pals|hydra)"
        ;;
    esac
}

# distlab_mpiexec_command NPROCS PPN: the mpiexec words that start NPROCS processes, PPN per node.
distlab_mpiexec_command() {
    local nprocs=$1 ppn=$2 bind=$DISTLAB_CPU_BIND
    local -a cmd extra
    cmd=("$DISTLAB_MPIEXEC")
    case $DISTLAB_MPIEXEC_FLAVOR in
    pals)
        cmd+=(-n "$nprocs" --ppn "$ppn")
        if ((ppn == 1)); then
            bind=none # a torchrun agent and its workers need every core of the node
        elif [[ -n $DISTLAB_DEPTH ]]; then
            cmd+=(--depth "$DISTLAB_DEPTH")
            bind=depth
        fi
        cmd+=(--cpu-bind "$bind")
        ;;
    hydra) cmd+=(-n "$nprocs" -ppn "$ppn" -f "$DISTLAB_HOSTFILE") ;;
    esac
    read -ra extra <<<"$DISTLAB_MPIEXEC_ARGS"
    cmd+=("${extra[@]}")
    printf '%s\n' "${cmd[@]}"
}

distlab_detect_launcher() {
    distlab_detect_mpiexec
    DISTLAB_LAUNCHER_DETAIL="$DISTLAB_MPIEXEC_FLAVOR mpiexec"
}
distlab_ranks_command() { distlab_mpiexec_command "$1" "$2"; } # NPROCS PPN: one process a rank
distlab_agents_command() { distlab_mpiexec_command "$1" 1; }   # NODES: one torchrun agent a node

if [[ ${DISTLAB_FUNCTIONS_ONLY:-0} == 1 ]]; then
    return 0 # the functions are defined; the tests call them one by one
fi
distlab_setup
