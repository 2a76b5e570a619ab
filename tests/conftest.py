import sys
from pathlib import Path

# tests/helpers.py is importable as `helpers` from every test tier
sys.path.insert(0, str(Path(__file__).resolve().parent))

import os
import tempfile

# The learner's notebook copies (tests/notebooks) replay the script runs their full notebooks made earlier
# in this session (nbval runs first: see the Makefile's order). Kernels inherit this variable.
os.environ.setdefault("DISTLAB_LAUNCH_CACHE", tempfile.mkdtemp(prefix="distlab-replay-"))
