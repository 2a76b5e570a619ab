import torch

from distlab import data, models


def test_param_count_formula_matches_model():
    for name in ("tiny", "small"):
        cfg = models.preset(name)
        assert models.count_params(models.build_transformer(cfg)) == cfg.num_params()


def test_a100_presets_have_the_sizes_the_chapters_claim():
    assert 1.2e9 < models.preset("a100").num_params() < 1.5e9
    large = models.preset("a100_large").num_params()
    assert large * 16 > 40e9 and large * 16 / 4 < 20e9  # AdamW state: > one A100-40GB, < half of it over 4


def test_init_depends_only_on_seed():
    a, b = models.build_transformer("tiny", seed=3), models.build_transformer("tiny", seed=3)
    c = models.build_transformer("tiny", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.output.weight, c.output.weight)


def test_attention_computes_local_heads():
    """A model whose q/k/v/o hold half the heads still runs: the view uses -1 heads (what TP relies on)."""
    cfg = models.preset("tiny")
    attention = models.Attention(cfg)
    half = cfg.dim // 2
    attention.wq = torch.nn.Linear(cfg.dim, half, bias=False)
    attention.wk = torch.nn.Linear(cfg.dim, half, bias=False)
    attention.wv = torch.nn.Linear(cfg.dim, half, bias=False)
    attention.wo = torch.nn.Linear(half, cfg.dim, bias=False)
    cos, sin = models.rope_tables(cfg.head_dim, 8)
    assert attention(torch.randn(2, 8, cfg.dim), cos, sin).shape == (2, 8, cfg.dim)


def test_causal_attention_ignores_the_future():
    model = models.build_transformer("tiny")
    tokens = data.token_batch(0, 2, 16, 128)[:, :16]
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 128
    assert torch.allclose(model(tokens)[:, :-1], model(changed)[:, :-1], atol=1e-6)


def test_global_batch_is_the_same_whatever_the_world_size():
    full = data.token_batch(step=2, global_batch=8, seq_len=16, vocab_size=128, seed=1)
    for world in (1, 2, 4, 8):
        shards = [data.shard_rows(full, r, world) for r in range(world)]
        assert torch.equal(torch.cat(shards), full)
    assert torch.equal(full[5], data.token_sample(2 * 8 + 5, 16, 128, seed=1))
    dataset = data.SyntheticTokens(64, 16, 128, seed=1)
    assert torch.equal(dataset[21], full[5])


def test_tokens_follow_the_rule_mostly():
    tokens = data.token_batch(0, 16, 64, 128)
    follows = ((5 * tokens[:, :-1] + 3) % 128 == tokens[:, 1:]).float().mean().item()
    assert 0.85 < follows < 0.95


def test_a_tiny_model_learns_the_data():
    torch.manual_seed(0)
    model = models.build_transformer("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        x, y = data.split_inputs_targets(data.token_batch(step, 16, 32, 128))
        loss = models.lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_regression_batch_is_deterministic():
    x1, y1 = data.regression_batch(3, 8, 4, 2, seed=0)
    x2, y2 = data.regression_batch(3, 8, 4, 2, seed=0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and y1.shape == (8, 2)


def test_the_shuffled_loader_reads_every_sample_once_an_epoch_and_resumes_where_it_stopped():
    from distlab import data

    loader = data.ShuffledLoader(num_samples=10, global_batch=4, seq_len=8, vocab_size=50, seed=3)
    first_epoch = torch.cat([loader.next_batch() for _ in range(2)] + [loader.next_batch()[:2]])
    samples = {tuple(data.token_sample(i, 8, 50, 3).tolist()) for i in range(10)}
    assert {tuple(row.tolist()) for row in first_epoch} == samples  # 10 rows: each sample once
    state = loader.state_dict()
    ahead = [loader.next_batch() for _ in range(3)]  # into the next epochs, a new order each
    again = data.ShuffledLoader(num_samples=10, global_batch=4, seq_len=8, vocab_size=50, seed=3)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(ahead, [again.next_batch() for _ in range(3)]))
    # a resume without the loader's state starts the order again: other rows
    fresh = data.ShuffledLoader(num_samples=10, global_batch=4, seq_len=8, vocab_size=50, seed=3)
    assert not all(torch.equal(a, b) for a, b in zip(ahead, [fresh.next_batch() for _ in range(3)]))


def test_the_rng_state_round_trip_covers_python_numpy_and_torch():
    import random

    from distlab import runtime

    state = runtime.rng_state()
    drawn = (random.random(), torch.rand(3).tolist())
    runtime.set_rng_state(state)
    assert (random.random(), torch.rand(3).tolist()) == drawn
