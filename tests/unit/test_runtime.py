"""distlab.runtime: the scripts' shared flags."""

import argparse
import io
import os
import re
import sys

import pytest

from distlab import runtime


def test_the_learning_rate_follows_the_model_size():
    """3e-3 trains the laptop presets; the a100 preset diverged at 3e-3 on an H200 (loss 10.8 -> 11.4)."""
    import argparse

    import pytest

    from distlab import runtime

    p = runtime.parser(None, presets=("tiny", "a100"))
    runtime.add_lr_flag(p)
    assert p.parse_args([]).lr == 3e-3
    assert p.parse_args(["--preset", "a100"]).lr == runtime.LARGE_MODEL_LR == 1e-4
    assert p.parse_args(["--preset", "a100", "--lr", "1e-3"]).lr == 1e-3    # the learner's choice wins
    tp = runtime.parser(None, presets=("tiny", "a100"))
    runtime.add_lr_flag(tp, 1e-3)
    assert tp.parse_args([]).lr == 1e-3 and tp.parse_args(["--preset", "a100"]).lr == 1e-4
    no_presets = runtime.parser(None)
    runtime.add_lr_flag(no_presets)
    assert no_presets.parse_args([]).lr == 3e-3
    with pytest.raises(TypeError):
        runtime.add_lr_flag(argparse.ArgumentParser())


def test_ranks_agree_on_the_attempt_even_when_a_dead_attempts_announcement_is_read_first():
    """torchrun's agent store outlives the workers: a rank of attempt 1 may read attempt 0's announcement before
    the new rank 0 makes its own. It must not stay there (issue 45 item 9)."""
    import threading
    import time

    import torch.distributed as dist

    from distlab.runtime import agree_on_attempt

    store = dist.HashStore()
    assert agree_on_attempt(store, 0, 1, 5) == 0  # attempt 0: its rank 0 announces it, then the job fails
    got = {}
    late = threading.Thread(target=lambda: (time.sleep(0.3), got.update({0: agree_on_attempt(store, 0, 3, 5)})))
    others = [threading.Thread(target=lambda r=r: got.update({r: agree_on_attempt(store, r, 3, 5, retry_s=0.1)}))
              for r in (1, 2)]
    for thread in [late, *others]:
        thread.start()
    for thread in [late, *others]:
        thread.join(10)
    assert got == {0: 1, 1: 1, 2: 1}


def _ranks_printing_to_one_pipe(whole_lines: bool, ranks: int = 4, lines: int = 2000) -> list[str]:
    """What ``ranks`` forked processes print, each as an unbuffered rank does (PYTHONUNBUFFERED, which the
    launchers set), into one pipe: ``print`` with several arguments, ``lines`` times each."""
    read_end, write_end = os.pipe()
    children = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:   # the child touches no torch: only its streams and print
            code = 1
            try:
                os.close(read_end)
                sys.stdout = io.TextIOWrapper(io.FileIO(write_end, "w", closefd=False), write_through=True)
                if whole_lines:
                    runtime.write_whole_lines()
                for i in range(lines):
                    print(f"rank {rank}:", "x" * 40, i)
                sys.stdout.flush()
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    os.close(write_end)
    with os.fdopen(read_end, "r") as pipe:
        output = pipe.read()
    for pid in children:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    return output.splitlines()


def test_each_rank_writes_whole_lines_into_a_shared_pipe():
    """Seen in make test: rank 0's ``checks: 2/3 passed`` ran into ``rank 2: [FAIL] ...`` on one line."""
    lines = _ranks_printing_to_one_pipe(whole_lines=True)
    pattern = re.compile(r"rank [0-3]: x{40} \d+")
    assert len(lines) == 4 * 2000 and all(pattern.fullmatch(line) for line in lines), \
        [line for line in lines if not pattern.fullmatch(line)][:3]


def test_start_sends_whole_lines_before_anything_else(monkeypatch):
    class Called(Exception):
        pass

    def called():
        raise Called

    monkeypatch.setattr(runtime, "write_whole_lines", called)
    with pytest.raises(Called), runtime.start(argparse.Namespace(device="cpu", seed=0)):
        pass


_LATE_RANK = r'''
import os, sys, time
import torch
import torch.distributed as dist
from distlab import runtime

with runtime.start(device="cpu", pg_timeout_s=2, rendezvous_timeout_s=40) as rt:
    if rt.rank == 1:  # never joins the collective, never sets the key
        time.sleep(120)  # the test ends it once rank 0 has answered
        os._exit(0)
    for what, call in (("collective", lambda: dist.all_reduce(torch.ones(1))),  # no explicit timeout: the group's
                       ("store", lambda: dist.distributed_c10d._get_default_store().get("never-set"))):
        began = time.monotonic()
        try:
            call()
            print(what, "returned")
        except Exception:
            print(what, f"{time.monotonic() - began:.1f}")
        sys.stdout.flush()
    os._exit(0)
'''


def test_once_formed_the_group_and_its_store_time_out_at_the_pg_timeout_not_the_rendezvous_one(tmp_path):
    """runtime.start forms the group under the longer rendezvous timeout (40 s here), then sets the process-group
    timeout (2 s) on the group (torch's _set_pg_timeout, distributed_c10d.py:1616-1661) and on its store
    (Store.set_timeout, torch/_C/_distributed_c10d.pyi:220). Two gloo ranks: rank 1 never joins an all-reduce nor sets a key. Rank 0's all-reduce, waited
    on with no timeout of its own, and its store get must fail within about 2 s, not 40 (review ch12 s15 confirm,
    finding 2: deadlocks.py waits with explicit timeouts, so its test could not see these lines go)."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "late_rank.py"
    script.write_text(_LATE_RANK)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "DISTLAB_", "SLURM_", "PBS_",
                                                                     "PMI_", "PALS_", "OMPI_"))}
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
             "PYTHONPATH": root, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, str(script)], env=base | {"RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    try:
        outs = [procs[0].communicate(timeout=150)[0]]
    finally:
        procs[1].kill()
        procs[1].communicate()
        procs[0].kill()
    seconds = dict(line.split() for line in outs[0].splitlines()
                   if line.split()[:1] in (["collective"], ["store"]) and len(line.split()) == 2)
    assert set(seconds) == {"collective", "store"}, outs[0][-3000:]
    assert float(seconds["collective"]) < 10, outs[0][-3000:]
    assert float(seconds["store"]) < 10, outs[0][-3000:]
