"""Lab 01's second exercise (labkit.exercises.ch01.check_step_peak): the right rule passes, a stub is "not written
yet", and each plausible wrong rule is rejected with the hint that names it."""

from __future__ import annotations

import pytest

from labkit.exercises import ch01 as ex
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong


def rule(fb_bytes_per_param=12, loss_gradients=2, step_bytes_per_param=20, with_activations=True, phase=None):
    """A step_peak built from its parts; the defaults are the right rule."""
    def step_peak(num_params, activation_bytes, batch, seq_len, vocab_size):
        fb = (fb_bytes_per_param * num_params + (activation_bytes if with_activations else 0)
              + loss_gradients * batch * seq_len * vocab_size * 4)
        step = step_bytes_per_param * num_params
        name = "forward/backward" if fb >= step else "optimizer step"
        return (phase or name), max(fb, step)
    return step_peak


def test_the_right_rule_passes(capsys):
    ex.check_step_peak(rule())
    assert "Correct" in capsys.readouterr().out


def test_the_cases_hold_each_phase_twice():
    """The check is not passable by always naming one phase: the cases hold each phase as the peak twice."""
    from distlab import memory, models

    phases = []
    for preset, batch in ex.STEP_PEAK_CASES:
        cfg = models.preset(preset)
        state = memory.training_state_bytes(cfg.num_params())
        phases.append(memory.predict_step_peak(state, memory.transformer_activation_bytes(cfg, batch), batch,
                                               cfg.seq_len, cfg.vocab_size).peak_phase)
    assert sorted(phases) == ["forward/backward"] * 2 + ["optimizer step"] * 2


@pytest.mark.parametrize("wrong, named", [
    (rule(fb_bytes_per_param=16), "no gradients yet"),
    (rule(loss_gradients=0), "loss's two fp32 gradients"),
    (rule(loss_gradients=1), "Only one of the loss's two gradients"),
    (rule(step_bytes_per_param=16), "foreach AdamW adds one fp32 temporary"),
    (rule(with_activations=False), "too small for rounding or a usual slip"),
    (rule(phase="forward/backward"), "'forward/backward' is not the phase that holds them"),
    (rule(phase="optimizer step"), "'optimizer step' is not the phase that holds them"),
])
def test_a_plausible_wrong_rule_is_rejected_and_named(wrong, named):
    with pytest.raises(ExerciseWrong, match=named):
        ex.check_step_peak(wrong)


def test_every_consumer_added_up_is_named():
    def summed(num_params, activation_bytes, batch, seq_len, vocab_size):
        return "forward/backward", 20 * num_params + activation_bytes + 8 * batch * seq_len * vocab_size

    with pytest.raises(ExerciseWrong, match="never alive together"):
        ex.check_step_peak(summed)


def test_a_stub_is_not_written_yet_and_a_bad_shape_is_wrong():
    def stub(*args):
        raise NotImplementedError

    with pytest.raises(ExerciseIncomplete, match="not written yet"):
        ex.check_step_peak(stub)
    with pytest.raises(ExerciseWrong, match=r"should return \(phase, bytes\)"):
        ex.check_step_peak(lambda *args: 3)
    with pytest.raises(ExerciseWrong, match="name it"):
        ex.check_step_peak(lambda *args: ("backward", rule()(*args)[1]))
