"""The chapters' pictures: every figure a chapter references exists, and every generator in coursetools.figures runs.

Also the data behind the ring picture: the chunk counts are chapter 03's algorithm, not a drawing."""

import re
from pathlib import Path

import pytest

from coursetools import figures

REPO = Path(__file__).resolve().parents[2]
CHAPTERS = REPO / "chapters"
REFERENCE = re.compile(r"!\[(?:[^\[\]]|\[[^\]]*\])*\]\((figures/[^)]+)\)")   # alt text may hold [0, 2, 4, 6]


def referenced() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for chapter in sorted(CHAPTERS.glob("[0-9][0-9]*.md")):   # every page of every chapter
        for target in REFERENCE.findall(chapter.read_text()):
            found.setdefault(target, []).append(chapter.name)
    return found


def test_every_referenced_figure_exists_and_comes_from_a_generator():
    refs = referenced()
    assert len(refs) >= 6, "the chapters embed their mechanisms' figures"
    for target, chapters in refs.items():
        assert (CHAPTERS / target).is_file(), f"{chapters} reference {target}, which is missing: run `make figures`"
        assert Path(target).name in figures.FIGURES, f"{target} has no generator in coursetools.figures.FIGURES"


def test_every_generated_figure_is_used_and_committed():
    used = {Path(t).name for t in referenced()}
    assert set(figures.FIGURES) == used, "a generator whose figure no chapter shows (or the reverse)"
    on_disk = {p.name for p in (CHAPTERS / "figures").glob("*.png")}
    assert on_disk == set(figures.FIGURES), "chapters/figures holds stale or missing files: run `make figures`"


def differs(fresh: Path, committed: Path) -> str | None:
    """How a freshly drawn PNG differs from the committed one (None: the same picture). Pixels, not bytes: the
    same drawing is the same picture whatever zlib made of it."""
    from matplotlib import image

    if fresh.read_bytes() == committed.read_bytes():
        return None
    a, b = image.imread(fresh), image.imread(committed)
    if a.shape != b.shape:
        return f"size {a.shape[:2]} against {b.shape[:2]}"
    changed = float((abs(a - b) > 1 / 255).any(axis=-1).mean())
    return None if changed == 0 else f"{100 * changed:.2f}% of the pixels"


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_each_generator_runs_and_draws_the_committed_picture(name, tmp_path):
    path = figures.render(name, tmp_path)
    assert path.stat().st_size > 5_000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    committed = CHAPTERS / "figures" / name
    assert committed.stat().st_size < 200_000  # small PNGs
    # a figure drawn from the library's functions goes stale when they change: the chapter would show old numbers
    difference = differs(path, committed)
    assert difference is None, f"chapters/figures/{name} is stale ({difference} differ): run `make figures`"


def test_a_stale_figure_is_found(tmp_path):
    one, other = (figures.render(name, tmp_path) for name in ("09_mesh_3d.png", "09_mesh_two_nodes.png"))
    assert differs(one, one) is None and differs(one, other) is not None


def test_the_ring_picture_is_the_ring_algorithm():
    history = figures.ring_allreduce_contributions(4)
    assert len(history) == 1 + 2 * 3                                 # inputs, 3 reduce-scatter, 3 all-gather steps
    after_reduce_scatter = history[3]
    for rank in range(4):                                            # rank r holds the full sum of chunk r + 1
        assert after_reduce_scatter[rank][(rank + 1) % 4] == 4
        assert sorted(after_reduce_scatter[rank]) == [1, 2, 3, 4]
    assert history[-1] == [[4] * 4] * 4                              # every rank holds every summed chunk
    for n in (2, 3, 5):
        assert figures.ring_allreduce_contributions(n)[-1] == [[n] * n] * n


def test_the_measured_hybrid_timeline_is_the_scripts_and_holds_every_collective_of_a_step():
    # the committed measurement (fsdp_tp_hybrid.py --timeline-out) against the formula of today's code: a
    # stale file (another model, plan or mesh) fails here; re-measure with the command in its "argv"
    import json

    from distlab import hybrid, models

    run = json.loads(figures.HYBRID_STEP_TIMELINE.read_text())
    assert run["script"] == "scripts/09_hybrid_parallel/fsdp_tp_hybrid.py" and "--timeline-out" in run["argv"]
    cfg = models.TransformerConfig(**run["model"])
    formula = hybrid.fsdp_tp_comm_formula(cfg, run["batch"], run["seq_len"], run["dp"], run["tp"])
    for lane in ("tp", "dp"):
        expected = sum(r["calls"] for r in formula if r["dimension"] == lane)
        assert sum(r["lane"] == lane for r in run["rows"]) == expected, lane
    assert [r for r in run["rows"] if r["lane"] == "backward"] and [r for r in run["rows"] if r["lane"] == "compute"]


def test_the_memory_picture_shows_predicted_equal_to_measured():
    for preset in ("tiny", "small"):
        parts = figures.training_memory_of(preset)
        assert parts["predicted"] == parts["measured"], preset


def test_the_measured_ddp_overlap_is_the_tiny_models_and_obeys_ddps_rule():
    """The committed measurement behind 04_ddp_overlap.png against today's model: every parameter's gradient once,
    the buckets' bytes = the parameter bytes, each bucket launched when its last gradient was ready (not before),
    and the first launched before backward had finished computing. A stale file fails; measure again with
    figures.measure_ddp_overlap()."""
    import json

    from distlab import models

    run = json.loads(figures.DDP_OVERLAP.read_text())
    model = models.build_transformer("tiny")
    ready = [e for e in run["backward_timeline"] if e["kind"] == "grad_ready"]
    assert sorted(e["param"] for e in ready) == sorted(name for name, _ in model.named_parameters())
    assert sum(b["bytes"] for b in run["buckets"]) == run["param_bytes"] == 4 * models.preset("tiny").num_params()
    for bucket in run["overlap"]["buckets"]:
        last = max(e["t"] for e in ready if e["bucket"] == bucket["index"])
        assert last <= bucket["launch"] <= bucket["end"] <= run["overlap"]["backward_end"]
    assert min(b["launch"] for b in run["overlap"]["buckets"]) < run["overlap"]["last_gradient"]


def test_the_measured_zero3_memory_is_the_tiny_models_units_one_at_a_time():
    """The committed measurement behind 05_zero3_memory.png against today's model, counted apart from the script:
    each unit's bytes from the model's own modules, gathered twice and dropped twice, never two at once, and the
    slices a quarter of the model. A stale file fails; measure again with figures.measure_zero3_memory()."""
    import json

    from distlab import models

    run = json.loads(figures.ZERO3_MEMORY.read_text())
    model = models.build_transformer("tiny")
    bytes_of = lambda *modules: sum(4 * q.numel() for m in modules for q in m.parameters())  # noqa: E731
    units = {"tok_embeddings": bytes_of(model.tok_embeddings), "head": bytes_of(model.norm, model.output),
             **{f"layers.{i}": bytes_of(block) for i, block in model.layers.items()}}
    assert run["units"] == units and run["whole_model_bytes"] == bytes_of(model) == sum(units.values())
    assert run["slices_bytes"] == run["whole_model_bytes"] // run["world_size"]
    gathers = [(e["event"].split(":")[0], e["bytes"]) for e in run["timeline"] if "gathered" in e["event"]]
    assert sorted(gathers) == sorted([(u, b) for u, b in units.items()] * 2)   # each unit alone, twice
    assert all(e["bytes"] == 0 for e in run["timeline"] if "dropped" in e["event"])
    assert run["gathered_peak_bytes"] == max(units.values())


def test_the_measured_prefetch_issues_each_gather_one_unit_ahead():
    """The committed measurement behind 05_zero3_prefetch.png against today's model: the tiny model's units in
    forward's order; every unit but the first gathered ahead, issued before the unit ahead of it began and waited
    for after it ended; two units' weights at the peak, never more. Measure again with
    figures.measure_zero3_prefetch()."""
    import json

    from distlab import models

    run = json.loads(figures.ZERO3_PREFETCH.read_text())
    model = models.build_transformer("tiny")
    block = sum(4 * q.numel() for q in model.layers["0"].parameters())
    units = [c["unit"] for c in run["computes"]]
    assert units == ["tok_embeddings", *[f"layers.{i}" for i in model.layers], "head"]
    forward = {g["unit"]: g for g in run["gathers"] if g["phase"] == "forward"}
    assert [u for u in units if forward[u]["prefetched"]] == units[1:]
    for before, unit in zip(run["computes"], run["computes"][1:]):
        g = forward[unit["unit"]]
        assert g["issued"] <= before["start"] and g["waited"] >= before["end"] and g["ready"] <= unit["start"]
    assert run["gathered_peak_bytes"] == 2 * block
    spans = {c["unit"]: (c["start"], c["end"]) for c in run["computes"]}
    for unit, ahead in (("layers.1", "layers.0"), ("head", "layers.1")):   # what the chapter reads off the picture
        g = forward[unit]
        assert min(g["ready"], spans[ahead][1]) - max(g["issued"], spans[ahead][0]) > 0, f"{unit}: no overlap"


def test_the_hang_picture_is_what_todays_diagnosis_reads_from_its_journals():
    import json

    from distlab import hangs

    run = json.loads(figures.HANG.read_text())
    journals = {int(r): j for r, j in run["journals"].items()}
    found = hangs.diagnose(journals)
    assert (found["cause"], found["verdict"]) == (run["cause"], run["verdict"])
    assert sorted(found["stuck"]) == [0, 1, 2]   # the picture's red boxes


def test_the_fault_drill_picture_restarts_from_the_last_checkpoint_before_the_death():
    import json

    run = json.loads(figures.FAULT_DRILL.read_text())
    died, every = run["died"]["step"], run["save_every"]
    first, second = ([r["step"] for r in run["records"] if r["attempt"] == a] for a in (0, 1))
    assert first == list(range(died)) and max(first) < died                 # the first attempt stops at the death
    assert second[0] == died // every * every                                # resumes where the last save left it
    assert second == list(range(second[0], run["steps"]))                    # and trains to the end
    assert run["extra"]["steps_trained_twice"] == list(range(second[0], died))


def test_the_launch_pictures_arrows_end_at_the_stores_edge_and_the_hangs_labels_stay_readable():
    """A learner's review (s14): the ranks' arrows ended on the store box's first line, and the red hatching ran over
    the labels of the calls the hang picture is about."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    from coursetools.drawings import ch12

    fig = Figure(figsize=figures.FIGURES["12_launch_and_rendezvous.png"][1])
    ch12.draw_launch_and_rendezvous(fig)
    ax = fig.axes[0]
    blue = (0xe6 / 255, 0xee / 255, 0xf8 / 255)
    store = next(p for p in ax.patches if isinstance(p, FancyBboxPatch) and p.get_facecolor()[:3] == blue)
    top = store.get_y() + store.get_height() + store.get_boxstyle().pad
    ends = [p._posA_posB[1][1] for p in ax.patches if isinstance(p, FancyArrowPatch) and p.get_linewidth() < 1]
    assert len(ends) == 8 and all(abs(end - top) < 1e-9 for end in ends), (ends, top)
    # the store's three lines fit inside it: its text's extent lies within the box
    renderer = FigureCanvasAgg(fig).get_renderer()
    label = next(t for t in ax.texts if t.get_text().startswith("rank 0's TCP store"))
    inside = store.get_window_extent(renderer)
    assert inside.y0 <= label.get_window_extent(renderer).y0 and label.get_window_extent(renderer).y1 <= inside.y1

    fig = Figure(figsize=figures.FIGURES["12_hang.png"][1])
    figures.draw_hang(fig)
    waiting = [t for t in fig.axes[0].texts if t.get_text().startswith("barrier")]
    assert waiting and all(t.get_bbox_patch() is not None for t in waiting)
