"""Chapter 09's bf16 checks see every tensor (issue 34): each gradient against its own largest, each parameter's
mean difference on its own. The faults planted here passed the checks of before: the q/k projections' gradients
halved (0.4% of the embedding's largest gradient, the old scale, against 5%) and the norm weights' AdamW state lost
mid-run (0.26% of the elements: the mean over all moved by 2% of lr, against lr / 5). Each fails now (0.5 against
5%; 0.79 lr against lr / 5), where the unplanted bf16 run stays at 1.0% and 0.06 lr (measured).

The bf16 run is a 2-block tiny model under CPU autocast on one device: real bf16 rounding against the fp32 run."""

from __future__ import annotations

import pytest
import torch

from distlab import data, metrics, models

CFG = models.preset("tiny", n_layers=2)
LR, STEPS, BATCH = 3e-3, 3, 2


def _train(bf16: bool, lose_norm_state_at: int | None = None):
    model = models.build_transformer(CFG, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    first = None
    for step in range(STEPS):
        if step == lose_norm_state_at:   # a resume that restored every AdamW state but the norm weights'
            for name, p in model.named_parameters():
                if "norm" in name:
                    optimizer.state.pop(p, None)
        inputs, targets = data.split_inputs_targets(data.token_batch(step, BATCH, CFG.seq_len, CFG.vocab_size, 0))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = models.lm_loss(model(inputs).float(), targets)
        loss.backward()
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return first, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs():
    return {"fp32": _train(False), "bf16": _train(True), "norm_state_lost": _train(True, lose_norm_state_at=1)}


def _check(actual, expected, kind):
    report = metrics.Report("test_bf16_checks")
    tolerance = metrics.BF16_GRAD_RELATIVE_TOLERANCE if kind == "grad" else metrics.bf16_param_mean_tolerance(LR)
    passed = metrics.check_bf16_tensors(report, actual, expected, kind=kind, tolerance=tolerance, label=kind)
    return passed, report.extra["bf16_worst_tensor"][kind]


def test_a_bf16_run_passes_both_checks(runs):
    (g32, p32), (g16, p16) = runs["fp32"], runs["bf16"]
    assert _check(g16, g32, "grad")[0] and _check(p16, p32, "param")[0]


def test_halved_query_and_key_gradients_fail_the_gradient_check(runs):
    (g32, _), (g16, _) = runs["fp32"], runs["bf16"]
    planted = {n: g / 2 if (".wq." in n or ".wk." in n) else g for n, g in g16.items()}
    names = list(g32)
    largest = max(g.abs().max().item() for g in g32.values())
    old = metrics.max_abs_diff([planted[n] for n in names], [g32[n] for n in names]) / largest
    assert old <= metrics.BF16_GRAD_RELATIVE_TOLERANCE           # the old check: largest difference / largest
    passed, worst = _check(planted, g32, "grad")
    assert not passed and worst["error"] == pytest.approx(0.5, abs=0.02)
    assert set(worst["over_tolerance"]) == {n for n in names if ".wq." in n or ".wk." in n}


def test_norm_weights_that_lost_their_adamw_state_fail_the_parameter_check(runs):
    (_, p32), (_, lost) = runs["fp32"], runs["norm_state_lost"]
    names = list(p32)
    old = metrics.mean_abs_diff([lost[n] for n in names], [p32[n] for n in names])
    assert old <= metrics.bf16_param_mean_tolerance(LR)           # the old check: the mean over every element
    passed, worst = _check(lost, p32, "param")
    assert not passed and worst["over_tolerance"] and all("norm" in n for n in worst["over_tolerance"])
