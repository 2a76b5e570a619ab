"""Chapter 10's numbers are what distlab.domain computes; the test fails when the text drifts from the code."""

from pathlib import Path

from coursetools import chapters
from distlab import domain

CHAPTER = chapters.text("10")  # every page of the chapter: a claim may move from one page to the next


def surface_table() -> str:
    lines = ["| ranks | split | ranks as rows x cols | tile (cells) | halo cells per tile cell |",
             "|---:|:---|:---|:---|---:|"]
    for row in domain.surface_to_volume_rows(720, 1440, (4, 16, 80), radius=3):
        lines.append(f"| {row['ranks']} | {row['split']} | {row['grid'][0]} x {row['grid'][1]} | "
                     f"{row['tile'][0]} x {row['tile'][1]} | {100 * row['ratio']:.2f}% |")
    return "\n".join(lines)


def test_surface_to_volume_table():
    assert surface_table() in CHAPTER, "the table in chapter 10 is stale:\n" + surface_table()
    from fractions import Fraction

    at_80 = {r["split"]: Fraction(r["ratio"]).limit_denominator(100)
             for r in domain.surface_to_volume_rows(720, 1440, (80,), radius=3)}
    assert at_80 == {"h": Fraction(2, 3), "hw": Fraction(1, 9)}
    assert "each band exchanges two thirds of its own size per pass, against one ninth for a tile" in " ".join(
        CHAPTER.split())


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
    assert "A norm does not force it" in flat and "needs this form, because the norm needs every cell" not in flat
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
