"""Chapter 10's numbers are what distlab.domain computes; the test fails when the text drifts from the code."""

from pathlib import Path

from coursetools import chapters
from distlab import domain

CHAPTER = chapters.text("10")  # every page of the chapter: a claim may move from one page to the next


def tile_ratios(row) -> list[float]:
    """Halo cells per tile cell of every tile of a table row's grid, from the bytes each rank sends (one channel,
    one sample, fp32): what each tile receives, since a neighbour sends it exactly the strip it sends back."""
    grid = domain.TileGrid(*row["grid"], 720, 1440)
    return [domain.halo_send_bytes(grid, r, 3, channels=1, batch=1) / 4 / (grid.tile_shape(r)[0] * grid.tile_shape(r)[1])
            for r in range(grid.size)]


def surface_table() -> str:
    lines = ["| ranks | split | ranks as rows x cols | tile (cells) | halo cells per tile cell, busiest tile | corner or "
             "end tile |", "|---:|:---|:---|:---|---:|---:|"]
    for row in domain.surface_to_volume_rows(720, 1440, (4, 16, 80), radius=3):
        ratios = tile_ratios(row)
        lines.append(f"| {row['ranks']} | {row['split']} | {row['grid'][0]} x {row['grid'][1]} | "
                     f"{row['tile'][0]} x {row['tile'][1]} | {100 * max(ratios):.2f}% | {100 * min(ratios):.2f}% |")
    return "\n".join(lines)


def test_surface_to_volume_table():
    """The table gives each split's busiest and idlest tile. A tile with a neighbour on every side is the busiest
    (halo_to_tile_ratio, the figure's curve), an end or corner tile receives half of it, and on a 2 x 2 grid, where
    every tile is a corner, each receives half of what the interior formula says."""
    assert surface_table() in CHAPTER, "the table in chapter 10 is stale:\n" + surface_table()
    from fractions import Fraction

    rows = domain.surface_to_volume_rows(720, 1440, (4, 16, 80), radius=3)
    for row in rows:
        ratios = tile_ratios(row)
        assert abs(min(ratios) - row["ratio"] / 2) < 1e-12                       # a corner or end: half
        interior = row["grid"][0] >= 3 and (row["split"] == "h" or row["grid"][1] >= 3)
        assert (abs(max(ratios) - row["ratio"]) < 1e-12) == interior, row          # the interior formula, if any
    two_by_two = next(r for r in rows if r["grid"] == (2, 2))
    flat = " ".join(CHAPTER.split())
    assert (f"Each receives {100 * max(tile_ratios(two_by_two)):.2f}%, half the {100 * two_by_two['ratio']:.2f}% that a "
            f"tile of the same size with a neighbour on every side would.") in flat
    at_80 = {r["split"]: Fraction(max(tile_ratios(r))).limit_denominator(100) for r in rows if r["ranks"] == 80}
    assert at_80 == {"h": Fraction(2, 3), "hw": Fraction(1, 9)}
    assert "each inner band exchanges two thirds of its own size per pass, against one ninth for an inner tile" in flat
    assert "| halo cells per tile cell |" not in CHAPTER


def test_halo_bytes_of_the_default_runs():
    assert domain.receptive_radius([3, 3, 3]) == 3 and "three 3 x 3 layers see 3 cells away" in CHAPTER
    bands = domain.TileGrid(4, 1, 32, 32)
    sent = [domain.halo_send_bytes(bands, r, 3, channels=4, batch=2) for r in range(4)]
    assert sent == [3072, 6144, 6144, 3072]
    assert f"**{sent[1]:,} bytes**" in CHAPTER and f"**{sent[0]:,}**" in CHAPTER
    tiles = domain.TileGrid(2, 2, 32, 32)
    sent = {domain.halo_send_bytes(tiles, r, 3, channels=4, batch=2) for r in range(4)}
    assert sent == {3648} and "**3,648 bytes**" in CHAPTER


def test_real_grids_section_states_what_the_code_does():
    flat = " ".join(CHAPTER.split())
    era5 = domain.TileGrid(4, 1, 721, 1440)
    heights = [era5.tile_shape(r)[0] for r in range(4)]
    assert heights == [181, 180, 180, 180] and "721 over 4 ranks: 181, 180, 180, 180" in flat
    bands = domain.TileGrid(4, 1, 9, 16)
    assert [bands.tile_shape(r)[0] for r in range(4)] == [3, 2, 2, 2] and "(bands of 3, 2, 2 and 2 rows)" in flat
    assert "ERA5's is 721 x 1440 cells" in flat
    # the runs the section names are the ones its script tests run
    tests = (Path(__file__).resolve().parents[1] / "scripts" / "test_10_domain_parallel.py").read_text()
    assert '"--height", "9", "--width", "16", "--split", "h"' in tests and "domain_train.py --height 9 --width 16" in flat
    assert '"--height", "30", "--width", "31"' in tests and "on a 30 x 31 field" in flat
    assert '"--height", "9", "--width", "11", "--split", "hw", "--periodic-width"' in tests and "on a 9 x 11 field" in flat
    import torch
    assert (Path(torch.__file__).parent / "distributed" / "tensor" / "_tp_conv.py").exists()


def test_the_mechanisms_are_described_as_the_code_runs_them():
    flat = " ".join(CHAPTER.split())
    # corners: the left/right message carries the rows the up/down exchange just brought (halo_send_bytes counts
    # tile height + 2 halo widths there), so the diagonal tile's corner arrives from the horizontal neighbour
    tiles = domain.TileGrid(2, 2, 32, 32)
    assert domain.halo_send_bytes(tiles, 0, 3, channels=1, batch=1) == (3 * 16 + 3 * (16 + 6)) * 4
    assert "arrive from the left or right neighbour, which received them from *its* vertical neighbour" in flat
    assert "travel through the vertical neighbour's horizontal exchange" not in flat
    # GroupNorm: torch's kernel is one Welford pass; the tiles' reduction is two passes
    import torch
    moments = Path(torch.__file__).parent / "include" / "ATen" / "native" / "cpu" / "moments_utils.h"
    assert "Compute rowwise moments by Welford algorithm" in moments.read_text()
    assert "torch's own GroupNorm makes one" in flat and "as GroupNorm itself computes it" not in flat
    # Chan's combination needs every tile's (count, mean, M2): summing them (an all-reduce) loses the spread of the
    # tiles' means, so the text says all-gather
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, 11.0, 12.0])
    tiles = [x[:3], x[3:]]
    summed_m2 = sum(((t - t.mean()) ** 2).sum() for t in tiles)
    chan_m2 = summed_m2 + sum(len(t) * (t.mean() - x.mean()) ** 2 for t in tiles)
    assert torch.isclose(chan_m2, ((x - x.mean()) ** 2).sum()) and not torch.isclose(summed_m2, chan_m2)
    assert "all-gather each tile's count, mean and sum of squared deviations" in flat
    assert "one all-reduce instead of two" not in flat
    # a norm does not force a halo before every layer
    assert "A norm between the convolutions does not force it" in flat and "needs this form, because the norm needs every cell" not in flat
    # the pole: the near side mirrored in order and turned half way round (tests/unit/test_domain.py checks it)
    assert "mirrored in order" in flat and "`domain.pole_halo`" in flat
    assert "a halo taken from the row itself shifted" not in flat


def test_the_tiny_example_is_a_stencil_on_two_tiles():
    """The 8-cell row of the chapter, summed over 3 cells on one device and on 2 tiles padded with their halos."""
    import torch
    import torch.nn.functional as F

    row, kernel = torch.arange(1.0, 9.0), torch.ones(1, 1, 3)
    whole = F.conv1d(row.view(1, 1, -1), kernel, padding=1).flatten()
    left, right = torch.cat([torch.zeros(1), row[:5]]), torch.cat([row[3:], torch.zeros(1)])  # halo of 1 cell
    tiles = [F.conv1d(t.view(1, 1, -1), kernel).flatten() for t in (left, right)]
    assert torch.equal(torch.cat(tiles), whole)
    show = lambda t: ", ".join(f"{v:g}" for v in t.tolist())
    flat = " ".join(CHAPTER.split())
    assert f"One device computes {show(whole)}." in flat
    assert f"its padded tile is {show(left)}. Rank 1's is {show(right)}." in flat
    assert f"gets {show(tiles[0])} and {show(tiles[1])}: the one-device row" in flat


def test_the_halo_exchange_picture_is_the_exchange():
    """10_halo_exchange.png is drawn from the exchange run on labels: rank 0's padded tile is the field's owners
    around it (corners included, zeros beyond the edge), and the cells each rank posts are halo_send_bytes'."""
    from coursetools.drawings import ch10

    for grid, width in ((domain.TileGrid(2, 2, 8, 8), 1), (domain.TileGrid(2, 2, 32, 32), 3),
                        (domain.TileGrid(4, 1, 32, 32), 3), (domain.TileGrid(3, 2, 11, 9), 2)):
        _, padded, messages = ch10.exchange_on_labels(grid, width)
        for rank in range(grid.size):
            rows, cols = grid.tile_slices(rank)
            around = [[next((r for r in range(grid.size) if grid.tile_slices(r)[0].start <= i < grid.tile_slices(r)[0].stop
                             and grid.tile_slices(r)[1].start <= j < grid.tile_slices(r)[1].stop), ch10.ZERO)
                       if 0 <= i < grid.height and 0 <= j < grid.width else ch10.ZERO
                       for j in range(cols.start - width, cols.stop + width)]
                      for i in range(rows.start - width, rows.stop + width)]
            assert padded[rank] == around
            cells = sum(c for sender, _, _, c in messages if sender == rank)
            assert cells * 4 == domain.halo_send_bytes(grid, rank, width, channels=1, batch=1)
    assert "Rows go first, then columns, so rank 3's corner reaches rank 0 through rank 1." in " ".join(CHAPTER.split())


# ---- the cold reviews' findings on chapter 10 (learn0813, src0813) ----------------------------------------------

def test_the_premise_has_a_number():
    """One sample's activations against the network's weights: 32 layers of 3 x 3 convolutions, 256 channels, on
    the 720 x 1440 grid in fp32, autograd keeping each layer's input."""
    layers, channels, cells = 32, 256, 720 * 1440
    activation = cells * channels * 4
    weights = layers * channels * channels * 9 * 4
    flat = " ".join(CHAPTER.split())
    assert (f"Each layer's input takes 720 x 1440 x {channels} x 4 bytes = {activation / 2**30:.2f} GiB, and autograd "
            f"keeps it for backward: {layers * activation / 2**30:.0f} GiB for one sample.") in flat
    assert (f"The weights take {layers} x {channels} x {channels} x 9 x 4 bytes = {weights / 2**20:.0f} MiB, "
            f"{layers * activation / weights:.0f} times less.") in flat
    assert 30 < layers * activation / 2**30 < 40       # "nearly fills an A100-40GB"
    assert "One sample nearly fills an A100-40GB." in flat


def test_torchs_conv_halo_conditions_are_stated_as_torch_checks_them():
    """_tp_conv.py: dilation 1; padded, stride 1; unpadded, stride == kernel and dividing the width."""
    import torch

    lines = (Path(torch.__file__).parent / "distributed" / "tensor" / "_tp_conv.py").read_text().splitlines()
    block = "\n".join(lines[21:41])
    assert lines[21].startswith("def _is_supported(input_size, kernel_size, stride, padding, dilation):")
    assert 'raise RuntimeError("Dilation must be 1 for tensor parallel convolution.")' in block
    assert "if padding[-1] != 0:" in block and "if stride[-1] != 1:" in block
    assert "input_size[-1] % stride[-1] == 0 and stride[-1] == kernel_size[-1]" in block
    flat = " ".join(CHAPTER.split())
    assert ("It takes one sharded dimension, dilation 1, and stride 1 when the convolution is padded; unpadded, the "
            "stride must equal the kernel and divide the width, a patchify (`_tp_conv.py:22-41`).") in flat
    assert "one sharded dimension, stride 1, dilation 1" not in flat


def test_the_words_the_reviews_could_not_follow():
    flat = " ".join(CHAPTER.split())
    # the halo's width is w, not the `width` beside the tile's width
    assert "Write w for the halo's width in cells." in flat and "`width` rows of its tile's width" not in flat
    # why domain_train.py exchanges before every layer, and no undefined "window"
    assert "because it is the simpler form" in flat and "whole window" not in flat
    # a mesh "row" was a dp index in a chapter where rows are grid rows
    assert "data-parallel rows" not in flat and "The `dp` rows" not in flat and "rows' losses" not in flat
    assert "Each data-parallel replica, one `dp` index with its own `domain` group" in flat
    # what the 0.47 is
    assert "the largest absolute gap between the two models' predicted fields" in flat


def test_the_tiles_picture_is_captioned_by_its_own_halo():
    """10_tiles_and_halos.png's left panel draws a halo of 2 cells: two 3 x 3 layers, as the caption says."""
    import inspect

    from coursetools import figures

    assert "grid, radius = domain.TileGrid(2, 2, 16, 16), 2" in inspect.getsource(figures.draw_tiles_and_halos)
    assert domain.receptive_radius([3, 3]) == 2
    flat = " ".join(CHAPTER.split())
    assert "rank 0's halo for two 3 x 3 layers (a receptive radius of 2 cells)" in flat


def test_the_halo_exchange_picture_writes_no_zero_for_padding():
    """A padding cell stays blank: the only "0"s drawn are rank 0's cells, in all three panels."""
    from matplotlib.figure import Figure

    from coursetools.drawings import ch10

    fig = Figure()
    ch10.draw_halo_exchange(fig)
    zeros = sum(t.get_text() == "0" for ax in fig.axes for t in ax.texts)
    after_rows, after_columns, _ = ch10.exchange_on_labels(domain.TileGrid(2, 2, 8, 8), 1)
    owned = lambda tiles: sum(label == 0 for tile in tiles for row in tile for label in row)
    assert zeros == owned(after_rows.values()) + owned(after_columns.values()) + owned([after_columns[0]])
    assert "grey blank cells lie beyond the field's edge" in " ".join(CHAPTER.split())


def test_lab_10_says_replica_where_it_meant_a_mesh_row():
    import json

    cells = json.loads((Path(__file__).resolve().parents[2] / "notebooks" / "10_domain_parallel.ipynb").read_text())
    lab = " ".join(" ".join("".join(c["source"]) for c in cells["cells"] if c["cell_type"] == "markdown").split())
    assert "2 rows of 2 tiles" not in lab and "2 data-parallel replicas (`dp` = 2)" in lab
    assert "for a tile with a neighbour on every side (a corner or end tile receives half)" in lab


def test_the_nccl_pairing_is_stated_as_chapter_03_states_it():
    # after0610 B2: two separate calls can deadlock; grouping rules it out (not "NCCL allows only when grouped")
    flat = " ".join(chapters.text("10").split())
    assert "which NCCL allows only when the two are grouped" not in flat and "were posted apart" not in flat
    assert ("With NCCL, two separate calls can deadlock (each rank's send waits for a receive queued behind it); "
            "grouping them rules that out (chapter 03).") in flat
    assert "were two separate calls, and each rank's send waited for a receive queued behind it" in flat


def test_the_tiles_curve_at_4_ranks_is_set_against_the_table():
    # after0610 B19: the picture's curve counts a neighbour on every side; the table's 2 x 2 tiles are corners
    rows = domain.surface_to_volume_rows(720, 1440, (4, 16, 80), radius=3)
    two_by_two = next(r for r in rows if r["grid"] == (2, 2))
    flat = " ".join(chapters.text("10").split())
    assert (f"So at 4 ranks it shows {100 * two_by_two['ratio']:.2f}%, not the table's "
            f"{100 * max(tile_ratios(two_by_two)):.2f}% for the 2 x 2 grid, whose tiles are all corners.") in flat
