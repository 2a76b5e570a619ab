# shellcheck shell=bash
# slurm/common.sh: the Slurm part of the course's jobs; what every scheduler shares is jobs/common.sh, sourced
# first. A job sources it, then launches scripts:
#
#     cd "${SLURM_SUBMIT_DIR:-.}" && { [[ -f slurm/common.sh ]] || cd ..; } || exit 2
#     source slurm/common.sh || exit 2
#     distlab_launch scripts/04_data_parallel/train_ddp.py --preset "$DISTLAB_PRESET" --device "$DISTLAB_DEVICE" \
#         --metrics-out "$DISTLAB_RUN_DIR/train_ddp.json"
#     distlab_finish
#
# What differs from PBS (pbs/common.sh): the nodes come from SLURM_JOB_NODELIST; srun starts the ranks (one task a
# GPU, the default) or one torchrun agent a node (DISTLAB_LAUNCHER=torchrun); the walltime's end is read from the
# job (EndTime), and Slurm can warn before it (#SBATCH --signal=B:USR1@N): the batch shell then launches nothing
# more and has the launch in progress checkpoint and stop; chains use sbatch --dependency=afterany and scancel. Every setting is an environment variable with a
# default (sbatch --export=ALL,NAME=value, or an export before sbatch); slurm/README.md lists them.

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    echo "slurm/common.sh is sourced by the jobs in slurm/, not run: see slurm/README.md" >&2
    exit 2
fi
# one task a GPU: the GPUs Slurm gave each node, unless told otherwise (else the site profile's, else 4)
[[ -z ${SLURM_GPUS_ON_NODE:-} || -n ${DISTLAB_GPUS_PER_NODE:-} ]] || DISTLAB_GPUS_PER_NODE=$SLURM_GPUS_ON_NODE
# the site profile when none is named (sites/README.md): nothing of Derecho's (ncarenv, /glade) in a Slurm job
DISTLAB_DEFAULT_SITE=generic-slurm
# shellcheck source=jobs/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../jobs/common.sh" || exit 2

DISTLAB_SCHEDULER=slurm
DISTLAB_JOB_ID=${SLURM_JOB_ID:-}
# At the time limit, and on a plain `scancel JOB`, slurmd sends TERM to every step, the batch shell's and the ranks',
# and KILL KillWait seconds later (src/slurmd/slurmd/req.c: _rpc_timelimit, _rpc_terminate_job; scancel.1: "This
# gives time for the running job/step(s) to clean up"). The job's srun gets that TERM too, prints "forcing job
# termination" and "Job step aborted: Waiting up to N seconds" (KillWait + 2). Its launch_fwd_signal(SIGKILL) marks
# the launch aborted (src/srun/signals.c:162-168, src/srun/launch.c:1659-1660 at 284c3b95), and srun then asks the
# controller to SIGKILL the step (slurm_kill_job_step, src/api/step_launch.c:728-731). The controller refuses: the
# job is already TIMEOUT or CANCELLED (src/slurmctld/job_mgr.c:9856, :5398), and a finished job's steps get
# ESLURM_ALREADY_DONE (src/stepmgr/stepmgr.c:633-636; Slurm 22.05: step_launch.c:666-671, step_mgr.c:621-624). So
# the ranks have KillWait seconds after their TERM: distlab_on_sigterm says a checkpointing launch writes its
# checkpoint if it fits in them. An srun TERMed while the job still runs (timeout under DISTLAB_LAUNCH_TIMEOUT, a
# kill, scancel --full) has its step SIGKILLed at once: the warning below signals the step, never this shell's srun.
# the job's time limit as Slurm names it (its TimeLimit field; "*** JOB ... CANCELLED AT ... DUE TO TIME LIMIT ***")
DISTLAB_LIMIT_NAME="time limit"
DISTLAB_RESTART_COUNT=${SLURM_RESTART_COUNT:-0} # a requeued job: how many times (Slurm's sbatch manual, SLURM_RESTART_COUNT)
DISTLAB_NODE_CORES=${SLURM_CPUS_ON_NODE:-}
DISTLAB_LAUNCHER=${DISTLAB_LAUNCHER:-srun}     # srun (one task a rank) | torchrun (one agent a node, via srun)
DISTLAB_SRUN=${DISTLAB_SRUN:-srun}             # Slurm's commands (the unit tests put stand-ins here)
DISTLAB_SRUN_ARGS=${DISTLAB_SRUN_ARGS:-}       # extra srun flags, e.g. "--cpu-bind=cores"
DISTLAB_SBATCH=${DISTLAB_SBATCH:-sbatch}
DISTLAB_SCANCEL=${DISTLAB_SCANCEL:-scancel}
DISTLAB_SCONTROL=${DISTLAB_SCONTROL:-scontrol}
DISTLAB_SQUEUE=${DISTLAB_SQUEUE:-squeue}
DISTLAB_CHAIN_SBATCH_ARGS=${DISTLAB_CHAIN_SBATCH_ARGS:-} # more sbatch options for a chain's next jobs ("--qos=... --signal=...")
DISTLAB_CHAIN_EXPORT=${DISTLAB_CHAIN_EXPORT:-}           # more NAME=value settings for a chain's next jobs (, between)
case $DISTLAB_LAUNCHER in
srun | torchrun) ;;
*) distlab_die "DISTLAB_LAUNCHER=$DISTLAB_LAUNCHER: use srun or torchrun" ;;
esac

# distlab_job_file NAME: the job file of this scheduler for a job's name (a chain submits its own file again)
distlab_job_file() { echo "$DISTLAB_ROOT/slurm/$1.sbatch"; }

export DISTLAB_CANCEL_COMMAND="scancel" # what cancels a job (the JupyterLab job says it)
export DISTLAB_DEFAULT_LOGIN_HOST=${DISTLAB_DEFAULT_LOGIN_HOST:-${SLURM_SUBMIT_HOST:-login}} # where sbatch ran (JupyterLab tunnel)
distlab_cancel_job() { "$DISTLAB_SCANCEL" "$1"; }

# distlab_job_field NAME: a field of `scontrol show job -o $SLURM_JOB_ID` (one line of NAME=value words)
distlab_job_field() {
    [[ -n ${SLURM_JOB_ID:-} ]] || return 0
    "$DISTLAB_SCONTROL" show job -o "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$1=//p" | head -n 1
}

# ---------------------------------------------------------------------------------------------------
# Nodes and the allocation's shape
# ---------------------------------------------------------------------------------------------------
distlab_discover_nodes() {
    [[ -n ${SLURM_JOB_NODELIST:-} ]] || distlab_die "SLURM_JOB_NODELIST is not set: submit the job with sbatch (see slurm/README.md)"
    local -a hosts
    mapfile -t hosts < <("$DISTLAB_SCONTROL" show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null)
    ((${#hosts[@]} > 0)) || distlab_die "scontrol show hostnames '$SLURM_JOB_NODELIST' lists no hosts"
    export DISTLAB_NODES="${hosts[*]}" DISTLAB_NNODES=${#hosts[@]}
    # Rank 0 and the torchrun rendezvous run on the first node of the allocation.
    export MASTER_ADDR=${DISTLAB_MASTER_ADDR:-${hosts[0]}}
    export MASTER_PORT=${DISTLAB_MASTER_PORT:-$(distlab_port_from_job_id "${SLURM_JOB_ID:-distlab}")}
    distlab_check_allocation
}

# distlab_check_allocation: the allocation fits one task a GPU, or the job stops with one line (exit 2) before it
# launches or queues anything. SLURM_GPUS_ON_NODE: the GPUs this node was given; SLURM_NTASKS_PER_NODE: set when
# the job asked --ntasks-per-node (Slurm's sbatch man page, "OUTPUT ENVIRONMENT VARIABLES").
distlab_check_allocation() {
    local gpus=${SLURM_GPUS_ON_NODE:-} tasks=${SLURM_NTASKS_PER_NODE:-}
    if [[ -n $gpus && $gpus != "$DISTLAB_GPUS_PER_NODE" ]]; then
        distlab_die "the job has $gpus GPU(s) a node but DISTLAB_GPUS_PER_NODE=$DISTLAB_GPUS_PER_NODE: ask --gpus-per-node=$DISTLAB_GPUS_PER_NODE, or leave DISTLAB_GPUS_PER_NODE unset"
    fi
    if [[ $DISTLAB_LAUNCHER == srun && -n $tasks && $tasks != "$DISTLAB_GPUS_PER_NODE" ]]; then
        distlab_die "--ntasks-per-node=$tasks but $DISTLAB_GPUS_PER_NODE GPU(s) a node: one task a GPU, ask --ntasks-per-node=$DISTLAB_GPUS_PER_NODE"
    fi
}

distlab_detect_launcher() {
    command -v "$DISTLAB_SRUN" >/dev/null 2>&1 || distlab_die "srun not found ($DISTLAB_SRUN): run the job with sbatch on a Slurm cluster"
    DISTLAB_LAUNCHER_DETAIL=srun
}

# distlab_ranks_command NPROCS PPN: srun's words for NPROCS tasks, PPN a node. Each task sees every GPU of its node
# and takes the one of its local rank (SLURM_LOCALID, read by distlab.runtime), unless the site profile binds GPUs.
# Slurm 22.05 to 23.02's srun does not read SLURM_CPUS_PER_TASK (its release notes): without --cpus-per-task
# each task would be bound to one CPU and run its 16 OpenMP threads there, so the step asks for the job's share.
# What sites set that would change the ranks, each overridden here (doc/man/man1/srun.1 of Slurm at 284c3b95):
# - --mpi=none: a site's MpiDefault=pmi2 (or cray_shasta) makes srun set PMI_RANK/PMI_SIZE (or PALS_RANKID without a
#   world size before Slurm 23.02) for the tasks, which distlab.runtime then reads as MPICH's (or PALS's) ranks; the
#   course's tasks use no MPI, so none (srun.1:2107, "--mpi ... Identify the type of MPI to be used").
# - --export=ALL: under a site's SBATCH_EXPORT=NONE (or sbatch --export=NONE) sbatch sets SLURM_EXPORT_ENV=NONE in
#   the job, which srun reads as its --export, and the tasks would lose PATH, the conda environment, the plugin's
#   LD_LIBRARY_PATH, NCCL_*/FI_*, MASTER_* and DISTLAB_DEADLINE: "To avoid steps inheriting environment export
#   settings (e.g. "NONE") from sbatch command, either set --export=ALL or the environment variable SLURM_EXPORT_ENV
#   should be set to "ALL"" (srun.1:1255-1262; sbatch.1:993-996).
# - --cpu-bind (DISTLAB_SRUN_CPU_BIND, the profile's: cores): each task's threads on its own cores; "Used only when
#   the task/affinity plugin is enabled" (srun.1:488-490), so harmless where it is not.
# - --gpu-bind (DISTLAB_SRUN_GPU_BIND, none by default): "closest" may give a task every GPU of its NUMA domain
#   (srun.1:3166-3170), so a site that binds GPUs says so in its profile and the rank map checks the result.
distlab_ranks_command() {
    local nprocs=$1 ppn=$2 nodes=$((($1 + $2 - 1) / $2)) cpus=${3:-${SLURM_CPUS_PER_TASK:-}}
    local -a cmd extra
    cmd=("$DISTLAB_SRUN" --nodes="$nodes" --ntasks="$nprocs" --ntasks-per-node="$ppn" --kill-on-bad-exit=1
        --mpi=none --export=ALL)
    [[ -n "$cpus" ]] && cmd+=(--cpus-per-task="$cpus")
    [[ -z ${DISTLAB_SRUN_CPU_BIND:-} ]] || cmd+=(--cpu-bind="$DISTLAB_SRUN_CPU_BIND")
    [[ -z ${DISTLAB_SRUN_GPU_BIND:-} ]] || cmd+=(--gpu-bind="$DISTLAB_SRUN_GPU_BIND")
    read -ra extra <<<"$DISTLAB_SRUN_ARGS"
    cmd+=("${extra[@]}")
    printf '%s\n' "${cmd[@]}"
}

# distlab_agents_command NODES: one task a node, for a torchrun agent that starts that node's workers: it gets every
# CPU the job has on the node (a task's share times the tasks a node), since its workers share them
distlab_agents_command() {
    local cpus=""
    [[ -n "${SLURM_CPUS_PER_TASK:-}" ]] && cpus=$((SLURM_CPUS_PER_TASK * ${SLURM_NTASKS_PER_NODE:-1}))
    distlab_ranks_command "$1" 1 "$cpus"
}

# ---------------------------------------------------------------------------------------------------
# Walltime: its end, and Slurm's warning before it
# ---------------------------------------------------------------------------------------------------
distlab_deadline() {
    # DISTLAB_DEADLINE (seconds since the epoch) = the job's EndTime less DISTLAB_WALLTIME_MARGIN, as under PBS:
    # the scripts that checkpoint (fault_drill.py) stop themselves before it, write a checkpoint and exit 0.
    # At the limit Slurm sends TERM to the ranks (up to about 30 s late: it checks limits every 30 s), and KILL
    # KillWait later (30 s by default, slurm.conf.5): too short for a large model's step and save, so the warning
    # (distlab_on_walltime_warning) or the deadline is the time to save.
    local end limit wait
    # a TERM (scancel, the limit) leaves the ranks KillWait seconds ("KillWait = 30 sec" in scontrol show config),
    # read first: a job with no time limit can still be cancelled
    if [[ -n ${SLURM_JOB_ID:-} ]]; then
        wait=$("$DISTLAB_SCONTROL" show config 2>/dev/null | sed -n 's/^KillWait *= *\([0-9][0-9]*\) sec.*/\1/p')
        [[ -z $wait ]] || DISTLAB_KILL_DELAY="${wait} s after the TERM (KillWait)"
    fi
    end=$(distlab_job_field EndTime)
    limit=$(distlab_job_field TimeLimit)
    [[ -n $end && $end != Unknown && $limit != UNLIMITED ]] || return 0 # not a Slurm job, or no limit
    end=$(date -d "$end" +%s 2>/dev/null) || distlab_die "cannot read the job's EndTime '$end'"
    # the job's end: a SIGTERM at or after it is the time limit's (distlab_on_sigterm), and the warning says how near
    export DISTLAB_JOB_END=$end
    [[ -z ${DISTLAB_DEADLINE:-} ]] || return 0 # given by hand
    (( end - $(date +%s) > DISTLAB_WALLTIME_MARGIN )) || distlab_die "the time limit ($limit) leaves less than DISTLAB_WALLTIME_MARGIN (${DISTLAB_WALLTIME_MARGIN}s): ask a longer --time or a smaller margin"
    DISTLAB_DEADLINE=$((end - DISTLAB_WALLTIME_MARGIN))
    export DISTLAB_DEADLINE
    distlab_log "deadline: scripts that checkpoint stop by $(date -d "@$DISTLAB_DEADLINE" +%T) (time limit $limit less a margin of ${DISTLAB_WALLTIME_MARGIN}s)"
}

# distlab_on_walltime_warning: the batch shell's USR1 trap (#SBATCH --signal=B:USR1@N: slurmctld checks limits every
# 30 s and sends the warning at the first check within N + 30 s of the end, so about N to N + 30 s before it, later
# when the controller is busy: controller.c restarts its 30 s after taking its lock). It runs at
# once (distlab_launch waits in the background). Nothing more is launched. A launch in progress that checkpoints
# (DISTLAB_CHECKPOINTING) is stopped now, while there is time: `scancel --signal=TERM JOB.STEP` sends TERM to the
# launch's step alone, the first numbered step that was not there before it (distlab_before_launch): not the batch
# step ("By default, signals other than SIGKILL are not sent to the batch step", scancel.1), nor the extern step
# (ssh sessions under pam_slurm_adopt) or a learner's `srun --overlap` shell, which `scancel JOB` would reach (slurmd
# req.c:4404-4407). So the drill's ranks (fault_drill.py's own on_sigterm; distlab.runtime installs no handler)
# write their checkpoint and exit; under torchrun they get the TERM directly (slurmstepd signals every process of
# the step, req.c:1219) and again from their agent. This shell's srun is not signalled. Ranks still starting, before the agent's handlers (installed after the rendezvous) or the drill's
# on_sigterm, die of the TERM's default action (stepd req.c signals every process of the step) without a checkpoint:
# nothing new was trained, and the last checkpoint stands. An agent
# SIGKILLs its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT s after that TERM (below). The limit itself leaves only KillWait
# for a step and a save (30 s by default): slurmd sends TERM to every step, then KILL (DISTLAB_KILL_DELAY, above).
# Two launches get no TERM:
# - one already writing its checkpoint at its own deadline (it wrote DISTLAB_STOPPING_FILE first): it stops by
#   itself, and the TERM would only start the agent's clock on its save;
# - one whose srun has made no step yet (the warning came as it started): scancel would signal no step (it signals
#   the steps there are, and succeeds), and the ranks would run on to the limit. Its srun is stopped instead, before
#   the ranks start (distlab_launch, DISTLAB_STOP_UNSTARTED); the last checkpoint is the one the job started from.
#   That TERM has srun ask the controller to SIGKILL a step it made meanwhile (step_launch.c:728-731): ranks just
#   started die, with nothing new trained.
# A launch that writes no checkpoint goes on: it may still end in time, and a TERM would save nothing.
distlab_on_walltime_warning() {
    DISTLAB_TERMINATED=1
    DISTLAB_TERMINATED_BY=${DISTLAB_TERMINATED_BY:-walltime warning} # a SIGTERM before it keeps its name
    local left="" current=${DISTLAB_CURRENT:-} saving=" ${DISTLAB_CHECKPOINTING:-} "
    saving=${saving//[,:]/ }
    [[ -z ${DISTLAB_JOB_END:-} ]] || left=", $((DISTLAB_JOB_END - $(date +%s))) s before the time limit"
    local said
    said="walltime warning from Slurm (USR1) at $(date +%T)$left: nothing more is launched"
    if [[ -n $current && $saving == *" $current "* && -z ${DISTLAB_STOPPED_BY:-} && -n ${SLURM_JOB_ID:-} ]]; then
        # written by global rank 0, perhaps on another node, into the shared run folder: an NFS client may miss a
        # file just made there for a few seconds, which costs nothing in the normal case (a deadline save ends by
        # DISTLAB_DEADLINE, before the agent's SIGKILL at the warning + the margin); it matters only for a save that
        # overruns its prediction
        if [[ -n ${DISTLAB_STOPPING_FILE:-} && -e $DISTLAB_STOPPING_FILE ]]; then
            distlab_log "$said; $current is already writing its checkpoint at its deadline: no SIGTERM (its agent would SIGKILL the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT s later, saved or not)"
            return 0
        fi
        DISTLAB_STOPPED_BY="walltime warning"
        local steps step signalled=$SLURM_JOB_ID
        # the launch's step: the first numbered step (JOB.0, JOB.1, ...) that was not there before it (a learner's
        # `srun --overlap` shell was); when squeue cannot say, every step of the job (scancel JOB)
        if steps=$(distlab_job_steps); then
            for step in $steps; do
                [[ " ${DISTLAB_STEPS_BEFORE:-} " == *" $step "* ]] || { signalled=$step && break; }
            done
            if [[ $signalled == "$SLURM_JOB_ID" ]]; then
                DISTLAB_STOP_UNSTARTED=1
                distlab_log "$said; $current has no step yet: its srun is stopped before the ranks start (the checkpoint this job started from stays the latest)"
                return 0
            fi
        fi
        distlab_log "$said; $current's ranks get SIGTERM now (scancel --signal=TERM $signalled: the launch's step, not this shell); ranks past their start end their step, write a checkpoint and stop, and a chained successor goes on from it (ranks still starting stop without one: the last checkpoint stands)"
        "$DISTLAB_SCANCEL" --signal=TERM "$signalled" || distlab_log "scancel --signal=TERM $signalled failed: $current goes on to the limit, whose TERM leaves its ranks only KillWait to save"
    else
        distlab_log "$said${current:+ ($current goes on: it writes no checkpoint)}"
    fi
}
trap distlab_on_walltime_warning USR1

# distlab_job_steps: the job's numbered steps (JOB.0, JOB.1, ...), its batch and extern steps left out, in the order
# they were made; fails when squeue cannot say
distlab_job_steps() {
    local steps
    steps=$("$DISTLAB_SQUEUE" -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null) || return 1
    grep '\.[0-9][0-9]*$' <<<"$steps" | sort -t. -k2,2n || true
}

# distlab_before_launch: what distlab_launch runs before its srun: the steps there are now are not the launch's
# (a learner's `srun --overlap` shell, an earlier launch's step still ending), so the warning does not signal them
distlab_before_launch() {
    [[ -n ${SLURM_JOB_ID:-} ]] || return 0
    DISTLAB_STEPS_BEFORE=$(distlab_job_steps | tr '\n' ' ') || DISTLAB_STEPS_BEFORE=""
}

distlab_chain_next() {
    # JOB_FILE NAME=VALUE...: submit the job that continues this one, starting when this one ends however it ends
    # (afterany: a job stopped at its limit did not end "ok"), with this job's own shape: nodes, tasks a node, GPUs
    # a node, time limit, partition, account and the node features asked for (--constraint). Prints its id.
    local -a args=(--parsable --dependency="afterany:$SLURM_JOB_ID" --nodes="$DISTLAB_NNODES")
    local partition account limit qos reservation
    partition=$(distlab_job_field Partition)
    account=$(distlab_job_field Account)
    limit=$(distlab_job_field TimeLimit)
    qos=$(distlab_job_field QOS)
    reservation=$(distlab_job_field Reservation)
    [[ -z $partition ]] || args+=(--partition="$partition")
    [[ -z $account || $account == "(null)" ]] || args+=(--account="$account")
    [[ -z $limit ]] || args+=(--time="$limit")
    # the QOS and the reservation: a workshop's jobs run in its reservation, and a successor outside it would wait
    # in the general queue (scontrol prints "(null)" for none; a QOS given by the site's default is said again)
    [[ -z $qos || $qos == "(null)" ]] || args+=(--qos="$qos")
    [[ -z $reservation || $reservation == "(null)" ]] || args+=(--reservation="$reservation")
    local features
    features=$(distlab_job_field Features)   # what -C asked for: the next job lands on the same kind of node
    [[ -z $features || $features == "(null)" ]] || args+=(--constraint="$features")
    [[ -z ${SLURM_NTASKS_PER_NODE:-} ]] || args+=(--ntasks-per-node="$SLURM_NTASKS_PER_NODE")
    [[ -z ${SLURM_GPUS_ON_NODE:-} ]] || args+=(--gpus-per-node="$SLURM_GPUS_ON_NODE")
    [[ -z ${SLURM_CPUS_PER_TASK:-} ]] || args+=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    # its output beside this job's (NAME.oJOBID, as #SBATCH --output=%x.o%j writes it)
    local stdout
    stdout=$(distlab_job_field StdOut)
    [[ -z $stdout ]] || args+=(--output="${stdout%/*}/%x.o%j")
    # what the first job was given on sbatch's command line beyond that (a --signal, a --qos): say it again here
    local -a extra
    read -ra extra <<<"${DISTLAB_CHAIN_SBATCH_ARGS:-}"
    args+=("${extra[@]}")
    # sbatch --export splits its list at every comma outside quotes: a value's commas become colons (chain-vars)
    local variables
    variables=$(distlab_jobs chain-vars "${@:2}") || return 2
    # --export=ALL hands on this job's environment, less what this job set for itself: the successor makes its own
    # run folder, deadline, NCCL log folder and rendezvous, and NCCL_DEBUG unless the user set it (this job's default
    # WARN, handed on, would read as the user's choice there, and its transport report would get no INFO lines)
    local -a own=(-u DISTLAB_RUN_DIR -u DISTLAB_JOB_RUN_DIR -u DISTLAB_DEADLINE -u DISTLAB_JOB_END -u NCCL_DEBUG_FILE -u MASTER_ADDR
        -u MASTER_PORT -u DISTLAB_NODES -u DISTLAB_NNODES -u DISTLAB_STOPPING_FILE)
    [[ -n ${DISTLAB_NCCL_DEBUG_GIVEN-${NCCL_DEBUG:-}} ]] || own+=(-u NCCL_DEBUG)
    # and the agents' shutdown timeout unless the user set it: the successor derives it from its own margin
    [[ -n ${DISTLAB_SHUTDOWN_TIMEOUT_GIVEN:-} ]] || own+=(-u TORCH_ELASTIC_SHUTDOWN_TIMEOUT)
    # and less this job's SLURM_* and SBATCH_* variables, which sbatch would read as options of the new job (a GPU
    # job's SLURM_MEM_PER_GPU beside the site's SLURM_MEM_PER_NODE: "mutually exclusive"); SLURM_CONF names the cluster
    local variable
    for variable in $(compgen -e SLURM_) $(compgen -e SBATCH_); do
        [[ $variable == SLURM_CONF ]] || own+=(-u "$variable")
    done
    env "${own[@]}" "$DISTLAB_SBATCH" "${args[@]}" --export="ALL,$variables${DISTLAB_CHAIN_EXPORT:+,$DISTLAB_CHAIN_EXPORT}" "$1" |
        cut -d';' -f1
}

if [[ ${DISTLAB_FUNCTIONS_ONLY:-0} == 1 ]]; then
    return 0 # the functions are defined; the tests call them one by one
fi
distlab_setup
