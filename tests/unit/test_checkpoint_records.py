"""The fault drill's stop check reads the checkpoint back from disk: planted folders that are not a whole checkpoint,
or not the latest, fail it."""

import warnings
from pathlib import Path

import pytest
import torch

from distlab import checkpointing


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real DCP checkpoint of step 3, saved by one process as rank 0 (DCP saves without a process group)."""
    run_dir = tmp_path_factory.mktemp("run")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 2)).sum().backward()
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "no process group": DCP then saves as a world of one
        path = checkpointing.save(checkpointing.TrainingState(model, optimizer, step=3, rank=0), run_dir)
    return run_dir, path


def test_a_whole_checkpoint_records_its_rank(saved):
    run_dir, path = saved
    assert checkpointing.latest_checkpoint(run_dir) == path == checkpointing.checkpoint_dir(run_dir, 3)
    assert checkpointing.records_every_rank(path, 1)


def test_planted_checkpoints_that_are_not_whole_fail(saved, tmp_path):
    _, path = saved
    # a world of two whose second rank's part is not in the map
    assert not checkpointing.records_every_rank(path, 2)
    # metadata cut short (a save killed while writing it), or not DCP's, or none at all
    cut = tmp_path / "step_000003"
    cut.mkdir()
    (cut / ".metadata").write_bytes((path / ".metadata").read_bytes()[:40])
    assert not checkpointing.records_every_rank(cut, 1)
    (cut / ".metadata").write_text("not a checkpoint")
    assert not checkpointing.records_every_rank(cut, 1)
    assert not checkpointing.records_every_rank(tmp_path / "step_000004", 1)


def test_a_later_checkpoint_in_the_folder_is_the_one_a_restart_would_take(saved, tmp_path):
    run_dir, path = saved
    later = checkpointing.checkpoint_dir(run_dir, 5)
    later.mkdir()
    (later / ".metadata").write_bytes((path / ".metadata").read_bytes())
    try:
        assert checkpointing.latest_checkpoint(run_dir) == later != checkpointing.checkpoint_dir(run_dir, 3)
    finally:
        (later / ".metadata").unlink()
        later.rmdir()


def test_the_drill_checks_the_checkpoint_it_stopped_with_by_reading_it_back():
    from pathlib import Path

    drill = (Path(__file__).resolve().parents[2] / "scripts" / "12_hpc_operations" / "fault_drill.py").read_text()
    assert "latest = checkpointing.latest_checkpoint(run_dir)" in drill
    assert ("whole = (latest == checkpointing.checkpoint_dir(run_dir, state.step)\n"
            "             and checkpointing.records_every_rank(latest, ranks, step=holds_step))") in drill
    assert "whole, latest, _ = stop_checkpoint_is_whole(run_dir, state, world_size)" in drill
    assert "whole, latest, ranks = agreed_stop_verdict(run_dir, state, rt.world_size, rt.rank, rt.device)" in drill
    assert "a checkpoint of the last step done is on disk" not in drill


def _fault_drill():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "12_hpc_operations" / "fault_drill.py"
    spec = importlib.util.spec_from_file_location("fault_drill", path)
    drill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drill)
    return drill


def test_a_stop_checkpoint_without_the_step_is_whole_when_the_run_was_told_not_to_hold_it(tmp_path):
    """Chapter 14's --checkpoint-holds runs save only what the learner names: a stop (the deadline, a SIGTERM) of a
    run holding no step must pass the drill's stop check; one that should hold it and does not must fail."""
    drill = _fault_drill()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 2)).sum().backward()
    optimizer.step()
    held = ("model", "optimizer", "rng")   # no step, no data position
    state = drill.HeldState(model, optimizer, None, 0, held, tmp_path / "losses.txt", main=True)
    state.step = 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpointing.save(state, tmp_path)
    whole, latest, ranks = drill.stop_checkpoint_is_whole(tmp_path, state, 1)
    assert (whole, latest, ranks) == (True, checkpointing.checkpoint_dir(tmp_path, 3), 1)
    # the same folder, checked for a run whose checkpoint should hold the step, is not whole
    assert not checkpointing.records_every_rank(latest, 1)
    state.held = ("model", "optimizer", "rng", "step")
    assert drill.stop_checkpoint_is_whole(tmp_path, state, 1)[0] is False


AGREED_VERDICT_SCRIPT = """
import sys, warnings
from pathlib import Path
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from test_checkpoint_records import _fault_drill
from distlab import checkpointing

dist.init_process_group("gloo")
rank = dist.get_rank()
drill = _fault_drill()
model = torch.nn.Linear(2, 2)
state = checkpointing.TrainingState(model, torch.optim.AdamW(model.parameters()), rank=rank)
state.step = 3
run_dir = Path({run_dir!r})
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    checkpointing.save(state, run_dir)
if rank == 1:
    # this rank's node does not see the new folder yet (an NFS client's attribute cache, for a few seconds)
    drill.checkpointing.latest_checkpoint = lambda folder: None
    assert drill.stop_checkpoint_is_whole(run_dir, state, 2)[0] is False
whole, latest, ranks = drill.agreed_stop_verdict(run_dir, state, 2, rank, "cpu")
print(f"rank {{rank}}: whole={{whole}} ranks={{ranks}}", flush=True)
dist.destroy_process_group()
"""


def test_every_rank_takes_rank_0s_verdict_on_the_stop_checkpoint(tmp_path):
    """After a stop's save each rank used to read the shared folder itself: a node that sees it late (NFS) failed a
    good stop and exited 1 while rank 0 exited 0, and its torchrun agent, its restart unused, restarted every worker.
    Rank 0 reads it and broadcasts the verdict: every rank exits with the same code."""
    from labkit import launch

    script = tmp_path / "agreed_verdict.py"
    script.write_text(AGREED_VERDICT_SCRIPT.format(tests=str(Path(__file__).parent), run_dir=str(tmp_path / "run")))
    result = launch.run(script, nproc=2, launcher="fork", stream=False, metrics=False, timeout=120)
    assert result.returncode == 0, result.tail()
    said = sorted(line for line in result.lines if line.startswith("rank "))
    assert said == ["rank 0: whole=True ranks=2", "rank 1: whole=True ranks=2"], result.tail()
