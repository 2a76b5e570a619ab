# Two commands on a fresh machine with Python 3.11:  make lab   |   make test
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
LAB_ARGS ?=
# Jupyter refuses to run as root unless told; containers and some workshop VMs run as root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
PYTEST_ARGS ?=

.PHONY: lab test venv student student-check unit scripts notebooks pbs slurm clean site site-check lab-check

# The virtualenv is rebuilt whenever the pins change.
$(STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# pip 23 or newer; a venv's own pip usually is already, and asking the index says so only after a round trip
	$(PY) -c 'import sys, pip; sys.exit(int(pip.__version__.split(".")[0]) < 23)' || $(PY) -m pip install --quiet --upgrade "pip>=23"
	$(PY) -m pip install --quiet --no-compile -r requirements.txt -c constraints.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e . || $(PY) -m pip install --quiet --no-deps -e .
	@# The bytecode pip would compile one package after another (30 s of CPU), compiled on every core at once;
	@# without it four ranks starting together would each compile torch's modules themselves. A file of a package
	@# that does not compile under this Python (pip skips those too) stops nothing. The packages' own test suites
	@# (tests/ folders: sympy's and numpy's, 2,000 files) are never imported here: skipping them saves 8 s of CPU.
	$(PY) -m compileall -q -j 0 -x '/tests?/' $(VENV)/lib >/dev/null 2>&1 || true
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (distlab)" >/dev/null
	touch $(STAMP)

venv: $(STAMP)

## Open the course in JupyterLab (learner copies in notebooks/student/)
## JupyterLab's settings for the course: no "notified about official Jupyter news?" prompt over the first lab
## (and no news fetch: compute nodes have no internet anyway), installed where JupyterLab reads overrides
LAB_OVERRIDES := $(VENV)/share/jupyter/lab/settings/overrides.json
$(LAB_OVERRIDES): jupyter/overrides.json $(STAMP)
	mkdir -p $(dir $@) && cp jupyter/overrides.json $@

lab: $(STAMP) $(LAB_OVERRIDES)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(ROOT_FLAG) $(LAB_ARGS)

NOTEBOOKS := $(wildcard notebooks/[0-9][0-9]_*.ipynb)

## Every test, in two phases. First, on three pytest workers (on two cores: a worker waiting on a clock leaves its
## core to the other two; with two, 218 of the phase's 1,074 core-seconds were idle and it took 536 s, with three 74
## idle and 467 s), which take the files in this order: the Slurm and PBS tiers (the Slurm jobs file first: its jobs
## wait on the cluster's clock for minutes, time the other workers spend on other files), scripts (4 CPU ranks), the notebooks (nbval), the learner's copies, and the unit tests (the long ones
## first; the short ones fill the end of the phase). --no-loadscope-reorder: pytest-xdist's own order is the files with
## the most tests first, which started the Slurm jobs file 6 minutes in, beside nothing (tests/conftest.py sets the
## order). A 4-rank job leaves a core idle for much of its life (start-up, rendezvous, the timeouts it waits out), so
## two workers run the same checks in about 60% of the time of one. Each learner's copy waits until its full notebook has run
## its last cell, on either worker, and replays the runs it made (--expect-replays: a copy's cell that starts its run
## again fails the test; DISTLAB_LAUNCH_CACHE, keyed on every input of a run, the files its arguments name among them,
## and restoring the files it left). Then, alone, the timing-sensitive tests. Every worker, notebook kernel and
## subprocess of a phase forks its CPU launches from one server that imported torch once (DISTLAB_FORK_SERVER,
## labkit.forkserver, started by tests/conftest.py): a few hundred launches skip 2.4 s of imports each; the notebooks'
## kernels fork from it too (the python3 kernel tests/conftest.py puts first on JUPYTER_PATH). torch.compile's tests
## (tests/scripts/test_compile.py) build inductor's C++ in the compiling process (TORCHINDUCTOR_COMPILE_THREADS=1: on
## 2 busy cores its pool of workers cost 7 s more) as scalar code (TORCHINDUCTOR_VEC_ISA_OK=0: built from a cold cache
## in 26 s where vectorised code took 39; the tests check what is computed, not how fast). Each test process and
## notebook kernel computes on one thread (OMP_NUM_THREADS=1, as every rank already does): two workers on two cores,
## each with torch's default of a thread a core, fought over them (a unit test's 30 tiny steps took 1.5 s alone and
## 15 s inside make test). Python writes the bytecode of what it compiles (PYTHONDONTWRITEBYTECODE unset, where a
## machine sets it): else every pytest process rewrote every test module's asserts again (a worker's collection took
## 19.7 s of CPU, 9 with the cache), and every process compiled the course's modules again. The writes are atomic, so
## two processes compiling one module agree.
PYTEST_WORKERS ?= 3
test: $(STAMP) $(LAB_OVERRIDES)
	unset PYTHONDONTWRITEBYTECODE && export DISTLAB_FORK_SERVER=1 TORCHINDUCTOR_COMPILE_THREADS=1 TORCHINDUCTOR_VEC_ISA_OK=0 OMP_NUM_THREADS=1 && export DISTLAB_LAUNCH_CACHE=$$(mktemp -d -t distlab-replay-XXXXXX) && trap 'rm -rf "$$DISTLAB_LAUNCH_CACHE"' EXIT && \
	$(PY) -m pytest tests/slurm tests/pbs tests/scripts $(NOTEBOOKS) tests/notebooks tests/unit --nbval-lax --nbval-kernel-name=python3 \
		--nbval-kernel-startup-timeout=180 -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not serial" --expect-replays $(PYTEST_ARGS) && \
	$(PY) -m pytest tests/scripts -m serial $(PYTEST_ARGS)

unit: $(STAMP)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)
scripts: $(STAMP)
	$(PY) -m pytest tests/scripts $(PYTEST_ARGS)
notebooks: $(STAMP)
	$(PY) -m pytest $(NOTEBOOKS) tests/notebooks --nbval-lax --nbval-current-env --nbval-kernel-startup-timeout=180 $(PYTEST_ARGS)
pbs: $(STAMP)
	$(PY) -m pytest tests/pbs $(PYTEST_ARGS)
## The Slurm tier alone: a real two-node Slurm cluster on this machine (coursetools/slurm_cluster.py; installs
## Debian's slurmctld, slurmd, slurm-client and munge when missing, as root)
slurm: $(STAMP)
	$(PY) -m pytest tests/slurm $(PYTEST_ARGS)

## How long the course's sentences are (chapters, labs' markdown, READMEs, CONTRIBUTING): mean <= 20 words, none over 40
.PHONY: prose
prose: $(STAMP)
	$(PY) -m coursetools.prose $(PROSE_ARGS)

## Regenerate the learner's notebooks from the full ones
student: $(STAMP)
	$(PY) -m coursetools.student notebooks

student-check: $(STAMP)
	$(PY) -m coursetools.student notebooks --check

clean:
	rm -rf $(VENV) .pytest_cache

## On a machine with NVIDIA GPUs: every chapter script on them, the baseline's MFU, memory model vs allocator,
## bandwidths; one JSON summary + a table in build/gpu_check/ (under 10 minutes; exit 2 without a GPU)
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(PY) -m coursetools.gpu_check $(GPU_CHECK_ARGS)

## chapter 01's ladder on one GPU, rung by rung (fp32 ... compiled, batch 16), the best rung profiled; build/gpu_ladder/
.PHONY: gpu-ladder
gpu-ladder: $(STAMP)
	$(PY) -m coursetools.gpu_ladder $(GPU_LADDER_ARGS)

## The chapters' pictures (chapters/figures/*.png), drawn by coursetools.figures from the library's own functions
.PHONY: figures
figures: $(STAMP)
	$(PY) -m coursetools.figures chapters/figures

## The course as a website in build/site/html: chapters, labs run on the CPU (cached: an unchanged lab is not run
## again; a failing cell fails the build), scripts and jobs as source (coursetools.site, Sphinx + MyST-NB, book/conf.py).
## Offline: open build/site/html/index.html, or `python -m http.server -d build/site/html`.
SITE := build/site
site: $(STAMP)
	$(PY) -m coursetools.site --out $(SITE)
	DISTLAB_STATIC_WIDGETS=1 DISTLAB_SITE_OUT=$(SITE) $(VENV)/bin/sphinx-build -W --keep-going -q -b html -c book \
		$(SITE)/source $(SITE)/html -d $(SITE)/doctrees
	@echo "the site: $(SITE)/html/index.html (or: python -m http.server -d $(SITE)/html)"

## The website as a reader meets it: headless Chromium (Debian's package) opens every page at desktop and phone
## widths; console errors, images that did not load, a search that finds nothing fail it; screenshots kept
site-check: $(STAMP)
	$(PY) -m coursetools.site_check $(SITE)/html --screenshots $(SITE)/screenshots

## Every lab as a learner meets it: JupyterLab (make lab's) over a copy of notebooks/, headless Chromium runs each
## lab and each learner's copy with Run All; an error, a warning shown, a cell left unrun, a widget opened on other
## values than its cell passed fail it (coursetools.lab_check)
lab-check: $(STAMP) $(LAB_OVERRIDES)
	$(PY) -m coursetools.lab_check $(LAB_CHECK_ARGS)
