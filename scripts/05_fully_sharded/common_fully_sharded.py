"""What chapter 05's three scripts share: the single-device baseline they are checked against, and the tolerances.

Not a script: ``zero_from_scratch.py``, ``train_fsdp.py`` and ``checkpoint_resume.py`` import it.
"""

import torch

from distlab import data, models
# bf16 mixed precision against the fp32 baseline: the tolerances every chapter uses, explained in distlab.metrics
from distlab.metrics import BF16_LOSS_TOLERANCE, bf16_param_mean_tolerance, mean_abs_diff  # noqa: F401

# fp32 tolerances (chapter 04 explains them): sharded and single-device runs add the same numbers in
# another order, so they differ by rounding only.
# * losses (values ~4): measured <= 1e-6;
# * parameters: AdamW moves a weight whose gradient is as small as the rounding noise by up to ~lr whatever
#   the noise says, so parameters are compared at lr / 10 (measured ~1e-5 after a few steps at lr 3e-3).
# * gradients (largest ~5e-2): measured ~1e-8 to 4e-7 (chapter 04's). Checked on their own because AdamW is
#   blind to a gradient's scale: a sharded optimizer that forgets to divide by N still takes (almost) the
#   right steps, so losses and parameters alone would not see it.
# On a GPU, loss and gradient tolerances widen 10x (distlab.metrics.fp32_tolerance says why).
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5


def param_tolerance(lr: float) -> float:
    return lr / 10


class Baseline:
    """The single-device run, in lockstep with the sharded one: same seed, same global batch, same AdamW."""

    def __init__(self, cfg, seed: int, lr: float, device, model=None, groups=None, max_grad_norm=None):
        self.cfg, self.seed, self.max_grad_norm = cfg, seed, max_grad_norm
        self.model = model if model is not None else models.build_transformer(cfg, seed=seed, device=device)
        self.optimizer = torch.optim.AdamW(groups(self.model) if groups else self.model.parameters(), lr=lr)
        self.losses: list[float] = []

    def step(self, tokens: torch.Tensor) -> float:
        inputs, targets = data.split_inputs_targets(tokens)
        loss = models.lm_loss(self.model(inputs), targets)
        loss.backward()
        self.grads = [p.grad.detach().clone() if p.grad is not None else None  # this step's, for the checks
                      for p in self.model.parameters()]                        # (None: a frozen parameter)
        if self.max_grad_norm is not None:   # the whole model's gradient norm, clipped as the sharded run must
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm).item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        return self.losses[-1]

    def state(self) -> dict:
        return {name: p.detach() for name, p in self.model.named_parameters()}

