import sys
from pathlib import Path

# tests/helpers.py is importable as `helpers` from every test tier
sys.path.insert(0, str(Path(__file__).resolve().parent))

import atexit
import os
import shutil
import tempfile

# The learner's notebook copies (tests/notebooks) replay the script runs their full notebooks made earlier
# in this session (nbval runs first: see the Makefile's order). Kernels inherit this variable.
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
# at slurmctld's 30 s check, a requeue starts the job again): first, so that the other worker's files fill that wait.
WAITS_LONGEST = "tests/slurm/test_slurm_jobs.py"


def pytest_collection_modifyitems(config, items):
    """The order pytest-xdist hands the files out in (make test's first phase takes them in collection order:
    --no-loadscope-reorder): the file that waits longest first, then the command line's order. --shuffle-files=SEED:
    an order drawn with SEED instead; every worker draws the same one (the same seed over the same collection)."""
    files = list(dict.fromkeys(item.nodeid.split("::")[0] for item in items))
    seed = config.getoption("shuffle_files")
    if seed is None:
        files.sort(key=lambda name: name != WAITS_LONGEST)                # stable: the rest keep their order
    else:
        import random

        random.Random(seed).shuffle(files)
    rank = {name: index for index, name in enumerate(files)}
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])   # stable: a file's tests keep their order


def pytest_configure(config):
    """make test (DISTLAB_FORK_SERVER=1): one fork server for the whole run, started before the workers, so every
    worker, notebook kernel and subprocess forks its CPU launches from a process that imported torch once, instead
    of each importing it in a server of its own (2.4 s each; 28 kernels in make test)."""
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
