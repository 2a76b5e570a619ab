"""Chapter 04's numbers, recomputed: the test fails when the chapter's pages (chapters/04_data_parallel.md,
chapters/04.2_ddp.md, read as one text) drift from the code."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from coursetools import chapters
from distlab import comm, memory, models

TEXT = chapters.text("04")
FLAT = " ".join(TEXT.split())  # the text as read: a phrase matches whatever the line breaks
GIB = 2**30
TORCH = Path(torch.__file__).parent


def says(phrase: str) -> None:
    assert " ".join(phrase.split()) in FLAT, \
        f"chapter 04 no longer says {phrase!r}: the code computes it; update the text"


def never_says(phrase: str) -> None:
    assert " ".join(phrase.split()) not in FLAT, f"chapter 04 says {phrase!r} again, which is wrong"


def test_bytes_per_step_of_the_tiny_model():
    tiny = models.preset("tiny")
    payload = comm.zero_step_bytes(tiny.num_params(), stage=0)["all_reduce"]
    # one claim in one sentence (issue 48 cut four short sentences that made it)
    says(f"Every step all-reduces every gradient once, 4 bytes a parameter in fp32, so the bytes are fixed by the "
         f"model: the tiny transformer's {tiny.num_params():,} parameters make {payload:,} bytes a step")
    sent = comm.bytes_sent_per_rank("all_reduce", payload, 4)
    says(f"{sent:,.0f} bytes per rank per step on 4 ranks")
    tensors = len(list(models.build_transformer(tiny, seed=0).parameters()))
    says(f"The by-hand version issues {tensors} all-reduces per step, one per parameter tensor")


def test_the_a100_preset_numbers():
    a100 = models.preset("a100")
    grads = comm.zero_step_bytes(a100.num_params(), stage=0)["all_reduce"]
    says(f"it is {grads / 1e9:.2f} GB per step, and each of 4 ranks\nsends "
         f"{comm.bytes_sent_per_rank('all_reduce', grads, 4) / 1e9:.2f} GB")
    state = memory.training_state_bytes(a100.num_params(), "fp32")
    bucket_copy = a100.num_params() * 4  # DDP's buckets: a second fp32 copy of every gradient (the default)
    says(f"Its fp32 training state is {state.total / GIB:.1f} GiB per GPU")
    says(f"a second copy of the gradients ({bucket_copy / GIB:.1f} GiB")
    # chapter 01's two phases, with the buckets in both and the activations chapter 01's bf16 run measured (batch 4)
    bf16_activations = 13.49
    phases = memory.predict_step_peak(state, round(bf16_activations * GIB), 4, a100.seq_len, a100.vocab_size)
    fb, step = (phases.total(p) + bucket_copy for p in ("forward/backward", "optimizer step"))
    says(f"with the {bf16_activations:.2f} GiB of activations its\nbf16 run saved at batch 4. Forward/backward then "
         f"holds {fb / GIB:.1f} GiB and the optimizer step {step / GIB:.1f} GiB")
    says(f"fits the A100-40GB's 40 GiB, with {(40 * GIB - max(fb, step)) / GIB:.1f} GiB to spare")
    never_says("before activations, so the replica fits")
    says(f"Each step all-reduces {grads / 1e9:.2f} GB\nof gradients")


def test_the_sampler_pads_so_every_rank_runs_the_same_number_of_steps():
    # 10 samples on 4 ranks: 3 each, two samples served twice (as the chapter says: equal steps, not an exact mean)
    indices = [list(DistributedSampler(range(10), num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    assert [len(i) for i in indices] == [3, 3, 3, 3]
    served = sorted(sum(indices, []))
    assert set(served) == set(range(10)) and len(served) == 12  # two repeats
    says("so that every rank runs the same number of steps and therefore the same collectives")
    never_says("pads the dataset for the same reason")


# ---- DDP's buckets and unused parameters, on one rank (gloo, in this process). DDP's constructor imports
# torch._dynamo, once per test process: a few seconds on a loaded machine, paid by the first of these tests


def bucket_bytes_per_step(steps=3, **ddp_options):
    """The bytes of every bucket DDP all-reduces, step by step, for 6 linears of 263,168 bytes (1.5 MiB)."""
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]), **ddp_options)
    seen = []

    def note(state, bucket):  # a comm hook that records and returns the bucket as it is (one rank: the sum)
        seen[-1].append(bucket.buffer().numel() * bucket.buffer().element_size())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, note)
    for _ in range(steps):
        seen.append([])
        ddp(torch.randn(1, 256)).sum().backward()
    return seen


def test_one_bucket_then_a_rebuild_only_without_find_unused_parameters(world_of_one):
    layer = 263_168
    total, first_cap = 6 * layer, dist._DEFAULT_FIRST_BUCKET_BYTES
    default = bucket_bytes_per_step()
    assert default[0] == [total]                                   # step 0: one bucket holding everything
    # rebuilt after it, once: the first bucket takes gradients until it holds 1 MiB (the one that crosses the
    # limit joins it: 4 layers), the rest (under 25 MiB) the second
    assert first_cap == 2**20 and default[1] == default[2] == [4 * layer, 2 * layer]
    assert default[1][0] - 256 * 256 * 4 < first_cap <= default[1][0]
    assert bucket_bytes_per_step(static_graph=True) == [[total], [total], [4 * layer, 2 * layer]]  # a step later
    # find_unused_parameters: cut by size from the first step in registration order (the bucket that reaches 1 MiB
    # holds the first-registered layers: 4 weights and 3 biases), launched in reverse, and never rebuilt
    first_registered = 4 * 256 * 256 * 4 + 3 * 256 * 4
    assert bucket_bytes_per_step(find_unused_parameters=True) == [[total - first_registered, first_registered]] * 3
    source = (TORCH / "nn" / "parallel" / "distributed.py").read_text().splitlines()
    assert source[152].strip() == "if static_graph or not find_unused_parameters:"
    assert "dist._DEFAULT_FIRST_BUCKET_BYTES if is_using_default else bucket_bytes_cap" in source[108]
    assert "bucketing could insert ALL-REDUCE comm op too early" in "\n".join(source[1390:1407])
    reducer = (TORCH / "include" / "torch" / "csrc" / "distributed" / "c10d" / "reducer.hpp").read_text().splitlines()
    assert "(static_graph_ || !find_unused_parameters_) && !has_rebuilt_bucket_" in reducer[150]
    assert "reduced in a predetermined order consistent across" in reducer[353]
    says("the first bucket (the gradients ready first, from\nthe output layer) takes gradients until it holds 1 MiB")
    says("With the default options (neither flag) or with `static_graph=True`, the first step runs with a single "
         "bucket holding everything")
    never_says("DDP cannot know the order before it has seen one backward pass")


class OneBranchUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_an_unused_parameter_fails_at_the_next_iteration_and_find_unused_parameters_fixes_it(world_of_one):
    torch.manual_seed(0)
    ddp = DDP(OneBranchUnused())
    ddp(torch.randn(2, 4)).sum().backward()                        # the step that skips a parameter: no error
    with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration") as error:
        ddp(torch.randn(2, 4))                                      # the next forward
    assert "Parameter indices which did not receive grad for rank 0: 2 3" in str(error.value)  # unused's weight, bias
    fixed = DDP(OneBranchUnused(), find_unused_parameters=True)
    for _ in range(2):
        fixed(torch.randn(2, 4)).sum().backward()
    assert fixed.module.unused.weight.grad is None and fixed.module.used.weight.grad is not None
    says("`Expected to have finished reduction in the prior iteration before starting a new one`")
    says("It hangs only when\n  the ranks differ in what they use")


def test_gloo_runs_two_worker_threads_and_ddp_syncs_buffers_by_default(world_of_one):
    header = (TORCH / "include" / "torch" / "csrc" / "distributed" / "c10d" / "ProcessGroupGloo.hpp").read_text()
    assert header.splitlines()[263].strip() == "int threads{2};"
    assert dist.group.WORLD._get_backend(torch.device("cpu")).options._threads == 2  # the group this test made
    says("a\nGloo process group runs two worker threads")
    never_says("run one after the\nother in Gloo's thread")
    assert DDP(nn.Linear(2, 2)).forward_sync_buffers is True
    says("(`forward_sync_buffers=True`, the\n  default in torch 2.13")


def test_ddp_broadcasts_the_course_models_buffers_at_every_forward(world_of_one, monkeypatch):
    tiny = models.preset("tiny")
    model = models.build_transformer(tiny, seed=0)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    says(f"RoPE's cos and sin tables ({buffer_bytes:,} bytes for the tiny preset)")
    calls, original = [], dist._broadcast_coalesced

    def counting(group, tensors, buffer_size, src):
        calls.append(sum(t.numel() * t.element_size() for t in tensors))
        return original(group, tensors, buffer_size, src)

    monkeypatch.setattr(dist, "_broadcast_coalesced", counting)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    for sync, expected in ((None, [buffer_bytes] * 2), (False, [])):
        options = {} if sync is None else {"forward_sync_buffers": sync}
        ddp = DDP(models.build_transformer(tiny, seed=0), **options)   # wrapping broadcasts weights and buffers
        calls.clear()
        for _ in range(2):
            ddp(tokens)
        assert calls == expected, (sync, calls)
    says("`forward_sync_buffers=False` skips it (the broadcast when wrapping stays)")


def test_the_overlap_figures_bars_overlap_each_other_as_the_text_says():
    # the committed measurement behind 04_ddp_overlap.png (4 CPU ranks, gloo): with two worker threads a bucket's
    # all-reduce starts before the previous one has finished
    import json

    from coursetools import figures
    bars = sorted(json.loads(figures.DDP_OVERLAP.read_text())["overlap"]["buckets"], key=lambda b: b["launch"])
    assert any(later["launch"] < earlier["end"] for earlier, later in zip(bars, bars[1:]))
    says("the bars of the four small buckets overlap each other")


def test_a_gpu_bar_ends_on_the_callbacks_stream_not_the_compute_stream():
    # BucketLog stamps the finish inside future.then(...): torch runs such a callback with a pool stream made
    # current after it waited for the future's (NCCL's) events, so the end event is recorded there
    future = (TORCH / "include" / "ATen" / "core" / "ivalue_inl.h").read_text().splitlines()
    assert "getStreamFromGlobalPool(device)" in future[1193] and "synchronizeWithCurrentStreams();" in future[1196]
    script = (Path(__file__).resolve().parents[2] / "scripts" / "04_data_parallel" / "train_ddp.py").read_text()
    assert 'entry["end"] = self.clock.mark()' in script and "return future.then(finished)" in script
    says("ends with one the future's callback records, on a stream torch takes from\nits pool")
    never_says("(`metrics.DeviceClock`) recorded on the compute stream")


# ---- issue 48: the chapter teaches first (a picture and a worked example), and defines a term before using it


def test_the_worked_example_is_what_autograd_computes():
    """The one-weight example of the first page, recomputed by autograd on one device: y = w x, loss (w x - y)² / 2,
    x = 1..8, y = 2 x, w = 1; four slices of two; the mean of the slice gradients is the whole batch's."""
    def gradient(xs, w=1.0):
        weight = torch.tensor(w, dtype=torch.float64, requires_grad=True)
        x = torch.tensor(xs, dtype=torch.float64)
        (0.5 * (weight * x - 2 * x) ** 2).mean().backward()
        return weight.grad.item()

    samples = [float(x) for x in range(1, 9)]
    whole = gradient(samples)
    local = [gradient(samples[2 * r:2 * r + 2]) for r in range(4)]
    mean = sum(local) / 4
    assert mean == whole == -25.5
    says(f"the gradient of the mean loss over the whole batch is the mean of -1, -4, ..., -64: **{whole:g}**")
    says(f"Rank 0 (x = 1, 2) gets {local[0]:g}, rank 1 gets {local[1]:g}, rank 2 gets {local[2]:g} and rank 3 gets "
         f"{local[3]:g}")
    says(f"Their mean is ({local[0]:g} - {-local[1]:g} - {-local[2]:g} - {-local[3]:g}) / 4 = **{mean:g}**")
    says(f"with a learning rate of 0.01 to w = 1 + 0.01 x {-mean:g} = {1 - 0.01 * mean:g}")
    uneven = [samples[:3], samples[3:4], samples[4:6], samples[6:]]
    mean_of_means = sum(gradient(s) for s in uneven) / 4
    assert abs(mean_of_means - whole) > 1
    says(f"Split the same eight samples 3, 1, 2, 2 and the mean of the four slice gradients is {mean_of_means:.1f}")


def test_the_picture_of_the_mechanism_draws_the_worked_example_and_comes_first():
    from coursetools.drawings import ch04
    step = ch04.data_parallel_step()
    assert step["local"] == [-2.5, -12.5, -30.5, -56.5] and step["mean"] == -25.5 and step["weight"] == 1.255
    assert 0 <= FLAT.index("figures/04_replicas_split_batch.png") < FLAT.index("figures/04_ddp_overlap.png")


def test_find_unused_parameters_and_static_graph_are_defined_where_they_first_appear():
    for option, definition in (("find_unused_parameters", "`find_unused_parameters=True` tells DDP that some "
                                "parameters may get no gradient in a step"),
                               ("static_graph", "`static_graph=True` promises that the set of parameters used is "
                                "the same in every step")):
        says(definition)
        assert FLAT.index(option) == FLAT.index(definition) + 1, f"{option} is used before it is defined"


def test_the_measured_overlap_is_read_as_it_was_measured():
    import json

    from coursetools import figures
    overlap = json.loads(figures.DDP_OVERLAP.read_text())["overlap"]
    third = round(overlap["hidden_fraction"] * 3)
    assert third == 1
    says("only about a third of the all-reduce time is hidden")
    says(f"backward returns {(overlap['backward_end'] - overlap['last_gradient']) * 1e3:.0f} ms after its last "
         f"gradient: the tiny model's {(overlap['last_gradient'] - overlap['backward_start']) * 1e3:.0f} ms of "
         "backward computing")


def test_the_bucket_table_is_the_measured_run():
    """The rebuilt buckets of train_ddp.py --bucket-mb 0.1 (the committed run behind 04_ddp_overlap.png): the table's
    rows, and the claim about their sizes against the cap torch computes (bucket_cap_mb x 1024 x 1024)."""
    import json

    from coursetools import figures
    run = json.loads(figures.DDP_OVERLAP.read_text())
    assert run["argv"][run["argv"].index("--bucket-mb") + 1] == "0.1"
    cap = 0.1 * 1024 * 1024
    source = (TORCH / "nn" / "parallel" / "distributed.py").read_text()
    assert "_MB_TO_BYTES = 1024 * 1024" in source and "int(effective_bucket_cap_mb * _MB_TO_BYTES)" in source
    buckets = run["buckets"]
    assert [b["bytes"] >= cap for b in buckets] == [True] * (len(buckets) - 1) + [False]
    says(f"Every later step all-reduces {['one', 'two', 'three', 'four'][len(buckets) - 1]}, filled from the output "
         f"layer backwards. {['One', 'Two', 'Three'][len(buckets) - 2]} reach 0.1 MiB ({cap:,.0f}\nbytes) or more, "
         f"and the last holds the rest")
    for b in buckets:
        first = ", ".join(f"`{p}`" for p in b["params"][:2 if b["index"] else 3])
        assert f"| {b['index']} | {b['bytes']:,} | {first}" in TEXT, b["index"]
    says(f"They add up to the same {sum(b['bytes'] for b in buckets):,} bytes")
    never_says("a little over 0.1 MB")
    says("`bucket_cap_mb` MiB (25 by\ndefault; torch multiplies it by 1024 x 1024)")


def test_the_overlapping_bars_are_explained_by_queueing():
    import json

    from coursetools import figures
    bars = json.loads(figures.DDP_OVERLAP.read_text())["overlap"]["buckets"]
    # the most bars in flight at once, from their launches and ends: more than Gloo's two threads
    most = max(sum(b["launch"] <= t < b["end"] for b in bars) for t in (b["launch"] for b in bars))
    assert most > 2
    says(f"that is why {most - 1} or {most} bars can overlap while only two move")


def test_words_that_mislead_are_gone():
    never_says("every second GPU")
    never_says("an all-reduce of P bytes")
    says("sent per rank = 2 (N-1)/N x S")
    never_says("the parameters barely change")
    never_says("divides the communication per sample by A")
    says("lets a batch A times larger cost the same bytes per\noptimizer step")
    says("every parameter's AccumulateGrad node")


def test_the_lab_draws_the_overlap_as_the_chapter_does():
    """Lab 04's plot and the chapter's 04_ddp_overlap.png read alike: the band is backward computing (to the last
    gradient), the dashed line is where backward returns."""
    import inspect
    import json

    from coursetools import figures
    chapter = inspect.getsource(figures.draw_ddp_overlap)
    assert 'ax.axvspan(0, ms(overlap["last_gradient"])' in chapter and 'ax.axvline(ms(overlap["backward_end"])' in chapter
    lab = json.loads((Path(__file__).resolve().parents[2] / "notebooks/04_data_parallel.ipynb").read_text())
    cells = ["".join(c["source"]) for c in lab["cells"]]
    plot = next(c for c in cells if "ax.axvspan(" in c)
    assert 'ax.axvspan(ms(overlap["backward_start"]), ms(overlap["last_gradient"])' in plot
    assert 'ax.axvline(ms(overlap["backward_end"])' in plot
    assert any("the dashed line is where backward returns" in c for c in cells)


def test_the_accumulation_snippet_defines_what_it_uses():
    """The no_sync() snippet of page 4.2 makes its inputs and targets from the loop's tokens, as train_ddp.py does."""
    import re

    snippet = next(block for block in re.findall(r"```python\n(.*?)```", TEXT, re.S) if "ddp.no_sync()" in block)
    assert "for i, tokens in enumerate(micro_batches):" in snippet
    assert "inputs, targets = data.split_inputs_targets(tokens)" in snippet
    script = (Path(__file__).resolve().parents[2] / "scripts" / "04_data_parallel" / "train_ddp.py").read_text()
    assert "inputs, targets = data.split_inputs_targets(tokens.to(rt.device))" in script
