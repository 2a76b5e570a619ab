"""coursetools: what builds and checks the course, run from the Makefile; a learner never needs to read it.

site             make site: the course laid out as a Sphinx source folder (chapters, labs, scripts, jobs)
site_check       make site-check: the website read in headless Chromium (DevTools protocol)
lab_check        make lab-check: every lab and learner's copy run in JupyterLab in headless Chromium
student          make student: the learner's copies of the notebooks; the notebooks' normal form
prose            make prose: how long the course's sentences are (the one measure the style test uses)
figures          make figures: the chapters' pictures, drawn from the library's own functions
drawings         each chapter's pictures of its mechanisms, a module a chapter (figures gathers them)
chapters         a chapter's pages, and the teach-first shape every chapter keeps (test_teach_first)
gpu_check        make gpu-check: every script on the GPUs present, one JSON summary and a table
gpu_ladder       make gpu-ladder: chapter 01's ladder on one GPU, rung by rung, and where the best step's time goes
demo_report      one HTML summary of a PBS job's runs, for an instructor (pbs/instructor_demo.pbs)
slurm_cluster    make test's Slurm tier: a real two-node Slurm cluster on this machine (munged, slurmctld, two slurmd)
test_timeline    where make test's time goes: each test file's wall time and the idle cores it leaves
jobs             the batch jobs' rules (jobs/common.sh calls it) and `python -m coursetools.jobs submit`
"""
