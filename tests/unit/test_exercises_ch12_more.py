"""Lab 12's exercise 3 (page 12.1): place each rank from the node file. The right answer passes; the plausible
wrong ones are rejected; an unwritten one is reported as incomplete; the lab holds the exercise under its title."""

import json
from pathlib import Path

import pytest

from labkit.exercises import ch12
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong

LAB = Path(__file__).resolve().parents[2] / "notebooks" / "12_hpc_operations.ipynb"


def right(nodefile):
    seen = {}
    placed = []
    for host in nodefile:
        placed.append((host, seen.get(host, 0)))
        seen[host] = seen.get(host, 0) + 1
    return placed


def wrong_local_rank_is_the_rank(nodefile):            # every rank on its own GPU number: GPU 5 of a 4-GPU node
    return [(host, rank) for rank, host in enumerate(nodefile)]


def wrong_one_line_a_node(nodefile):                    # the file read as one line a node: rank r on line r // 4
    per_node = nodefile.count(nodefile[0])
    return [(nodefile[rank // per_node], rank % per_node) for rank in range(len(nodefile))]


def wrong_hosts_sorted(nodefile):                       # the nodes sorted by name, not in the scheduler's order
    hosts = sorted(set(nodefile))
    per_node = len(nodefile) // len(hosts)
    return [(hosts[rank // per_node], rank % per_node) for rank in range(len(nodefile))]


def wrong_round_robin(nodefile):                        # rank r on node r mod nodes (mpiexec places in blocks)
    hosts = list(dict.fromkeys(nodefile))
    return [(hosts[rank % len(hosts)], rank // len(hosts)) for rank in range(len(nodefile))]


def wrong_local_rank_mod_nodes(nodefile):              # the node count taken for the ranks a node
    hosts = list(dict.fromkeys(nodefile))
    return [(host, rank % len(hosts)) for rank, host in enumerate(nodefile)]


def test_the_right_placement_passes():
    assert ch12.check_placement(right)


@pytest.mark.parametrize("wrong", [wrong_local_rank_is_the_rank, wrong_one_line_a_node, wrong_hosts_sorted,
                                   wrong_round_robin, wrong_local_rank_mod_nodes])
def test_plausible_wrong_placements_are_rejected(wrong):
    with pytest.raises(ExerciseWrong):
        ch12.check_placement(wrong)


def test_an_unwritten_placement_is_incomplete(monkeypatch):
    monkeypatch.setenv("DISTLAB_INCOMPLETE_EXERCISE", "raise")
    with pytest.raises(ExerciseIncomplete):
        ch12.check_placement(lambda nodefile: None)

    def stub(nodefile):
        raise NotImplementedError
    with pytest.raises(ExerciseIncomplete):
        ch12.check_placement(stub)


def test_the_checker_holds_no_answer_to_import():
    # its expected placements are data, and no function of the module returns one from a node file
    for name in dir(ch12):
        value = getattr(ch12, name)
        if callable(value) and not name.startswith("check_") and name[0] != "_":
            try:
                got = value(["n1", "n1", "n2", "n2"])
            except Exception:
                continue
            assert got != [("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)], name


def test_the_lab_holds_exercise_3_under_its_title_and_checks_it():
    cells = json.loads(LAB.read_text())["cells"]
    text = ["".join(c["source"]) for c in cells]
    heading = next(i for i, t in enumerate(text) if t.startswith("## Exercise 3: place each rank from the node file"))
    assert "def placement(nodefile):" in text[heading + 1] and "### BEGIN SOLUTION" in text[heading + 1]
    assert "exercises.check_placement(placement)" in text[heading + 2]
    assert "check" in cells[heading + 2]["metadata"].get("tags", [])


def test_the_expected_placements_are_what_a_real_mpiexec_does(tmp_path):
    """MPICH's Hydra mpiexec (in the environment, PYTORCH_NOTES) with the exercise's nodes, in the scheduler's order,
    and -ppn: each rank's PMI_HOSTNAME and MPI_LOCALRANKID are the checker's written-out answer."""
    import shutil
    import signal
    import subprocess
    import sys

    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    if mpiexec is None:
        pytest.skip("no mpiexec beside this Python")
    for nodefile, want in ch12.PLACEMENT_CASES[:2]:
        hosts = list(dict.fromkeys(nodefile))
        ppn = nodefile.count(hosts[0])
        (tmp_path / "hosts.txt").write_text("".join(f"{h}:{ppn}\n" for h in hosts))
        command = [mpiexec, "-launcher", "fork", "-f", str(tmp_path / "hosts.txt"), "-ppn", str(ppn),
                   "-n", str(len(nodefile)), "sh", "-c", 'echo "$PMI_RANK $PMI_HOSTNAME $MPI_LOCALRANKID"']
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if done.returncode == -signal.SIGPIPE:
            # Hydra's own teardown: once in make test (s18g, two loaded cores) mpiexec itself died of SIGPIPE as its
            # eight instant ranks exited (0 in 100 runs alone). The placements it prints are what this test checks:
            # one more run, and a second death fails below
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (done.returncode, done.stderr[-500:])
        rows = sorted((int(r), h, int(l)) for r, h, l in (line.split() for line in done.stdout.splitlines()))
        assert [(h, l) for _, h, l in rows] == want


def _markdown(title_start: str) -> str:
    cells = json.loads(LAB.read_text())["cells"]
    return next(" ".join("".join(c["source"]).split()) for c in cells
                if c["cell_type"] == "markdown" and "".join(c["source"]).startswith(title_start))


def test_the_lab_says_when_the_node_files_rule_holds():
    # a source review: PALS places --ppn ranks on each distinct host; "a node's ranks are its lines" holds only when
    # the select line's mpiprocs equals --ppn, as in every course job
    import re

    job = (Path(__file__).resolve().parents[2] / "pbs" / "12_hpc_operations.pbs").read_text()
    mpiprocs = int(re.search(r"^#PBS -l select=\d+:.*mpiprocs=(\d+)", job, flags=re.M).group(1))
    text = _markdown("## Exercise 3: place each rank from the node file")
    assert "one line per rank, so each host appears once for every rank it runs" in text
    assert f"when the select line's `mpiprocs` equals `--ppn`, as in every course job (here {mpiprocs} and 4)" in text
    # PALS's own rule comes after the task, as a note: the function takes no --ppn, so it is not the one to write
    note = ("(Cray PALS itself places `--ppn` ranks on each distinct host; with `mpiprocs` equal to `--ppn` the two "
            "rules agree.)")
    assert note in text and text.index("Write `placement(nodefile)`") < text.index(note)


def test_the_labs_last_submission_names_the_account():
    # pbs/README.md: the jobs carry no account line, so qsub needs -A (as chapter 12.3 writes it)
    readme = (Path(__file__).resolve().parents[2] / "pbs" / "README.md").read_text()
    assert 'qsub -A "$PBS_ACCOUNT"' in readme
    text = _markdown("## Going further")
    assert '`qsub -A "$PBS_ACCOUNT" pbs/12_hpc_operations.pbs`' in text
    # Slurm: nothing sets $ACCOUNT; slurm/README.md has the learner export SBATCH_ACCOUNT, which sbatch reads
    slurm_readme = (Path(__file__).resolve().parents[2] / "slurm" / "README.md").read_text()
    assert "export SBATCH_ACCOUNT=<your account>" in slurm_readme
    assert "$ACCOUNT" not in text
    assert ("with `SBATCH_ACCOUNT` exported as slurm/README.md says: `sbatch slurm/12_hpc_operations.sbatch`" in text)
    assert "$ACCOUNT " not in (Path(__file__).resolve().parents[2] / "slurm" / "12_hpc_operations.sbatch").read_text()
    # and it names all four things the job runs (pbs/12_hpc_operations.pbs launches tuning.py too)
    job = (Path(__file__).resolve().parents[2] / "pbs" / "12_hpc_operations.pbs").read_text()
    assert "scripts/12_hpc_operations/tuning.py" in job
    assert "the profiles with NCCL kernels, and the tuning tables on the job's GPUs" in text


def test_exercise_2_says_what_journals_hold():
    # the learner writes missing_ranks(journals, label): the cell gives the container's shape, the keys of a call as
    # distlab.hangs writes them, and how to get the run's journals
    import inspect

    from distlab import hangs

    text = _markdown("## Exercise 2")
    source = inspect.getsource(hangs)
    assert 'json.dumps({"rank": self.rank, "state": self.state, "calls": self.calls})' in source
    assert ('entry = {"label": label, "op": op, "group": group, "members": list(members or []), "peer": peer,'
            in source)
    assert ("`journals` maps each rank (an `int`) to its journal, a dict whose `\"calls\"` lists the rank's calls in "
            "order.") in text
    assert ("Each call is a dict with `label`, `op`, `group`, `members` (the group's ranks; empty for a send or a "
            "receive) and `done`") in text
    cells = json.loads(LAB.read_text())["cells"]
    check = next("".join(c["source"]) for c in cells if "check_missing_ranks" in "".join(c["source"]))
    assert 'journals = {int(rank): journal for rank, journal in skipped.metrics["extra"]["journals"].items()}' in check
    assert '`{int(r): j for r, j in skipped.metrics["extra"]["journals"].items()}`' in text


def test_the_timelines_title_says_which_steps_it_covers():
    # the drawing is the first active step (profiling.timeline, first_step_only); the title's overlap both steps
    import inspect

    from distlab import profiling

    assert "first_step_only" in inspect.signature(profiling.timeline).parameters
    text = _markdown("### The backward overlap, measured")
    assert ("The title's numbers cover both active steps; the drawing, and Exercise 1's check on this run, the first "
            "only.") in text
    cells = json.loads(LAB.read_text())["cells"]
    title = next("".join(c["source"]) for c in cells if "def draw_timeline" in "".join(c["source"]))
    assert "ms of communication in 2 steps; drawn: the first)" in title
    assert "run `qsub pbs/12_hpc_operations.pbs`" not in text



def test_a_wrong_placement_is_not_told_the_expected_one():
    """The message names the first wrong rank and why, never the place it should have (a wrong guess must not read
    the answer off the checker)."""
    nodefile, want = ch12.PLACEMENT_CASES[0]
    got = [(str(h), int(l)) for h, l in wrong_local_rank_is_the_rank(list(nodefile))]
    first_wrong = next(r for r, (g, w) in enumerate(zip(got, want)) if g != w)
    with pytest.raises(ExerciseWrong) as wrong:
        ch12.check_placement(wrong_local_rank_is_the_rank)
    message = str(wrong.value)
    assert f"rank {first_wrong} got" in message and str(want[first_wrong]) not in message


def test_a_wrong_answer_on_a_hand_made_case_shows_that_cases_input():
    # a learner told "journal set #3" or "node file #2" must be able to test against it: the message shows the case's
    # input (the journals' calls, the node file's lines) or, for a timeline whose numbers would name the answer, says
    # what it holds and how to read its rows; never its answer (test_exercises_never_give_the_answer.py)
    with pytest.raises(ExerciseWrong) as wrong:
        ch12.check_missing_ranks(lambda journals, label: [0])
    assert ("journal set #1 (rank 0: sync, barrier*; rank 1: sync, barrier*; rank 2: sync, barrier*; rank 3: sync, "
            "end*; * waiting)") in str(wrong.value)
    with pytest.raises(ExerciseWrong) as wrong:
        ch12.check_placement(wrong_local_rank_is_the_rank)
    assert "node file #1 (8 lines: n1 n1 n1 n1 n2 n2 n2 n2)" in str(wrong.value)
    with pytest.raises(ExerciseWrong) as wrong:
        ch12.check_hidden_communication(lambda rows: 99.0)
    said = str(wrong.value)
    assert "`from labkit.exercises.ch12 import TIMELINE_CASES; TIMELINE_CASES[0]`" in said
    namespace = {}
    exec(said.split("its rows: `")[1].split("`")[0].replace("; ", "\n"), namespace)   # the line runs as given


def test_the_labs_kinds_and_exercise_1_say_what_is_checked_and_what_hides():
    """A closing review (s14): the four kinds partition the trace's step spans, so they add up to those by
    construction; what profile_step.py checks is that the spans cover its own clock's time, within its tolerance. A
    learner's review (s14): Exercise 1 counts communication where backward's span and compute both hold, so the lab
    says that backward's span has gaps with no compute, which hide nothing (ch12.check_hidden_communication's slip)."""
    import re

    profile = (Path(__file__).resolve().parents[2] / "scripts" / "12_hpc_operations" / "profile_step.py").read_text()
    fraction = float(re.search(r"^KINDS_TOLERANCE_FRACTION = ([\d.]+)", profile, flags=re.M).group(1))
    seconds = float(re.search(r"^KINDS_TOLERANCE_SECONDS = ([\d.]+)", profile, flags=re.M).group(1))
    kinds = _markdown("Time per kind on each rank, from its own trace:")
    assert "The four add up to the active steps' wall time." not in kinds
    assert ("The four split each active step's span in the trace, so they add up to those spans by construction. What "
            "the script checks is that the spans cover the time it measured with its own clock, within "
            f"{100 * fraction:.0f}% + {1000 * seconds:.0f} ms.") in kinds
    exercise = _markdown("## Exercise 1: read a timeline and say what overlaps")
    assert ("Backward's span has gaps in which nothing computes (Python, waiting): communication there hides "
            "nothing.") in exercise
