"""Chapter 09's PBS job and the instructor's demo job.

* Dry runs on 1, 2 and 4 fake Derecho nodes (Cray PALS stand-in): every mesh the job launches fills the ranks it
  asks for, keeps TP inside a node and splits its batch; the 3-D run appears from 2 nodes on.
* The hybrid scripts on two nodes, end to end on one machine: a real MPICH mpiexec (Hydra, ``-launcher fork``),
  a fake PBS_NODEFILE of two hosts x 2 ranks, as tests/pbs/test_pbs_two_nodes.py does. Their checks pass (each
  compares with the single-device run) and their losses equal the same scripts' with the same flags on one node
  (4 ranks started by fork).
* The instructor's demo on those two nodes writes one HTML file with the table and the plots.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pbs_helpers import LEAKY_PREFIXES, PBS_DIR, ROOT, run_bash, tool, write_nodefile
from test_pbs_job_files import accepted_flags, directives, dry_run, resources, script_of

from helpers import forkexec_settings

from labkit import launch
from coursetools import demo_report
from distlab.runtime import free_port

JOB = PBS_DIR / "09_hybrid_parallel.pbs"
DEMO = PBS_DIR / "instructor_demo.pbs"
LAUNCH_TIMEOUT_S = 90  # inside the job (DISTLAB_LAUNCH_TIMEOUT); each test's own limit is above it
PIPELINE_BATCH = 16  # the pipeline scripts' default global batch, which the job keeps


def mesh_of(args: list[str]) -> dict:
    value = {flag: int(args[args.index(f"--{flag}") + 1]) for flag in ("pp", "dp", "tp") if f"--{flag}" in args}
    return {"pp": 1, "dp": 1, "tp": 1, **value}


# ---- dry runs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_the_job_fits_every_mesh_to_its_nodes(nodes, job_env, fake_pals, tmp_path):
    write_nodefile(tmp_path / "nodefile", [f"dec{i:04d}" for i in range(1, nodes + 1)], 4)
    env = job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_DEVICE": "cuda", "DISTLAB_PRESET": "a100"}
    commands = dry_run(JOB, env)
    launched = {}
    for command in commands:
        script, args = script_of(command)
        ranks, per_node = int(command[command.index("-n") + 1]), int(command[command.index("--ppn") + 1])
        mesh = mesh_of(args)
        name = Path(script).name
        launched.setdefault(name, []).append(args)
        assert per_node == 4
        if name != "rank_grid.py":  # rank_grid takes dp from the world
            assert mesh["pp"] * mesh["dp"] * mesh["tp"] == ranks, (name, mesh, ranks)
        assert mesh["tp"] <= 4, f"{name}: TP {mesh['tp']} leaves a node"
        if "--microbatches" in args:
            microbatches = int(args[args.index("--microbatches") + 1])
            assert microbatches >= mesh["pp"] and PIPELINE_BATCH % (mesh["dp"] * microbatches) == 0
        unknown = {a for a in args if a.startswith("--")} - accepted_flags(ROOT / script)
        assert not unknown, f"{script} does not define {sorted(unknown)}"
    two_d = [mesh_of(a) for a in launched["fsdp_tp_hybrid.py"]]
    assert two_d == [{"pp": 1, "dp": min(nodes, 2), "tp": 4}] * 2  # 1 node: tp 4; 2+: tp 4 x dp 2; both plans
    assert [a[a.index("--embedding-plan") + 1] for a in launched["fsdp_tp_hybrid.py"]] == ["usual", "alternative"]
    assert [a[a.index("--dp-mode") + 1] for a in launched["pp_dp_hybrid.py"]] == ["ddp", "fsdp"]
    if nodes == 1:
        assert "hybrid_3d.py" not in launched  # the 3-D mesh needs 2+ nodes
    else:
        assert [mesh_of(a) for a in launched["hybrid_3d.py"]] == [{"pp": 2, "dp": nodes // 2, "tp": 4}]


@pytest.mark.parametrize("setting, message", [
    ({"HYBRID_TP": "3"}, "HYBRID_TP=3 does not divide the job's 8 GPUs"),
    ({"HYBRID_PP": "3"}, "HYBRID_PP=3 does not divide the job's 8 GPUs"),
    ({"HYBRID_TP": "two"}, "must be positive integers"),
    ({"HYBRID_PP": "0"}, "must be positive integers"),
])
def test_a_bad_mesh_setting_stops_the_job_with_one_line(setting, message, job_env, fake_pals):
    result = run_bash(["bash", str(JOB)], job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_DRY_RUN": "1", **setting},
                      timeout=60)
    errors = [line for line in result.output.splitlines() if line.startswith("distlab: error: ")]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.output


def test_demo_job_file_is_sane_and_launches_scripts_with_flags_they_accept(job_env, fake_pals):
    text = DEMO.read_text()
    assert subprocess.run(["bash", "-n", str(DEMO)], capture_output=True, timeout=30).returncode == 0
    shellcheck = tool("shellcheck")
    if shellcheck:
        checked = subprocess.run([shellcheck, "-x", "--severity=warning", "pbs/instructor_demo.pbs"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stdout
    d = directives(DEMO)
    assert "-j oe" in d and "-S /bin/bash" in d and not any(x.startswith("-A") for x in d)
    res = resources(DEMO)
    assert res["walltime"] <= "00:30:00" and res["select"].startswith("2:") and "ngpus=4:mpiprocs=4" in res["select"]
    assert "# shellcheck source=pbs/common.sh\nsource pbs/common.sh || exit 2" in text
    assert text.rstrip().endswith("distlab_finish")
    commands = dry_run(DEMO, job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_DEVICE": "cuda",
                                        "DISTLAB_PRESET": "a100"})
    chapters = []
    for command in commands:
        script, args = script_of(command)
        chapters.append(script.split("/")[1][:2])
        assert "--metrics-out" in args and "--device" in args
        unknown = {a for a in args if a.startswith("--")} - accepted_flags(ROOT / script)
        assert not unknown, f"{script} does not define {sorted(unknown)}"
        mesh = mesh_of(args)
        assert mesh["tp"] <= 4
    assert chapters == ["03", "04", "05", "06", "07", "09", "09"]


def test_demo_refuses_one_node(job_env, fake_pals, tmp_path):
    write_nodefile(tmp_path / "nodefile", ["dec0001"], 4)
    result = run_bash(["bash", str(DEMO)], job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_DRY_RUN": "1"},
                      timeout=60)
    assert result.returncode == 2 and "the demo shows 2 nodes" in result.output


# ---- the demo report's pure parts --------------------------------------------------------------------------

def test_demo_report_rows(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"script": "09_hybrid_parallel/x.py", "world_size": 4, "device": "cpu",
                                "losses": [4.9, 4.7], "checks": [{"name": "a", "passed": True},
                                                                 {"name": "b", "passed": False}],
                                "throughput": {"step_seconds": 0.25, "tokens_per_s": 1234.5, "mfu": None}}))
    runs = [demo_report.parse_run(f"good=1={good}"), demo_report.parse_run(f"skipped=0={tmp_path / 'none.json'}"),
            demo_report.parse_run(f"crashed=2={tmp_path / 'none.json'}")]
    rows = demo_report.summary_rows(runs)
    assert [r["result"] for r in rows] == ["FAILED (1)", "skipped", "FAILED (2)"]
    assert (rows[0]["checks"], rows[0]["last loss"], rows[0]["step time"], rows[0]["tokens/s"], rows[0]["MFU"]) == (
        "1/2", "4.7000", "250.0 ms", "1,234", "-")
    assert rows[1]["checks"] == "-"
    table = demo_report.text_table(rows).splitlines()
    assert table[0].split()[:3] == ["run", "script", "result"] and len(table) == 4


# ---- two nodes on one machine ------------------------------------------------------------------------------

def two_node_env(tmp: Path) -> dict:
    mpiexec = tool("mpiexec")
    env = {k: v for k, v in os.environ.items() if not k.startswith(LEAKY_PREFIXES)}
    if mpiexec is None or "HYDRA" not in run_bash([mpiexec, "--version"], env).output:
        pytest.skip("needs MPICH's mpiexec (pip install mpich)")
    return env | {
        "PBS_NODEFILE": str(write_nodefile(tmp / "nodefile", ["localhost", "127.0.0.1"], 2)),
        "PBS_JOBID": "4343.desched1", "PBS_O_WORKDIR": str(ROOT), "DISTLAB_RUN_DIR": str(tmp / "run"),
        "DISTLAB_MODULES": "", "DISTLAB_CONDA_ENV": "", "DISTLAB_PREFLIGHT": "0", "DISTLAB_PYTHON": sys.executable,
        "DISTLAB_MPIEXEC": mpiexec, "DISTLAB_MPIEXEC_ARGS": "-launcher fork", "DISTLAB_GPUS_PER_NODE": "2",
        "DISTLAB_DEVICE": "cpu", "DISTLAB_PRESET": "tiny", "DISTLAB_LAUNCH_TIMEOUT": str(LAUNCH_TIMEOUT_S),
        "DISTLAB_MASTER_PORT": str(free_port()), **forkexec_settings(),
    }


@pytest.fixture(scope="module")
def hybrid_job(tmp_path_factory):
    """Chapter 09's job on 2 fake nodes x 2 ranks: the 2-D and 3-D scripts, once, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("hybrid_job")
    env = two_node_env(tmp) | {"DISTLAB_ONLY": "fsdp_tp_hybrid.py hybrid_3d.py", "HYBRID_EMBEDDING_PLANS": "usual"}
    start = time.monotonic()
    result = run_bash(["bash", str(JOB)], env, timeout=3 * LAUNCH_TIMEOUT_S)
    return result, tmp / "run", time.monotonic() - start


def test_hybrid_scripts_pass_their_checks_on_two_nodes(hybrid_job):
    result, run, _ = hybrid_job
    assert result.returncode == 0, result.output[-4000:]
    commands = (run / "commands.sh").read_text()
    assert commands.count("-n 4 -ppn 2 -f") == 2  # both launched on 2 nodes x 2 ranks by Hydra
    for name in ("fsdp_tp_hybrid_usual", "hybrid_3d"):
        metrics = json.loads((run / f"{name}.json").read_text())
        assert metrics["world_size"] == 4
        names = [c["name"] for c in metrics["checks"]]
        assert metrics["checks"] and all(c["passed"] for c in metrics["checks"]), metrics["checks"]
        assert any("single" in n or "one device" in n or "reference" in n for n in names), names
    assert "skip rank_grid.py" in result.output and "skip pp_dp_hybrid.py" in result.output
    assert (run / "hybrid_3d_gantt.png").stat().st_size > 0


def test_two_nodes_give_the_losses_of_one_node(hybrid_job):
    """The same script and flags on 4 ranks of one node (started by fork): the same losses. On CPU the ranks do
    the same arithmetic wherever they run, so the losses agree to rounding (1e-6 allows another thread count)."""
    result, run, _ = hybrid_job
    assert result.returncode == 0, result.output[-4000:]
    for line in (run / "commands.sh").read_text().splitlines():
        script, args = script_of(shlex.split(line))
        two_nodes_file = Path(args[args.index("--metrics-out") + 1])
        one_node_args = [a for i, a in enumerate(args) if a != "--metrics-out" and
                         not (i > 0 and args[i - 1] == "--metrics-out") and a != "--plot" and
                         not (i > 0 and args[i - 1] == "--plot")]
        two = json.loads(two_nodes_file.read_text())
        one = launch.run(script, nproc=4, args=one_node_args, stream=False, launcher="fork").metrics
        assert one["world_size"] == two["world_size"] == 4
        assert len(one["losses"]) == len(two["losses"]) >= 2
        difference = max(abs(a - b) for a, b in zip(one["losses"], two["losses"]))
        assert difference <= 1e-6, (script, one["losses"], two["losses"])


def test_instructor_summary_from_the_two_node_runs(hybrid_job):
    """The demo job's last step, on the real metrics of the two-node runs (its launches are the 09 job's, through
    the same pbs/common.sh, and its launch list is the dry run above): one HTML file, table and plots."""
    result, run, _ = hybrid_job
    assert result.returncode == 0, result.output[-4000:]
    specs = [f"fsdp_tp_hybrid=0={run / 'fsdp_tp_hybrid_usual.json'}", f"hybrid_3d=0={run / 'hybrid_3d.json'}",
             f"pp_train=0={run / 'not_run.json'}", f"broken=1={run / 'not_run.json'}"]
    out = run / "instructor_demo.html"
    summary = subprocess.run([sys.executable, "-m", "coursetools.demo_report", "--out", str(out), "--title", "demo",
                              *specs], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr
    page = out.read_text()
    rows = re.findall(r"<tr><td>(\w+)</td><td>[^<]*</td><td>([^<]+)</td>", page)
    assert dict(rows) == {"fsdp_tp_hybrid": "ok", "hybrid_3d": "ok", "pp_train": "skipped", "broken": "FAILED (1)"}
    assert "1 run(s) failed:</b> broken" in page
    assert page.count("data:image/png;base64,") == 3  # losses, communication, the pipeline's Gantt chart
    assert "Pipeline of hybrid_3d" in page
    assert re.search(r"hybrid_3d\s+09_hybrid_parallel/hybrid_3d\.py\s+ok\s+4\s+cpu", summary.stdout)
