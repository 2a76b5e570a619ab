"""Each rank's threads on its GPU's NUMA node, on a fake sysfs tree of a node wired as Frontier's is.

OLCF's Frontier user guide (the NUMA note of "Frontier Compute Nodes") gives the wiring: 4 NUMA nodes of 16 cores
(2 hardware threads each: 0-63 and 64-127), 8 GPUs, each beside one L3 region of 8 cores:

    NUMA 0: threads 000-007, 064-071 | GPU 4     threads 008-015, 072-079 | GPU 5
    NUMA 1: threads 016-023, 080-087 | GPU 2     threads 024-031, 088-095 | GPU 3
    NUMA 2: threads 032-039, 096-103 | GPU 6     threads 040-047, 104-111 | GPU 7
    NUMA 3: threads 048-055, 112-119 | GPU 0     threads 056-063, 120-127 | GPU 1

The tree holds what Linux shows for it: /sys/bus/pci/devices/<bus id>/numa_node and local_cpulist, the node's CPUs
(drivers/pci/pci-sysfs.c), the device's vendor and class, and each CPU's hardware threads,
/sys/devices/system/cpu/cpu<N>/topology/thread_siblings_list. The expected cores below are the guide's table, typed
in, not computed.
"""

from pathlib import Path

import pytest

from distlab import runtime

NUMA_OF_GPU = {4: 0, 5: 0, 2: 1, 3: 1, 6: 2, 7: 2, 0: 3, 1: 3}
NODE_CPULIST = {0: "0-15,64-79", 1: "16-31,80-95", 2: "32-47,96-111", 3: "48-63,112-127"}
# the guide's table: GPU -> its L3 region's hardware threads
GUIDE = {0: "48-55,112-119", 1: "56-63,120-127", 2: "16-23,80-87", 3: "24-31,88-95",
         4: "0-7,64-71", 5: "8-15,72-79", 6: "32-39,96-103", 7: "40-47,104-111"}


def bus(gpu: int) -> str:
    return f"0000:{0xc1 + 8 * gpu:02x}:00.0"  # made-up addresses, one a GPU


# every CPU of the node: a job that holds the whole node may use them all
ALL = set(range(128))


def fake_sysfs(root: Path, numa_of_gpu: dict[int, int], node_cpulist: dict[int, str], siblings: dict[int, str]) -> Path:
    for gpu, node in numa_of_gpu.items():
        device = root / "bus" / "pci" / "devices" / bus(gpu)
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{node}\n")
        (device / "local_cpulist").write_text(node_cpulist[node] + "\n")
        (device / "vendor").write_text("0x1002\n")
        (device / "class").write_text("0x038000\n")
    nic = root / "bus" / "pci" / "devices" / "0000:01:00.0"  # another kind of device: not a GPU of the node
    nic.mkdir(parents=True)
    for name, value in (("numa_node", "0"), ("local_cpulist", node_cpulist[0]), ("vendor", "0x17db"),
                        ("class", "0x020000")):
        (nic / name).write_text(value + "\n")
    for cpu, threads in siblings.items():
        topology = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(threads + "\n")
    return root


@pytest.fixture
def frontier_sysfs(tmp_path: Path) -> Path:
    # a core's second hardware thread is the core + 64 (the guide's 0-63, then 64-127)
    siblings = {cpu: f"{cpu % 64},{cpu % 64 + 64}" for cpu in range(128)}
    return fake_sysfs(tmp_path, NUMA_OF_GPU, NODE_CPULIST, siblings)


def test_cpulists_read_and_written_as_the_kernel_prints_them():
    assert runtime.parse_cpulist("0-2,64,70-71\n") == [0, 1, 2, 64, 70, 71]
    assert runtime.format_cpulist({71, 0, 1, 2, 64, 70}) == "0-2,64,70-71"


def test_each_rank_gets_its_gpus_l3_region_on_a_reverse_wired_node(frontier_sysfs):
    buses = [bus(gpu) for gpu in range(8)]  # local rank i uses GPU i
    for rank in range(8):
        node, cpus = runtime.gpu_local_cpus(rank, buses, frontier_sysfs, allowed=ALL)
        assert node == NUMA_OF_GPU[rank]
        assert cpus == runtime.parse_cpulist(GUIDE[rank]), rank
    # the shares of one node's ranks do not overlap, and together they are the node
    shares = [set(runtime.gpu_local_cpus(rank, buses, frontier_sysfs, allowed=ALL)[1]) for rank in (0, 1)]
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(runtime.parse_cpulist(NODE_CPULIST[3]))


def test_the_rank_map_check_fails_the_launchers_block_binding_and_passes_the_gpus(frontier_sysfs):
    buses = [bus(gpu) for gpu in range(8)]

    def placements(cpus_of_rank):
        return [{"host": "frontier00001", "rank": r, "cpus": cpus_of_rank(r),
                 "gpu_numa_node": runtime.gpu_numa_node(buses[r], frontier_sysfs)[0],
                 "gpu_numa_cpus": runtime.gpu_numa_node(buses[r], frontier_sysfs)[1]} for r in range(8)]

    # the guide's L3 regions, typed in: each rank on its GPU's node, no two sharing a core
    assert runtime.affinity_problems(placements(lambda r: runtime.parse_cpulist(GUIDE[r]))) == []
    # every rank on its GPU's whole NUMA node: on its node, but two ranks share every core there
    whole = runtime.affinity_problems(placements(lambda r: runtime.parse_cpulist(NODE_CPULIST[NUMA_OF_GPU[r]])))
    assert whole == ["ranks 0 and 1 on frontier00001 share cores 48-63,112-127",
                     "ranks 2 and 3 on frontier00001 share cores 16-31,80-95",
                     "ranks 4 and 5 on frontier00001 share cores 0-15,64-79",
                     "ranks 6 and 7 on frontier00001 share cores 32-47,96-111"], whole
    # ranks of two hosts may use the same core numbers
    two_hosts = placements(lambda r: runtime.parse_cpulist(GUIDE[r]))
    two_hosts[1] = {**two_hosts[0], "rank": 1, "host": "frontier00002"}
    assert runtime.affinity_problems(two_hosts) == []
    # srun --cpu-bind=cores, 8 tasks of 8 cores: task i on the i-th block, 8i..8i+7 (the planted mis-binding)
    block = placements(lambda r: list(range(8 * r, 8 * r + 8)))
    problems = runtime.affinity_problems(block)
    # only NUMA 1 holds the GPUs of its own tasks (2 and 3): every other task is a node away from its GPU
    assert [int(line.split()[1]) for line in problems] == [0, 1, 4, 5, 6, 7], problems
    assert problems[0] == ("rank 0 on frontier00001: cores 0-7 are not on its GPU's NUMA node 3 "
                           "(48-63,112-127)")


def test_binding_moves_the_process_or_says_why_not(frontier_sysfs, tmp_path):
    calls = []
    buses = [bus(gpu) for gpu in range(8)]
    line = runtime.bind_to_gpu(0, buses, frontier_sysfs, setaffinity=lambda pid, cpus: calls.append((pid, cpus)),
                               allowed=ALL)
    assert calls == [(0, set(runtime.parse_cpulist(GUIDE[0])))]
    assert line == "GPU affinity: cores 48-55,112-119 (NUMA node 3, the GPU's)"

    def refused(pid, cpus):
        raise OSError(22, "Invalid argument")

    assert runtime.bind_to_gpu(0, buses, frontier_sysfs, setaffinity=refused, allowed=ALL) == (
        "GPU affinity: cannot bind to 48-55,112-119 (Invalid argument); the launcher's binding stays")
    # no NUMA information (a one-socket machine: numa_node -1), or no such device: nothing is moved
    (frontier_sysfs / "bus" / "pci" / "devices" / bus(0) / "numa_node").write_text("-1\n")
    assert runtime.gpu_numa_node(bus(0), frontier_sysfs) == (None, [])
    assert runtime.bind_to_gpu(0, buses, frontier_sysfs, setaffinity=refused).startswith(
        "GPU affinity: the GPU's NUMA node is unknown")
    assert runtime.gpu_numa_node("0000:ff:00.0", tmp_path / "nothing") == (None, [])


def test_a_rank_that_sees_only_its_own_gpu_still_gets_its_l3_region(frontier_sysfs):
    """OLCF's common layout, srun -N1 -n8 -c7 --gpus-per-task=1 --gpu-bind=closest: each task sees one GPU
    (frontier_user_guide.rst), so the other local ranks' GPUs are unknown; the node's GPUs come from sysfs."""
    for gpu in range(8):
        buses: list[str | None] = [None] * 8
        buses[gpu] = bus(gpu)
        assert runtime.gpu_local_cpus(gpu, buses, frontier_sysfs, allowed=ALL)[1] == \
            runtime.parse_cpulist(GUIDE[gpu]), gpu


def test_a_job_that_holds_part_of_a_numa_node_shares_only_its_own_cores(frontier_sysfs):
    """A shared-node job whose cpuset holds threads 0-7,64-71 of NUMA 0 (GPUs 4 and 5): the two ranks split those,
    as torch's --numa-binding=exclusive splits only the allowed CPUs, rather than one rank getting cores outside
    the job (where sched_setaffinity would keep only the allowed ones: both ranks on the same cores)."""
    buses = [bus(4), bus(5)]
    allowed = set(runtime.parse_cpulist("0-7,64-71"))
    shares = [runtime.gpu_local_cpus(r, buses, frontier_sysfs, allowed=allowed)[1] for r in (0, 1)]
    assert shares == [runtime.parse_cpulist("0-3,64-67"), runtime.parse_cpulist("4-7,68-71")], shares


def test_hardware_threads_numbered_side_by_side_stay_with_their_core(tmp_path):
    """A node whose Linux numbers a core's two threads side by side (cpu 2i and 2i + 1, one core): 40 CPUs, 20
    cores, 3 GPUs on one NUMA node. Each rank gets whole cores, 6, 7 and 7 of them; cutting the CPU list into
    thirds would put core 6's threads (12, 13) in two ranks."""
    siblings = {cpu: f"{cpu - cpu % 2}-{cpu - cpu % 2 + 1}" for cpu in range(40)}
    sysfs = fake_sysfs(tmp_path, {0: 0, 1: 0, 2: 0}, {0: "0-39"}, siblings)
    buses = [bus(gpu) for gpu in range(3)]
    shares = [runtime.gpu_local_cpus(r, buses, sysfs, allowed=set(range(40)))[1] for r in range(3)]
    assert shares == [runtime.parse_cpulist("0-11"), runtime.parse_cpulist("12-25"), runtime.parse_cpulist("26-39")]
