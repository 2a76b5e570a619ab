"""Chapter 05's numbers, recomputed: the test fails when the chapter's pages (chapters/05_fully_sharded.md, 05.2_*,
05.3_*, read as one text by ``coursetools.chapters.text``) drift from the code.

Also pins what the chapter says of FSDP2's call counts: with ``reshard_after_forward=True`` forced on the root
(as train_fsdp.apply_fsdp does) a step all-gathers 6 times on the tiny model; with the root left at its default,
5. Measured on a fake process group (one process, 4 ranks' worth of sharding, no ranks launched)."""

import re
import sys
from pathlib import Path

import matplotlib.colors
import pytest
import torch
from torch.distributed.tensor import Shard

from coursetools import chapters
from distlab import comm, memory, models

REPO = Path(__file__).resolve().parents[2]
TEXT = chapters.text("05", REPO)
FLAT = " ".join(TEXT.split())   # where the text's lines break is no part of what it says
GIB = 2**30


def says(phrase: str) -> None:
    phrase = " ".join(phrase.split())
    assert phrase in FLAT, f"chapter 05 no longer says {phrase!r}: the code computes it; update the text"


def gib(num_params, ranks, stage):
    return memory.zero_state_bytes(num_params, ranks, stage).total / GIB


def test_the_zero_table_bytes_per_parameter():
    totals = [memory.zero_state_bytes(1, 4, stage).total for stage in range(4)]
    says(f"| DDP | 2 | 2 | 12 | {totals[0]:g} |")
    says(f"| ZeRO-1: shard the optimizer state | 2 | 2 | 12 / N | {totals[1]:g} |")
    says(f"| ZeRO-2: and the gradients | 2 | 2 / N | 12 / N | {totals[2]:g} |")
    says(f"| ZeRO-3: and the weights | 2 / N | 2 / N | 12 / N | {totals[3]:g} |")
    # the table is the ZeRO paper's 2 + 2 + 12; FSDP2 and autocast keep fp32 weights: 4 + 4 + 8, the same total
    assert "ZeRO-3 (FSDP): and the weights" not in FLAT
    fp32 = memory.zero_state_bytes(1, 1, 0, precision="fp32")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4, 4, 8) and fp32.total == totals[0]
    says(f"{fp32.params:g} + {fp32.grads:g} + {fp32.optimizer:g} bytes, the same {totals[0]:g} (page 5.3)")
    says("That 2 + 2 + 12 is the ZeRO paper's layout")
    # the stages picture draws the paper's split: its caption says FSDP2's, with the same total
    says(f"The split is the ZeRO paper's; FSDP2 holds {fp32.params:g} + {fp32.grads:g} + {fp32.optimizer:g} of the "
         f"same {fp32.total:g} (this page's first section)")


def test_the_tiny_measurements_table_is_the_formula():
    n = models.preset("tiny").num_params()
    ddp, one, two = (memory.zero_state_bytes(n, 4, s, precision="fp32") for s in (0, 1, 2))
    says(f"| DDP (formula) | {ddp.params:,.0f} | {ddp.grads:,.0f} | {ddp.optimizer:,.0f} |")
    says(f"| ZeRO-1, measured | {one.params:,.0f} | {one.grads:,.0f} | {one.optimizer:,.0f} |")
    says(f"| ZeRO-2, measured | {two.params:,.0f} | {two.grads:,.0f} | {two.optimizer:,.0f} |")
    step1, step3 = comm.zero_step_bytes(n, 1), comm.zero_step_bytes(n, 3)
    says(f"stage 1 all-reduces {step1['all_reduce']:,} bytes\nand all-gathers {step1['all_gather']:,}")
    ratio = comm.step_bytes_sent_per_rank(step1, 4) / comm.step_bytes_sent_per_rank(comm.zero_step_bytes(n, 0), 4)
    assert ratio == 1.5
    # measured: the payloads the run hands its collectives; derived: the ring model's bytes on the wire
    payload = sum(step1.values()) / sum(comm.zero_step_bytes(n, 0).values())
    assert payload == 2.0
    # the body gives the bytes on the wire; what is measured and what derived is said in "How we know" only
    says(f"and all-gathers {step1['all_gather']:,}: 3(N-1)/N P b per rank, {ratio:g} times DDP's bytes on the wire")
    body = FLAT[:FLAT.index("## How we know")]
    assert "that is measured" not in body and f"{payload:.1f} times DDP" not in body
    says(f"it hands its collectives {sum(step1.values()):,} bytes a step, {payload:.1f} times DDP's all-reduce of "
         f"{comm.zero_step_bytes(n, 0)['all_reduce']:,} (measured). So each rank sends {ratio:g} times DDP's bytes "
         f"(derived by the ring model from the payloads)")
    assert "measured 1.5 times DDP" not in FLAT and "Every claim here is a measurement" not in FLAT
    says("Two kinds are derived, and said so")
    says(f"{step3['all_gather']:,} bytes all-gathered in 6 calls")
    says(f"- {step3['reduce_scatter']:,} bytes reduce-scattered in 3 calls.")


def test_the_sizing_table_in_gib():
    for size in (7, 13):
        for ranks in (4, 8, 16):
            cells = " | ".join(f"{gib(size * 1e9, ranks, s):.1f}" for s in range(4))
            says(f"| {size} B, N = {ranks} | {cells} |")
    # the sentences under it: 13 B under ZeRO-3 does not fit one 4-GPU node, and two nodes leave 15.8 GiB; the
    # smallest GPU count is lab 05's Exercise 3 (7 GPUs leave 12.3 GiB), which the chapter must not contradict
    assert gib(13e9, 4, 3) > 40 and next(n for n in range(1, 17) if 40 - gib(13e9, n, 3) >= 12) == 7
    says(f"A 13 B model's ZeRO-3 state does not fit one 4-GPU Derecho node ({gib(13e9, 4, 3):.1f} GiB a GPU); on "
         f"two nodes, 8 GPUs, it leaves {40 - gib(13e9, 8, 3):.1f} GiB for activations")
    assert "at least 8 GPUs" not in FLAT
    assert next(n for n in (1, 2, 4, 8, 16) if gib(13e9, n, 2) <= 40) == 16
    says(f"ZeRO-2 fits its state only from 16 GPUs, with\n{int(40 - gib(13e9, 16, 2))} GiB to spare")
    large = models.preset("a100_large").num_params()
    says(f"the `a100_large` preset, {large / 1e9:.2f} B parameters. Its state under DDP is {gib(large, 1, 0):.1f} GiB")
    says(f"sharded over the 4 GPUs of one node it is {gib(large, 4, 3):.1f} GiB per GPU")
    says(f"needs {gib(7e9, 1, 0):.0f} GiB of training state per GPU")
    # a100_large's baseline fits the H200 of the one-rank run (62.80 GiB peak), not an A100-40GB
    assert 40 < gib(large, 1, 0) < 141e9 / GIB
    says("No A100-40GB can hold its baseline")
    assert "No single GPU can hold" not in FLAT
    says("Beware a name: `train_fsdp.py --preset a100` trains `a100_large`")
    says(f"for the {models.preset('a100').num_params() / 1e9:.2f} B-parameter `a100`\n preset (not `a100_large`)")


def test_bf16_unit_roundoff():
    unit_roundoff = torch.finfo(torch.bfloat16).eps / 2  # 8 significant bits: 2^-8
    assert unit_roundoff == 2.0**-8
    says(f"a unit roundoff of\n2^-8, about {100 * unit_roundoff:.2f}%")
    code = (REPO / "distlab" / "metrics.py").read_text()  # where the bf16 tolerances are stated
    assert "2^-8" in code and "2^-9" not in code


def test_zero_1_is_not_said_to_cost_ddps_traffic():
    assert "Stages 1 and 2 cost DDP's communication" not in FLAT
    says("Stage 2 costs DDP's communication")


@pytest.fixture(scope="module")
def fsdp_all_gathers():
    """All-gather and reduce-scatter calls of one forward + backward of the tiny model, root forced or default."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(REPO / "scripts" / "05_fully_sharded"))
    import train_fsdp  # noqa: E402  (the script's own apply_fsdp)

    sys.path.pop(0)
    counts = {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        for root in ("forced", "default"):
            model = models.build_transformer(models.preset("tiny"), seed=0)
            if root == "forced":
                train_fsdp.apply_fsdp(model)
            else:
                for block in model.layers.values():
                    fully_shard(block, reshard_after_forward=True)
                fully_shard(model)  # reshard_after_forward=None: False for the root
            tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
            with CommDebugMode() as mode:
                models.lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            calls = {str(k): v for k, v in mode.get_comm_counts().items()}
            counts[root] = (calls.get("c10d._allgather_base_"), calls.get("c10d._reduce_scatter_base_"))
    finally:
        dist.destroy_process_group()
    return counts


@pytest.mark.filterwarnings("ignore:Full backward hook", "ignore:FSDP2-wrapped module")
def test_fsdp2_call_counts_forced_root_and_default_root(fsdp_all_gathers):
    assert fsdp_all_gathers["forced"] == (6, 3)   # 3 units (2 blocks + root), twice each
    assert fsdp_all_gathers["default"] == (5, 3)  # the root keeps its gathered weights for backward
    says("all-gathered in 6 calls (3 units, twice each, the root included because we force it to reshard)")
    says("With the root left at its\ndefault the root would gather once: 5 calls.")
    says("Left to its default (`None`),\nFSDP2 reshards every unit but the root")


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_fsdp2_gathers_for_backward_from_a_hook_on_the_outputs_and_reshards_a_forced_root(fsdp_all_gathers):
    """In eager mode FSDP2 registers a tensor hook on each unit's outputs (_fsdp_state.py:452); its
    RegisterPreBackwardFunction is applied only under functorch transforms (:453-463). So the root's output keeps
    the model's own grad_fn and carries FSDP2's _pre_backward as a hook. And the root forced to reshard
    (train_fsdp.apply_fsdp) has freed its gathered storages once forward is done (6 all-gathers, not 5), so the
    chapter may not say that FSDP2 keeps it gathered from forward to backward."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (registers FSDP2)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(REPO / "scripts" / "05_fully_sharded"))
    import train_fsdp  # noqa: E402

    sys.path.pop(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        model = models.build_transformer(models.preset("tiny"), seed=0)
        train_fsdp.apply_fsdp(model)
        logits = model(torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0)))
        hooks = [getattr(h, "__name__", "") for h in (logits._backward_hooks or {}).values()]
        root_group = model._get_fsdp_state()._fsdp_param_group
        root_bytes = [t.untyped_storage().size() for p in root_group.fsdp_params for t in p.all_gather_outputs]
    finally:
        dist.destroy_process_group()
    assert "RegisterPreBackward" not in type(logits.grad_fn).__name__ and hooks == ["_pre_backward"]
    assert root_bytes and set(root_bytes) == {0}
    pre = torch_lines("_fsdp_state.py", 434, 452)
    assert "t.register_hook(self._pre_backward)" in pre and "RegisterPreBackwardFunction" not in pre
    functorch = torch_lines("_fsdp_state.py", 453, 463)
    assert "_are_functorch_transforms_active()" in functorch and "RegisterPreBackwardFunction.apply(self, t)" in functorch
    assert "Another identity on each unit's output" not in FLAT and "runs from `RegisterPreBackwardFunction`" not in FLAT
    says("A hook on each unit's output tensors fires FSDP2's gather for backward")
    says("(`_fsdp_state.py:434-452`)")
    says("only under functorch transforms (`:453-463`)")
    assert fsdp_all_gathers["forced"][0] == 6
    assert "FSDP2 does not reshard the root after forward" not in FLAT
    says("Left to its default, FSDP2 would not reshard the root after forward")


def test_zero3_by_hand_numbers_are_the_tiny_models():
    """Stage 3 by hand: the slices, the bytes and the one block alive, recomputed from the model (the script's
    test, tests/scripts/test_05_fully_sharded.py, measures the same numbers on 4 ranks)."""
    cfg = models.preset("tiny")
    model = models.build_transformer(cfg)
    n = sum(p.numel() for p in model.parameters())
    block = 4 * sum(p.numel() for p in model.layers["0"].parameters())
    embedding = 4 * model.tok_embeddings.weight.numel()
    units = cfg.n_layers + 2                     # the embedding, each block, the head
    gathered = comm.zero_step_bytes(n, 3)["all_gather"]
    says(f"slice r of every parameter: {n // 4:,} of the tiny model's {n:,} parameters on each of 4 ranks")
    says(f"{gathered:,} all-gathered per step in {2 * units} calls ({units} units, twice each)")
    says(f"{comm.zero_step_bytes(n, 3)['reduce_scatter']:,} reduce-scattered in {units}")
    says(f"At every measured event, at most {block:,} bytes of gathered weights are alive: one block.")
    says(f"The script measures that moment too: {2 * block:,} bytes, two blocks' worth.")   # buffer + copies
    says("A copy of a weight made inside a module")
    says(f"The whole model is {4 * n:,} bytes, which ZeRO-1 and ZeRO-2")
    says(f"sends {gathered - embedding:,} bytes instead of {gathered:,}: the embedding's {embedding:,}\nbytes once less")
    says(f"(half the bytes: {comm.zero_step_bytes(n, 3, param_bytes=2)['all_gather']:,} per step instead of {gathered:,})")
    says(f"backward gathers it again on top: {3 * block:,} bytes at the peak, three blocks' worth and\n  "
         f"{3 * block / (4 * n):.1f} times the whole model")
    # like with like: the prefetch's figure is the event-level one (the committed prefetch run), as is the 213,504
    import json
    run = json.loads((REPO / "chapters" / "figures" / "data" / "05_zero3_prefetch.json").read_text())
    assert run["gathered_peak_bytes"] == 2 * block
    says(f"At the measured events, one unit is whole while the next one's gather fills its buffer: {2 * block:,} "
         f"bytes at most instead of {block:,} (measured)")
    says("Without prefetch, two blocks' worth was alive only for the moment inside a gather; with it, for as long "
         "as a unit computes")
    # the sketch's 4 units against train_fsdp.py's 3: the root takes the embedding and the head
    says(f"on the same {units} units")
    says(f"The tiny model has {cfg.n_layers + 1}: its {cfg.n_layers} blocks and the root, one unit fewer than the "
         f"sketch's {units}, because the root holds the embedding and the head together")


def test_fsdp_call_counts_are_one_a_unit():
    """train_fsdp.py's units: each block and the root; twice the all-gathers when they reshard after forward."""
    units = models.preset("tiny").n_layers + 1
    says(f"The script also counts the calls: {2 * units} all-gathers and {units} reduce-scatters a step, one a unit.")


def test_fsdp_peak_by_phase_terms_and_the_h200_run():
    """The terms of FSDP2's peak (distlab.memory.fsdp_unit_bytes), the torch lines the chapter cites, and the one-GPU
    run of BENCHMARKS.md (one H200, a100_large on one rank: 62.80 GiB max_memory_allocated)."""
    from pathlib import Path as _Path

    import torch

    large = models.preset("a100_large")
    n = large.num_params()
    units = memory.fsdp_unit_bytes(large.vocab_size, large.dim, large.n_layers, n, param_bytes=2)
    block = (n - 2 * large.vocab_size * large.dim - large.dim) // large.n_layers
    assert sum(v for k, v in units.items() if "root" not in k) == 10 * block          # 2 + 2 + 2 + 4
    says("about 10 bytes per parameter of a block (2 + 2 + 2 + 4: gathered weights, their gradients, the next "
         "block's gather, the previous reduce-scatter's input)")
    temporary = memory.FOREACH_ADAMW_TEMPORARY_BYTES_PER_PARAM
    shards = memory.zero_state_bytes(1, 1, 0, precision="fp32").total
    says(f"{shards:g}/N bytes per parameter. AdamW's foreach implementation (one kernel over many parameters at "
         f"once) adds a temporary fp32 copy, {temporary:g}/N: {shards + temporary:g}/N bytes per parameter")
    fp32 = memory.fsdp_unit_bytes(large.vocab_size, large.dim, large.n_layers, n, param_bytes=4)
    assert sum(v for k, v in fp32.items() if "root" not in k) == 16 * block
    one_rank = memory.predict_step_peak(memory.zero_state_bytes(n, 1, 3, precision="fp32"), 0, 1, large.seq_len,
                                        large.vocab_size, fsdp_units=units)
    assert one_rank.peak_phase == "optimizer step"
    says(f"the optimizer step held the peak, {one_rank.peak / GIB:.2f}\nGiB predicted against 62.80 GiB measured")
    assert memory.within_margin(one_rank.peak, 62.80 * GIB)
    fsdp = _Path(torch.__file__).parent / "distributed" / "fsdp" / "_fully_shard"
    state = (fsdp / "_fsdp_state.py").read_text().splitlines()
    assert "For the root, do not reshard after forward" in state[202] and "post_forward_mesh_info = None" in state[206]
    collectives = (fsdp / "_fsdp_collectives.py").read_text().splitlines()
    assert "all_gather_output = all_gather_comm.allocate(" in collectives[350]
    assert "reduce_scatter_input = reduce_scatter_comm.allocate(" in collectives[596]
    says("`_fsdp_state.py:203-207`")
    says("`_fsdp_collectives.py:597`")
    says("`_fsdp_collectives.py:351`")
    # the root's gradients wait for the final callback; the previous block's reduce-scatter input is kept until this
    # block's post-backward, which reshards its weights first
    assert "fsdp_param_group.post_backward()" in state[414] and "_root_post_backward_final_callback" in state[394]
    group = (fsdp / "_fsdp_param_group.py").read_text().splitlines()
    assert "self.reshard()" in group[637] and "if self.reshard_after_backward:" in group[636]
    assert "reduce_scatter_max_input_buffers" in group[646] and "oldest = states.pop(0)" in group[654]
    assert "del oldest" in group[657]
    says("(`_fsdp_state.py:411-415`)")
    says("(`_fsdp_param_group.py:647-658`, one buffer in flight by default)")
    says("(`:637-638`)")
    says("the root's unsharded gradients (the output layer's and the final norm's)")
    assert units["the root's unsharded gradients (output, final norm)"] == 2 * (large.vocab_size * large.dim + large.dim)


def test_what_the_chapter_says_of_bf16_sums_checkpoint_names_and_tolerances():
    """Issue 37's four claims, against the code they describe: the resume checks parameters at lr / 10
    (common_fully_sharded.param_tolerance), the snippet is distlab.checkpointing's (LAYOUT_FREE), torch strips
    checkpoint_wrapper's prefix at the lines cited, and bf16 gradients are rounded before the fp32 sum."""
    import inspect

    sys.path.insert(0, str(REPO / "scripts" / "05_fully_sharded"))
    from common_fully_sharded import LOSS_TOLERANCE, param_tolerance

    from distlab import checkpointing

    flat = " ".join(TEXT.split())
    assert LOSS_TOLERANCE == 1e-5 and param_tolerance(1.0) == 1.0 / 10
    says("single-device run's within 1e-5, and the parameters at the end within lr / 10")
    source = inspect.getsource(checkpointing.TrainingState)
    assert "get_state_dict(self.model, self.optimizer, options=LAYOUT_FREE)" in source and \
        "get_state_dict(self.model, self.optimizer, options=LAYOUT_FREE)" in TEXT
    assert checkpointing.LAYOUT_FREE.flatten_optimizer_state_dict and \
        "LAYOUT_FREE = StateDictOptions(flatten_optimizer_state_dict=True)" in TEXT
    torch_dir = Path(torch.__file__).parent / "distributed"
    wrapper = (torch_dir / "algorithms" / "_checkpoint" / "checkpoint_wrapper.py").read_text().splitlines()
    assert "param_name.replace(_CHECKPOINT_PREFIX" in "".join(wrapper[56:86])
    assert "_replace_by_prefix(state_dict" in "".join(wrapper[56:86])
    dcp = (torch_dir / "checkpoint" / "state_dict.py").read_text().splitlines()
    assert 'name.replace(_CHECKPOINT_PREFIX, "")' in dcp[180]
    assert "checkpoint_wrapper.py` lines 57-86" in flat and "`torch/distributed/checkpoint/state_dict.py` line 181" in flat
    assert "summing over many ranks loses nothing" not in flat and "already rounded to 8 significant bits" in flat


FSDP2_SOURCE = Path(torch.__file__).parent / "distributed" / "fsdp" / "_fully_shard"


def torch_lines(name: str, first: int, last: int) -> str:
    """Lines first..last (1-based, inclusive) of an FSDP2 source file of the installed torch."""
    return "".join((FSDP2_SOURCE / name).read_text().splitlines(keepends=True)[first - 1:last])


def test_how_fsdp2_keeps_the_weights_out_of_autograd_is_what_torch_does():
    """The chapter's contrast between the sketch and FSDP2, held to torch 2.13's source at the lines it cites."""
    assert "free_storage(tensor)" in torch_lines("_fsdp_param.py", 827, 831)
    assert "storage.resize_(0)" in torch_lines("_fsdp_param.py", 1072, 1074)
    assert "alloc_storage(tensor)" in torch_lines("_fsdp_param.py", 823, 825)
    assert "storage.resize_(size)" in torch_lines("_fsdp_param.py", 1066, 1069)
    assert "fsdp_param.alloc_all_gather_outputs()" in torch_lines("_fsdp_collectives.py", 463, 463)
    assert "def foreach_all_gather_copy_out(" in torch_lines("_fsdp_collectives.py", 431, 431)
    assert "_unsafe_preserve_version_counter" in torch_lines("_fsdp_collectives.py", 484, 487)
    assert "torch.as_strided(" in torch_lines("_fsdp_param.py", 665, 679)
    assert not any("saved_tensors_hooks" in f.read_text() for f in FSDP2_SOURCE.glob("*.py"))
    assert "RegisterPostBackwardFunction.apply(self, *inp_tensors)" in torch_lines("_fsdp_param_group.py", 891, 903)
    post = torch_lines("_fsdp_param_group.py", 1110, 1127)
    assert "class RegisterPostBackwardFunction" in post and "ctx.param_group.post_backward()" in post
    assert "ctx.state._pre_backward(grad)" in torch_lines("_fsdp_state.py", 514, 530)
    says("It has no saved-tensor\nhook and no autograd function around its gather.")
    says("After forward it frees that tensor's memory with `storage.resize_(0)`.")
    says("That is the planted bug `free-before-backward` plus one step: the refill.")
    says("`--backward-weights refill` runs FSDP2's way in the sketch, with no notes.")   # tests/scripts runs it
    script = (REPO / "scripts" / "05_fully_sharded" / "zero3_from_scratch.py").read_text()
    assert 'choices=("notes", "refill")' in script and "storage.resize_(tensor.numel() * tensor.element_size())" in script
    says("(`_fsdp_param.py:827-831`)")
    says("(`_fsdp_param_group.py:891-903, 1110-1127`)")
    assert "FSDP2 is the same mechanism, engineered" not in FLAT


def test_fsdp2_prefetches_forward_only_when_told_and_backward_by_default():
    """Forward: explicit prefetch only for the modules given to set_modules_to_forward_prefetch (the default overlap
    is implicit: the CPU runs ahead); backward: a default prefetch unless set_modules_to_backward_prefetch is used."""
    assert "self._states_to_forward_prefetch: list[FSDPState] = []" in torch_lines("_fsdp_state.py", 72, 72)
    assert "for fsdp_state in self._states_to_forward_prefetch:" in torch_lines("_fsdp_state.py", 315, 320)
    assert "implicit forward prefetching" in torch_lines("_fsdp_param_group.py", 60, 68)
    assert "# implicit prefetch" in torch_lines("_fsdp_param_group.py", 417, 432)
    assert "default_prefetch = len(self._states_to_backward_prefetch) == 0" in torch_lines("_fsdp_state.py", 384, 391)
    assert "self._backward_prefetch()" in torch_lines("_fsdp_param_group.py", 576, 585)
    assert "def _backward_prefetch(self)" in torch_lines("_fsdp_param_group.py", 795, 831)
    assert "with no option set. So most of the traffic hides" not in FLAT   # the old claim: forward prefetched too
    says("with no option set, nothing is prefetched")
    says("happens\nonly for the modules passed to `set_modules_to_forward_prefetch`")
    says("by default each unit's pre-backward hook issues the all-gather of the unit that runs backward next")
    says("(`_fsdp_state.py:72, 315-320`)")
    says("`--planted-bug late-prefetch` issues each gather once the\nunit ahead has computed.")


def test_the_tiny_model_shape_is_the_preset():
    """The chapter states the tiny model's shape once; it must be the ``tiny`` preset's."""
    cfg = models.preset("tiny")
    n = cfg.num_params()
    assert n == models.count_params(models.build_transformer(cfg))
    block = 4 * (n - 2 * cfg.vocab_size * cfg.dim - cfg.dim) // cfg.n_layers      # fp32 bytes of one block
    says(f"{cfg.n_layers} blocks of width {cfg.dim} with {cfg.n_heads} heads, a feed-forward width of "
         f"{cfg.ffn_hidden}, a vocabulary of {cfg.vocab_size} and sequences of {cfg.seq_len} tokens. That is "
         f"{n:,} parameters, {4 * n:,} bytes in fp32, and one block is {block:,} bytes of it.")
    says(f"The flat floor is rank 0's slices, {n // 4:,} parameters x 4 bytes =\n{4 * (n // 4):,} bytes")
    says(f"The cross marks the moment inside a gather, {2 * block:,} bytes on\ntop of the floor")
    # the true peak, floor included, is above ZeRO-2's whole weights on this two-block model (finding 3)
    peak = 4 * (n // 4) + 2 * block
    assert peak > 4 * n
    says(f"rank 0 then holds {4 * (n // 4):,} + {2 * block:,} = {peak:,} bytes, more than the {4 * n:,} that ZeRO-2 "
         f"keeps. On a model of two blocks, ZeRO-3's weights peak above ZeRO-2's.")


def test_the_chapter_keeps_the_teach_first_shape_and_draws_its_mechanism_first():
    """Issue 48: three pages, each body under the limit with no source line or test named before "How we know"; the
    picture of what each GPU holds comes before the two measured figures of ZeRO-3 by hand."""
    assert chapters.problems("05", REPO) == []
    assert [p.name for p in chapters.pages("05", REPO)] == [
        "05_fully_sharded.md", "05.2_zero3_and_fsdp2.md", "05.3_precision_checkpoints_sizing.md"]
    shown = re.findall(r"!\[[^\]]*\]\(figures/([^)]+)\)", TEXT)
    assert shown.index("05_what_each_gpu_holds.png") < shown.index("05_zero3_memory.png") < shown.index(
        "05_zero3_prefetch.png")
    for name in ("05_zero3_memory.png", "05_zero3_prefetch.png"):
        assert (REPO / "chapters" / "figures" / "data" / name.replace(".png", ".json")).is_file()   # measured


def test_the_picture_of_what_each_gpu_holds_is_zeros_definition():
    """The drawing reads which kinds each stage shards off distlab.memory.zero_state_bytes, and FSDP's units off the
    tiny model: checked here against ZeRO's definition and against the model built, not against the drawing."""
    from coursetools.drawings import ch05

    assert [ch05.sharded_kinds(stage) for stage in range(4)] == [
        {"params": False, "grads": False, "optimizer": False},
        {"params": False, "grads": False, "optimizer": True},
        {"params": False, "grads": True, "optimizer": True},
        {"params": True, "grads": True, "optimizer": True}]
    model = models.build_transformer(models.preset("tiny"))
    units = dict(ch05.tiny_units())
    assert units["block 0"] == units["block 1"] == sum(p.numel() for p in model.layers["0"].parameters())
    assert sum(units.values()) == models.count_params(model)
    says("GPU cannot compute with a quarter of a layer")


def _drawn_bars() -> dict[tuple[str, int, str], tuple[list, list]]:
    """05_what_each_gpu_holds.png as drawn: for each (column title, GPU, kind) the bar's outlines (its cuts, as
    fractions of the bar) and its filled slices (start, width, colour), read off the figure's rectangles."""
    from matplotlib.figure import Figure

    import coursetools.figures  # noqa: F401  (the drawings import their helpers from it)
    from coursetools.drawings import ch05

    fig = Figure(figsize=ch05.FIGURES["05_what_each_gpu_holds.png"][1])
    ch05.draw_what_each_gpu_holds(fig)
    ax = fig.axes[0]
    titles = {t.get_text(): t.get_position()[0] for t in ax.texts if t.get_text() in [s for s, _, _ in ch05.STRATEGIES]}
    rows: dict[tuple[str, float], list] = {}
    for r in ax.patches:
        centre = r.get_x() + r.get_width() / 2
        column = min(titles, key=lambda t: abs(titles[t] - centre))
        rows.setdefault((column, round(r.get_y(), 6)), []).append(r)
    bars = {}
    for column in titles:
        ys = sorted((y for c, y in rows if c == column), reverse=True)   # GPU 0's weights, gradients, optimizer, GPU 1's...
        for i, y in enumerate(ys):
            patches = rows[(column, y)]
            outlines = [r for r in patches if not r.get_fill()]
            left = min(r.get_x() for r in outlines)
            width = sum(r.get_width() for r in outlines)
            cuts = [round((r.get_x() - left) / width, 6) for r in sorted(outlines, key=lambda r: r.get_x())]
            filled = sorted((round((r.get_x() - left) / width, 6), round(r.get_width() / width, 6),
                             matplotlib.colors.to_hex(r.get_facecolor())) for r in patches
                            if r.get_fill() and matplotlib.colors.to_hex(r.get_facecolor()) != "#ffffff")
            bars[(column, i // 3, ch05.KINDS[i % 3][0])] = (cuts, filled)
    return bars


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_the_picture_cuts_gradients_and_optimizer_state_by_unit_as_fsdp2_does():
    """Review src0107 finding 7: under FSDP2 a parameter's gradient and its AdamW moments are DTensors cut like the
    parameter (Shard(0), the same local shape), so GPU r keeps part r of every unit for all three kinds. Seen on a
    fake process group (rank 1 of 4) after one step; the ZeRO-3 columns of the picture must cut all three bars the
    same way, by unit, and colour the same slices."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from coursetools.drawings import ch05
    from coursetools.figures import RANK_COLOURS

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        model = models.build_transformer(models.preset("tiny"), seed=0)
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
        models.lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        for p in model.parameters():
            for kind in (p.grad, optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"]):
                assert kind.placements == p.placements == (Shard(0),) and kind.to_local().shape == p.to_local().shape
    finally:
        dist.destroy_process_group()

    units = [size for _, size in ch05.tiny_units()]
    unit_cuts = [round(sum(units[:i]) / sum(units), 6) for i in range(len(units))]
    bars = _drawn_bars()
    between, running = (title for title, stage, _ in ch05.STRATEGIES if stage == 3)
    for gpu in range(4):
        for column in (between, running):
            for kind in ("params", "grads", "optimizer"):
                assert bars[(column, gpu, kind)][0] == unit_cuts, (column, gpu, kind)
        owned = bars[(between, gpu, "params")][1]
        assert len(owned) == len(units) and {colour for *_, colour in owned} == {RANK_COLOURS[gpu]}
        for kind in ("grads", "optimizer"):   # gathered for the moment: the weights only, never the other two
            assert bars[(between, gpu, kind)][1] == bars[(running, gpu, kind)][1] == owned, (gpu, kind)
    assert len(bars[(running, 0, "params")][1]) == len(units) + 3   # block 0 whole: its four quarters
    says("In the two ZeRO-3 columns all three bars are cut into FSDP's **units**")
    says("Each GPU keeps its quarter of every unit, for the weights, their gradients and the optimizer state alike.")
    # How we know cites where torch does it; the lines cited are read here
    assert "fsdp_param.sharded_param.grad = new_sharded_dtensor_grad" in torch_lines("_fsdp_collectives.py", 751, 754)
    assert "def to_sharded_dtensor" in torch_lines("_fsdp_param.py", 770, 782)
    assert "self._sharding_spec" in torch_lines("_fsdp_param.py", 770, 782)
    adam = "".join((Path(torch.__file__).parent / "optim" / "adam.py").read_text().splitlines(keepends=True)[177:184])
    assert 'state["exp_avg"] = torch.zeros_like(' in adam and 'state["exp_avg_sq"] = torch.zeros_like(' in adam
    says("through `to_sharded_dtensor` (`_fsdp_collectives.py:751-754`)")
    says("parameter's own sharding (`_fsdp_param.py:770-782`)")
    says("(`torch/optim/adam.py:178-184`)")


def test_the_prefetch_caption_reads_the_measured_gathers():
    """The caption's two gather times are the committed run's (chapters/figures/data/05_zero3_prefetch.json)."""
    import json

    run = json.loads((REPO / "chapters" / "figures" / "data" / "05_zero3_prefetch.json").read_text())
    ms = {g["unit"]: 1e3 * (g["ready"] - g["issued"]) for g in run["gathers"] if g["phase"] == "forward"}
    says(f"layers.0's gather, {ms['layers.0']:.1f} ms against\nlayers.1's {ms['layers.1']:.1f} ms")
    says("A black tick marks where rank 0 began to wait")


def test_terms_and_code_a_cold_reader_needs_are_on_the_page():
    """A learner's review (learn0507): each term where it is first used, each excerpt complete."""
    says("Above them sits the **root** unit, the whole model, which holds only what no smaller unit owns: nothing "
         "in the tiny model.")
    says("From stage 2 on, where a rank holds only its slice of the gradient, the norm needs every slice")
    says("k = self.slice_len[i]")
    says("p, shard = self.params[i], self.shards[i]")
    assert FLAT.index("`shard_groups` is AdamW's parameter groups") < FLAT.index("AdamW(shard_groups")
    says("a DTensor's `placements` say how it is cut over the `device_mesh`")
    assert "chapter 06's plans" not in FLAT
    says("because the state is keyed by parameter name, it finds them")
    says("(every unit kept whole, plus the unit gathered again for backward)")
    says("It lets autograd keep its saved weight, but empties that weight's memory in between.")
    page2 = (REPO / "chapters" / "05.2_zero3_and_fsdp2.md").read_text()
    assert "MixedPrecisionPolicy" not in page2 and "checkpoint(block)" not in page2   # options come on page 5.3
    says("on rank 0, a third copy on a single device")
    says("**units** of the `tiny` transformer (groups of layers gathered together, page 5.2)")
    says("empty where another GPU holds it")


def test_the_any_model_vocabulary_and_the_symbols():
    """--any-model's head bias of 127 comes from a vocabulary of 127, said where the bias is; the loss gradients are
    B x T x V as in chapter 01; y = xW is chapter 01's convention, and nn.Linear stores W transposed."""
    script = (REPO / "scripts" / "05_fully_sharded" / "zero_from_scratch.py").read_text()
    assert '{"vocab_size": 127} if args.any_model' in script and models.preset("tiny").vocab_size == 128
    says("(`--any-model` uses a vocabulary of 127, so the output layer's bias has 127 entries)")
    assert "B x S x V" not in FLAT
    says("B x T x V numbers each")
    assert "for `y = x W^T`, `dx = dy W`" not in FLAT
    linear = torch.nn.Linear(3, 2)
    assert tuple(linear.weight.shape) == (2, 3)   # out x in: nn.Linear computes x W^T with this W
    says("for `y = xW`, `dx = dy W^T`")
    assert "The persistent state is therefore" not in FLAT


def test_the_what_each_gpu_holds_title_names_both_splits():
    """The picture's columns are named ZeRO-3 (FSDP): its title gives FSDP2's fp32 split beside the paper's."""
    from coursetools.drawings import ch05

    paper = memory.zero_state_bytes(1, 1, 0)
    fp32 = memory.zero_state_bytes(1, 1, 0, precision="fp32")
    assert paper.total == fp32.total == 16
    assert f"{paper.params:g} + {paper.grads:g} + {paper.optimizer:g}" in ch05.TITLE
    assert f"FSDP2's {fp32.params:g} + {fp32.grads:g} + {fp32.optimizer:g}" in ch05.TITLE
