"""Torch's pipeline schedules keep every microbatch's output (the logits, not the loss) on the last stage, and the
planner counts them there for the layouts torch's stage runs (FSDP under PP)."""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import importlib
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
    # during the last backward all M are kept; after it torch.cat copies them (_merge_outputs)
    assert with_outputs == max(without + m * logits, 2 * m * logits)


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
    from pathlib import Path

    from distlab import planner

    text = " ".join((Path(__file__).parents[2] / "chapters/11.3_the_planners_model.md").read_text().split())
    spec, h100 = planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"]
    run, kept = (planner.tune(spec, h100, planner.Layout(1, 8, 8, 1, 3), options, 64)
                 for options in (planner.Options(), planner.Options(pp_return_outputs=True)))
    assert run.fits and not kept.fits
    assert (f"Then 11.2's `tp=1,pp=8,dp=8,zero=3` would need {kept.memory_per_gpu_bytes['total'] / planner.GIB:.1f} "
            f"GiB, not {run.memory_per_gpu_bytes['total'] / planner.GIB:.1f}.") in text
    assert "The course's pipeline scripts pass `return_outputs=False`, and the planner assumes it." in text


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
