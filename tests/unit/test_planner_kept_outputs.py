"""Torch's pipeline schedules keep every microbatch's output (the logits, not the loss) on the last stage, and the
planner counts them there for the layouts torch's stage runs (FSDP under PP)."""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import importlib
from dataclasses import replace

from distlab.planner.spec import Layout, ModelSpec, Options, microbatches

planner_memory = importlib.import_module("distlab.planner.memory")   # the package re-exports distlab.memory


class Head(nn.Module):
    def __init__(self, hidden=8, vocab=11):
        super().__init__()
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(x)


def _loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


@pytest.mark.parametrize("cls", [ScheduleGPipe, Schedule1F1B])
def test_the_last_stage_keeps_every_microbatchs_logits(world_of_one, cls):
    stage = PipelineStage(Head(), 0, 1, torch.device("cpu"))
    schedule = cls(stage, 4, loss_fn=_loss)
    x, y = torch.randn(8, 3, 8), torch.randint(0, 11, (8, 3))
    merged = schedule.step(x, target=y)
    kept = stage.output_chunks
    # the module's outputs, one per microbatch, kept after the step: not the scalar losses
    assert len(kept) == 4 and all(t.shape == (2, 3, 11) for t in kept)
    assert merged.shape == (8, 3, 11) and merged.data_ptr() not in {t.data_ptr() for t in kept}
    stage2 = PipelineStage(Head(), 0, 1, torch.device("cpu"))
    cls(stage2, 4, loss_fn=_loss).step(x, target=y, return_outputs=False)
    assert stage2.output_chunks == []



def _model():
    return ModelSpec(name="t", layers=8, hidden=512, heads=8, kv_heads=8, ffn=1536, vocab=32000, seq_len=1024,
                     micro_batch=1, global_batch=64)


def test_the_planner_counts_the_kept_logits_on_torchs_last_stage():
    model, layout = _model(), Layout(tp=1, pp=4, dp=2, zero_stage=3)
    m = microbatches(model, layout)
    logits = model.micro_batch * model.seq_len * model.vocab * 4      # fp32: the root's output_dtype
    keep = Options(pp_return_outputs=True)
    assert planner_memory.kept_output_bytes(model, layout, 3, keep) == m * logits
    assert planner_memory.kept_output_bytes(model, layout, 2, keep) == 0
    assert planner_memory.kept_output_bytes(model, layout, 3) == 0      # the course's scripts: return_outputs=False
    assert planner_memory.kept_output_bytes(model, Layout(tp=1, pp=4, dp=2, zero_stage=1), 3, keep) == 0
    with_outputs = planner_memory.activation_bytes(model, layout, 3, keep)
    without = planner_memory.activation_bytes(model, layout, 3)
    assert with_outputs == without + m * logits   # during the last backward all M are kept
    # after it torch.cat copies them (_merge_outputs), once backward has freed the activations and REDUCE_GRAD the
    # unsharded gradients and gathered weights: the state, the reserve and two copies
    stage = [planner_memory.memory_per_gpu(model, layout, 3, o) for o in (Options(), keep)]
    state = sum(stage[0][part] for part in ("params", "grads", "optimizer"))
    assert stage[1]["total"] == max(stage[0]["total"] + m * logits, state + stage[0]["reserve"] + 2 * m * logits)


# every script that steps a torch pipeline schedule, found by what it calls (a fixed list missed tuning.py's)
SCRIPTS = sorted(str(p.relative_to(Path(__file__).parents[2])) for p in (Path(__file__).parents[2] / "scripts").rglob("*.py")
                 if "schedule.step(" in p.read_text())


@pytest.mark.parametrize("path", SCRIPTS)
def test_the_courses_pipeline_steps_keep_no_outputs(path):
    """What the planner assumes (Options.pp_return_outputs False): every schedule.step in the scripts says so."""
    from pathlib import Path

    code = [line.split("#")[0] for line in (Path(__file__).parents[2] / path).read_text().splitlines()]
    steps = sum(line.lstrip().startswith("schedule.step(") for line in code)   # calls, not the docstring's
    assert steps and sum("return_outputs=False" in line for line in code) == steps


def test_the_chapter_states_the_assumption_with_the_planners_numbers():
    """The learner's review s16, findings 1-4: the kept logits' arithmetic, page 11.2's 70B row by row (M, s, the
    vocabulary, fp32), the cat's copy in place of the last stage's activations, the option's scope (FSDP under PP
    only: 11.2's ZeRO-1 choice does not change), and the body's pitfall with the difference."""
    from pathlib import Path

    from distlab import planner

    root = Path(__file__).parents[2]
    text = " ".join((root / "chapters/11.3_the_planners_model.md").read_text().split())
    spec, h100 = planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"]
    layout = planner.Layout(1, 8, 8, 1, 3)
    run, kept = (planner.tune(spec, h100, layout, options, 64)
                 for options in (planner.Options(), planner.Options(pp_return_outputs=True)))
    assert run.fits and not kept.fits
    gib = planner.GIB
    total, without = kept.memory_per_gpu_bytes["total"] / gib, run.memory_per_gpu_bytes["total"] / gib
    assert (f"Then 11.2's `tp=1,pp=8,dp=8,zero=3` would need {total:.1f} GiB, not {without:.1f} (its first "
            "stage's, the fuller one without the logits), and more if the caller keeps the returned tensor into the "
            "next step.") in text
    assert "The course's pipeline scripts pass `return_outputs=False`, and the planner assumes it." in text
    # the arithmetic, with the settings the search chose for the row (return_outputs switched, nothing else)
    settings = run.settings
    assert settings["micro_batch"] == 1 and layout.tp == 1 and layout.cp == 1
    tuned = replace(spec, micro_batch=settings["micro_batch"])
    options = [Options(chunks=settings["chunks"], activation_checkpointing=settings["checkpointing"],
                       pp_return_outputs=keep) for keep in (False, True)]
    last, m = layout.pp - 1, microbatches(tuned, layout)
    logits = planner_memory.kept_output_bytes(tuned, layout, last, options[1])
    assert logits == m * tuned.seq_len * tuned.vocab * 4
    assert (f"that is {m} micro-batches x {tuned.seq_len:,} tokens x {tuned.vocab:,} (LLaMA-2's vocabulary) x 4 bytes "
            f"= {logits / gib:.1f} GiB, kept through the last backward") in text
    stage = [planner_memory.memory_per_gpu(tuned, layout, last, o) for o in options]
    before = stage[0]["total"]
    assert (f"kept through the last backward. The last stage then holds {before / gib:.1f} + {logits / gib:.1f} = "
            f"{(before + logits) / gib:.1f} GiB.") in text
    assert ("the step's final `torch.cat` copies them into one more 62.5 GiB tensor beside them: "
            f"{2 * logits / gib:.0f} GiB at once") in text and logits / gib == 62.5
    # the copy's moment is the larger: backward freed the activations, REDUCE_GRAD the unsharded gradients and the
    # gathered weights (the planner's temporary buffers); the state, the reserve and the two copies are left
    state = sum(stage[0][part] for part in ("params", "grads", "optimizer"))
    held, freed = stage[0]["activations"], stage[0]["temporary"]
    assert (stage[1]["activations"], stage[1]["temporary"]) == (2 * logits, 0.0)
    assert stage[1]["total"] == pytest.approx(state + stage[0]["reserve"] + 2 * logits)
    assert stage[1]["total"] > before + logits
    assert round(stage[1]["total"] / gib, 1) == round(total, 1)
    assert (f"By then backward has freed the stage's {held / gib:.1f} GiB of activations, and its REDUCE_GRAD the "
            f"{freed / gib:.1f} GiB of unsharded gradients and gathered weights. What is left is the state's "
            f"{state / gib:.1f} GiB, the reserve's {stage[0]['reserve'] / gib:.0f} and the {2 * logits / gib:.0f}: "
            f"{total:.1f} GiB, the larger of the two moments, which the planner counts.") in text
    # the first stage is the fuller one without the logits
    first = planner_memory.memory_per_gpu(tuned, layout, 0, options[0])["total"]
    assert first > stage[0]["total"] and round(first / gib, 1) == round(without, 1)
    # the scope: FSDP under PP only; 11.2's first choice, ZeRO-1 beside PP, keeps no logits in the planner
    zero1 = planner.Layout(4, 4, 4, 1, 1)
    plain, keeping = (planner.tune(spec, h100, zero1, planner.Options(pp_return_outputs=keep), 64)
                      for keep in (False, True))
    assert plain.memory_per_gpu_bytes == keeping.memory_per_gpu_bytes
    assert ("It applies to FSDP under PP, the layouts the planner runs under torch's pipeline stage. ZeRO-1 beside PP "
            "is modelled as Megatron-Core runs it, not torch's stage.") in text
    assert ("M x b x s x (vocabulary / t) numbers, the logits of every micro-batch, in fp32 as the course's root "
            "returns them (half that in bf16)") in text
    # the body's pitfall: the difference, rounded
    assert (f"keeps every micro-batch's logits on the last stage unless you pass `return_outputs=False` (chapter "
            f"07.2): {total - without:.0f} GiB more on page 11.2's `tp=1,pp=8,dp=8,zero=3`") in text


def test_the_torch_lines_cited_for_the_kept_outputs_hold_what_is_said():
    """Each line the bullet cites, read in the installed torch: the default in both class families, the kept
    output, its clearing, the loss computed from it, the final copy, and the backward that frees the graph."""
    import importlib.util
    from pathlib import Path

    torch_dir = Path(importlib.util.find_spec("torch").origin).parent
    text = " ".join((Path(__file__).parents[2] / "chapters/11.3_the_planners_model.md").read_text().split())

    def lines(path, first, last=None):
        return "\n".join((torch_dir / path).read_text().splitlines()[first - 1:last or first])

    schedules = "distributed/pipelining/schedules.py"
    source = (torch_dir / schedules).read_text().splitlines()

    def owner(line):   # the class a line of schedules.py sits in
        return next(s.split("(")[0][len("class "):] for s in reversed(source[:line]) if s.startswith("class "))

    assert "return_outputs: bool = True" in lines(schedules, 745) and owner(745) == "PipelineScheduleSingle"
    assert "return_outputs: bool = True" in lines(schedules, 1939) and owner(1939) == "PipelineScheduleMulti"
    assert "self.output_chunks.append(output)" in lines("distributed/pipelining/stage.py", 907, 908)
    assert "self._stage.clear_runtime_states()" in lines(schedules, 772)
    assert "stage.clear_runtime_states()" in lines(schedules, 1972)
    assert "self.output_chunks.clear()" in (torch_dir / "distributed/pipelining/stage.py").read_text()
    assert "loss = self._compute_loss(output" in lines(schedules, 299, 304)
    assert "return self._merge_outputs(self._stage.output_chunks)" in lines(schedules, 794, 797)
    assert "return self._merge_outputs(stage.output_chunks)" in lines(schedules, 1995, 1997)
    # before the copy: REDUCE_GRAD (single-stage: the end of _step_microbatches; the runtime: its action) runs FSDP's
    # post_backward, which drops the unsharded gradients and reshards
    assert "self._stage.perform_reduce_grad(" in lines(schedules, 1177)
    assert "elif comp_type == REDUCE_GRAD:" in lines(schedules, 2605) and "perform_reduce_grad" in lines(schedules, 2607)
    reduce_grad = lines("distributed/pipelining/stage.py", 1164, 1191)
    assert "def perform_reduce_grad(" in reduce_grad and "fsdp_param_group.post_backward()" in reduce_grad
    post_backward = lines("distributed/fsdp/_fully_shard/_fsdp_param_group.py", 626, 638)
    assert "fsdp_param.unsharded_accumulated_grad = None" in post_backward
    assert "fsdp_param.unsharded_param.grad = None" in post_backward and "self.reshard()" in post_backward
    backward = lines("distributed/pipelining/_backward.py", 434, 437)
    assert "torch.autograd.backward(" in backward and "retain_graph" not in backward
    assert "If ``False``, the graph used to compute the grad\n            will be freed" in lines(
        "autograd/__init__.py", 307, 310)
    for cited in ("(`schedules.py:745` in the single-stage classes, `:1939` in the multi-stage ones)",
                  "`stage.py:907-908`", "`schedules.py:772` (`:1972`)", "`schedules.py:299-304`",
                  "`schedules.py:794-797` (`:1995-1997`)", "(`schedules.py:1177`; the runtime's action, `:2605-2607`)",
                  "(`stage.py:1164-1191`)", "(`_fsdp_param_group.py:626-638`)", "(`_backward.py:434-437`)", "(`autograd/__init__.py:307-310`)"):
        assert cited in text, cited


def test_chapter_07s_example_passes_return_outputs_false_on_every_rank():
    """Chapter 07.2's code block is what a learner copies: each `schedule.step(` in it passes return_outputs=False,
    as the course's scripts do, and the page says why (the last stage would keep every microbatch's logits)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "chapters" / "07.2_interleaving_and_zero_bubble.md").read_text()
    block = text[text.index("stage = PipelineStage(my_layers"):]
    block = block[:block.index("```")]
    calls = [line for line in block.splitlines() if "schedule.step(" in line]
    assert len(calls) == 3 and all("return_outputs=False" in line for line in calls), calls
    assert "By default it keeps every microbatch's output, the logits, until\nthe next step" in text
