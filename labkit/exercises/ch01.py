"""Lab 01's exercise checks (the single-device baseline).

* Exercise 1: the parameter count of a model and the bytes of its training state, each a number the learner
  computes and :func:`check_value` compares with the library's count.
* Exercise 2, :func:`check_step_peak`: the learner's ``step_peak(num_params, activation_bytes, batch, seq_len,
  vocab_size) -> (phase, bytes)``, the peak of one fp32 training step on a GPU (foreach AdamW) and the phase that
  holds it, against ``memory.predict_step_peak`` on runs where each phase wins; each usual slip is named.
"""

from __future__ import annotations

from labkit.exercises.checks import (ExerciseIncomplete, ExerciseWrong, call_learner, check_value, learner_check,
                                     sentence, wrong_number)

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_value", "check_step_peak", "STEP_PEAK_CASES"]

# (preset, batch) the peak exercise is checked on: the a100 preset at batch 1 and 2 (the optimizer step holds the
# peak) and 4 and 8 (forward/backward does), fp32 activations from the formula.
STEP_PEAK_CASES = [("a100", 1), ("a100", 2), ("a100", 4), ("a100", 8)]
PHASES = ("forward/backward", "optimizer step")


def _case(preset: str, batch: int):
    from distlab import memory, models

    cfg = models.preset(preset)
    n = cfg.num_params()
    activations = memory.transformer_activation_bytes(cfg, batch)
    args = (n, activations, batch, cfg.seq_len, cfg.vocab_size)
    return args, memory.predict_step_peak(memory.training_state_bytes(n), activations, batch, cfg.seq_len,
                                          cfg.vocab_size)


def _slips(num_params, activations, batch, seq_len, vocab_size) -> dict[str, int]:
    """The bytes each usual slip gives (forward/backward and optimizer step computed the slipped way, the larger
    taken), with what to say about it."""
    loss = 2 * batch * seq_len * vocab_size * 4
    n = num_params
    return {
        "You added every consumer up (16 B a parameter + activations + loss gradients + the temporaries). They are "
        "never alive together: the gradients appear in backward as the activations are freed.":
            20 * n + activations + loss,
        "You added the training state and the activations up (16 B a parameter + activations). The gradients do not "
        "exist at the top of backward; the activations are gone by the optimizer step.": 16 * n + activations,
        "Forward/backward has no gradients yet at the top of backward: 12 B a parameter (weights and moments), not 16.":
            max(16 * n + activations + loss, 20 * n),
        "The loss's two fp32 gradients of B x T x V numbers (8 B T V bytes) are alive at the top of backward.":
            max(12 * n + activations, 20 * n),
        "Only one of the loss's two gradients? Both are alive: nll_loss's and log_softmax's, 4 bytes a number each.":
            max(12 * n + activations + loss // 2, 20 * n),
        "The optimizer step holds 20 B a parameter on a GPU: foreach AdamW adds one fp32 temporary a parameter.":
            max(12 * n + activations + loss, 16 * n),
    }


@learner_check
def check_step_peak(step_peak) -> None:
    """``step_peak(num_params, activation_bytes, batch, seq_len, vocab_size) -> (phase, bytes)``: the peak of an
    fp32 training step on a GPU with foreach AdamW, and "forward/backward" or "optimizer step", the phase that
    holds it; checked on :data:`STEP_PEAK_CASES`."""
    for preset, batch in STEP_PEAK_CASES:
        args, phases = _case(preset, batch)
        where = f"`step_peak(...)` for the {preset} preset at batch {batch}"
        got = call_learner("step_peak", step_peak, *args)
        if got is None:
            raise ExerciseIncomplete("`step_peak` is not written yet. It returned None.")
        try:
            phase, peak = got
            peak = float(peak)
        except (TypeError, ValueError):
            raise ExerciseWrong(f"{where} should return (phase, bytes), not {got!r}.") from None
        if phase not in PHASES:
            raise ExerciseWrong(f"{where} returned the phase {phase!r}: name it \"forward/backward\" or "
                                f"\"optimizer step\".")
        if abs(peak - phases.peak) > 1e-6 * phases.peak:
            slip = next((why for why, wrong in _slips(*args).items() if abs(peak - wrong) <= 1e-6 * wrong), "")
            rule = ("Forward/backward: 12 B a parameter + activations + 8 B T V; optimizer step: 20 B a parameter; "
                    "the peak is the larger.")
            raise ExerciseWrong(f"{where} returned {peak / 2**30:,.3f} GiB: "
                                + (slip or f"{sentence(wrong_number(peak, phases.peak))} {rule}"))
        if phase != phases.peak_phase:
            raise ExerciseWrong(f"{where}: the bytes are right, but {phase!r} is not the phase that holds them: work "
                                f"out each phase's bytes and see which is the larger.")
    print(f"Correct: the peak and its phase on {len(STEP_PEAK_CASES)} runs. The optimizer step holds it at "
          f"batch 1 and 2, forward/backward from batch 4: activations grow with the batch, the 20 B a parameter "
          f"do not.")
