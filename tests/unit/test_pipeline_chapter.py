"""Chapter 07's numbers and its scripts' pure parts: the bubble table in the chapter is what distlab.schedules
computes; stage placement, layer split and configuration checks; torch's V schedules read as our data."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from coursetools import chapters
from distlab import runtime, schedules

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "07_pipeline_parallel"))

import common_pipeline  # noqa: E402  (the scripts' shared helper, imported as the scripts import it)



def chapter_text() -> str:
    """Both pages of chapter 07 (7.1 and 7.2), as one text."""
    return chapters.text("07", REPO)


def flat_text() -> str:
    """The chapter with its line breaks and runs of spaces as single spaces: a sentence held wherever it wraps."""
    return " ".join(chapter_text().split())


TABLE_RANKS = (4, 8, 16)
TABLE_MICROBATCHES = (4, 8, 16, 64, 256)


def percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"


def bubble_table() -> str:
    """The chapter's bubble table, computed: closed forms where they exist, the simulator for zero bubble.

    Interleaved 1F1B needs M to be a multiple of P (as in Megatron-LM); where it is not, the cell says so.
    """
    lines = ["| P | M | GPipe | 1F1B | interleaved, V = 2 | interleaved, V = 4 | zero bubble (ZB-H1) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for ranks in TABLE_RANKS:
        for microbatches in TABLE_MICROBATCHES:
            gpipe = schedules.bubble_fraction_from_timeline(schedules.simulate(schedules.gpipe(ranks, microbatches)))
            one_f_one_b = schedules.bubble_fraction(ranks, microbatches)
            interleaved = [percent(schedules.bubble_fraction(ranks, microbatches, v))
                           if microbatches % ranks == 0 else "needs M % P = 0" for v in (2, 4)]
            zero = schedules.bubble_fraction_from_timeline(
                schedules.simulate(schedules.zero_bubble_h1(ranks, microbatches)), ranks)
            lines.append(f"| {ranks} | {microbatches} | {percent(gpipe)} | {percent(one_f_one_b)} | "
                         f"{interleaved[0]} | {interleaved[1]} | {percent(zero)} |")
    return "\n".join(lines)


def test_the_chapter_table_is_what_the_library_computes():
    text = chapter_text()
    assert bubble_table() in text, "the bubble table in the chapter is stale: paste bubble_table() into it\n" \
                                   + bubble_table()


def test_the_table_says_1f1b_has_gpipes_bubble_and_only_interleaving_or_zero_bubble_shrink_it():
    for ranks in TABLE_RANKS:
        for microbatches in TABLE_MICROBATCHES:
            gpipe = schedules.bubble_fraction_from_timeline(schedules.simulate(schedules.gpipe(ranks, microbatches)))
            one_f_one_b = schedules.bubble_fraction_from_timeline(
                schedules.simulate(schedules.one_f_one_b(ranks, microbatches)))
            assert gpipe == pytest.approx(one_f_one_b) == pytest.approx(schedules.bubble_fraction(ranks, microbatches))
            zero = schedules.bubble_fraction_from_timeline(
                schedules.simulate(schedules.zero_bubble_h1(ranks, microbatches)), ranks)
            assert zero < one_f_one_b


def test_numbers_quoted_in_the_chapter_text():
    text = flat_text()
    # P = 4, M = 8: the running example of the chapter and of the scripts' defaults.
    for value in (schedules.bubble_fraction(4, 8), schedules.bubble_fraction(4, 8, 2), 3 / 27,
                  schedules.bubble_fraction_from_timeline(schedules.simulate(schedules.naive(4, 8)))):
        assert percent(value) in text, f"{percent(value)} not in the chapter"
    peaks = schedules.peak_activations(schedules.one_f_one_b(4, 8))
    assert peaks == {0: 4, 1: 3, 2: 2, 3: 1}
    assert schedules.peak_activations(schedules.gpipe(4, 8)) == {r: 8 for r in range(4)}
    assert schedules.one_f_one_b(4, 8).format().splitlines()[0] in text
    assert schedules.zero_bubble_h1(4, 8).format().splitlines()[0] in text
    interleaved_rank_0 = schedules.peak_activations(schedules.interleaved_1f1b(4, 8, 2))[0] / 2
    assert interleaved_rank_0 == 4 + 3 / 2 and f"{interleaved_rank_0:g} for P = 4 and V = 2" in text
    assert "4, 3, 2 and 1 on the four ranks, against 8" in text


# ---- the scripts' pure helpers ----------------------------------------------------------------------------

def test_layers_split_contiguously_and_evenly():
    assert [common_pipeline.layers_of_stage(8, 4, s) for s in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [common_pipeline.layers_of_stage(10, 4, s) for s in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert sum((common_pipeline.layers_of_stage(5, 5, s) for s in range(5)), []) == list(range(5))


def test_stage_placement_loop_and_v():
    assert [common_pipeline.stage_indices("Interleaved1F1B", r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6],
                                                                                              [3, 7]]
    assert [common_pipeline.stage_indices("ZBVZeroBubble", r, 4, 2) for r in range(4)] == [[0, 7], [1, 6], [2, 5],
                                                                                            [3, 4]]
    assert common_pipeline.stage_indices("1F1B", 2, 4, 1) == [2]


@pytest.mark.parametrize("schedule, ranks, microbatches, per_rank, message", [
    ("Zigzag", 4, 8, None, "unknown schedule 'Zigzag'"),
    ("1F1B", 4, 2, None, "needs at least as many microbatches as stages"),
    ("DualPipeV", 4, 6, None, "--microbatches 6 < 8 stages"),
    ("ZBVZeroBubble", 4, 8, 3, "does not fit"),
    ("GPipe", 4, 8, 2, "holds one stage per rank"),
    ("Interleaved1F1B", 4, 6, None, "not a multiple of 4"),
    ("InterleavedZeroBubble", 4, 9, None, "is not a multiple of 2"),     # torch refuses it too (2 rounds)
])
def test_bad_pipeline_configurations_are_refused_with_one_line(schedule, ranks, microbatches, per_rank, message):
    with pytest.raises(runtime.ConfigError, match=re.escape(message)):
        common_pipeline.check_pipeline_config(schedule, ranks, microbatches, per_rank)


def test_good_configurations_give_the_stages_per_rank():
    # ZBV: torch refuses no microbatch count (it pads its plan to 2P - 1 and drops the padding), nor do we
    for microbatches in (1, 4, 7, 8):
        assert common_pipeline.check_pipeline_config("ZBVZeroBubble", 4, microbatches, None) == 2
    # InterleavedZeroBubble: torch's rule, M a multiple of max(1, M // P); ZB-H1 is built for any M
    for microbatches in (2, 6, 10):
        assert common_pipeline.check_pipeline_config("InterleavedZeroBubble", 4, microbatches, None) == 1
    assert common_pipeline.check_pipeline_config("1F1B", 4, 4, None) == 1
    assert common_pipeline.check_pipeline_config("Interleaved1F1B", 4, 8, None) == 2
    assert common_pipeline.check_pipeline_config("Interleaved1F1B", 4, 8, 3) == 3
    assert common_pipeline.check_pipeline_config("DualPipeV", 4, 8, None) == 2
    assert common_pipeline.check_pipeline_config("GPipe", 4, 1, None) == 1


def test_transformer_stages_keep_the_full_models_names():
    from distlab import models

    full = models.build_transformer(models.preset("tiny", n_layers=8), seed=0)
    names = [n for s in range(4) for n, _ in common_pipeline.transformer_stage(full, s, 4).named_parameters()]
    assert sorted(names) == sorted(n for n, _ in full.named_parameters())
    middle = common_pipeline.transformer_stage(full, 1, 4)
    assert list(middle.layers) == ["2", "3"] and middle.tok_embeddings is None and middle.output is None


# ---- torch's V schedules, read as distlab data (fake process group: no ranks launched) -------------------

@pytest.fixture
def v_schedule_order():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make(name, ranks, microbatches):
        from torch.distributed.pipelining.schedules import get_schedule_class

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
        try:
            stages = [PipelineStage(torch.nn.Linear(2, 2), s, 2 * ranks, torch.device("cpu"))
                      for s in (0, 2 * ranks - 1)]
            return get_schedule_class(name)(stages, microbatches, loss_fn=lambda out, target: out.sum()).pipeline_order
        finally:
            dist.destroy_process_group()

    return make


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_v_schedules_read_as_valid_split_schedules_in_a_v(name, v_schedule_order):
    theirs = schedules.from_torch_pipeline_order(v_schedule_order(name, 4, 8), 8, name=name)
    theirs.validate()                    # DualPipeV mixes full backwards B with split ones (I, W)
    assert theirs.split_backward and theirs.chunks == 2
    assert {r: theirs.stages_of_rank(r) for r in range(4)} == {0: [0, 7], 1: [1, 6], 2: [2, 5], 3: [3, 4]}
    ours = schedules.zbv(4, 8) if name == "ZBVZeroBubble" else schedules.dual_pipe_v(4, 8)
    bubble = schedules.bubble_fraction_from_timeline(schedules.simulate(ours), 4)
    assert bubble == pytest.approx(schedules.bubble_fraction_from_timeline(schedules.simulate(theirs), 4))
    text = flat_text()
    if name == "ZBVZeroBubble":
        assert bubble == pytest.approx(1 / 17)    # 5.9%: below ZB-H1's 11.1% with the same F = I = W
        assert f"with F = I = W, gives {percent(bubble)} for P = 4 and M = 8" in text
    else:
        # its paired forwards send their output only after the paired full backward: 11.1%, not ZBV's 5.9%
        assert bubble == pytest.approx(1 / 9)
        assert f"DualPipeV as torch runs it simulates to {percent(bubble)}" in text


def test_record_actions_starts_the_clock_once_the_device_has_the_input():
    # A fake device: the schedule's NCCL wait for the input only queued a wait on the stream, so the input
    # lands 5 units after the host calls the pass; sync() is when the host waits for it. Starting the clock
    # before the sync would time the wait as work (start 0, not 5) and make the bubble come out low.
    now, in_flight = [0.0], [5.0]

    def sync():
        now[0] += in_flight[0]
        in_flight[0] = 0.0

    class FakeStage:
        stage_index = 2

        def forward_one_chunk(self, chunk_id, *args, **kwargs):
            now[0] += 1.0

        def backward_one_chunk(self, chunk_id, *args, **kwargs):
            now[0] += 2.0

        def backward_weight_one_chunk(self, chunk_id, *args, **kwargs):
            now[0] += 1.0

    stage, events = FakeStage(), []
    common_pipeline.record_actions(stage, events, sync=sync, clock=lambda: now[0])
    stage.forward_one_chunk(0)
    in_flight[0] = 3.0
    stage.backward_one_chunk(0, full_backward=False)
    stage.backward_weight_one_chunk(0)
    assert events == [(2, 0, "F", 5.0, 6.0, False), (2, 0, "B", 9.0, 11.0, False), (2, 0, "W", 11.0, 12.0, False)]


def test_held_activations_are_counted_until_autograd_frees_them():
    torch = pytest.importorskip("torch")

    class FakeStage:        # forward_one_chunk(chunk_id, x) as torch's PipelineStage calls it
        stage_index = 3

        def __init__(self):
            self.weight = torch.nn.Parameter(torch.ones(4))
            self.outputs = {}

        def forward_one_chunk(self, chunk_id, x):
            self.outputs[chunk_id] = torch.tanh(x * self.weight)
            return self.outputs[chunk_id]

    stage, held = FakeStage(), common_pipeline.HeldActivations()
    held.watch(stage)
    inputs = {m: torch.ones(4, requires_grad=True) for m in range(3)}
    for m in range(3):
        stage.forward_one_chunk(m, inputs[m])
    assert held.peak == 3 and set(held.alive) == {(3, 0), (3, 1), (3, 2)}
    stage.outputs.pop(0).sum().backward()                 # a full backward frees microbatch 0's activations
    assert set(held.alive) == {(3, 1), (3, 2)}
    # an input gradient alone (torch's I) keeps the graph for W: microbatch 1 stays held ...
    output = stage.outputs.pop(1).sum()
    torch.autograd.grad(output, inputs[1], retain_graph=True)
    assert (3, 1) in held.alive
    torch.autograd.grad(output, stage.weight, retain_graph=True)    # ... until W, and until the graph goes
    assert (3, 1) in held.alive
    del output                       # (freed at once: the hooks save without a cycle through tanh's output)
    assert set(held.alive) == {(3, 2)}
    held.reset()
    assert held.peak == 1


# ---- the two bubble conventions, and ZB-H1's closed form (issue 9, items 3 and 11) ---------------------------

def idle_time_per_rank(schedule) -> list[float]:
    """Simulated idle time of every rank: the step (first start to last end) minus the rank's own work."""
    timeline = schedules.simulate(schedule)
    step = max(e.end for e in timeline) - min(e.start for e in timeline)
    return [step - sum(e.end - e.start for e in timeline if e.rank == r) for r in sorted({e.rank for e in timeline})]


def test_both_bubble_conventions_are_named_and_agree():
    text = flat_text()
    share = schedules.bubble_fraction(4, 8)                       # idle / step
    timeline = schedules.simulate(schedules.one_f_one_b(4, 8))
    step = max(e.end for e in timeline)
    useful = sum(e.end - e.start for e in timeline) / 4
    overhead = (step - useful) / useful                           # idle / ideal step, measured on the simulation
    assert overhead == pytest.approx((4 - 1) / 8) and share == pytest.approx(overhead / (1 + overhead))
    assert f"**(P - 1) / M**: {percent(overhead)} for the same pipeline" in text
    assert "**share of the step**" in text and "**relative to the ideal step**" in text
    conventions = (REPO / "chapters" / "00_conventions.md").read_text()
    assert f"For P = 4 and M = 8 they are {percent(overhead)} and {percent(share)}." in conventions


def test_zb_h1_closed_form_holds_for_m_at_least_p_only():
    text = flat_text()
    for ranks in TABLE_RANKS:
        for microbatches in TABLE_MICROBATCHES:
            simulated = schedules.bubble_fraction_from_timeline(
                schedules.simulate(schedules.zero_bubble_h1(ranks, microbatches)), ranks)
            closed_form = (ranks - 1) / (3 * microbatches + ranks - 1)
            if microbatches >= ranks:
                assert simulated == pytest.approx(closed_form)
                # a third of 1F1B's idle time (F = B = W = 1 against F = 1, B = 2), not a third of the fraction
                zb, one_f_one_b = (idle_time_per_rank(s) for s in (schedules.zero_bubble_h1(ranks, microbatches),
                                                                   schedules.one_f_one_b(ranks, microbatches)))
                assert zb == pytest.approx([ranks - 1] * ranks)
                assert one_f_one_b == pytest.approx([3 * (ranks - 1)] * ranks)
            else:
                assert simulated > closed_form + 0.05
    short = schedules.bubble_fraction_from_timeline(schedules.simulate(schedules.zero_bubble_h1(8, 4)), 8)
    assert f"the table's {percent(short)} for P = 8 and M = 4, where the formula would say {percent(7 / 19)}" in text
    ratio = (3 / 27) / schedules.bubble_fraction(4, 8)
    assert f"11.1% is {ratio:.2f} of 1F1B's 27.3%" in text
    assert "about a third of 1F1B's." not in text


def notebook_check_cell(marker: str) -> str:
    import nbformat

    notebook = nbformat.read(REPO / "notebooks" / "07_pipeline_parallel.ipynb", as_version=4)
    cells = [c.source for c in notebook.cells if "check" in c.metadata.get("tags", []) and marker in c.source]
    assert len(cells) == 1, marker
    return cells[0]


@pytest.mark.parametrize("marker, name, wrong, right", [
    # exercise 2: P = 8, M = 32, V = 4; the ideal-relative convention (P-1)/(VM) is the plausible wrong answer
    ('check_value("bubble"', "bubble", 7 / (4 * 32), 7 / (4 * 32 + 7)),
    # exercise 3: (P-1)/M <= 5% gives 140 microbatches; as a share of the step, (P-1)/(M+P-1) <= 5% gives 133
    ('check_value("microbatches_needed"', "microbatches_needed", 140, 133),
])
def test_the_exercises_say_which_convention_and_reject_the_other(marker, name, wrong, right):
    from labkit.exercises import ch07 as exercises

    source = notebook_check_cell(marker)
    namespace = {"exercises": exercises, "schedules": schedules, "print": lambda *a, **k: None}
    with pytest.raises(exercises.ExerciseWrong):
        exec(source, {**namespace, name: wrong})
    exec(source, {**namespace, name: right})  # the right convention passes


def test_the_ends_of_the_a100_pipeline_are_heavier_than_its_middle():
    torch = pytest.importorskip("torch")
    from distlab import models

    config = models.preset("a100")
    with torch.device("meta"):                      # shapes only: no memory, no time
        model = models.Transformer(models.preset("a100", n_layers=1))
    output = sum(p.numel() for p in model.output.parameters())
    block = sum(p.numel() for p in model.layers["0"].parameters())
    embedding = model.tok_embeddings.weight.numel()
    text = flat_text()
    assert f"{config.vocab_size:,} x {config.dim:,} = {output / 1e6:.1f} M parameters" in text
    assert f"a transformer block {block / 1e6:.1f} M" in text and output > block
    assert f"carries {output / block:.1f} blocks' worth" in text
    assert f"another {embedding / 1e6:.1f} M in its embedding table" in text
    assert f"with {config.n_layers // 4} blocks on each of 4 stages" in text
    # Llama 3's words, as the course's source registry holds them (section 3.3.2, looked up once, quoted there)
    from distlab.planner.sources import SOURCES

    for key, words in [("llama3_pipeline_imbalance", "The first stage consumes more memory due to the embedding "
                                                     "and the warm-up micro-batches"),
                       ("llama3_pipeline_imbalance", "the execution latency bottleneck"),
                       ("llama3_pipeline_schedule", "To balance the pipeline, we reduce one Transformer layer each "
                                                    "from the first and the last stages, respectively")]:
        assert words in SOURCES[key].quote and SOURCES[key].where.startswith("section 3.3.2")
        assert words in " ".join(text.split()), words


def test_zero_bubble_memory_as_the_chapter_states_it():
    text = flat_text()
    zb_h1, one_f_one_b = (schedules.peak_activations(s) for s in (schedules.zero_bubble_h1(4, 8),
                                                                  schedules.one_f_one_b(4, 8)))
    assert max(zb_h1.values()) == max(one_f_one_b.values())        # 1F1B's highest peak, not more
    assert zb_h1 == {r: 4 for r in range(4)} and "4, 4, 4 and 4 on four ranks" in text
    zbv = schedules.peak_activations(schedules.zbv(4, 8))
    assert zbv == {r: 8 for r in range(4)} and "holds 8 (stage, microbatch) pairs on every rank" in text
    short = schedules.peak_activations(schedules.zbv(4, 4))      # M = 4 < 2P: the padding's actions dropped
    assert short == {0: 5, 1: 6, 2: 7, 3: 8} and "Ranks 0 to 3 then hold at most 5, 6, 7 and 8 (stage, microbatch) pairs (measured)" in text
    assert "ZB-H1 costs no memory where it counts." in text and "for more memory" not in text


def test_each_bubble_tolerance_tells_its_schedule_from_the_nearest_other():
    import pp_schedules     # the script's constants (its main() runs only as a script)

    simulated = {name: schedules.bubble_fraction_from_timeline(schedules.simulate(schedule), 4) for name, schedule in {
        "GPipe": schedules.gpipe(4, 8), "1F1B": schedules.one_f_one_b(4, 8),
        "Interleaved1F1B": schedules.interleaved_1f1b(4, 8, 2), "InterleavedZeroBubble": schedules.zero_bubble_h1(4, 8),
        "ZBVZeroBubble": schedules.zbv(4, 8), "DualPipeV": schedules.dual_pipe_v(4, 8)}.items()}
    for name, bubble in simulated.items():
        tolerance = pp_schedules.BUBBLE_TOLERANCE.get(name, pp_schedules.DEFAULT_BUBBLE_TOLERANCE)
        nearest = min(abs(bubble - other) for other in simulated.values() if abs(bubble - other) > 1e-9)
        assert tolerance < nearest / 2, f"{name}: {tolerance} does not tell it from a bubble {nearest:.3f} away"
    text = flat_text()
    tolerance = {name: f"{100 * pp_schedules.BUBBLE_TOLERANCE.get(name, pp_schedules.DEFAULT_BUBBLE_TOLERANCE):g}"
                 for name in simulated}
    assert f"{tolerance['GPipe']} points for GPipe and 1F1B" in text and tolerance["GPipe"] == tolerance["1F1B"]
    assert f"{tolerance['DualPipeV']} for interleaved and DualPipeV" in text
    assert tolerance["DualPipeV"] == tolerance["Interleaved1F1B"]
    assert f"{tolerance['ZBVZeroBubble']} for ZBV" in text


def test_measured_costs_read_pass_times_hand_offs_and_dispatch_from_a_timeline():
    def event(rank, stage, microbatch, kind, start, end):
        return {"rank": rank, "stage": stage, "microbatch": microbatch, "kind": kind, "start": start, "end": end}

    # Two ranks, 1F1B-like: rank 0's second forward waited for nothing (gap 0.25 = dispatch); rank 1's
    # forward waited for rank 0's (hand-off 0.5 after it ended); rank 0's I waited for rank 1's B.
    timeline = [event(0, 0, 0, "F", 0.0, 1.0), event(0, 0, 1, "F", 1.25, 2.25), event(1, 1, 0, "F", 1.5, 2.5),
                event(1, 1, 0, "B", 2.75, 4.75), event(0, 0, 0, "I", 5.25, 6.25), event(0, 0, 0, "W", 6.5, 7.5)]
    costs = common_pipeline.measured_costs(timeline, chunks=1)
    assert costs.forward == 1.0 and costs.backward == 2.0 and costs.send == 0.5
    assert costs.dispatch == 0.25


def test_a_paired_forwards_output_is_taken_to_leave_when_its_pair_ends():
    # DualPipeV: torch sends a paired forward's output behind the pair (OVERLAP_F_B's sends follow both halves),
    # so rank 1, waiting for it, waits 0.5 after the pair's backward ends, not 2.5 after the forward did.
    def event(rank, stage, microbatch, kind, start, end):
        return {"rank": rank, "stage": stage, "microbatch": microbatch, "kind": kind, "start": start, "end": end}

    timeline = [event(0, 0, 1, "F", 0.0, 1.0), event(0, 3, 0, "B", 1.0, 3.0), event(1, 1, 1, "F", 3.5, 4.5)]
    assert common_pipeline.handoff_latency(timeline) == 2.5                         # the forward's end
    assert common_pipeline.measured_costs(timeline, 1, frozenset({(0, 1)})).send == 0.5   # the pair's end
    dual = schedules.dual_pipe_v(4, 8)
    held = common_pipeline.paired_forwards(dual)
    assert len(held) == sum(len(p) for p in dual.overlap_f_b.values()) > 0
    assert all(dual.actions[r][i].kind == "F" and dual.actions[r][i + 1].kind == "B"
               for r, positions in dual.overlap_f_b.items() for i in positions)
    assert common_pipeline.paired_forwards(schedules.zbv(4, 8)) == frozenset()


# ---- review of issue 36's pipeline half: what the V schedules' checks can and cannot show -------------------

def test_v_schedule_peaks_do_not_tell_w_release_from_i_release_and_the_chapter_says_so():
    # ZBV runs each W right behind its I until its cool-down, DualPipeV mostly full backwards: their peaks come
    # out the same whether a pair is released at W or at I, so only ZB-H1's run (4,4,4,4 against 4,3,2,1)
    # tests the release point.
    for schedule, peak in ((schedules.zbv(4, 8), 8), (schedules.zbv(4, 4), None), (schedules.dual_pipe_v(4, 8), 9)):
        at_w = schedules.peak_activations(schedule)
        assert at_w == schedules.peak_activations(schedule, release_on_input_grad=True), schedule.name
        assert peak is None or set(at_w.values()) == {peak}
    zb_h1 = schedules.zero_bubble_h1(4, 8)
    assert schedules.peak_activations(zb_h1) != schedules.peak_activations(zb_h1, release_on_input_grad=True)
    text = " ".join(chapter_text().split())
    assert ("ZBV's and DualPipeV's peaks are the same either way (8 and 9 on every rank at M = 8:" in text
            and "only the ZB-H1 run tells the release points apart" in text)


def test_the_chapter_says_which_builders_restate_torchs_planner():
    # schedules.interleaved_zero_bubble, zbv and dual_pipe_v follow torch's _calculate_single_rank_operations
    # step for step (same phases, counts and special cases), so they are not "written apart from torch".
    import inspect

    from torch.distributed.pipelining import schedules as torch_schedules

    for cls in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        assert "_calculate_single_rank_operations" in vars(getattr(torch_schedules, cls)), cls
    # the marks of the restatement: torch's ZBV loop condition and DualPipeV's lone first pair on the last rank
    assert "while forwards[up] < forwards[down] or forwards[down] < planned" in inspect.getsource(schedules.zbv)
    assert "while f1_cnt < f0_cnt or f0_cnt < n_micro" in inspect.getsource(torch_schedules.ScheduleZBVZeroBubble)
    assert "if i == 0 and rank == num_ranks - 1" in inspect.getsource(schedules.dual_pipe_v)
    assert "if i == 0 and rank == num_ranks - 1" in inspect.getsource(torch_schedules.ScheduleDualPipeV)
    text = " ".join(chapter_text().split())
    assert "apart from torch" not in text
    assert ("`interleaved_zero_bubble`, `zbv` and `dual_pipe_v`, restate torch's own planners (each class's "
            "`_calculate_single_rank_operations`" in text)
    for path in ("scripts/07_pipeline_parallel/common_pipeline.py", "scripts/07_pipeline_parallel/pp_schedules.py",
                 "notebooks/07_pipeline_parallel.ipynb"):
        assert "apart from torch" not in (REPO / path).read_text(), path


def test_the_chapter_does_not_count_the_labs_gpipe_run_as_a_checked_bubble():
    # The lab runs GPipe timed but lets its timing check miss (a note, not a failure): GPipe's bubble is
    # checked nowhere; the chapter must say the lab only warns, and that 1F1B's equal bubble is the timed one.
    import nbformat

    notebook = nbformat.read(REPO / "notebooks" / "07_pipeline_parallel.ipynb", as_version=4)
    cell = next(c.source for c in notebook.cells if c.cell_type == "code" and '("GPipe", 20)' in c.source)
    assert "assert set(missed) <= {TIMING_CHECK}" in cell
    text = " ".join(chapter_text().split())
    assert ("(GPipe's timed run is the lab's, which checks its order and memory but only warns when its bubble "
            "misses; its bubble is 1F1B's, timed here)") in text


# ---- issue 48: the walks the pages make on their charts, terms defined before use, the conventions said once ----

def idle_intervals(schedule, rank: int) -> list[tuple[float, float]]:
    """The simulated idle intervals of one rank within the step (F = 1, B = 2; I = W = 1 when split)."""
    timeline = schedules.simulate(schedule)
    step = max(e.end for e in timeline)
    mine = sorted((e.start, e.end) for e in timeline if e.rank == rank)
    edges = [(0.0, mine[0][0])] + [(a[1], b[0]) for a, b in zip(mine, mine[1:])] + [(mine[-1][1], step)]
    return [(start, end) for start, end in edges if end > start + 1e-9]


def test_the_relay_and_gpipe_walks_are_the_simulators():
    text = flat_text()
    naive = schedules.naive(4, 1)                                     # the whole batch as one unit
    assert idle_intervals(naive, 3)[0] == (0.0, 3.0)
    assert [end - start for start, end in idle_intervals(naive, 0)] == [9.0]
    assert ("rank 3 waits 3 units while ranks 0, 1 and 2 run their forwards. Rank 0 then waits 9 units for the "
            "backward to come back") in text
    gpipe = schedules.gpipe(4, 8)
    step = max(e.end for e in schedules.simulate(gpipe))
    idle = sum(end - start for start, end in idle_intervals(gpipe, 3))
    assert (idle, step) == (9.0, 33.0) and "9 of rank 3's 33 units are grey" in text
    for schedule, words in ((schedules.interleaved_1f1b(4, 8, 2), "The step ends at {} units instead of 33"),
                            (schedules.zbv(4, 8), "The step ends at {} units.")):
        assert words.format(f"{max(e.end for e in schedules.simulate(schedule)):g}") in text


def test_the_readmes_zero_for_zbv_is_reconciled_with_our_5_9_percent():
    """Review src0107 finding 10: the zero-bubble README gives ZBV a bubble rate of 0, the body 5.9% at P = 4,
    M = 8. The authors' planner (zbv.py) counts a rank's idle time only after its first forward; our ZBV, too, has
    none there: each rank is busy in one stretch, the ranks start half a unit apart, and that stagger is the 5.9%."""
    text = flat_text()
    for microbatches, bubble in ((8, "5.9%"), (16, "3.0%")):
        timeline = schedules.simulate(schedules.zbv(4, microbatches))
        busy = schedules._busy_intervals(timeline)
        assert [len(busy[rank]) for rank in range(4)] == [1] * 4                  # no gap after a rank's first pass
        assert [busy[rank][0][0] for rank in range(4)] == [0.0, 0.5, 1.0, 1.5]    # a stage's pass apart
        assert percent(schedules.bubble_fraction_from_timeline(timeline)) == bubble
    eight = schedules.simulate(schedules.zbv(4, 8))
    pass_time = {e.end - e.start for e in eight}
    assert pass_time == {0.5}
    step, work = max(e.end for e in eight), sum(e.end - e.start for e in eight if e.rank == 0)
    assert (step / 0.5, work / 0.5) == (51, 48) and percent(1 - work / step) == "5.9%"
    assert "The README's 0 for ZBV and our 5.9% describe the same timeline." in text
    assert ("counts a rank's idle time only after that rank's first forward. Run at p = 4, m = 8 with F = B = W and "
            "free messages, it finds no such idle time.") in text
    assert "so the step lasts 51 passes of one stage for 48 of work: 5.9% idle." in text
    assert "each rank works without a break from its first pass to its last, starting 0.5 units after" in text
    assert "That fixed stagger shrinks against the step as M grows: 3.0% at M = 16." in text
    assert "Our ZBV, with F = I = W, gives 5.9% for P = 4 and M = 8." in text
    # the README's row as it reads at main 39f2c18 (since July 2024), not its first version's
    assert "B = (p-1)/(m+p-1) for 1F1B, B/3 for ZB1P and 0 for ZB2P and ZBV" in text
    assert "gives (p-1)/3m for ZB1P" not in text


def test_zb_h1s_walk_says_w_fills_the_slots_where_1f1b_waited():
    text = flat_text()
    one_f_one_b, zb_h1 = schedules.one_f_one_b(4, 8), schedules.zero_bubble_h1(4, 8)
    first_wait = {name: [end - start for start, end in idle_intervals(s, 0)]
                  for name, s in (("1F1B", one_f_one_b), ("ZB-H1", zb_h1))}
    assert first_wait["1F1B"] == [6.0, 1.0, 1.0, 1.0] and first_wait["ZB-H1"] == [3.0]
    assert "In 1F1B it waits 6 units for its first backward" in text and "In ZB-H1 it waits 3" in text
    assert "rank 0 waits one unit before each of its last three backwards" in text
    # the last rank: idle at the end of 1F1B's drain, busy with its deferred W's in ZB-H1
    assert idle_intervals(one_f_one_b, 3)[-1] == (27.0, 33.0) and idle_intervals(zb_h1, 3)[-1][1] == 3.0
    last = [e.kind for e in sorted(schedules.simulate(zb_h1), key=lambda e: e.start) if e.rank == 3][-4:]
    assert last == ["W"] * 4
    assert "idle for the last 6 units of 1F1B's drain" in text and "W fills the slots where 1F1B waited" in text


def test_each_term_is_defined_where_it_first_appears():
    page = chapters.pages("07", REPO)[0].read_text()
    first_page = "\n".join(line for line in page.splitlines() if not line.startswith("#"))   # a heading names it
    for term in ("GPipe", "1F1B", "fill", "drain", "stages"):
        first = re.search(rf"\b{term}\b", first_page)
        assert first and first_page[first.start() - 2:first.start()] == "**", f"{term} used before its definition"
    text = flat_text()
    assert "rank-loads" not in text and "That is the whole point of 1F1B." in text
    assert chapters.headings(chapters.pages("07", REPO)[-1].read_text())[-1] == "How we know"


def test_the_two_bubble_conventions_are_stated_once():
    import nbformat

    text = flat_text()
    assert text.count("relative to the ideal step") == 1 and text.count("(P - 1) / M") == 1
    notebook = nbformat.read(REPO / "notebooks" / "07_pipeline_parallel.ipynb", as_version=4)
    lab = " ".join(c.source for c in notebook.cells if c.cell_type == "markdown")
    assert "ideal step" not in lab and "(P-1)/M" not in lab and "Two conventions" not in lab


def test_the_pictures_show_the_bubbles_the_pages_quote(monkeypatch):
    from matplotlib.figure import Figure

    from coursetools.drawings import ch07
    from distlab import gantt

    drawn = []          # what each picture hands the Gantt chart (its drawing is test_figures' to compare)
    monkeypatch.setattr(gantt, "plot_gantt", lambda events, ax=None, **kwargs: drawn.append(list(events)))
    monkeypatch.setattr(Figure, "tight_layout", lambda self, *args, **kwargs: None)      # layout: not the point
    text = flat_text()
    expected = {"07_naive_relay.png": schedules.naive(4, 1), "07_gantt_gpipe.png": schedules.gpipe(4, 8),
                "07_gantt_1f1b.png": schedules.one_f_one_b(4, 8),
                "07_gantt_interleaved.png": schedules.interleaved_1f1b(4, 8, 2),
                "07_gantt_zb_h1.png": schedules.zero_bubble_h1(4, 8), "07_gantt_zbv.png": schedules.zbv(4, 8)}
    assert set(ch07.FIGURES) == set(expected)
    for name, schedule in expected.items():
        draw, size = ch07.FIGURES[name]
        drawn.clear()
        draw(Figure(figsize=size))
        assert drawn == [schedules.simulate(schedule)], name
        bubble = percent(schedules.bubble_fraction_from_timeline(drawn[0], 4))
        assert bubble in text and f"(figures/{name})" in chapter_text()


def test_what_a_cold_reader_needs_is_on_the_page():
    """A learner's review (learn0507): the ZB-H1 caption says where the idle time is, terms come before their use,
    and what proves (quotes, the README's table) sits in "How we know"."""
    text = flat_text()
    body = text[:text.index("## How we know")]
    zb_h1 = schedules.zero_bubble_h1(4, 8)
    for rank in range(4):
        first_i = min(e.start for e in schedules.simulate(zb_h1) if e.rank == rank and e.kind == "I")
        idle = idle_intervals(zb_h1, rank)
        assert sum(end - start for start, end in idle) == 3.0 and all(end <= first_i for _, end in idle)
    assert idle_intervals(zb_h1, 3) == [(0.0, 3.0)] and idle_intervals(zb_h1, 0) == [(4.0, 7.0)]
    assert ("Each rank is idle for 3 units in all, each of them before its first I: rank 3 before its first forward, "
            "rank 0 after its four forwards.") in text and "idle only at the start" not in text
    assert body.index("**loop placement**") < body.index("rank P - 1 in a loop placement")
    assert "V is the number of stages each rank holds. ZB-H1 splits each backward" in text
    assert text.index("V is the number of stages each rank holds") < text.index("Next: [7.2")
    assert "or at the end of the step if no receive follows" in text
    assert "slightly more activations" not in text and "batch x sequence x hidden" not in text
    assert "y = x W" not in text and "Y = X Wᵀ (chapter 06's notation)" in text
    assert "one layer fewer on the first stage and one fewer on the last" in body
    for proof in ("ZB1P", "ZB-2p", "Activation Memory", "To balance the pipeline", "our builder's order"):
        assert proof not in body, proof
    assert text.index("### The pipeline's ends") > text.index("## How we know")


def test_the_interleaved_legend_says_stage_and_the_lab_says_idle_time_shrinks_v_fold():
    import nbformat
    from matplotlib.figure import Figure

    from coursetools.drawings import ch07

    fig = Figure(figsize=(10, 2.3))
    ch07.draw_gantt_interleaved(fig)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "paler: the rank's second stage" in legend and "paler: a later chunk" not in legend
    # interleaving divides each rank's idle time by V; the bubble, a share of the step, falls less (27.3% -> 15.8%)
    for v in (2, 4):
        assert idle_time_per_rank(schedules.interleaved_1f1b(4, 8, v)) == pytest.approx(
            [t / v for t in idle_time_per_rank(schedules.one_f_one_b(4, 8))])
    assert schedules.bubble_fraction(4, 8) / schedules.bubble_fraction(4, 8, 2) < 1.8
    notebook = nbformat.read(REPO / "notebooks" / "07_pipeline_parallel.ipynb", as_version=4)
    lab = " ".join(" ".join(c.source.split()) for c in notebook.cells if c.cell_type == "markdown")
    assert "interleaving shrinks the idle time V-fold" in lab and "shrinks it V-fold" not in lab
    assert "divides each rank's idle time by V" in lab and "divides the bubble by about V" not in lab


def test_the_nccl_pairing_and_zb_h2_read_plainly():
    # after0610 B2: two separate calls can deadlock with NCCL; grouping rules it out (chapter 03), not "requires"
    flat = flat_text()
    assert "requires a send and a receive between the same two ranks" not in flat
    assert ("With NCCL, two separate calls between the same two ranks can deadlock: each rank's send waits for a "
            "receive queued behind it. Grouping them rules that out (chapter 03).") in flat
    # B13: the ZB-H2 sentence in one parse
    assert ("ZB-H2, the paper's second handcrafted schedule, and its automatic schedules run more forwards ahead, "
            "holding up to twice 1F1B's activations, and remove the bubble altogether.") in flat
