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
