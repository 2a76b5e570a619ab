"""Chapter 14's registry (labkit.broken_runs): every entry well formed, every script accepts its arguments (parsed
in this process by the script's own parser, no launch), and the runs tests/scripts/test_14 leaves to an earlier
chapter's test are really run there."""

from __future__ import annotations

import argparse
import ast
import json
import runpy
import sys
from pathlib import Path

import pytest

from labkit import broken_runs

ROOT = Path(__file__).resolve().parents[2]
RUNS = broken_runs.BROKEN_RUNS


class _Parsed(Exception):
    """Raised by the patched parse_args once the script's parser has accepted its arguments."""

    def __init__(self, namespace):
        super().__init__("parsed")
        self.namespace = namespace


def parse_with_the_scripts_parser(script: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """Run ``script`` as __main__ up to its ``parse_args()`` and return what that parsed: argparse's own refusal
    (an unknown flag, a choice it does not have) is a SystemExit, as on the command line."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.syspath_prepend(str((ROOT / script).parent))   # the script's sibling imports
    monkeypatch.chdir(ROOT)
    with pytest.raises(_Parsed) as parsed:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    return parsed.value.namespace


def every_command():
    for run in RUNS:
        for role, args in (("broken", run.args), ("fixed", run.fixed_args), ("prepare", run.prepare_args),
                           ("fixed-prepare", run.fixed_prepare_args),
                           *((f"wrong-fix-{i}", a) for i, (a, _) in enumerate(run.wrong_fixes))):
            if args or role in ("broken", "fixed"):
                yield pytest.param(run, list(args), id=f"{run.name}-{role}")


@pytest.mark.parametrize("run, args", list(every_command()))
def test_every_script_accepts_its_arguments(run, args, monkeypatch, tmp_path):
    namespace = parse_with_the_scripts_parser(run.script, broken_runs.fill(args, tmp_path), monkeypatch)
    if "--planted-bug" in args:
        assert namespace.planted_bug == run.name   # the case's name is the script's --planted-bug value
    if "--hang" in args and args[args.index("--hang") + 1] != "none":
        assert namespace.hang == run.name


def test_an_argument_the_script_does_not_have_is_refused(monkeypatch):
    """The check above can fail: a planted bug the script does not define stops argparse."""
    with pytest.raises(SystemExit):
        parse_with_the_scripts_parser(broken_runs.TRAIN_DDP, ["--planted-bug", "not-a-bug"], monkeypatch)


def test_the_registry_is_well_formed():
    names = [run.name for run in RUNS]
    assert len(names) == len(set(names)) and len(names) >= 12
    assert [run.family for run in RUNS] == sorted((run.family for run in RUNS), key=broken_runs.FAMILIES.index)
    assert set(broken_runs.FAMILIES) == {run.family for run in RUNS}   # every family has a case
    for run in RUNS:
        assert run.name.islower() and " " not in run.name and (ROOT / run.script).exists(), run.name
        assert run.args != run.fixed_args and run.fix_kind in ("setting", "function"), run.name
        # a check that fails, a journal's diagnosis, or one rank's error named by torch's failure summary
        assert [bool(run.failing_checks), run.hang, bool(run.first_failure)].count(True) == 1, run.name
        assert all(look != run.name for look in run.look_alikes) and run.look_alikes, run.name
        for look in run.look_alikes:   # another case, or a plausible wrong cause in words
            assert look in names or " " in look, (run.name, look)
        for text in (run.symptom, run.cause, run.tell_apart, run.fix):
            assert text.endswith((".", ")")) and len(text) > 30, (run.name, text)
        assert "{run_dir}" in " ".join(run.args) or not run.prepare_args, run.name
        assert all(key.split(".")[0] in ("checks", "losses", "comm", "extra", "throughput", "timeline", "output")
                   for key in run.evidence), run.name   # output: the lines the run printed, its errors


def test_the_dropped_dropout_case_says_why():
    assert "dropout" in broken_runs.__doc__ and "no dropout" in broken_runs.__doc__


def test_symptom_and_fix_checks_read_the_metrics():
    run = broken_runs.case("loss-on-wrong-stage")
    broken = {"checks": [{"name": "losses equal the single-device run's", "passed": False},
                         {"name": "the loss fell", "passed": False},
                         {"name": "parameters after training equal the single-device run's", "passed": True}]}
    assert broken_runs.symptom_seen(run, broken) == []
    assert broken_runs.fix_holds(run, broken)   # a fixed run may not fail them
    fixed = {"checks": [dict(c, passed=True) for c in broken["checks"]]}
    assert broken_runs.fix_holds(run, fixed) == [] and broken_runs.symptom_seen(run, fixed)
    assert broken_runs.fix_holds(run, {"checks": fixed["checks"][2:]}) == [
        "check 'losses equal the single-device run's...' did not run", "check 'the loss fell...' did not run"]
    hang = broken_runs.case("uneven-inputs")
    assert broken_runs.symptom_seen(hang, {"checks": [], "extra": {"cause": "skipped collective"}}) == []
    assert broken_runs.symptom_seen(hang, {"checks": [], "extra": {"cause": "none"}})
    assert broken_runs.fix_holds(hang, {"checks": [], "extra": {"cause": "skipped collective"}})
    assert broken_runs.symptom_seen(hang, None) == ["the run wrote no metrics"]


# torch's failure summary as torchrun ends with it (torch 2.13, a CPU run of the case under torchrun: rank 3 raised,
# ranks 0 and 2 failed on gloo's lost peer while the agent stopped them, rank 1 only got the agent's SIGTERM)
TORCHRUN_ENDS = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
scripts/04_data_parallel/train_ddp.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_04:18:01
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 28770)  (SIGTERM)
  error_file: /tmp/torchelastic_x/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
    File "scripts/04_data_parallel/train_ddp.py", line 481, in main
      loss.backward()
  RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:44187.
  
  At:
    scripts/04_data_parallel/train_ddp.py(180): finished
  
[2]:
  time      : 2026-12-03_04:18:03
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 28771)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 28771
[3]:
  time      : 2026-12-03_04:18:01
  host      : localhost
  rank      : 2 (local_rank: 2)
  exitcode  : -15 (pid: 28772)  (SIGTERM)
  error_file: /tmp/torchelastic_x/attempt_0/2/error.json
  traceback : Traceback (most recent call last):
  RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:45200.
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_04:17:59
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : 1 (pid: 28773)
  error_file: /tmp/torchelastic_x/attempt_0/3/error.json
  traceback : Traceback (most recent call last):
    File "torch/nn/functional.py", line 2615, in embedding
      return torch.embedding(weight, input, padding_idx, scale_grad_by_freq, sparse)
  IndexError: index out of range in self
  
============================================================
"""


def test_the_failure_summary_is_read_as_torch_writes_it():
    failures = broken_runs.failure_summary("[rank3]: a line of a rank's own\n" + TORCHRUN_ENDS)
    assert [(f["rank"], f["root"], f["exitcode"]) for f in failures] == [(3, True, 1), (0, False, -15), (1, False, -15),
                                                                         (2, False, -15)]
    assert failures[0]["error"] == "IndexError: index out of range in self"
    assert failures[1]["error"].startswith("RuntimeError: [../gloo") and failures[2]["error"].startswith("Signal 15")
    assert broken_runs.failure_summary("Traceback (most recent call last):\nIndexError: x\n") is None
    no_record = TORCHRUN_ENDS.replace("  traceback : Traceback (most recent call last):\n    File \"torch/nn/func"
                                      "tional.py\", line 2615, in embedding\n      return torch.embedding(weight, "
                                      "input, padding_idx, scale_grad_by_freq, sparse)\n  IndexError: index out of "
                                      "range in self", "  traceback : To enable traceback see: https://pytorch.org/"
                                      "docs/stable/elastic/errors.html")
    assert broken_runs.failure_summary(no_record)[0]["error"].startswith("To enable traceback see")


def _torchrun_summary(tmp_path, errors: dict[int, tuple[int, str]]) -> str:
    """torch's own ChildFailedError message, as torchrun's agent builds it: one ProcessFailure a failed rank, in rank
    order (one poll looks at the ranks in order: torch/distributed/elastic/multiprocessing/api.py:967-980), each
    reading the error file @record writes ({rank: (whole-second timestamp, the traceback's last line)})."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {}
    for rank in range(4):
        path = tmp_path / f"{rank}.json"
        if rank in errors:
            timestamp, error = errors[rank]
            path.write_text(json.dumps({"message": {"message": error, "extraInfo": {
                "py_callstack": f"Traceback (most recent call last):\n  File \"x.py\", line 1, in main\n{error}\n",
                "timestamp": str(timestamp)}}}))
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1 if rank in errors else -15,
                                        error_file=str(path))
    return ChildFailedError("train_ddp.py", failures).format_msg()


def test_torchruns_root_cause_in_one_second_is_the_lowest_rank_and_the_case_is_still_read(tmp_path):
    """torch names the failure with the smallest timestamp, in whole seconds, the first found of equals (errors/
    __init__.py:155-157, 248-250). Rank 2, losing rank 3 in the same second, is named the root cause (as CI saw on
    2 loaded cores): the case is still shown by rank 3's IndexError under "Failures" at the same time. A second
    apart, the root cause is the earlier rank's, and a lost peer named first a second before is not this case."""
    run = broken_runs.case("token-out-of-vocabulary")
    lost = "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:39125."
    index = "IndexError: index out of range in self"
    tied = broken_runs.failure_summary(_torchrun_summary(tmp_path, {2: (1000, lost), 3: (1000, index)}))
    three = next(f for f in tied if f["rank"] == 3)
    assert (tied[0]["rank"], tied[0]["error"], three["root"], three["error"]) == (2, lost, False, index)
    assert three["time"] == tied[0]["time"] and len({f["time"] for f in tied}) == 2   # ranks 0, 1: the agent's clock
    assert broken_runs.symptom_seen(run, None, _torchrun_summary(tmp_path, {2: (1000, lost), 3: (1000, index)})) == []
    later = broken_runs.failure_summary(_torchrun_summary(tmp_path, {2: (1001, lost), 3: (1000, index)}))
    assert (later[0]["rank"], later[0]["error"]) == (3, index)
    assert "the summary's root cause is rank 2, not rank 3" in broken_runs.symptom_seen(
        run, None, _torchrun_summary(tmp_path, {2: (1000, lost), 3: (1001, index)}))
    one_error = {2: (1000, lost), 3: (1000, lost)}   # rank 3 lost a peer too: no rank's own exception
    assert broken_runs.symptom_seen(run, None, _torchrun_summary(tmp_path, one_error)) == [
        f"the root cause's error is {lost!r}, not {index!r}"]


def test_an_error_one_rank_raises_is_read_in_the_output():
    """The summary must name the case's rank and error as the root cause, with every other rank failed or stopped; a
    run that wrote its metrics ran to its end. Without a summary (mpiexec, srun), the error's words are enough."""
    run = broken_runs.case("token-out-of-vocabulary")
    assert run.first_failure[0] == 3 and broken_runs.symptom_seen(run, None, TORCHRUN_ENDS) == []
    assert broken_runs.symptom_seen(run, None, TORCHRUN_ENDS.replace("rank      : 3", "rank      : 1")) == [
        "the summary's root cause is rank 1, not rank 3"]
    assert broken_runs.symptom_seen(run, {"checks": []}, TORCHRUN_ENDS) == [
        "the run wrote its metrics: it ran to its end"]
    assert broken_runs.symptom_seen(run, None, None)
    three = TORCHRUN_ENDS[:TORCHRUN_ENDS.index("[2]:")] + TORCHRUN_ENDS[TORCHRUN_ENDS.index("[3]:"):]
    assert broken_runs.symptom_seen(run, None, three) == ["the summary lists 3 failed ranks of 4: some rank went on"]
    # on a GPU, rank 3's own NCCL watchdog may abort it (SIGABRT) before @record writes: the summary's root cause is
    # that rank's signal, and its log holds the assert
    aborted = "[rank3]: Process group watchdog thread terminated with exception: CUDA error: device-side assert " \
              "triggered\n" + TORCHRUN_ENDS.replace("exitcode  : 1 (pid: 28773)", "exitcode  : -6 (pid: 28773)")
    aborted = aborted[:aborted.index("  traceback : Traceback", aborted.index("Root Cause"))] + \
        "  traceback : Signal 6 (SIGABRT) received by PID 28773\n" + "=" * 60 + "\n"
    assert broken_runs.failure_summary(aborted)[0]["error"].startswith("Signal 6")
    assert broken_runs.symptom_seen(run, None, aborted) == []
    assert broken_runs.symptom_seen(run, None, aborted[aborted.index("\n") + 1:]) == [
        "the root cause's error is 'Signal 6 (SIGABRT) received by PID 28773', not 'IndexError: index out of range "
        "in self'"]   # a SIGABRT with no assert in the log is not this case
    on_gpu = "[rank3]: torch.AcceleratorError: CUDA error: device-side assert triggered\n"
    assert broken_runs.symptom_seen(run, None, on_gpu) == []   # mpiexec or srun: no summary, the error's words
    assert broken_runs.symptom_seen(run, None, "RuntimeError: Connection closed by peer\n") == [
        "no rank's output says 'IndexError: index out of range in self'"]


def test_the_command_line_check_reads_the_output_of_an_error(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text(TORCHRUN_ENDS)
    assert broken_runs.main(["check", "token-out-of-vocabulary", str(tmp_path / "absent.json"), "--output", str(log)]) \
        == 0
    assert broken_runs.main(["check", "token-out-of-vocabulary", str(tmp_path / "absent.json")]) == 1
    assert "token-out-of-vocabulary: broken as planted" in capsys.readouterr().out


def test_the_command_line_check_exits_1_unless_the_symptom_is_there(tmp_path, capsys):
    metrics = tmp_path / "m.json"
    metrics.write_text(json.dumps({"checks": [{"name": "no straggler: every rank ...", "passed": False}]}))
    assert broken_runs.main(["check", "slow-rank", str(metrics)]) == 0
    assert broken_runs.main(["check", "slow-rank", str(metrics), "--fixed"]) == 1
    assert broken_runs.main(["check", "slow-rank", str(tmp_path / "absent.json")]) == 1
    out = capsys.readouterr().out
    assert "slow-rank: broken as planted" in out and "NOT fixed" in out and "wrote no metrics" in out


def test_runs_left_to_an_earlier_chapters_test_are_run_there_with_the_same_arguments():
    """tests/scripts/test_14 does not launch these again: the named test must exist and launch the same script
    with every one of the case's arguments (a run folder aside)."""
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    try:
        from test_14_when_it_goes_wrong import COVERED_ELSEWHERE
    finally:
        sys.path.remove(str(ROOT / "tests" / "scripts"))
    assert COVERED_ELSEWHERE
    for (name, fixed), (path, test_name) in COVERED_ELSEWHERE.items():
        run = broken_runs.case(name)
        tree = ast.parse((ROOT / path).read_text())
        test = next((node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == test_name), None)
        assert test is not None, f"{path} has no {test_name}"
        source = ast.get_source_segment((ROOT / path).read_text(), test)
        decorators = "".join(ast.get_source_segment((ROOT / path).read_text(), d) for d in test.decorator_list)
        constants = {node.targets[0].id for node in tree.body if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Constant) and node.value.value == run.script}
        assert run.script in source or any(constant in source for constant in constants), (name, path)
        prepare, args = (run.fixed_prepare_args, run.fixed_args) if fixed else (run.prepare_args, run.args)
        for arg in (*prepare, *args):
            if arg not in ("{run_dir}",) and not arg.startswith("{"):
                assert f'"{arg}"' in source + decorators, f"{name}: {arg} not in {path}::{test_name}"


def test_a_one_shard_resume_without_its_file_or_on_other_ranks_stops_with_one_line(tmp_path, monkeypatch):
    """checkpoint-one-shard's resume loads rank 0's file: absent (a clean run's checkpoint) or shaped for another
    world size, it is a config error (one line, exit 2) before any rank loads, not a traceback on every rank."""
    from distlab import runtime

    run = broken_runs.case("checkpoint-one-shard")
    args = parse_with_the_scripts_parser(run.script, broken_runs.fill(run.args, tmp_path), monkeypatch)
    import checkpoint_resume   # on sys.path: the parse above put the script's folder there

    step = tmp_path / "step_000002"
    step.mkdir()
    (step / ".metadata").touch()
    step.with_suffix(".json").write_text(json.dumps({"world_size": 4, "step": 2}))
    with pytest.raises(runtime.ConfigError, match="is missing"):
        checkpoint_resume.check_config(args, 4)
    (step / checkpoint_resume.ONE_RANKS_MODEL).touch()
    checkpoint_resume.check_config(args, 4)
    with pytest.raises(runtime.ConfigError, match="fit 4 ranks, not 2"):
        checkpoint_resume.check_config(args, 2)


def test_a_slow_rank_the_straggler_check_cannot_see_is_a_config_error(monkeypatch, tmp_path):
    """profile_step checks stragglers under DDP only, and slows rank 1: under FSDP or on one rank the planted
    fault would pass unnoticed, so it stops with one line instead."""
    from distlab import runtime

    run = broken_runs.case("slow-rank")
    args = parse_with_the_scripts_parser(run.script, broken_runs.fill(run.args, tmp_path), monkeypatch)
    import profile_step   # on sys.path: the parse above put the script's folder there

    profile_step.check_config(args, 4)
    for strategy, world in (("fsdp", 4), ("ddp", 1)):
        with pytest.raises(runtime.ConfigError, match="slow-rank"):
            profile_step.check_config(argparse.Namespace(**{**vars(args), "strategy": strategy}), world)


def test_a_loss_read_on_rank_0_under_a_v_schedule_is_a_config_error(monkeypatch, tmp_path):
    """Under a V schedule rank 0 holds the first and the last stage: loss-on-wrong-stage would read the right
    loss there and pass every check, so it stops with one line instead."""
    from distlab import runtime

    run = broken_runs.case("loss-on-wrong-stage")
    args = parse_with_the_scripts_parser(run.script, broken_runs.fill(run.args, tmp_path), monkeypatch)
    import pp_train   # on sys.path: the parse above put the script's folder there

    pp_train.resolve_training_flags(args)   # the script's own defaults (--layers), as main() fills them
    pp_train.check_config(args, 4)
    v_shaped = argparse.Namespace(**{**vars(args), "schedule": "ZBVZeroBubble", "stages_per_rank": None})
    with pytest.raises(runtime.ConfigError, match="rank 0 holds the last stage"):
        pp_train.check_config(v_shaped, 4)


def test_the_uneven_inputs_fix_given_to_another_hang_is_a_config_error(monkeypatch, tmp_path):
    from distlab import runtime

    run = broken_runs.case("uneven-inputs")
    args = parse_with_the_scripts_parser(run.script, broken_runs.fill(run.fixed_args, tmp_path), monkeypatch)
    import deadlocks   # on sys.path: the parse above put the script's folder there

    deadlocks.check_config(args, 4)
    with pytest.raises(runtime.ConfigError, match="changes nothing under --hang mismatched-collectives"):
        deadlocks.check_config(argparse.Namespace(**{**vars(args), "hang": "mismatched-collectives"}), 4)
