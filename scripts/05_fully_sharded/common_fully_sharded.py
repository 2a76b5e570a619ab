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

    def __init__(self, cfg, seed: int, lr: float, device, model=None, groups=None):
        self.cfg, self.seed = cfg, seed
        self.model = model if model is not None else models.build_transformer(cfg, seed=seed, device=device)
        self.optimizer = torch.optim.AdamW(groups(self.model) if groups else self.model.parameters(), lr=lr)
        self.losses: list[float] = []

    def step(self, tokens: torch.Tensor) -> float:
        inputs, targets = data.split_inputs_targets(tokens)
        loss = models.lm_loss(self.model(inputs), targets)
        loss.backward()
        self.grads = [p.grad.detach().clone() if p.grad is not None else None  # this step's, for the checks
                      for p in self.model.parameters()]                        # (None: a frozen parameter)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        return self.losses[-1]

    def state(self) -> dict:
        return {name: p.detach() for name, p in self.model.named_parameters()}


def make_any_model(model):
    """The transformer as a user's own model often is, for the hand-written ZeRO to prove it takes any model:

    * the output head tied to the embedding (one weight under two names: one slice, one gradient);
    * every norm frozen (``requires_grad=False``: never reduced, never stepped, left as it was);
    * a bias on the head, sized by the vocabulary (127 with ``--any-model``): a size no rank count above 1 divides.
    """
    model.output.weight = model.tok_embeddings.weight
    model.output.bias = torch.nn.Parameter(torch.zeros(model.output.out_features, device=model.output.weight.device))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.requires_grad_(False)
    return model


def parameter_groups(model, any_model: bool, lr: float) -> list[dict]:
    """AdamW's parameter groups. The plain model: one group (AdamW's defaults). With ``--any-model``, two, as
    training recipes set them: the matrices with weight decay 0.1; the embedding (tied head) and the bias
    without weight decay, at half the learning rate. Frozen parameters are in no group."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]   # a tied weight once
    if not any_model:
        return [{"params": [p for _, p in trainable]}]
    decayed = [p for n, p in trainable if p.dim() == 2 and "embeddings" not in n]
    rest = [p for n, p in trainable if not (p.dim() == 2 and "embeddings" not in n)]
    return [{"params": decayed, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": lr / 2}]
