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
