"""Deterministic synthetic data: the same global batch whatever the world size.

Every sample is a pure function of ``(seed, sample index)``, so the single-device reference and every
rank of a parallel run see exactly the same numbers; a rank just takes its rows of the global batch.

The token sequences follow a simple rule with noise (``next = (5 * prev + 3) mod vocab`` nine times in ten)
so a model has something to learn: losses fall, and parallel runs can be compared over many steps.
Nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

NOISE_PROBABILITY = 0.1


def _generator(seed: int, index: int) -> torch.Generator:
    # A distinct, reproducible stream per sample; the large odd multiplier spreads nearby seeds apart.
    return torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**63 - 1))


def _follow_rule(noise: torch.Tensor, noisy: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Apply ``next = (5 * prev + 3) mod vocab`` along the last dim, except where ``noisy`` picks ``noise``."""
    tokens = noise.clone()
    for t in range(1, tokens.shape[-1]):  # one loop over time, vectorised over samples
        rule = (5 * tokens[..., t - 1] + 3) % vocab_size
        tokens[..., t] = torch.where(noisy[..., t], noise[..., t], rule)
    return tokens


def _sample_noise(index: int, seq_len: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _generator(seed, index)
    noise = torch.randint(0, vocab_size, (seq_len + 1,), generator=gen)
    noisy = torch.rand(seq_len + 1, generator=gen) < NOISE_PROBABILITY
    return noise, noisy


def token_sample(index: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """Sequence number ``index``: ``seq_len + 1`` tokens (inputs are ``[:-1]``, next-token targets ``[1:]``)."""
    noise, noisy = _sample_noise(index, seq_len, vocab_size, seed)
    return _follow_rule(noise, noisy, vocab_size)


def token_batch(step: int, global_batch: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """The global batch of training step ``step``: (global_batch, seq_len + 1) int64 tokens.

    Row i is ``token_sample(step * global_batch + i)``: a rank that takes rows [a, b) sees those samples.
    """
    first = step * global_batch
    pairs = [_sample_noise(first + i, seq_len, vocab_size, seed) for i in range(global_batch)]
    noise = torch.stack([n for n, _ in pairs])
    noisy = torch.stack([m for _, m in pairs])
    return _follow_rule(noise, noisy, vocab_size)


def split_inputs_targets(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens[:, :-1], tokens[:, 1:]


def shard_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous rows of a global batch (the batch must divide evenly: check it first)."""
    if batch.shape[0] % world_size:
        raise ValueError(f"a batch of {batch.shape[0]} rows does not split over {world_size} ranks")
    rows = batch.shape[0] // world_size
    return batch[rank * rows:(rank + 1) * rows]


class SyntheticTokens(Dataset):
    """A map-style dataset of token sequences, for DataLoader + DistributedSampler."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int, seed: int = 0):
        self.num_samples, self.seq_len, self.vocab_size, self.seed = num_samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        return token_sample(index, self.seq_len, self.vocab_size, self.seed)


def regression_batch(step: int, global_batch: int, in_features: int, out_features: int,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) for the MLP: y is a fixed random linear map of x plus a nonlinearity, so it is learnable."""
    teacher = torch.Generator().manual_seed(seed)
    weight = torch.randn(in_features, out_features, generator=teacher) / in_features**0.5
    gen = _generator(seed + 1, step)
    x = torch.randn(global_batch, in_features, generator=gen)
    return x, torch.tanh(x @ weight)


class ShuffledLoader:
    """A finite dataset of ``num_samples`` sequences (``token_sample``), read in a shuffled order epoch after epoch,
    as ``DistributedSampler(shuffle=True)`` reads one: the order comes from a generator whose state moves on with
    every epoch. Every rank holds the same loader and takes its rows of each global batch (``shard_rows``).

    A resumed run must continue the same order, not restart it: ``state_dict`` (the generator's state, the epoch's
    order and the position in it) goes into the checkpoint, which is what the batch-as-a-function-of-the-step data
    of the other scripts never needed (chapter 12's fault drill)."""

    def __init__(self, num_samples: int, global_batch: int, seq_len: int, vocab_size: int, seed: int = 0):
        self.num_samples, self.global_batch, self.seq_len, self.vocab_size, self.seed = (
            num_samples, global_batch, seq_len, vocab_size, seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch, self.position = 0, 0
        self.order = torch.randperm(num_samples, generator=self.generator)

    def next_batch(self) -> torch.Tensor:
        """The next global batch, (global_batch, seq_len + 1) tokens; a new shuffled epoch when one runs out."""
        rows = []
        while len(rows) < self.global_batch:
            if self.position == self.num_samples:
                self.epoch, self.position = self.epoch + 1, 0
                self.order = torch.randperm(self.num_samples, generator=self.generator)
            take = min(self.global_batch - len(rows), self.num_samples - self.position)
            rows += self.order[self.position:self.position + take].tolist()
            self.position += take
        return torch.stack([token_sample(i, self.seq_len, self.vocab_size, self.seed) for i in rows])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "order": self.order.clone(),
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order = state["order"].clone()
        self.generator.set_state(state["generator"])
