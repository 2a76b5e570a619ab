"""labkit.launch: both launchers give scripts the same job, failures surface clearly, nothing hangs."""

from pathlib import Path

import pytest

from labkit import launch
from helpers import assert_all_checks_passed, assert_config_error, assert_usage_error

PROBE = str(Path(__file__).with_name("probe_job.py"))


@pytest.mark.parametrize("launcher", ["fork", "torchrun"])
def test_both_launchers_give_the_same_job(launcher, monkeypatch):
    # torchrun exactly as a person types it: its agent and ranks new interpreters (make test's other torchrun
    # launches fork them from its server: launch.RANK_PYTHON_ENV)
    monkeypatch.delenv(launch.RANK_PYTHON_ENV, raising=False)
    result = launch.run(PROBE, nproc=4, launcher=launcher, stream=False)
    metrics = assert_all_checks_passed(result)
    assert metrics["world_size"] == 4
    assert [r[:2] for r in metrics["extra"]["ranks"]] == [[r, r] for r in range(4)]


def test_output_is_streamed_live(capsys):
    launch.run(PROBE, nproc=2)
    out = capsys.readouterr().out
    assert out.startswith("$ torchrun --standalone --nproc_per_node=2")
    assert "probe ok: world 2" in out


def test_a_failing_rank_raises_with_the_tail_of_the_output():
    with pytest.raises(launch.LaunchError, match="probe failure on rank 2") as error:
        launch.run(PROBE, nproc=4, args=["--fail-rank", "2"], stream=False, timeout=60)
    assert error.value.result.returncode == 1
    assert error.value.result.seconds < 30, "the other ranks must not wait for a dead peer"


def test_config_error_exits_2_on_every_rank():
    assert_config_error(PROBE, ["--bad-config"], "probe told to fail")


def test_a_zero_flag_ends_as_one_usage_line_on_every_rank():
    # the tracker's example: `domain_train.py --groups 0` once ended in a ZeroDivisionError on every rank
    result = assert_usage_error("scripts/10_domain_parallel/domain_train.py", ["--groups", "0"], "--groups")
    assert "error: argument --groups: must be a positive integer, not 0" in result.output


def test_config_error_under_torchrun():
    assert_config_error(PROBE, ["--bad-config"], "probe told to fail", launcher="torchrun")


@pytest.mark.parametrize("launcher, timeout", [("fork", 3), ("torchrun", 12)])
def test_a_hung_run_is_killed_at_the_timeout_ranks_and_all(launcher, timeout, tmp_path):
    """Nothing outlives a run's timeout. torchrun starts each worker in a session of its own, so a kill of
    torchrun's process group alone left the ranks running (seen: a 1 s limit's run trained 500 steps for 52 s)."""
    with pytest.raises(launch.LaunchError, match=f"did not finish within {timeout} s"):
        launch.run(PROBE, nproc=2, launcher=launcher, args=["--sleep", "60", "--pid-folder", str(tmp_path)],
                   stream=False, timeout=timeout)
    pids = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(pids) == 2, "both ranks had started before the timeout"
    assert [pid for pid in pids if alive(pid)] == []


def alive(pid: int) -> bool:
    """Still running: not gone and not a zombie left for its parent to reap."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_the_replay_cache_returns_the_earlier_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DISTLAB_LAUNCH_CACHE", str(tmp_path))
    # keyed on the probe alone here: distlab may be edited by someone else between the two runs
    # (tests/unit/test_launch_cache.py checks that the real key covers distlab and the chapter's helpers)
    monkeypatch.setattr(launch, "run_dependencies", lambda script: [Path(script)])
    first = launch.run(PROBE, nproc=2, stream=False)
    second = launch.run(PROBE, nproc=2)
    assert second.metrics == first.metrics and second.output == first.output
    assert "replayed" in capsys.readouterr().out
    assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("flag, cause", [("--fail-check", "FAIL] a check told to fail"),
                                         ("--raise-after", "RuntimeError: raised after the run")])
def test_exit_code_is_honest_under_torchrun(flag, cause):
    """Ranks leave through os._exit after a clean run (runtime.start): the exit code must still be 1."""
    result = launch.run(PROBE, nproc=2, args=[flag], launcher="torchrun", stream=False, check=False)
    assert result.returncode == 1 and "exitcode  : 1" in result.output, result.tail()
    assert cause in result.output


TWO_RESUMES = """
import dataclasses, sys
from labkit import broken_runs
case = broken_runs.case("checkpoint-one-shard")   # on 2 ranks here: its check names say 2 ranks, not 4
case = dataclasses.replace(case, failing_checks=tuple(c.replace("4 ranks", "2 ranks").replace("read by 4", "read by 2") for c in case.failing_checks))
variants = {"as the case": None, "another key": case.args + ("--batch", "8")}   # 8 is the default: the same run
order = list(variants) if sys.argv[2] == "forward" else list(variants)[::-1]
for name in order:
    result = broken_runs.run_case(case.name, run_dir=sys.argv[1], nproc=2, args_override=variants[name],
                                  stream=False, timeout=90)
    missing = broken_runs.symptom_seen(case, result.metrics)
    print(f"{name}: {missing or 'the symptom'}", flush=True)
    assert not missing, result.tail()
"""


def test_two_workers_resume_in_one_folder_on_one_cache(tmp_path):
    """make test runs chapter 14's lab and its script tests side by side on one launch cache, in the same run
    folders: each worker runs a checkpoint case's interrupted job, then resumes it, in opposite orders of two resumes
    that share the interrupted job. With a cache that replayed a run's output but not the checkpoint it wrote, the
    worker that came second found an empty folder to resume from ("the run wrote no metrics")."""
    import os
    import subprocess
    import sys

    environment = dict(os.environ, DISTLAB_LAUNCH_CACHE=str(tmp_path / "cache"), DISTLAB_FORK_SERVER="1")
    workers = [subprocess.Popen([sys.executable, "-c", TWO_RESUMES, str(tmp_path / "run"), order],
                                cwd=launch.REPO_ROOT, env=environment, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for order in ("forward", "backward")]
    outputs = [worker.communicate(timeout=240)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], "\n\n".join(outputs)
    assert all(output.count(": the symptom") == 2 for output in outputs), outputs
