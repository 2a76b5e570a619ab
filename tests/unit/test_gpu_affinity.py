"""Each rank's threads on its GPU's NUMA node, on a fake sysfs tree of a node wired as Frontier's is.

OLCF's Frontier user guide (the NUMA note of "Frontier Compute Nodes") gives the wiring: 4 NUMA nodes of 16 cores
(2 hardware threads each: 0-63 and 64-127), 8 GPUs, each beside one L3 region of 8 cores:

    NUMA 0: threads 000-007, 064-071 | GPU 4     threads 008-015, 072-079 | GPU 5
    NUMA 1: threads 016-023, 080-087 | GPU 2     threads 024-031, 088-095 | GPU 3
    NUMA 2: threads 032-039, 096-103 | GPU 6     threads 040-047, 104-111 | GPU 7
    NUMA 3: threads 048-055, 112-119 | GPU 0     threads 056-063, 120-127 | GPU 1

The tree holds what Linux shows for it: /sys/bus/pci/devices/<bus id>/numa_node and local_cpulist, the node's CPUs
(drivers/pci/pci-sysfs.c). The expected cores below are the guide's table, typed in, not computed.
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


@pytest.fixture
def frontier_sysfs(tmp_path: Path) -> Path:
    for gpu, node in NUMA_OF_GPU.items():
        device = tmp_path / "bus" / "pci" / "devices" / bus(gpu)
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{node}\n")
        (device / "local_cpulist").write_text(NODE_CPULIST[node] + "\n")
    return tmp_path


def test_cpulists_read_and_written_as_the_kernel_prints_them():
    assert runtime.parse_cpulist("0-2,64,70-71\n") == [0, 1, 2, 64, 70, 71]
    assert runtime.format_cpulist({71, 0, 1, 2, 64, 70}) == "0-2,64,70-71"


def test_each_rank_gets_its_gpus_l3_region_on_a_reverse_wired_node(frontier_sysfs):
    buses = [bus(gpu) for gpu in range(8)]  # local rank i uses GPU i
    for rank in range(8):
        node, cpus = runtime.gpu_local_cpus(rank, buses, frontier_sysfs)
        assert node == NUMA_OF_GPU[rank]
        assert cpus == runtime.parse_cpulist(GUIDE[rank]), rank
    # the shares of one node's ranks do not overlap, and together they are the node
    shares = [set(runtime.gpu_local_cpus(rank, buses, frontier_sysfs)[1]) for rank in (0, 1)]
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(runtime.parse_cpulist(NODE_CPULIST[3]))


def test_the_rank_map_check_fails_the_launchers_block_binding_and_passes_the_gpus(frontier_sysfs):
    buses = [bus(gpu) for gpu in range(8)]

    def placements(cpus_of_rank):
        return [{"host": "frontier00001", "rank": r, "cpus": cpus_of_rank(r),
                 "gpu_numa_node": runtime.gpu_numa_node(buses[r], frontier_sysfs)[0],
                 "gpu_numa_cpus": runtime.gpu_numa_node(buses[r], frontier_sysfs)[1]} for r in range(8)]

    bound = placements(lambda r: runtime.gpu_local_cpus(r, buses, frontier_sysfs)[1])
    assert runtime.affinity_problems(bound) == []
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
    line = runtime.bind_to_gpu(0, buses, frontier_sysfs, setaffinity=lambda pid, cpus: calls.append((pid, cpus)))
    assert calls == [(0, set(runtime.parse_cpulist(GUIDE[0])))]
    assert line == "GPU affinity: cores 48-55,112-119 (NUMA node 3, the GPU's)"

    def refused(pid, cpus):
        raise OSError(22, "Invalid argument")

    assert runtime.bind_to_gpu(0, buses, frontier_sysfs, setaffinity=refused) == (
        "GPU affinity: cannot bind to 48-55,112-119 (Invalid argument); the launcher's binding stays")
    # no NUMA information (a one-socket machine: numa_node -1), or no such device: nothing is moved
    (frontier_sysfs / "bus" / "pci" / "devices" / bus(0) / "numa_node").write_text("-1\n")
    assert runtime.gpu_numa_node(bus(0), frontier_sysfs) == (None, [])
    assert runtime.bind_to_gpu(0, buses, frontier_sysfs, setaffinity=refused).startswith(
        "GPU affinity: the GPU's NUMA node is unknown")
    assert runtime.gpu_numa_node("0000:ff:00.0", tmp_path / "nothing") == (None, [])
