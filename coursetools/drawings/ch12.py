"""Chapter 12's pictures of its mechanisms: a job from the scheduler to each rank's process group. Drawn from a model
of the launch (the environment each launcher gives its processes, read by ``distlab.runtime.launcher_env``, the
function every script calls), never from a measured run."""

from __future__ import annotations

# coursetools.figures is imported inside the functions: it gathers this module when it is itself imported

NODES = ("n1", "n2")
GPUS_PER_NODE = 4
JOB_ID = "1234"


def job_port(job_id: str = JOB_ID) -> int:
    """The MASTER_PORT the course's job libraries export (pbs/common.sh and slurm/common.sh), computed by running
    ``distlab_port_from_job_id`` of jobs/common.sh itself: 20000 plus the ``cksum`` of the job id modulo 12000."""
    import re
    import subprocess
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "jobs" / "common.sh").read_text()
    function = re.search(r"^distlab_port_from_job_id\(\) \{\n.*?^\}\n", source, flags=re.M | re.S).group(0)
    done = subprocess.run(["bash", "-c", f'{function}\ndistlab_port_from_job_id "$1"', "bash", job_id],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def bare_srun_port(job_id: str = JOB_ID) -> int:
    """The port the runtime derives when no MASTER_PORT is exported, as under a bare srun of one's own."""
    from distlab import runtime

    return runtime.launcher_env(srun_env(0, exported=False)).master_port


def srun_env(rank: int, exported: bool = True) -> dict:
    """What ``srun -n 8 --ntasks-per-node=4`` gives task ``rank`` of job ``JOB_ID`` on nodes n1 and n2; in a course
    job (``exported``) with the MASTER_ADDR and MASTER_PORT that slurm/common.sh exports."""
    exports = {"MASTER_ADDR": NODES[0], "MASTER_PORT": str(job_port())} if exported else {}
    return exports | {"SLURM_JOB_ID": JOB_ID, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % GPUS_PER_NODE),
            "SLURM_NODEID": str(rank // GPUS_PER_NODE), "SLURM_NTASKS": str(len(NODES) * GPUS_PER_NODE),
            "SLURM_STEP_NUM_TASKS": str(len(NODES) * GPUS_PER_NODE),
            "SLURM_STEP_TASKS_PER_NODE": f"{GPUS_PER_NODE}(x{len(NODES)})", "SLURM_STEP_NODELIST": "n[1-2]"}


def mpiexec_env(rank: int) -> tuple[dict, str]:
    """What ``mpiexec -n 8 --ppn 4`` (Cray PALS) under PBS gives process ``rank`` of a course job (with what
    pbs/common.sh exports: the node file's first host, the job's port), and the job's node file."""
    env = {"MASTER_ADDR": NODES[0], "MASTER_PORT": str(job_port()), "PBS_JOBID": JOB_ID, "PBS_NODEFILE": "nodefile", "PALS_RANKID": str(rank), "PMI_RANK": str(rank),
           "PMI_SIZE": str(len(NODES) * GPUS_PER_NODE), "PALS_LOCAL_RANKID": str(rank % GPUS_PER_NODE),
           "PALS_LOCAL_SIZE": str(GPUS_PER_NODE)}
    return env, "".join(f"{node}\n" * GPUS_PER_NODE for node in NODES)   # one line per rank


def launch_model() -> list:
    """Each rank's ``LauncherEnv`` in a course job, as the runtime reads it under srun; mpiexec under PBS gives the
    same ranks, local ranks, rank 0's host and port (checked here, so the picture holds for both schedulers)."""
    from distlab import runtime

    found = []
    for rank in range(len(NODES) * GPUS_PER_NODE):
        slurm = runtime.launcher_env(srun_env(rank))
        env, nodefile = mpiexec_env(rank)
        pbs = runtime.launcher_env(env, read_file=lambda path: nodefile)
        assert (slurm.rank, slurm.local_rank, slurm.world_size, slurm.master_addr, slurm.master_port) == (
            pbs.rank, pbs.local_rank, pbs.world_size, pbs.master_addr, pbs.master_port)
        found.append(slurm)
    return found


def draw_launch_and_rendezvous(fig) -> None:
    """Five stages, top to bottom: the scheduler allocates two nodes; the job script runs on the first; the launcher
    starts one process a GPU on each node (srun or mpiexec; torchrun: one agent a node); every rank connects to rank
    0's store at the address it derived; the store hands out the backend's addresses and the process group forms."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    from coursetools.figures import RANK_COLOURS

    ranks = launch_model()
    addr, port = ranks[0].master_addr, ranks[0].master_port
    ax = fig.subplots()
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 7.4)
    ax.axis("off")

    def box(x, y, w, h, text, face="#f4f4f4", edge="#777777", size=7, weight="normal"):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.04", facecolor=face, edgecolor=edge))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, fontweight=weight)

    def arrow(start, end, colour="#555555", style="-|>", lw=1.0):
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=9, color=colour, lw=lw))

    def stage(y, number, text):
        ax.text(0.05, y, f"{number}", fontsize=9, fontweight="bold", va="center", color="#c0392b")
        ax.text(0.3, y, text, fontsize=6.8, va="center", color="#333333")

    # 1. the scheduler
    box(4.0, 6.55, 4.0, 0.7, f"scheduler (Slurm or PBS): job {JOB_ID} gets nodes {NODES[0]} and {NODES[1]},\n"
        f"{GPUS_PER_NODE} GPUs each (SLURM_JOB_NODELIST=n[1-2]; PBS_NODEFILE)", face="#fdf2d0", edge="#b58900")
    stage(6.9, 1, "allocate")
    # 2. the job script, on the first node
    box(4.0, 5.45, 4.0, 0.7, f"the job script (sbatch / qsub) runs on {NODES[0]}:\n"
        "sets modules, threads, the run folder; then starts the launcher", face="#eef3e2", edge="#6b8e23")
    stage(5.8, 2, "run the script")
    arrow((6.0, 6.55), (6.0, 6.15))
    # 3. the launcher, on every node: one process a GPU
    stage(4.55, 3, "launch:")
    stage(4.25, "", "one process\n  a GPU")
    node_x = {NODES[0]: 1.55, NODES[1]: 6.75}
    rank_xy = {}
    for node, x0 in node_x.items():
        ax.add_patch(FancyBboxPatch((x0, 3.15), 4.6, 1.85, boxstyle="round,pad=0.05", facecolor="#fafafa",
                                    edgecolor="#777777"))
        ax.text(x0 + 0.08, 4.93, f"node {node}: srun or mpiexec starts {GPUS_PER_NODE} ranks\n"
                "(torchrun: one agent a node starts them)", fontsize=6, va="top", color="#555555")
        arrow((6.0, 5.45), (x0 + 2.3, 5.02))
    for where in ranks:
        node = NODES[where.rank // where.local_world_size]
        x = node_x[node] + 0.15 + where.local_rank * 1.12
        colour = RANK_COLOURS[where.local_rank % len(RANK_COLOURS)]
        box(x, 3.3, 1.0, 1.05, f"rank {where.rank}\nlocal rank {where.local_rank}\n-> GPU {where.local_rank}",
            face="white", edge=colour, size=6.5)
        rank_xy[where.rank] = (x + 0.5, 3.3)
    five = ranks[5]
    ax.text(8.95, 2.05, f"each rank reads its launcher's variables:\nrank = node x {GPUS_PER_NODE} + local rank\n"
            f"(rank {five.rank} = {five.rank // GPUS_PER_NODE} x {GPUS_PER_NODE} + {five.local_rank})",
            va="center", fontsize=6.3, color="#333333")
    # 4. the rendezvous at rank 0's address
    stage(2.05, 4, "rendezvous")
    # tall enough for its three lines; the ranks' arrows end at its top edge (its y + height + the box's pad), not on
    # its first line
    store_y, store_h, pad = 1.6, 0.8, 0.04
    box(3.3, store_y, 5.4, store_h, f"rank 0's TCP store at {addr}:{port}\n(the job exports both: first node, cksum "
        f"of the job id;\na bare srun derives port {bare_srun_port()} instead)", face="#e6eef8", edge="#1f77b4",
        size=6.3)
    for rank, (x, y) in rank_xy.items():
        arrow((x, y), (6.0 + (x - 6.0) * 0.25, store_y + store_h + pad), colour="#1f77b4", lw=0.6)
    # 5. the process group
    stage(0.75, 5, "process group")
    box(3.2, 0.35, 5.6, 0.8, f"the store hands out NCCL's unique id (gloo: each rank's address); then\n"
        f"init_process_group returns on all {len(ranks)} ranks: one process group, a world of {len(ranks)}",
        face="#f2e6f7", edge="#8172b3")
    arrow((6.0, store_y - pad), (6.0, 1.17))


# ---- 12.2: what the watchdog does with a collective that never completes ----------------------------------------

def draw_watchdog(fig) -> None:
    """One NCCL rank whose all-reduce never completes, with and without blocking wait. By default the Python
    thread goes on at once (the call only queued the kernel), the kernel spins on the GPU, the watchdog thread
    checks the queued work, and at the process group's timeout (the course's default) it tears the process down.
    Under blocking wait ``all_reduce()`` itself waits (``dist.all_reduce`` calls ``work.wait()``, and the wait polls
    until the work completes or times out, checking the timeout in the rank's own thread), then raises. torch 2.12
    and later start no watchdog under blocking wait ("TORCH_NCCL_BLOCKING_WAIT is enabled, NO watchdog thread is
    created.", ProcessGroupNCCL.cpp), so its lane is empty there."""
    from matplotlib.patches import Rectangle

    from distlab import runtime

    timeout = runtime.DEFAULT_PG_TIMEOUT_S
    axes = fig.subplots(2, 1, sharex=True)
    lanes = ["Python thread", "GPU stream", "watchdog thread"]
    end = timeout * 1.25
    for ax, blocking in zip(axes, (False, True)):
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
        ax.invert_yaxis()
        if blocking:
            ax.add_patch(Rectangle((0, -0.3), timeout, 0.6, facecolor="#f4c7c3", edgecolor="#c0392b", hatch="//"))
            ax.text(4, 0, "all_reduce() waits in work.wait(), polling the work and its timeout; it raises at the timeout",
                    fontsize=6.5, va="center")
        else:
            ax.add_patch(Rectangle((0, -0.3), end * 0.008, 0.6, color="#1f77b4"))
            ax.text(end * 0.012, 0, "all_reduce() queues the kernel and returns", fontsize=6.5, va="center")
            wait_from = timeout * 0.45
            ax.add_patch(Rectangle((wait_from, -0.3), timeout - wait_from, 0.6, facecolor="#f4c7c3",
                                   edgecolor="#c0392b", hatch="//"))
            ax.text(wait_from + 4, 0, "waits for the result (.item(), a sync, the next step)", fontsize=6.5,
                    va="center")
        ax.add_patch(Rectangle((0, 0.7), timeout, 0.6, facecolor="#f4c7c3", edgecolor="#c0392b", hatch="//"))
        ax.text(4, 1, "the NCCL kernel spins, waiting for a peer that never calls", fontsize=6.5, va="center")
        if blocking:
            ax.text(4, 2, "none: blocking wait starts no watchdog (no tear-down, no dump on a timeout)",
                    fontsize=6.5, va="center", color="#555555")
        else:
            checks = [t for t in range(0, int(timeout) + 1, int(timeout) // 10)]
            ax.plot(checks, [2] * len(checks), "|", color="#555555", markersize=8)
            ax.text(checks[1], 1.65, "checks the queued work (many times a second; ticks not to scale)", fontsize=6.5,
                    va="center", color="#555555")
        ax.axvline(timeout, color="#c0392b", lw=1.2)
        if blocking:
            ax.text(timeout + 3, 0, "all_reduce() raises:\nthe rank's except runs", fontsize=6.5, va="center",
                    color="#c0392b")
            ax.set_title("TORCH_NCCL_BLOCKING_WAIT=1: the call itself waits, and raises at the timeout", fontsize=8)
        else:
            ax.text(timeout + 3, 2, "logs the timeout, dumps\nthe flight recorder (on by default),\ntears the process down",
                    fontsize=6.5, va="center", color="#c0392b")
            ax.set_title("the default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3): the watchdog ends the process", fontsize=8)
        ax.set_xlim(0, end)
        ax.tick_params(axis="x", labelsize=7)
    axes[1].set_xlabel(f"seconds since the call (process-group timeout: {timeout:g} s, the course's default)",
                       fontsize=7)
    fig.tight_layout()


# ---- 12.3: the walltime, the deadline, the checkpoint -----------------------------------------------------------

def stop_step(step_s: float, save_s: float, start_s: float, deadline_s: float) -> float:
    """When the drill stops: after each step it stops if the next step and a checkpoint would pass the deadline
    (fault_drill.py: ``time + longest step + max(longest save, longest step) > deadline``). Returns the time of
    the last step's end."""
    now = start_s
    while now + step_s + max(save_s, step_s) <= deadline_s:
        now += step_s
    return now


def _job_constants() -> tuple[int, int, int]:
    """The margin of jobs/common.sh, the Slurm job's warning and PBS's default kill_delay."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    margin = int(re.search(r"DISTLAB_WALLTIME_MARGIN=\$\{DISTLAB_WALLTIME_MARGIN:-(\d+)\}",
                           (root / "jobs" / "common.sh").read_text()).group(1))
    warning = int(re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", (root / "slurm" / "12_hpc_operations.sbatch").read_text(),
                            flags=re.M).group(1))
    return margin, warning, 10     # kill_delay: 10 s unless the queue sets another (OpenPBS req_runjob.c)


# Slurm's KillWait unless slurm.conf sets another: DEFAULT_KILL_WAIT, 30 s (src/common/read_config.h)
SLURM_KILL_WAIT = 30


def draw_walltime(fig) -> None:
    """The last ten minutes of a job that stops itself: steps of 40 s, a 60 s checkpoint, the deadline (the end less
    the margin), Slurm's warning to the batch shell, the end (PBS's SIGTERM, Slurm's TERM) and PBS's SIGKILL; the
    next job, chained with afterany, resumes from the checkpoint."""
    from matplotlib.patches import Rectangle

    margin, warning, kill_delay = _job_constants()
    step, save, start = 40, 60, -600
    deadline = -margin
    stopped = stop_step(step, save, start, deadline)
    ax = fig.subplots()
    t = start
    while t < stopped:
        ax.add_patch(Rectangle((t + 1.5, 1.25), step - 3, 0.5, color="#1f77b4"))
        t += step
    ax.add_patch(Rectangle((stopped + 1.5, 1.25), save - 3, 0.5, color="#ff7f0e"))
    ax.text(stopped + save / 2, 1.5, "save", ha="center", va="center", fontsize=6.5, color="white")
    ax.text(start + 5, 2.0, f"steps of {step} s (blue); after each, stop if one more step and a {save} s checkpoint "
            "(orange) would pass the deadline; then exit 0", fontsize=6.3, va="center")
    ax.add_patch(Rectangle((25, 2.3), 200, 0.45, color="#2ca02c", alpha=0.85))
    ax.text(30, 2.52, "next job (afterany): resumes", fontsize=6.3, va="center", color="white")
    marks = [(-warning, f"Slurm: USR1 to the batch shell, {warning} s ahead\n(the job launches nothing more) ",
              "#8172b3", 0.3, "right"),
             (deadline, f" DISTLAB_DEADLINE:\n the end less {margin} s", "#c0392b", 0.3, "left"),
             (0, "the walltime's end:\nPBS SIGTERM (next\nMoM poll), Slurm TERM ", "black", 0.9, "right")]
    for x, label, colour, y, side in marks:
        ax.axvline(x, color=colour, lw=1.1, ls="-" if x == 0 else "--")
        ax.text(x, y, label, fontsize=6.3, va="top" if y < 1 else "center", ha=side, color=colour)
    # the two KILLs after the end, labelled to the right of both lines (a label drawn across a line misreads)
    kills = [(kill_delay, f"PBS SIGKILL, {kill_delay} s or more later (next MoM poll)", "#555555", 0.3),
             (SLURM_KILL_WAIT, f"Slurm KILL, KillWait ({SLURM_KILL_WAIT} s by default) after its TERM", "#8172b3", 0.75)]
    for x, label, colour, y in kills:
        ax.axvline(x, color=colour, lw=1.1, ls=":")
        ax.annotate(label, xy=(x, y), xytext=(SLURM_KILL_WAIT + 8, y), fontsize=6.3, va="center", color=colour,
                    arrowprops={"arrowstyle": "->", "color": colour, "lw": 0.8})
    ax.set_yticks([1.5, 2.52], ["this job", "the next job"], fontsize=7)
    ax.set_ylim(2.9, 0.2)
    ax.set_xlim(start, 300)
    ax.set_xlabel("seconds from the walltime's end", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"a job that stops itself: its last step ends at {stopped} s, its checkpoint at {stopped + save} s, "
                 f"before the deadline ({deadline} s)", fontsize=8)


# ---- 12.4: one DDP step on one rank, and the four kinds of time ------------------------------------------------

# A model of one rank's DDP step, in ms: data loading (idle), forward, backward, three buckets whose gradients are
# ready 20, 40 and 60 ms into backward, each all-reduce 18 ms on gloo's worker thread (one after the other), then
# the optimizer step once the last all-reduce is done.
STEP_MODEL = {"data": 5, "forward": 30, "backward": 60, "buckets_ready": (20, 40, 60), "all_reduce": 18,
              "optimizer": 8}


def step_trace(model: dict = STEP_MODEL) -> dict:
    """The model as a Chrome trace of the kind torch.profiler writes on a CPU (main thread's ``aten::`` events, a
    ``backward`` span, ``gloo:all_reduce`` on a worker thread, a ``ProfilerStep#`` span), so that the course's own
    ``distlab.profiling`` splits it into the four kinds, as ``profile_step.py`` does a real trace."""
    ms = 1000.0   # the trace counts microseconds
    events = []

    def event(name, start, end, tid, cat="cpu_op"):
        events.append({"ph": "X", "name": name, "ts": start * ms, "dur": (end - start) * ms, "tid": tid, "cat": cat})

    forward_start = model["data"]
    backward_start = forward_start + model["forward"]
    backward_end = backward_start + model["backward"]
    event("aten::forward_ops", forward_start, backward_start, 1)
    event("aten::backward_ops", backward_start, backward_end, 1)
    event("backward", backward_start, backward_end, 1, cat="user_annotation")
    free = 0.0
    for ready in model["buckets_ready"]:
        start = max(backward_start + ready, free)
        free = start + model["all_reduce"]
        event("gloo:all_reduce", start, free, 2)
    end = max(free, backward_end) + model["optimizer"]
    event("aten::optimizer_step", max(free, backward_end), end, 1)
    event("ProfilerStep#1", 0, end, 1, cat="user_annotation")
    return {"traceEvents": events}


def step_kinds(model: dict = STEP_MODEL) -> dict:
    """Milliseconds of the model's step in each kind (distlab.profiling.time_per_kind), and the share of its
    communication hidden behind backward's compute (distlab.profiling.backward_overlap)."""
    from distlab import profiling

    trace = step_trace(model)
    kinds = profiling.time_per_kind(trace)
    overlap = profiling.backward_overlap(trace)
    return {**{k: round(kinds[k] * 1000, 6) for k in profiling.KINDS}, "step": round(kinds["window_seconds"] * 1000, 6),
            "hidden_fraction": overlap["hidden_fraction"]}


def draw_step_timeline(fig) -> None:
    """One DDP rank's step from the model: the main thread's forward, backward and optimizer, the bucket
    all-reduces on gloo's thread, and below them the step cut into the four kinds of time."""
    from matplotlib.patches import Rectangle

    from coursetools.figures import RANK_COLOURS
    from distlab import profiling

    trace = step_trace()
    events = profiling.complete_events(trace)
    kinds = step_kinds()
    ax = fig.subplots()
    colours = {"compute": "#888888", "communication": RANK_COLOURS[3], "overlapped": RANK_COLOURS[2],
               "idle": "#ffffff"}
    labels = {"aten::forward_ops": "forward", "aten::backward_ops": "backward", "aten::optimizer_step": "opt."}
    for e in events:
        start, end = (v / 1000 for v in profiling.span(e))
        if e["name"] in labels:
            ax.add_patch(Rectangle((start, 2.6), end - start, 0.6, facecolor="#888888", edgecolor="white"))
            ax.text((start + end) / 2, 2.9, labels[e["name"]], ha="center", va="center", fontsize=7, color="white")
        elif e["name"].startswith("gloo:"):
            ax.add_patch(Rectangle((start, 1.7), end - start, 0.6, facecolor=RANK_COLOURS[1], edgecolor="white"))
            ax.text((start + end) / 2, 2.0, "all-reduce", ha="center", va="center", fontsize=6.5, color="white")
    ready = STEP_MODEL["data"] + STEP_MODEL["forward"]
    for r in STEP_MODEL["buckets_ready"]:
        ax.plot([ready + r] * 2, [2.55, 2.35], color="#333333", lw=0.8)
    ax.text(ready + 1, 2.45, "a bucket's gradients ready", fontsize=6, va="center", color="#333333")
    # the four kinds, instant by instant
    window = profiling.merge(profiling.step_spans(events))
    thread = profiling.main_thread(events)
    compute = [profiling.span(e) for e in events if profiling.is_compute(e, "cpu", thread)]
    communication = [profiling.span(e) for e in events if profiling.is_communication(e)]
    pieces = {"compute": profiling.subtract(compute, communication),
              "communication": profiling.subtract(communication, compute),
              "overlapped": profiling.intersect(compute, communication),
              "idle": profiling.subtract(window, profiling.merge(compute + communication))}
    names = {"compute": "computes only", "communication": "exposed communication", "overlapped": "overlapped",
             "idle": "idle"}
    for kind, spans in pieces.items():
        for s, e in spans:
            ax.add_patch(Rectangle((s / 1000, 0.6), (e - s) / 1000, 0.6, facecolor=colours[kind], edgecolor="#555555",
                                   lw=0.5, hatch="//" if kind == "communication" else None))
    legend = [Rectangle((0, 0), 1, 1, facecolor=colours[k], edgecolor="#555555", hatch="//" if k == "communication"
                        else None, label=f"{names[k]}: {kinds[k]:g} ms") for k in profiling.KINDS]
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, -0.55), ncol=4, fontsize=6.5, frameon=False)
    ax.set_yticks([0.9, 2.0, 2.9], ["the four kinds", "gloo's thread", "main thread"], fontsize=7)
    ax.set_ylim(0.3, 3.4)
    ax.set_xlim(0, kinds["step"] + 2)
    ax.set_xlabel("ms since the step began (a model, not a measurement)", fontsize=7)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"one DDP step of {kinds['step']:g} ms: the last bucket's all-reduce waits for backward's end, "
                 "and the optimizer waits for it", fontsize=8)
    fig.tight_layout()


FIGURES = {
    "12_launch_and_rendezvous.png": (draw_launch_and_rendezvous, (9, 5.6)),
    "12_watchdog.png": (draw_watchdog, (9, 3.6)),
    "12_walltime.png": (draw_walltime, (10.5, 3.2)),
    "12_step_timeline.png": (draw_step_timeline, (9, 3.0)),
}
