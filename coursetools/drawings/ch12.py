"""Chapter 12's pictures of its mechanisms: a job from the scheduler to each rank's process group. Drawn from a model
of the launch (the environment each launcher gives its processes, read by ``distlab.runtime.launcher_env``, the
function every script calls), never from a measured run."""

from __future__ import annotations

# coursetools.figures is imported inside the functions: it gathers this module when it is itself imported

NODES = ("n1", "n2")
GPUS_PER_NODE = 4
JOB_ID = "1234"


def srun_env(rank: int) -> dict:
    """What ``srun -n 8 --ntasks-per-node=4`` gives task ``rank`` of job ``JOB_ID`` on nodes n1 and n2."""
    return {"SLURM_JOB_ID": JOB_ID, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % GPUS_PER_NODE),
            "SLURM_NODEID": str(rank // GPUS_PER_NODE), "SLURM_NTASKS": str(len(NODES) * GPUS_PER_NODE),
            "SLURM_STEP_NUM_TASKS": str(len(NODES) * GPUS_PER_NODE),
            "SLURM_STEP_TASKS_PER_NODE": f"{GPUS_PER_NODE}(x{len(NODES)})", "SLURM_STEP_NODELIST": "n[1-2]"}


def mpiexec_env(rank: int) -> tuple[dict, str]:
    """What ``mpiexec -n 8 --ppn 4`` (Cray PALS) under PBS gives process ``rank``, and the job's node file."""
    env = {"PBS_JOBID": JOB_ID, "PBS_NODEFILE": "nodefile", "PALS_RANKID": str(rank), "PMI_RANK": str(rank),
           "PMI_SIZE": str(len(NODES) * GPUS_PER_NODE), "PALS_LOCAL_RANKID": str(rank % GPUS_PER_NODE),
           "PALS_LOCAL_SIZE": str(GPUS_PER_NODE)}
    return env, "".join(f"{node}\n" * GPUS_PER_NODE for node in NODES)   # a host a line, once a rank


def launch_model() -> list:
    """Each rank's ``LauncherEnv``, as the runtime reads it under srun; mpiexec under PBS gives the same ranks,
    local ranks and rank 0's host (checked here, so the picture holds for both schedulers)."""
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
    box(3.3, 1.75, 5.4, 0.6, f"rank 0's TCP store at {addr}:{port}\n(MASTER_ADDR: first node; MASTER_PORT: "
        "from the job id)", face="#e6eef8", edge="#1f77b4")
    for rank, (x, y) in rank_xy.items():
        arrow((x, y), (6.0 + (x - 6.0) * 0.25, 2.35), colour="#1f77b4", lw=0.6)
    # 5. the process group
    stage(0.75, 5, "process group")
    box(3.2, 0.35, 5.6, 0.8, f"the store hands out NCCL's unique id (gloo: each rank's address); then\n"
        f"init_process_group returns on all {len(ranks)} ranks: one process group, a world of {len(ranks)}",
        face="#f2e6f7", edge="#8172b3")
    arrow((6.0, 1.75), (6.0, 1.17))


FIGURES = {
    "12_launch_and_rendezvous.png": (draw_launch_and_rendezvous, (9, 5.6)),
}
