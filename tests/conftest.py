import sys
from pathlib import Path

# tests/helpers.py is importable as `helpers` from every test tier
sys.path.insert(0, str(Path(__file__).resolve().parent))

import atexit
import os
import shutil
import tempfile

# The learner's notebook copies (tests/notebooks) replay the script runs their full notebooks made earlier
# in this session (nbval runs them first: see the Makefile's order and the hooks below). Kernels inherit this variable.
# `make test` makes it (and removes it); a pytest run without it makes its own and removes it at exit.
if "DISTLAB_LAUNCH_CACHE" not in os.environ:
    os.environ["DISTLAB_LAUNCH_CACHE"] = tempfile.mkdtemp(prefix="distlab-replay-")
    atexit.register(shutil.rmtree, os.environ["DISTLAB_LAUNCH_CACHE"], ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--expect-replays", action="store_true",
                     help="the learner's copies: every run a cell shared with its full notebook starts must be "
                          "replayed from the run the full notebook made earlier in this make test")
    parser.addoption("--shuffle-files", type=int, default=None, metavar="SEED",
                     help="run the test files in an order drawn with SEED (each file's tests keep their order): "
                          "a test that passes only after, or only beside, another shows up as a failure")


# The file whose tests wait longest on a clock they cannot hurry (the Slurm cluster's jobs: a time limit's warning comes
# at slurmctld's 30 s check, a requeue starts the job again): first, so that the other workers' files fill that wait.
WAITS_LONGEST = "tests/slurm/test_slurm_jobs.py"
# The unit files that take 10 s or more in make test (BENCHMARKS.md, the seventeenth session): first among the unit
# files, which end the phase, so that it ends on short files. A long file handed out last kept one worker busy for
# 25 s after the other had finished. (Only the order changes: a file missing here runs all the same.)
LONG_UNIT_FILES = ("tests/unit/test_site.py", "tests/unit/test_planner_dry_run.py", "tests/unit/test_forkserver.py",
                   "tests/unit/test_figures.py", "tests/unit/test_chapter_text_11.py", "tests/unit/test_planner.py")


def pytest_collection_modifyitems(config, items):
    """The order pytest-xdist hands the files out in (make test's first phase takes them in collection order:
    --no-loadscope-reorder): the file that waits longest first, then the command line's order, the long unit files
    first among the unit files. --shuffle-files=SEED: an order drawn with SEED instead; every worker draws the same
    one (the same seed over the same collection). Either way the learner's copies come after the full notebooks."""
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    seed = config.getoption("shuffle_files")
    if seed is None:
        files.sort(key=lambda name: name != WAITS_LONGEST)                # stable: the rest keep their order
        long_units = [name for name in LONG_UNIT_FILES if name in files]
        rest = [name for name in files if name not in long_units]
        first_unit = next((i for i, name in enumerate(rest) if name.startswith("tests/unit/")), len(rest))
        files = rest[:first_unit] + long_units + rest[first_unit:]
    else:
        import random

        random.Random(seed).shuffle(files)
    # the learner's copies right after the last full notebook, whatever the order asked: a copy waits for its
    # notebook (helpers.wait_for_full_notebook), and a notebook handed out after it could be queued behind it
    copies = [name for name in files if name.startswith("tests/notebooks/")]
    files = [name for name in files if name not in copies]
    after_notebooks = 1 + max((i for i, name in enumerate(files) if name.endswith(".ipynb")), default=-1)
    files[after_notebooks:after_notebooks] = copies
    rank = {name: index for index, name in enumerate(files)}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])   # stable: a file's tests keep their order


class FullNotebooksRun:
    """Counts the cells a full notebook has left to run in this process (nbval: one test a code cell; one worker
    runs a whole notebook); when none is left, a file under the replay cache says so, and its learner's copy, which
    replays its runs, may start (helpers.wait_for_full_notebook). A plugin, not this file's hooks: a conftest's
    test hooks see only the tests under its own folder, and the notebooks are not under tests/."""

    def __init__(self):
        self.cells_left: dict[str, int] = {}

    def pytest_collection_finish(self, session):
        for item in session.items:
            path = item.nodeid.split("::")[0]
            if path.endswith(".ipynb"):
                self.cells_left[path] = self.cells_left.get(path, 0) + 1

    def pytest_runtest_logfinish(self, nodeid, location):
        path = nodeid.split("::")[0]
        if path in self.cells_left:
            self.cells_left[path] -= 1
            if self.cells_left[path] == 0:
                from helpers import full_notebook_done

                done = full_notebook_done(Path(path).name)
                done.parent.mkdir(parents=True, exist_ok=True)
                done.touch()


def pytest_configure(config):
    """make test (DISTLAB_FORK_SERVER=1): one fork server for the whole run, started before the workers, so every
    worker, notebook kernel and subprocess forks its CPU launches from a process that imported torch once, instead
    of each importing it in a server of its own (2.4 s each; 28 kernels in make test)."""
    config.pluginmanager.register(FullNotebooksRun(), "full-notebooks-run")
    from labkit import forkserver

    if os.environ.get(forkserver.ENABLE_ENV) == "1" and not os.environ.get(forkserver.SOCKET_ENV):
        forkserver.start_server()
        # and torchrun's agents and ranks fork from it too (labkit.forkexec), except where a test asks for the
        # real interpreter (tests/scripts/test_launch.py keeps one job that way)
        from helpers import scheduler_python
        from labkit import launch

        os.environ[launch.RANK_PYTHON_ENV] = scheduler_python()
        # and the notebooks' kernels (make test names the kernel, python3, instead of nbval's current environment)
        from helpers import forked_kernels

        os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [forked_kernels(), os.environ.get("JUPYTER_PATH")]))
