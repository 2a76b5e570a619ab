"""Point-to-point that is safe on NCCL, not only on gloo.

On NCCL, two ranks that each send to the other before receiving can wait forever, while gloo lets them
pass (see distlab.comm: the pair's operations share one stream; only a batch_isend_irecv posts them
together). Two ways to enforce the rule without a GPU:

* statically: no script in scripts/ calls dist.send / recv / isend / irecv itself; point-to-point goes
  through ``dist.batch_isend_irecv([dist.P2POp(...), ...])``;
* at run time: the scripts that use point-to-point run on gloo (2 ranks: the ring of 2, where left and right
  are one rank, is the dangerous case) with every operation recorded, and the records replayed under
  NCCL's rules (``comm.nccl_p2p_deadlocks``) must show no pair waiting forever.
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest

from distlab import comm
from labkit import launch

SCRIPTS = sorted((launch.REPO_ROOT / "scripts").rglob("*.py"))
UNPAIRED = {"send", "recv", "isend", "irecv"}
S, R = "send", "recv"


def unpaired_calls(source: str) -> list[str]:
    """Calls of dist.send/recv/isend/irecv (or torch.distributed.X, or the bare names imported from it).
    ``dist.P2POp(dist.isend, ...)`` names isend without calling it: allowed."""
    tree, found = ast.parse(source), []
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("torch.distributed") for alias in node.names
                if alias.name in UNPAIRED}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in UNPAIRED \
                and ast.unparse(f.value) in ("dist", "torch.distributed"):
            found.append(f"line {node.lineno}: {ast.unparse(f)}(...)")
        elif isinstance(f, ast.Name) and f.id in imported:
            found.append(f"line {node.lineno}: {f.id}(...)")
    return found


def test_the_static_rule_sees_unpaired_calls_and_allows_batches():
    bad = "import torch.distributed as dist\nw = dist.isend(x, 1)\ndist.recv(y, src=1)\n"
    also_bad = "from torch.distributed import irecv\nirecv(y, 0)\n"
    good = "import torch.distributed as dist\ndist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1)])\n"
    assert len(unpaired_calls(bad)) == 2 and len(unpaired_calls(also_bad)) == 1
    assert unpaired_calls(good) == []


# Scripts that send and receive on their own on purpose, with the run that proves their correct path safe
# under NCCL's rules (replayed below): chapter 12 teaches the unpaired hang and fixes it with an even/odd order.
PROVEN_AT_RUN_TIME = {"12_hpc_operations/deadlocks.py": (4, ["--hang", "none"])}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_script_sends_or_receives_outside_a_batch(script):
    if f"{script.parent.name}/{script.name}" in PROVEN_AT_RUN_TIME:
        pytest.skip("point-to-point on its own on purpose; its correct order is replayed under NCCL's rules below")
    calls = unpaired_calls(script.read_text())
    assert not calls, (f"{script.name}: point-to-point outside batch_isend_irecv can hang on NCCL; pair the send "
                       f"with its receive in one dist.batch_isend_irecv([...]) (or prove an even/odd order at run "
                       f"time: PROVEN_AT_RUN_TIME): {calls}")


# ---- the NCCL model, on hand-written orders -------------------------------------------------------------

def test_both_sending_first_deadlocks_on_nccl():
    both_send_first = {0: [(S, 1, None), (R, 1, None)], 1: [(S, 0, None), (R, 0, None)]}
    assert comm.nccl_p2p_deadlocks(both_send_first) == [
        "ranks 0 and 1 would wait forever on NCCL: rank 0 is stuck at [send #0 to 1], rank 1 at [send #0 to 0]"]


def test_a_batch_or_an_even_odd_order_does_not():
    batched = {0: [(S, 1, 1), (R, 1, 1)], 1: [(R, 0, 7), (S, 0, 7)]}
    even_odd = {0: [(S, 1, None), (R, 1, None)], 1: [(R, 0, None), (S, 0, None)]}
    assert comm.nccl_p2p_deadlocks(batched) == [] and comm.nccl_p2p_deadlocks(even_odd) == []


def test_a_ring_of_four_sending_first_is_safe_but_a_ring_of_two_is_not():
    ring = lambda n: {r: [(S, (r + 1) % n, None), (R, (r - 1) % n, None)] for r in range(n)}  # noqa: E731
    assert comm.nccl_p2p_deadlocks(ring(4)) == []          # each pair sees one send and one receive
    assert len(comm.nccl_p2p_deadlocks(ring(2))) == 1      # left and right are the same rank


def test_an_unmatched_message_is_reported():
    assert "rank 1 at [nothing left]" in comm.nccl_p2p_deadlocks({0: [(S, 1, None)], 1: []})[0]


# ---- the real scripts, recorded on gloo and replayed under NCCL's rules ------------------------------------
# Rings on 2 ranks (left = right: the dangerous case); the pipeline on 4 (1F1B's steady state sends both ways
# between every pair of neighbours).

def _recorded_run(tmp_path, script, nproc, args=()):
    log = tmp_path / Path(script).stem
    log.mkdir()
    launch.run(script, nproc=nproc, args=list(args), stream=False, launcher="fork",
               env={"DISTLAB_P2P_LOG": str(log)}, metrics=False)
    notes = {r: [tuple(json.loads(line)) for line in (log / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(nproc)}
    return notes


BAD_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    me, other = dist.get_rank(), 1 - dist.get_rank()
    request = dist.isend(torch.ones(4), other)      # both ranks send first: fine on gloo
    dist.recv(torch.empty(4), other)
    request.wait()
    dist.destroy_process_group()
""")


def test_the_recorder_catches_an_order_gloo_forgives(tmp_path):
    script = tmp_path / "both_send_first.py"
    script.write_text(BAD_SCRIPT)
    notes = _recorded_run(tmp_path, script, 2)
    assert notes[0] == [(S, 1, None), (R, 1, None)]
    assert len(comm.nccl_p2p_deadlocks(notes)) == 1


@pytest.mark.parametrize("script, nproc, args", [
    ("scripts/03_communication/ring_allreduce.py", 2, ["--numel", "64"]),
    ("scripts/03_communication/collectives.py", 2, []),
    ("scripts/08_sequence_parallel/ring_attention.py", 2, ["--layout", "zigzag"]),
    ("scripts/07_pipeline_parallel/pp_manual.py", 4, ["--steps", "1", "--no-reference", "--layers", "4",
                                                      "--microbatches", "6", "--batch", "6"]),
    *[(f"scripts/{name}", nproc, args) for name, (nproc, args) in PROVEN_AT_RUN_TIME.items()
      if (launch.REPO_ROOT / "scripts" / name).exists()],
], ids=lambda value: Path(value).stem if isinstance(value, str) and value.endswith(".py") else None)
def test_point_to_point_scripts_cannot_deadlock_on_nccl(tmp_path, script, nproc, args):
    notes = _recorded_run(tmp_path, script, nproc, args)
    assert any(notes.values()), "no point-to-point recorded: the recorder saw nothing"
    assert comm.nccl_p2p_deadlocks(notes) == []
