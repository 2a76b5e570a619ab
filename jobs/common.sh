# shellcheck shell=bash
# jobs/common.sh: what the course's jobs share under every scheduler, written once. A scheduler's part
# (pbs/common.sh, slurm/common.sh) sources it, adds only what differs (the job's nodes, how ranks and torchrun
# agents are started, the walltime and its warning, chaining and cancelling jobs), then calls distlab_setup.
# A job sources its scheduler's part, then launches scripts:
#
#     source pbs/common.sh || exit 2          # or: source slurm/common.sh
#     distlab_launch scripts/04_data_parallel/train_ddp.py --preset "$DISTLAB_PRESET" --device "$DISTLAB_DEVICE" \
#         --metrics-out "$DISTLAB_RUN_DIR/train_ddp.json"
#     distlab_finish
#
# Here: the settings both share, modules and conda, the python check, NCCL/libfabric (and gloo) for Slingshot,
# per-rank NCCL logs and the transport report, OpenMP threads per rank, the run folder on scratch (never over an
# earlier run's files), the launch of one script on every GPU (one process a rank, or one torchrun agent a node),
# the SIGTERM trap, the final table. Anything wrong stops the job at once with one line "distlab: error: ...".

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    echo "jobs/common.sh is sourced by pbs/common.sh and slurm/common.sh, not run: see pbs/README.md" >&2
    exit 2
fi

set -uo pipefail # no -e: one failing script must not stop the others; distlab_finish reports it

distlab_log() { printf 'distlab: %s\n' "$*"; }
distlab_die() {
    printf 'distlab: error: %s\n' "$*" >&2
    exit 2
}

# ---------------------------------------------------------------------------------------------------
# Settings (defaults for Derecho-class nodes: 4 x A100 per node, conda). Each is an environment variable with
# a default: qsub -v NAME=value, sbatch --export=ALL,NAME=value, or an export before submitting.
# ---------------------------------------------------------------------------------------------------
DISTLAB_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || distlab_die "cannot find the repository root"
# The site profile first (sites/README.md): its values are defaults for the settings below, and a value already in
# the environment wins over it. The scheduler's part names the default profile: generic-slurm under Slurm, derecho
# under PBS. DISTLAB_SITE is a profile's name (sites/NAME.sh) or a file's path.
distlab_site_file() {
    case $1 in
    */*) echo "$1" ;;
    *) echo "$DISTLAB_ROOT/sites/$1.sh" ;;
    esac
}
DISTLAB_SITE=${DISTLAB_SITE:-${DISTLAB_DEFAULT_SITE:-generic-slurm}}
DISTLAB_SITE_FILE=$(distlab_site_file "$DISTLAB_SITE")
if [[ ! -r $DISTLAB_SITE_FILE ]]; then
    DISTLAB_SITES=$(for f in "$DISTLAB_ROOT"/sites/*.sh; do f=${f##*/}; [[ $f == common.sh ]] || printf '%s ' "${f%.sh}"; done)
    distlab_die "DISTLAB_SITE=$DISTLAB_SITE: no profile $DISTLAB_SITE_FILE (the profiles: ${DISTLAB_SITES% })"
fi
# shellcheck source=sites/generic-slurm.sh
source "$DISTLAB_SITE_FILE" || distlab_die "the site profile $DISTLAB_SITE_FILE failed"
DISTLAB_GPUS_PER_NODE=${DISTLAB_GPUS_PER_NODE:-4}      # ranks per node: one per GPU
DISTLAB_NPROCS=${DISTLAB_NPROCS:-}                     # ranks of one launch (default: every GPU of the job)
DISTLAB_DEVICE=${DISTLAB_DEVICE:-cuda}                 # what the jobs pass to --device
DISTLAB_PRESET=${DISTLAB_PRESET:-a100}                 # what the jobs pass to --preset
DISTLAB_ONLY=${DISTLAB_ONLY:-}                         # run only these scripts (file names; , : or space between)
DISTLAB_DRY_RUN=${DISTLAB_DRY_RUN:-0}                  # 1: print the launch commands, run nothing
DISTLAB_LAUNCH_TIMEOUT=${DISTLAB_LAUNCH_TIMEOUT:-}     # seconds one launch may take (default: the walltime)
DISTLAB_PREFLIGHT=${DISTLAB_PREFLIGHT:-1}              # 1: check that python imports torch and distlab first
# Not the cuda module: PyTorch's wheels and conda packages bring their own CUDA runtime and NCCL, and the module's
# older libraries ahead on LD_LIBRARY_PATH give undefined-symbol errors at import (the rank map names the
# libcudart and libnccl each rank loaded). Load cuda only to build something, such as the aws-ofi-nccl plugin.
DISTLAB_MODULES=${DISTLAB_MODULES-}                    # modules to load ("" for none; the site profile's)
DISTLAB_CONDA_ENV=${DISTLAB_CONDA_ENV-distlab}         # conda environment to activate ("" for none)
DISTLAB_NETWORK=${DISTLAB_NETWORK:-auto}               # slingshot: NCCL/libfabric settings below; none; auto: by hsn*
DISTLAB_NCCL_OFI=${DISTLAB_NCCL_OFI:-auto}             # auto | 1 | 0: force NCCL onto the aws-ofi-nccl plugin
DISTLAB_NCCL_PLUGIN_DIR=${DISTLAB_NCCL_PLUGIN_DIR:-}   # a folder holding libnccl-net*.so (aws-ofi-nccl), searched first
DISTLAB_SCRATCH=${DISTLAB_SCRATCH:-}                   # where run folders go (default: $SCRATCH, else the site's scratch)
DISTLAB_SITE_SCRATCH=${DISTLAB_SITE_SCRATCH:-}         # the site's scratch (the profile's: Derecho's /glade/...)
DISTLAB_GPU_VENDOR=${DISTLAB_GPU_VENDOR:-nvidia}       # nvidia (NCCL) | amd (RCCL): which net plugin is looked for
DISTLAB_RUN_DIR_REUSE=${DISTLAB_RUN_DIR_REUSE:-0}      # 1: allow a DISTLAB_RUN_DIR that already holds files
# numa: each GPU rank moves its threads to its GPU's NUMA node (distlab.runtime.bind_to_gpu, read from sysfs), which
# on nodes wired in another order than the launcher's blocks (Frontier's) is not the cores srun gave it; off: no
export DISTLAB_GPU_AFFINITY=${DISTLAB_GPU_AFFINITY:-numa}
DISTLAB_WALLTIME_MARGIN=${DISTLAB_WALLTIME_MARGIN:-120} # seconds before the walltime by which scripts stop themselves
[[ $DISTLAB_WALLTIME_MARGIN =~ ^[0-9]+$ ]] || distlab_die "DISTLAB_WALLTIME_MARGIN=$DISTLAB_WALLTIME_MARGIN is not a number of seconds"
# torchrun's agent, told to stop (Slurm's walltime warning, a qsig -s TERM or scancel --signal=TERM), SIGKILLs its
# workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT s later, 30 unless set (torch 2.13 distributed/launcher/api.py:145-149,
# elastic/agent/server/api.py:752-754): too short for a long step and a save. Both schedulers' jobs give them what
# they budget for a last step and checkpoint before the end, DISTLAB_WALLTIME_MARGIN, and never less than torch's 30 s:
# a margin cut to use more of the walltime must not cut the agents' grace too (0 is accepted, api.py:150-153, and
# SubprocessContext._close then SIGKILLs at once after the TERM: elastic/multiprocessing/api.py:1023-1053). Slurm's
# warning (180 s) comes earlier than that, so the SIGKILL still comes before the limit. A worker's failure keeps its
# 30 s whatever this says (local_elastic_agent.py:392-393, 517-518). Whether the user gave it is noted: a successor
# makes its own unless the user did (slurm/common.sh and pbs/common.sh, distlab_chain_next).
DISTLAB_SHUTDOWN_TIMEOUT_GIVEN=${DISTLAB_SHUTDOWN_TIMEOUT_GIVEN-${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-}}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$((DISTLAB_WALLTIME_MARGIN > 30 ? DISTLAB_WALLTIME_MARGIN : 30))}
[[ $DISTLAB_GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] || distlab_die "DISTLAB_GPUS_PER_NODE=$DISTLAB_GPUS_PER_NODE is not a positive integer"
[[ -z $DISTLAB_NPROCS || $DISTLAB_NPROCS =~ ^[1-9][0-9]*$ ]] || distlab_die "DISTLAB_NPROCS=$DISTLAB_NPROCS is not a positive integer"

# ---------------------------------------------------------------------------------------------------
# Software: modules, conda, python
# ---------------------------------------------------------------------------------------------------
distlab_load_modules() {
    [[ -n $DISTLAB_MODULES ]] || return 0
    local init modules rc
    if ! type module >/dev/null 2>&1; then
        # A batch shell that is not a login shell may lack the module function: look for Lmod's set-up.
        for init in ${DISTLAB_MODULE_INIT:-${MODULESHOME:+$MODULESHOME/init/bash} /etc/profile.d/z00_lmod.sh /etc/profile.d/lmod.sh /etc/profile.d/modules.sh}; do
            if [[ -r $init ]]; then
                set +u
                # shellcheck disable=SC1090 # the site's own file
                source "$init"
                set -u
                break
            fi
        done
    fi
    if ! type module >/dev/null 2>&1; then
        distlab_log "no 'module' command here: not loading $DISTLAB_MODULES"
        return 0
    fi
    read -ra modules <<<"$DISTLAB_MODULES"
    set +u # module scripts read unset variables
    module load "${modules[@]}"
    rc=$?
    set -u
    ((rc == 0)) || distlab_die "module load $DISTLAB_MODULES failed: set DISTLAB_MODULES to your site's modules ('' for none)"
}

distlab_activate_conda() {
    [[ -n $DISTLAB_CONDA_ENV ]] || return 0
    if [[ ${CONDA_DEFAULT_ENV:-} == "$DISTLAB_CONDA_ENV" ]]; then
        return 0
    fi
    if ! type conda >/dev/null 2>&1; then
        distlab_log "no conda here: not activating '$DISTLAB_CONDA_ENV', using $(command -v python3 || echo 'no python3')"
        return 0
    fi
    local hook rc
    set +u # conda's activation scripts read unset variables
    hook=$(conda shell.bash hook 2>/dev/null) && eval "$hook"
    conda activate "$DISTLAB_CONDA_ENV"
    rc=$?
    set -u
    ((rc == 0)) || distlab_die "conda activate $DISTLAB_CONDA_ENV failed: create it once with 'conda env create -f environment.yml'"
}

distlab_check_python() {
    DISTLAB_PYTHON=${DISTLAB_PYTHON:-python}
    command -v "$DISTLAB_PYTHON" >/dev/null 2>&1 || distlab_die "DISTLAB_PYTHON=$DISTLAB_PYTHON: no such command"
    # Every rank imports distlab from this checkout, whatever is installed in the environment.
    export PYTHONPATH="$DISTLAB_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    [[ $DISTLAB_PREFLIGHT == 1 ]] || return 0
    local report
    # a ROCm build of torch answers torch.cuda too (HIP), with torch.version.hip set and torch.version.cuda None
    report=$("$DISTLAB_PYTHON" -c 'import sys, torch, distlab
cuda = torch.cuda.is_available()
hip = getattr(torch.version, "hip", None)
runtime = f"rocm {hip}" if hip else f"cuda {torch.version.cuda}"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {runtime}, "
      f"{torch.cuda.device_count() if cuda else 0} GPU(s) visible on this node")' 2>&1) ||
        distlab_die "$DISTLAB_PYTHON cannot import torch and distlab: ${report##*$'\n'}"
    distlab_log "$report"
    if [[ $DISTLAB_DEVICE == cuda && $report == *" 0 GPU(s) "* ]]; then
        distlab_die "no GPU is visible but DISTLAB_DEVICE=cuda: ask for GPUs (-l select=...:ngpus=4) or set DISTLAB_DEVICE=cpu"
    fi
}

# distlab_site_report: what the site profile chose, one line each, in every job's first lines (and the preflight's
# preflight.txt): a first job on a new site shows which defaults it ran with.
distlab_site_report() {
    local none="(none)"
    distlab_log "site profile $DISTLAB_SITE ($DISTLAB_SITE_FILE): ${DISTLAB_SITE_DESCRIPTION:-}"
    distlab_log "  modules: ${DISTLAB_MODULES:-$none}; scratch: $(distlab_scratch || echo "none (DISTLAB_SCRATCH, \$SCRATCH${DISTLAB_SITE_SCRATCH:+, $DISTLAB_SITE_SCRATCH})")"
    distlab_log "  partition: ${SLURM_JOB_PARTITION:-${PBS_QUEUE:-${DISTLAB_SITE_PARTITION:-$none}}}; QOS: ${SLURM_JOB_QOS:-${DISTLAB_SITE_QOS:-$none}}; constraint: ${DISTLAB_SITE_CONSTRAINT:-$none}${SLURM_JOB_RESERVATION:+; reservation: $SLURM_JOB_RESERVATION}"
    distlab_log "  network: $DISTLAB_NETWORK; GPUs: $DISTLAB_GPU_VENDOR ($([[ $DISTLAB_GPU_VENDOR == amd ]] && echo RCCL || echo NCCL)), $DISTLAB_GPUS_PER_NODE a node; cores a node: ${DISTLAB_NODE_CORES:-${DISTLAB_SITE_CORES_PER_NODE:-unknown}}"
    local gpu_bind="$none (each rank takes the GPU of its local rank)"
    distlab_log "  binding: cpu ${DISTLAB_SRUN_CPU_BIND:-${DISTLAB_CPU_BIND:-$none}}, gpu ${DISTLAB_SRUN_GPU_BIND:-$gpu_bind}, each GPU rank's threads to its GPU's NUMA node: $DISTLAB_GPU_AFFINITY${CUDA_VISIBLE_DEVICES:+; CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES}${HIP_VISIBLE_DEVICES:+; HIP_VISIBLE_DEVICES=$HIP_VISIBLE_DEVICES}${ROCR_VISIBLE_DEVICES:+; ROCR_VISIBLE_DEVICES=$ROCR_VISIBLE_DEVICES}"
    local variable
    for variable in NCCL_SOCKET_IFNAME NCCL_NET NCCL_NET_PLUGIN FI_PROVIDER NCCL_CROSS_NIC; do
        [[ -z ${!variable:-} ]] || distlab_log "  $variable=${!variable}"
    done
}

# ---------------------------------------------------------------------------------------------------
# Network: NCCL over HPE Slingshot-11 (Derecho and other Cray EX systems). Each setting keeps a value
# already in the environment, so `qsub -v NCCL_DEBUG=INFO` or an export before sourcing wins.
# ---------------------------------------------------------------------------------------------------
distlab_network_env() {
    # what the user asked of NCCL_DEBUG (qsub -v, or an export), before the WARN default below: distlab_nccl_info
    # must tell the user's choice from that default
    DISTLAB_NCCL_DEBUG_GIVEN=${DISTLAB_NCCL_DEBUG_GIVEN-${NCCL_DEBUG:-}}
    # NCCL's own lines, one file a rank (%h host, %p pid) in the run folder on scratch, not interleaved in the job's
    # output and not in node-local /tmp, which is gone with the job: distlab_report_transport reads them.
    if [[ -z ${NCCL_DEBUG_FILE:-} && -n ${DISTLAB_RUN_DIR:-} ]]; then
        mkdir -p "$DISTLAB_RUN_DIR/nccl" && export NCCL_DEBUG_FILE=$DISTLAB_RUN_DIR/nccl/nccl.%h.%p.log
    fi
    if [[ $DISTLAB_NETWORK == auto ]]; then
        # Slingshot NICs show up as hsn0, hsn1, ...; elsewhere NCCL_SOCKET_IFNAME=hsn would leave NCCL no interface.
        if compgen -G "${DISTLAB_SYS_NET:-/sys/class/net}/hsn*" >/dev/null; then # (tests point DISTLAB_SYS_NET elsewhere)
            DISTLAB_NETWORK=slingshot
        else
            DISTLAB_NETWORK=none
            distlab_log "no Slingshot interface (hsn*) on this node: leaving NCCL's network settings alone"
        fi
    fi
    case $DISTLAB_NETWORK in
    slingshot) ;;
    none) return 0 ;;
    *) distlab_die "DISTLAB_NETWORK=$DISTLAB_NETWORK: use auto, slingshot or none" ;;
    esac
    # Bootstrap and socket traffic over the Slingshot interfaces hsn0..hsnN, not the management Ethernet
    # (NCCL reads the value as a prefix of interface names).
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-hsn}
    # The scripts run CPU-side collectives (object collectives, CPU tensors) on gloo ("cuda:nccl,cpu:gloo").
    # Gloo wants one exact interface name; left alone it binds to whatever the host name resolves to, and a
    # two-node run can hang until the process-group timeout. Same network as NCCL: the first hsn interface.
    if [[ -z ${GLOO_SOCKET_IFNAME:-} ]]; then
        local first
        first=$(compgen -G "${DISTLAB_SYS_NET:-/sys/class/net}/hsn*" | sort | head -n 1)
        [[ -z $first ]] || export GLOO_SOCKET_IFNAME=${first##*/}
    fi
    # Let a ring or tree leave a node on a different NIC than it entered (4 NICs per node, not rail-wired).
    export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-1}
    # NCCL_NET_GDR_LEVEL is left to NCCL: NCAR's PyTorch jobs set it (PHB) and later dropped it, and we have
    # not measured it stable on Derecho (pbs/README.md). Set it yourself to try: qsub -v NCCL_NET_GDR_LEVEL=PHB.
    # Warnings only; NCCL_DEBUG=INFO shows the transport chosen (distlab_nccl_transport reads it).
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    # libfabric's Slingshot provider. Without DISABLE_HOST_REGISTER CUDA allocations can deadlock with it;
    # a larger completion queue avoids overruns at scale; userfaultfd is the memory-cache monitor HPE found
    # NCCL not to deadlock with (HPE, "Running NCCL-Based Applications"; pbs/README.md lists the sources).
    export FI_PROVIDER=${FI_PROVIDER:-cxi}
    export FI_CXI_DISABLE_HOST_REGISTER=${FI_CXI_DISABLE_HOST_REGISTER:-1}
    export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
    export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}
    # PyTorch talks through NCCL, not GPU-aware MPI: asking Cray MPICH for GPU support without its GTL
    # library linked aborts at start.
    export MPICH_GPU_SUPPORT_ENABLED=${MPICH_GPU_SUPPORT_ENABLED:-0}
    # NCCL's fast path over Slingshot is the aws-ofi-nccl plugin; neither conda-forge's nor pip's PyTorch
    # ships it. NCCL_NET="AWS Libfabric" makes NCCL fail at start when the plugin is missing instead of
    # silently falling back to TCP sockets, so "auto" sets it only when distlab_find_nccl_plugin finds one.
    if [[ -z ${NCCL_NET:-} ]]; then
        local use_ofi=$DISTLAB_NCCL_OFI plugin
        plugin=$(distlab_find_nccl_plugin)
        if [[ -n $plugin ]]; then
            distlab_log "$(distlab_plugin_name "$plugin"): $plugin"
            # NCCL dlopens libnccl-net.so (or libnccl-net-$NCCL_NET_PLUGIN.so), RCCL librccl-net.so (or
            # librccl-net-$NCCL_NET_PLUGIN.so: RCCL's src/net.cc:398-407), through the library path
            case ":${LD_LIBRARY_PATH:-}:" in *":${plugin%/*}:"*) ;; *) export LD_LIBRARY_PATH=${plugin%/*}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ;; esac
            local base=${plugin##*/}
            if [[ $base == lib?ccl-net-ofi.so* && ! -e ${plugin%/*}/${base%%-ofi.so*}.so ]]; then
                export NCCL_NET_PLUGIN=${NCCL_NET_PLUGIN:-ofi}
            fi
        fi
        if [[ $DISTLAB_GPU_VENDOR == amd && $use_ofi == auto ]]; then
            # RCCL uses the plugin it loaded without being told; NCCL_NET="AWS Libfabric" is NCCL's name for it and is
            # left unset here, as the course has not run RCCL (sites/README.md)
            use_ofi=0
        elif [[ $use_ofi == auto ]]; then
            use_ofi=0
            [[ -z $plugin ]] || use_ofi=1
        fi
        if [[ $use_ofi == 1 ]]; then
            export NCCL_NET="AWS Libfabric"
        elif ((DISTLAB_NNODES > 1)); then
            distlab_log "no aws-ofi-nccl plugin found: NCCL between nodes uses TCP sockets on $NCCL_SOCKET_IFNAME (slow; see pbs/README.md, 'NCCL on Slingshot')"
        fi
    fi
}

# distlab_find_nccl_plugin: the path of an aws-ofi-nccl plugin (libnccl-net*.so), or on AMD nodes
# (DISTLAB_GPU_VENDOR=amd) of aws-ofi-rccl's (librccl-net*.so, the name RCCL opens: RCCL's src/net.cc:407), or
# nothing. Looks in DISTLAB_NCCL_PLUGIN_DIR, then every folder of LD_LIBRARY_PATH, then the conda environment's lib.
distlab_find_nccl_plugin() {
    local -a dirs names=(libnccl-net.so "libnccl-net*.so*")
    local dir found name
    [[ $DISTLAB_GPU_VENDOR != amd ]] || names=(librccl-net.so "librccl-net*.so*" "${names[@]}")
    IFS=: read -ra dirs <<<"${DISTLAB_NCCL_PLUGIN_DIR}:${LD_LIBRARY_PATH:-}:${CONDA_PREFIX:+$CONDA_PREFIX/lib}"
    for dir in "${dirs[@]}"; do
        [[ -n $dir && -d $dir ]] || continue
        # lib?ccl-net.so first: the name NCCL (RCCL) opens without NCCL_NET_PLUGIN
        for name in "${names[@]}"; do
            # shellcheck disable=SC2086 # the name is a pattern
            for found in "$dir"/$name; do
                if [[ -e $found ]]; then
                    echo "$found"
                    return 0
                fi
            done
        done
    done
    return 1
}

# distlab_plugin_name PATH: what the preflight calls the file it found, before any rank runs: RCCL's (aws-ofi-rccl's
# librccl-net.so) or NCCL's. Whether RCCL loaded it, and by what name, is only in RCCL's own INFO lines ("NET/Plugin:
# Loaded net plugin AWS Libfabric (v5)", or "NET/Plugin: No plugin found (librccl-net.so)"), which
# distlab_report_transport reads at the end (coursetools/jobs.py, nccl_details, cites them)
distlab_plugin_name() {
    case ${1##*/} in
    librccl-net*) echo "RCCL net plugin file (aws-ofi-rccl; whether RCCL loaded it: its 'NET/Plugin' line, in the transport report)" ;;
    *) echo "aws-ofi-nccl plugin" ;;
    esac
}

# distlab_jobs SUBCOMMAND ARGS...: the job rules written in Python (coursetools/jobs.py, standard library only), run
# with the job's python once it is known, else python3; the checkout's own copy, whatever is installed. -S: no
# site-packages to set up (the module needs none), a quicker start for the few calls a job makes.
distlab_jobs() {
    PYTHONPATH="$DISTLAB_ROOT${PYTHONPATH:+:$PYTHONPATH}" "${DISTLAB_PYTHON:-python3}" -S -m coursetools.jobs "$@"
}

# distlab_nccl_transport LOG...: the network NCCL chose, from its NCCL_DEBUG=INFO lines. One line:
# "OFI (aws-ofi-nccl, provider cxi)", "Socket (TCP on [0]hsn0:10.1.2.3<0>)", "IB", or "none reported".
distlab_nccl_transport() { distlab_jobs transport "$@"; }

# distlab_nccl_details LOG...: whether the network channels use GPUDirect RDMA, and which net plugin NCCL loaded
# (or why none: both ways NCCL says a plugin is unusable, before and from 2.28.3; coursetools/jobs.py cites them)
distlab_nccl_details() { distlab_jobs details "$@"; }

# distlab_nccl_info COMMAND...: run COMMAND (a distlab_launch) with NCCL's INFO lines of initialisation and network,
# which tell the transport NCCL chose (distlab_report_transport reads them), unless the user set NCCL_DEBUG.
# Not NCCL_DEBUG=${NCCL_DEBUG:-INFO}: on Slingshot distlab_network_env has already exported WARN by then.
distlab_nccl_info() {
    NCCL_DEBUG=${DISTLAB_NCCL_DEBUG_GIVEN:-INFO} NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT,NET} "$@"
}

# distlab_nccl_warnings: NCCL's WARN lines of this job, which go only to the per-rank NCCL_DEBUG_FILE files in the
# run folder (not the job's output): the first five, each with its file, and how many there are in all.
distlab_nccl_warnings() { distlab_jobs warnings "${DISTLAB_RUN_DIR:-}/nccl"; }

# distlab_report_transport LOG...: print the transport; one loud line when it is TCP sockets on Slingshot.
# The lines also go to the run directory's nccl_transport.txt, which distlab_finish adds to the summary.
distlab_report_transport() {
    local transport library=NCCL
    [[ $DISTLAB_GPU_VENDOR != amd ]] || library=RCCL # RCCL keeps NCCL's "NCCL INFO" lines: the same rules read them
    transport=$(distlab_nccl_transport "$@")
    {
        distlab_log "$library transport: $transport"
        if [[ $transport == Socket* && $DISTLAB_NETWORK == slingshot ]]; then
            distlab_log "WARNING: NCCL IS USING TCP SOCKETS ON A SLINGSHOT NODE: traffic between nodes runs at a fraction of the network's speed; put the aws-ofi-nccl plugin on LD_LIBRARY_PATH or set DISTLAB_NCCL_PLUGIN_DIR (pbs/README.md)"
        fi
        local detail
        while IFS= read -r detail; do distlab_log "$library $detail"; done < <(distlab_nccl_details "$@")
    } | if [[ -n ${DISTLAB_RUN_DIR:-} && -d ${DISTLAB_RUN_DIR:-} ]]; then tee -a "$DISTLAB_RUN_DIR/nccl_transport.txt"; else cat; fi
}

# ---------------------------------------------------------------------------------------------------
# Threads, logs, durations, ports, run folder
# ---------------------------------------------------------------------------------------------------
distlab_omp_threads() {
    # Always set, never "only when unset": PBS itself sets OMP_NUM_THREADS to the chunk's ncpus (64 on Derecho)
    # when the select line has no ompthreads= (PBS Professional Reference Guide, "Environment variables"), so
    # 4 ranks a node would each run 64 threads on 64 cores. Each rank gets its share of the node's cores
    # (DISTLAB_NODE_CORES, from the scheduler: PBS's NCPUS, Slurm's SLURM_CPUS_ON_NODE); DISTLAB_OMP_THREADS=n
    # asks for another number.
    local cores=${DISTLAB_NODE_CORES:-$(nproc 2>/dev/null || echo "$DISTLAB_GPUS_PER_NODE")} threads
    threads=${DISTLAB_OMP_THREADS:-$((cores / DISTLAB_GPUS_PER_NODE))}
    [[ $threads =~ ^[0-9]+$ ]] || distlab_die "DISTLAB_OMP_THREADS=$threads is not a positive integer"
    export OMP_NUM_THREADS=$((threads > 0 ? threads : 1))
}

distlab_tee() {
    # tee that outlives a SIGTERM. qdel and the walltime signal the job shell's processes (PBS: on the first node,
    # where this tee runs; Slurm: the batch step's), tee too; a dead tee
    # turns rank 0's next print into BrokenPipeError before its checkpoint is written. An ignored signal stays
    # ignored across exec, so this tee ends only when the ranks close the pipe, and the log keeps their last line.
    (
        trap '' TERM
        exec tee "$@"
    )
}

distlab_seconds() { distlab_jobs seconds "$1"; } # PBS's durations: [[HH:]MM:]SS -> seconds

# distlab_chain_successor JOB_FILE NAME=VALUE...: submit this job's successor in a chain (distlab_chain_next) once a
# job, and set DISTLAB_CHAIN_NEXT to its id. Slurm's requeue and PBS's rerun run the same job again, with the same id
# and environment (DISTLAB_RESTART_COUNT > 0), while the first attempt's successor is still queued: it waits for this
# job id to end, and a requeued job has not ended. A second successor would run beside the first from the same
# checkpoint folder, each would submit its own, and the chain would branch. So the first attempt notes the id in
# its run folder (DISTLAB_JOB_RUN_DIR/chain_next, which every attempt shares), and a restarted attempt that finds
# it submits nothing. A restart before the note was written (between sbatch's answer and the next line) still
# submits a second one.
distlab_chain_successor() {
    local noted=$DISTLAB_JOB_RUN_DIR/chain_next
    DISTLAB_CHAIN_NEXT=
    if ((${DISTLAB_RESTART_COUNT:-0} > 0)) && [[ -s $noted ]]; then
        DISTLAB_CHAIN_NEXT=$(<"$noted")
        distlab_log "next job of the chain: $DISTLAB_CHAIN_NEXT (submitted by this job's first attempt; this is its restart $DISTLAB_RESTART_COUNT): no other is submitted"
        return 0
    fi
    DISTLAB_CHAIN_NEXT=$(distlab_chain_next "$@") || return 2
    printf '%s\n' "$DISTLAB_CHAIN_NEXT" >"$noted" || distlab_log "cannot note the next job's id in $noted: a restart of this job would submit another"
    distlab_log "next job of the chain: $DISTLAB_CHAIN_NEXT (starts when $DISTLAB_JOB_ID ends, however it ends)"
}

distlab_chain_done() {
    # NEXT_JOB METRICS_FILE: the run is complete (its metrics say so: checks passed, not stopped early), so the
    # chain's queued successor is cancelled and no finished run queues more jobs; its note goes too, so that a
    # restart of this job chains afresh
    local next=$1 metrics=$2
    [[ -n $next && -f $metrics ]] || return 0
    if distlab_jobs complete "$metrics"; then
        distlab_cancel_job "$next" && distlab_log "the run is complete: the chain's next job $next is cancelled"
        rm -f "${DISTLAB_JOB_RUN_DIR:-/nonexistent}/chain_next"
    fi
}

distlab_port_from_job_id() {
    # The same job id gives the same port on every node; two jobs sharing a node rarely collide.
    local sum
    sum=$(printf '%s' "$1" | cksum) || return 1
    echo $((20000 + ${sum%% *} % 12000))
}

# distlab_scratch: where this job's run folder goes. DISTLAB_SCRATCH, else $SCRATCH (set by many sites),
# else the site's scratch (DISTLAB_SITE_SCRATCH: Derecho's /glade/derecho/scratch/$USER) when it exists;
# nothing when there is none (then the repository's runs/ folder, which suits a laptop, not $HOME on a
# cluster: Derecho's home has a 50 GB quota and the chapter 05 job's a100 checkpoints alone are larger).
distlab_scratch() {
    local candidate
    for candidate in "$DISTLAB_SCRATCH" "${SCRATCH:-}" "$DISTLAB_SITE_SCRATCH"; do
        if [[ -n $candidate && -d $candidate && -w $candidate ]]; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}

# distlab_make_run_dir: this job's run folder. A job that Slurm requeued (node failure, preemption: the same job id,
# SLURM_RESTART_COUNT set, Slurm's sbatch manual) or that PBS reran (qrerun: the same PBS_JOBID, run_count in
# qstat -f; PBS sets no variable for it, OpenPBS src/resmom/start_exec.c:161-174) is the same run, not another one: its
# folder carries the restart count (<folder>.restart<N>), never over the first attempt's files, and
# DISTLAB_JOB_RUN_DIR names the first attempt's folder, where the job's checkpoints are, so that the job resumes
# from them (12_hpc_operations: the fault drill's default folder).
distlab_make_run_dir() {
    local restarts=${DISTLAB_RESTART_COUNT:-0}
    [[ $restarts =~ ^[0-9]+$ ]] || restarts=0
    if [[ -z ${DISTLAB_RUN_DIR:-} ]]; then
        local scratch
        if scratch=$(distlab_scratch); then
            DISTLAB_RUN_DIR=$scratch/distlab/runs/${DISTLAB_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)-$$}
        elif [[ -n ${DISTLAB_JOB_ID:-} && -n ${HOME:-} && $DISTLAB_ROOT/ == "${HOME%/}"/* ]]; then
            # a batch job with the course in $HOME: its quota (50 GB on Derecho) is no place for checkpoints
            distlab_die "no scratch folder (DISTLAB_SCRATCH, \$SCRATCH, $DISTLAB_SITE_SCRATCH) and the repository is in \$HOME: set DISTLAB_SCRATCH or DISTLAB_RUN_DIR"
        else
            DISTLAB_RUN_DIR=$DISTLAB_ROOT/runs/${DISTLAB_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)-$$}
            distlab_log "no scratch folder (DISTLAB_SCRATCH, \$SCRATCH, $DISTLAB_SITE_SCRATCH): writing under the repository"
        fi
    fi
    DISTLAB_JOB_RUN_DIR=${DISTLAB_JOB_RUN_DIR:-$DISTLAB_RUN_DIR}
    export DISTLAB_JOB_RUN_DIR
    if ((restarts > 0)); then
        DISTLAB_RUN_DIR=$DISTLAB_JOB_RUN_DIR.restart$restarts
        distlab_log "this job was restarted $restarts time(s) (requeued or rerun, the same job id): this attempt writes to its own folder; the job's checkpoints stay in $DISTLAB_JOB_RUN_DIR"
    fi
    # Never write over an earlier run's metrics, logs or checkpoints: a folder that holds files is refused.
    if [[ $DISTLAB_RUN_DIR_REUSE != 1 && -d $DISTLAB_RUN_DIR ]] && [[ -n $(ls -A "$DISTLAB_RUN_DIR" 2>/dev/null) ]]; then
        distlab_die "DISTLAB_RUN_DIR=$DISTLAB_RUN_DIR already holds files: name a new folder (or DISTLAB_RUN_DIR_REUSE=1 to write over them)"
    fi
    mkdir -p "$DISTLAB_RUN_DIR/logs" || distlab_die "cannot create the run directory $DISTLAB_RUN_DIR"
    export DISTLAB_RUN_DIR
    distlab_log "this job writes to $DISTLAB_RUN_DIR: hosts.txt, commands.sh, logs/, summary.txt and each script's metrics (*.json)"
    DISTLAB_HOSTFILE=$DISTLAB_RUN_DIR/hosts.txt # one line per node, for mpiexec -f (Hydra)
    printf '%s\n' "${DISTLAB_NODES// /$'\n'}" >"$DISTLAB_HOSTFILE"
}

# ---------------------------------------------------------------------------------------------------
# The one launch function
# ---------------------------------------------------------------------------------------------------
DISTLAB_RESULTS=()
DISTLAB_LAUNCHES=0

# distlab_launch SCRIPT [ARGS...]: run SCRIPT on DISTLAB_NPROCS ranks (default: every GPU of the job),
# one per GPU, with DISTLAB_LAUNCHER. Returns the script's exit code; distlab_finish sums them up.
distlab_launch() {
    (($# >= 1)) || distlab_die "distlab_launch needs a script"
    local script=$1
    shift
    local -a target=("$script")
    if [[ $script == -m ]]; then # a module of this checkout: distlab_launch -m distlab.runtime ARGS
        (($# >= 1)) || distlab_die "distlab_launch -m needs a module"
        script=$1
        target=(-m "$1")
        shift
    fi
    local name=${script##*/}
    local only=" ${DISTLAB_ONLY//[,:]/ } " # names separated by commas, colons or spaces
    if [[ -n ${DISTLAB_ONLY// /} && $only != *" $name "* ]]; then
        distlab_log "skip $name (DISTLAB_ONLY=$DISTLAB_ONLY)"
        return 0
    fi
    if [[ ${DISTLAB_TERMINATED:-0} == 1 ]]; then
        distlab_not_launched "$name"
        return 143
    fi
    # the deadline has come (DISTLAB_DEADLINE: the job's end less the margin): what is launched now runs into the
    # margin and meets the walltime's TERM and KILL; the job stops here, as a launch that stopped at it does (below)
    if [[ ${DISTLAB_DEADLINE:-} =~ ^[0-9]+ ]] && (($(date +%s) >= ${BASH_REMATCH[0]})); then
        DISTLAB_TERMINATED=1
        DISTLAB_TERMINATED_BY=${DISTLAB_TERMINATED_BY:-deadline}
        distlab_not_launched "$name"
        return 143
    fi
    if [[ ${target[0]} != -m && ! -f $script ]]; then
        distlab_log "FAILED $name: $script does not exist in $DISTLAB_ROOT"
        DISTLAB_RESULTS+=("missing $name")
        [[ $DISTLAB_DRY_RUN == 1 ]] || return 2 # a dry run still shows the command
    fi

    local nprocs=${DISTLAB_NPROCS:-$((DISTLAB_NNODES * DISTLAB_GPUS_PER_NODE))}
    local ppn=$((nprocs < DISTLAB_GPUS_PER_NODE ? nprocs : DISTLAB_GPUS_PER_NODE))
    local nodes=$(((nprocs + ppn - 1) / ppn))
    if ((nprocs % ppn != 0 || nodes > DISTLAB_NNODES)); then
        distlab_die "$nprocs ranks do not fit $DISTLAB_NNODES node(s) x $DISTLAB_GPUS_PER_NODE GPUs (DISTLAB_NPROCS, DISTLAB_GPUS_PER_NODE)"
    fi
    DISTLAB_LAUNCHES=$((DISTLAB_LAUNCHES + 1))

    local -a cmd
    if [[ $DISTLAB_LAUNCHER != torchrun ]]; then
        # One process per GPU (mpiexec, srun); distlab.runtime reads rank and local rank from the launcher's
        # variables (PALS_*, PMI_*, SLURM_*).
        mapfile -t cmd < <(distlab_ranks_command "$nprocs" "$ppn")
        cmd+=("$DISTLAB_PYTHON" -u "${target[@]}" "$@")
    else
        # One torchrun agent per node; the agents meet at MASTER_ADDR:MASTER_PORT (c10d rendezvous) and
        # each starts one worker per GPU. The agent of the first node (rank 0 of this mpiexec or srun) hosts the
        # rendezvous store: is_host, passed through torchrun's PET_RDZV_CONF variable, says so explicitly
        # rather than leaving torch to guess from host names.
        mapfile -t cmd < <(distlab_agents_command "$nodes")
        # shellcheck disable=SC2016 # expanded by the agent's shell on its own node, not here
        cmd+=(bash -c 'agent=${PALS_RANKID:-${PMI_RANK:-${SLURM_PROCID:-}}}; [[ -z $agent ]] || export PET_RDZV_CONF=is_host=$((agent == 0)); exec "$@"' torchrun-agent
            "$DISTLAB_PYTHON" -m torch.distributed.run --nnodes="$nodes" --nproc-per-node="$ppn"
            --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"
            --rdzv-id="${DISTLAB_JOB_ID:-distlab}-$DISTLAB_LAUNCHES" --max-restarts="${DISTLAB_MAX_RESTARTS:-0}"
            "${target[@]}" "$@")
    fi
    if [[ -n $DISTLAB_LAUNCH_TIMEOUT ]]; then
        cmd=(timeout --kill-after=15 "$DISTLAB_LAUNCH_TIMEOUT" "${cmd[@]}")
    fi

    local line log
    line=$(printf '%q ' "${cmd[@]}")
    printf '%s\n' "$line" >>"$DISTLAB_RUN_DIR/commands.sh"
    distlab_log "launch $name: $nprocs rank(s) on $nodes node(s) with $DISTLAB_LAUNCHER"
    echo "+ $line"
    if [[ $DISTLAB_DRY_RUN == 1 ]]; then
        [[ ${target[0]} == -m || -f $script ]] && DISTLAB_RESULTS+=("dry-run $name")
        return 0
    fi
    log=$DISTLAB_RUN_DIR/logs/$(printf '%02d' "$DISTLAB_LAUNCHES")_${name%.py}.log
    # shellcheck disable=SC2034 # read by the job after the launch (chapter 14's broken runs read an error there)
    DISTLAB_LAST_LOG=$log
    local start=$SECONDS rc pid tee_pid out
    # a script that checkpoints writes this file when it begins to stop at its own deadline, before its last
    # checkpoint: Slurm's walltime warning then leaves it to finish (slurm/common.sh, distlab_on_walltime_warning)
    export DISTLAB_STOPPING_FILE=${log%.log}.stopping
    rm -f "$DISTLAB_STOPPING_FILE" # an earlier run's, in a reused run folder (DISTLAB_RUN_DIR_REUSE): not this launch's
    DISTLAB_STOP_UNSTARTED=0
    DISTLAB_CURRENT=$name
    if [[ ${DISTLAB_TERMINATED:-0} == 1 ]]; then # told to stop while this launch was being prepared
        DISTLAB_CURRENT=
        distlab_not_launched "$name"
        return 143
    fi
    # In the background, waited for: bash runs a trap at once when the signal interrupts `wait`, but only after a
    # foreground command completes (bash manual, "Signals"). At the time limit Slurm SIGKILLs the job KillWait
    # seconds after its SIGTERM (slurmd's _rpc_terminate_job), which can be before the ranks have ended: the traps
    # must report while the launch still runs. `wait` returns above 128 for each trapped signal; once the launch
    # has ended, `wait` gives its own exit code.
    ! declare -F distlab_before_launch >/dev/null || distlab_before_launch # the scheduler's part notes what it needs
    exec {out}> >(distlab_tee "$log")
    tee_pid=$!
    "${cmd[@]}" </dev/null >&"$out" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        # the walltime warning found this launch before its ranks started (DISTLAB_STOP_UNSTARTED): it stops here
        if [[ $DISTLAB_STOP_UNSTARTED == 1 ]]; then
            DISTLAB_STOP_UNSTARTED=0
            kill -TERM "$pid" 2>/dev/null
        fi
        wait "$pid"
    done
    wait "$pid"
    rc=$?
    exec {out}>&-
    while kill -0 "$tee_pid" 2>/dev/null; do wait "$tee_pid"; done # a trapped signal returns from wait early
    wait "$tee_pid" # the log and the job's output hold the launch's last line before the result line
    local seconds=$((SECONDS - start))
    DISTLAB_CURRENT=
    # the launch stopped itself at the deadline (a checkpointing script wrote its stop file first): the job launches
    # nothing more, as after the walltime warning; under PBS, which sends no warning, nothing else would stop it
    # before the walltime's TERM
    if [[ -e $DISTLAB_STOPPING_FILE ]]; then
        DISTLAB_TERMINATED=1
        DISTLAB_TERMINATED_BY=${DISTLAB_TERMINATED_BY:-deadline}
    fi
    if ((rc == 0)); then
        distlab_log "ok $name in ${seconds}s"
        DISTLAB_RESULTS+=("ok $name ${seconds}s")
    elif [[ -n ${DISTLAB_STOPPED_BY:-} ]]; then # its ranks got SIGTERM (distlab_on_sigterm)
        local planned=""
        # torch re-raises the TERM in its agent, which exits 1, and srun reports each such task as an error; at the
        # time limit every step gets TERM twice (Slurm's slurmd: _rpc_timelimit, then _rpc_terminate_job), so each
        # agent prints two SignalException tracebacks, and still waits for its workers (torch's agent run(): the
        # second TERM interrupts its shutdown, and its finally clause shuts the workers down again)
        if [[ $DISTLAB_LAUNCHER == torchrun && $DISTLAB_STOPPED_BY == "walltime warning" ]]; then
            planned="; a planned stop: torchrun's agents exit 1 after a TERM, and srun's 'Exited with exit code 1' lines say only that"
        elif [[ $DISTLAB_LAUNCHER == torchrun && $DISTLAB_STOPPED_BY == "$DISTLAB_LIMIT_NAME" ]]; then
            planned="; torchrun's agents exit 1 after a TERM (their tracebacks end 'SignalException: ... got signal: 15'), and the exit-code lines say only that"
        fi
        distlab_log "stopped $name: exit code $rc after ${seconds}s, by $(distlab_stop_reason)$planned (log: $log)"
        DISTLAB_RESULTS+=("stopped($rc) $name ${seconds}s ($DISTLAB_STOPPED_BY)")
    else
        distlab_log "FAILED $name: exit code $rc after ${seconds}s (log: $log)"
        DISTLAB_RESULTS+=("FAILED($rc) $name ${seconds}s")
    fi
    return "$rc"
}

# distlab_not_launched NAME: a launch the job was told not to start, and why: the first reason it was told to stop,
# SIGTERM (scancel, qdel), the time limit's SIGTERM, the walltime warning (Slurm's USR1) or the deadline (a launch
# stopped at it, or it has passed); the last two are the job stopping in time, no failure
distlab_not_launched() {
    local why=${DISTLAB_TERMINATED_BY:-SIGTERM} line
    case $why in
    "walltime warning") line="Slurm's walltime warning (USR1) came" ;;
    deadline) line="the job stopped for its deadline (DISTLAB_DEADLINE, the end less DISTLAB_WALLTIME_MARGIN)" ;;
    "$DISTLAB_LIMIT_NAME") line="the job reached its $DISTLAB_LIMIT_NAME (SIGTERM)" ;;
    *) line="the job got SIGTERM" ;;
    esac
    distlab_log "not launched $1: $line"
    DISTLAB_RESULTS+=("not-launched $1 ($why)")
}

# distlab_on_sigterm: the job shell's SIGTERM trap (qdel, scancel, the time limit). It runs at once (distlab_launch
# waits in the background). The ranks stop at the end of their step if they got the signal too: under Slurm from
# slurmd, every step on every node; under PBS the MoM signals only the first node's job processes (its tasks'
# sessions, the job shell's: OpenPBS src/resmom/mom_main.c:5353-5360, linux/mom_mach.c:1314-1372), so a rank, on the
# first node or another, gets it only if it runs in that session or mpiexec passes it on (not checked for PALS or
# Hydra), and a drill's one rank that got it stops them all. Only
# a script the job names in DISTLAB_CHECKPOINTING (names; , : or space between) writes a checkpoint on the way out,
# and only then does the line say so; no later launch starts: the job is being ended. After a scancel, a qdel or
# the limit the scheduler kills what is left of the job, as DISTLAB_KILL_DELAY says (Slurm's KillWait; PBS's
# kill_delay and the MoM's poll), and nothing after a qsig -s TERM or a scancel --signal=TERM: the checkpoint is
# there only if a step and a save fit before. The summary is written now, as it stands, perhaps before the launch
# in progress has ended.
distlab_on_sigterm() {
    DISTLAB_TERMINATED=1
    local why=SIGTERM
    # the time limit's SIGTERM: at or after the job's end, where the scheduler's part knows it (DISTLAB_JOB_END), by
    # this node's clock, which may run a few seconds behind the controller's that decides the limit: 5 s of slack.
    # Named as the scheduler names it (DISTLAB_LIMIT_NAME): Slurm's "time limit", PBS's "walltime".
    if [[ -n ${DISTLAB_JOB_END:-} ]] && (($(date +%s) >= DISTLAB_JOB_END - 5)); then
        why=$DISTLAB_LIMIT_NAME
    fi
    DISTLAB_STOPPED_BY=$why
    DISTLAB_TERMINATED_BY=${DISTLAB_TERMINATED_BY:-$why} # the first reason names what is not launched after it
    local current=${DISTLAB_CURRENT:-} saving=" ${DISTLAB_CHECKPOINTING:-} " signal="SIGTERM"
    [[ $why == SIGTERM ]] || signal="SIGTERM at the $DISTLAB_LIMIT_NAME"
    saving=${saving//[,:]/ }
    # when the scheduler's KILL follows, as its part read it at the job's start: Slurm's KillWait (slurm/common.sh),
    # PBS's kill_delay and the MoM's poll (pbs/common.sh, distlab_kill_delay)
    local kill=${DISTLAB_KILL_DELAY:-"when the scheduler sends it"}
    if [[ -n $current && $saving == *" $current "* ]]; then
        distlab_log "$signal: $current's ranks stop at the end of their step and write a checkpoint if they finish before the KILL, $kill; nothing more is launched"
    else
        distlab_log "$signal: the ranks stop${current:+ ($current)}; no checkpoint is written; nothing more is launched"
    fi
    if [[ -n ${DISTLAB_RUN_DIR:-} && -d ${DISTLAB_RUN_DIR:-} ]]; then
        distlab_write_summary >"$DISTLAB_RUN_DIR/summary.txt"
        distlab_log "the summary so far: $DISTLAB_RUN_DIR/summary.txt"
    fi
}

# distlab_stop_reason: the SIGTERM that stopped the launch in progress, in words
distlab_stop_reason() {
    case ${DISTLAB_STOPPED_BY:-} in
    "$DISTLAB_LIMIT_NAME") echo "SIGTERM at the $DISTLAB_LIMIT_NAME" ;;
    "walltime warning") echo "the SIGTERM sent at the walltime warning" ;;
    *) echo "SIGTERM" ;;
    esac
}

# distlab_rank_map [ARGS...]: every rank of the job prints its host, rank, local rank, CUDA_VISIBLE_DEVICES
# and the GPU it uses (python -m distlab.runtime), started exactly as the chapter scripts are; it fails when
# two ranks of a node share a GPU or the local ranks are wrong, before a chapter runs.
distlab_rank_map() {
    distlab_launch -m distlab.runtime --device "$DISTLAB_DEVICE" --metrics-out "$DISTLAB_RUN_DIR/rank_map.json" "$@"
}

# distlab_write_summary: what ran, one line a launch, and the launch in progress if the job is being stopped
distlab_write_summary() {
    echo "job ${DISTLAB_JOB_ID:-local} on $DISTLAB_NNODES node(s): $DISTLAB_NODES"
    if ((${#DISTLAB_RESULTS[@]} == 0)) && [[ -z ${DISTLAB_CURRENT:-} ]]; then echo "  (nothing launched)"; fi
    ((${#DISTLAB_RESULTS[@]} == 0)) || printf '  %s\n' "${DISTLAB_RESULTS[@]}"
    [[ -z ${DISTLAB_CURRENT:-} ]] || echo "  stopping $DISTLAB_CURRENT (${DISTLAB_STOPPED_BY:-SIGTERM}): its ranks got SIGTERM; its log has their last lines"
    if [[ -f $DISTLAB_RUN_DIR/nccl_transport.txt ]]; then sed 's/^distlab: /  /' "$DISTLAB_RUN_DIR/nccl_transport.txt"; fi
    distlab_nccl_warnings | sed 's/^/  /'
}

# distlab_finish: print what ran, write it to the run directory, exit 1 if any launch failed.
distlab_finish() {
    local result failed=0
    distlab_write_summary | tee "$DISTLAB_RUN_DIR/summary.txt"
    for result in "${DISTLAB_RESULTS[@]}"; do
        # a launch held back by the walltime warning or the deadline is the job stopping in time, not a failure
        [[ $result == ok* || $result == dry-run* || $result == *"(walltime warning)" || $result == *"(deadline)" ]] ||
            failed=1
    done
    distlab_log "metrics and logs in $DISTLAB_RUN_DIR"
    exit "$failed"
}

# ---------------------------------------------------------------------------------------------------
# Set up the job now
# ---------------------------------------------------------------------------------------------------
# distlab_setup: what sourcing a scheduler's common.sh does, in this order. The scheduler's part defines
# distlab_discover_nodes, distlab_detect_launcher, distlab_deadline, distlab_ranks_command, distlab_agents_command,
# distlab_chain_next, distlab_cancel_job, and sets DISTLAB_SCHEDULER, DISTLAB_JOB_ID, DISTLAB_NODE_CORES and
# DISTLAB_LIMIT_NAME (the job's time limit in its scheduler's words).
distlab_setup() {
    cd "$DISTLAB_ROOT" || distlab_die "cannot cd to $DISTLAB_ROOT"
    distlab_discover_nodes
    distlab_make_run_dir
    distlab_load_modules
    distlab_activate_conda
    distlab_check_python
    distlab_network_env
    distlab_detect_launcher
    distlab_omp_threads
    distlab_deadline
    trap distlab_on_sigterm TERM
    distlab_site_report
    distlab_log "job ${DISTLAB_JOB_ID:-local} ($DISTLAB_SCHEDULER): $DISTLAB_NNODES node(s) [$DISTLAB_NODES] x $DISTLAB_GPUS_PER_NODE GPU(s); launcher $DISTLAB_LAUNCHER${DISTLAB_LAUNCHER_DETAIL:+ ($DISTLAB_LAUNCHER_DETAIL)}; MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"
    distlab_log "run directory $DISTLAB_RUN_DIR"
}
