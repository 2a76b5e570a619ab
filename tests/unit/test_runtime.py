"""distlab.runtime: the scripts' shared flags."""


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
