"""distlab.domain: tile grids, receptive radius, the halo formulas, and a 1-tile stack equal to the model."""

import pytest
import torch

from distlab import domain


def test_grid_coordinates_and_neighbours():
    grid = domain.TileGrid(2, 3, 8, 9)
    assert [grid.coords(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert grid.neighbours(4) == {"up": 1, "down": None, "left": 3, "right": 5}
    assert grid.neighbours(0) == {"up": None, "down": 3, "left": None, "right": 1}
    assert grid.tile_slices(5) == (slice(4, 8), slice(6, 9))


@pytest.mark.parametrize("split, ranks, shape", [("h", 4, (4, 1)), ("hw", 4, (2, 2)), ("hw", 8, (2, 4)),
                                                 ("hw", 6, (2, 3)), ("hw", 7, (1, 7))])
def test_grid_shape(split, ranks, shape):
    assert domain.grid_shape(split, ranks) == shape


def test_receptive_radius_adds_the_layers_reach():
    assert domain.receptive_radius([3, 3, 3]) == 3
    assert domain.receptive_radius([5, 3]) == 3
    assert domain.receptive_radius([3, 3], dilations=[1, 2]) == 3
    with pytest.raises(ValueError):
        domain.receptive_radius([4])


def test_tile_problems():
    assert domain.tile_problems(domain.TileGrid(4, 1, 32, 32), 3) == []
    assert domain.tile_problems(domain.TileGrid(3, 1, 32, 32), 1) == []  # uneven: tiles of 11, 11 and 10 rows
    assert "does not split" in domain.tile_problems(domain.TileGrid(3, 1, 2, 32), 1)[0]
    assert "wider than a tile" in domain.tile_problems(domain.TileGrid(4, 1, 8, 32), 3)[0]
    assert domain.tile_problems(domain.TileGrid(4, 1, 8, 2), 3) == ["a halo of 3 rows is wider than a tile (2 rows): "
                                                                     "use fewer ranks along the height, a larger "
                                                                     "field or a shallower stack"]


def test_halo_bytes_worked_by_hand():
    grid = domain.TileGrid(2, 2, 16, 16)  # tiles of 8 x 8, each with one vertical and one horizontal neighbour
    # 2 rows of 8 up or down; 2 columns of 8 + 2 * 2 (the corners) left or right; 3 channels, batch 1, fp32
    assert domain.halo_send_bytes(grid, 0, 2, channels=3, batch=1) == (2 * 8 + 2 * 12) * 3 * 4
    assert domain.halo_send_bytes(grid, 0, 0, channels=3, batch=1) == 0
    bands = domain.TileGrid(4, 1, 16, 16)
    assert [domain.halo_send_bytes(bands, r, 1, 1, 1, 1) for r in range(4)] == [16, 32, 32, 16]


def test_halo_to_tile_ratio_is_surface_over_volume():
    assert domain.halo_to_tile_ratio(16, 64, 1, "h") == pytest.approx(2 / 16)
    assert domain.halo_to_tile_ratio(10, 10, 1, "hw") == pytest.approx((12 * 12 - 100) / 100)
    # doubling the tile's side halves the ratio (nearly, with the corners)
    assert domain.halo_to_tile_ratio(64, 64, 2, "hw") / domain.halo_to_tile_ratio(32, 32, 2, "hw") < 0.52


@pytest.mark.parametrize("exchange", ["once", "per-layer"])
def test_one_tile_stack_equals_the_model(exchange):
    # a single tile has no neighbours: the halo is the field's zero padding, and no message is posted
    model = domain.build_conv_stack((2, 5, 3), 3, seed=1)
    field = torch.randn(2, 2, 12, 10, generator=torch.Generator().manual_seed(0))
    grid = domain.TileGrid(1, 1, 12, 10)
    torch.testing.assert_close(domain.tile_conv_stack(model, field, grid, 0, exchange=exchange), model(field),
                               rtol=1e-5, atol=1e-6)


def test_one_tile_cnn_and_group_norm_equal_the_model():
    model = domain.build_field_cnn(seed=3)
    fields, targets = domain.field_batch(0, 2, 2, 16, 16, seed=0)
    grid = domain.TileGrid(1, 1, 16, 16)
    torch.testing.assert_close(domain.tile_field_cnn(model, fields, grid, 0), model(fields), rtol=1e-5, atol=1e-6)
    assert fields.shape == targets.shape == (2, 2, 16, 16)
    assert not torch.allclose(fields, targets)


# ---- notebook 10's exercise checks reject plausible wrong answers --------------------------------------------


def _notebook_cell(marker: str) -> str:
    import nbformat

    from pathlib import Path

    nb = nbformat.read(Path(__file__).resolve().parents[2] / "notebooks" / "10_domain_parallel.ipynb", as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "code" and marker in c.source)


def test_halo_exercise_rejects_plausible_slips():
    from labkit.exercises import ch10 as exercises

    check = _notebook_cell('exercises.check_value("halo"')
    for wrong in (4,    # forgot the dilation
                  10,   # k - 1 per layer instead of (k - 1) / 2
                  11):  # k per layer
        with pytest.raises(exercises.ExerciseWrong):
            exec(check, {"exercises": exercises, "domain": domain, "halo": wrong})
    exec(check, {"exercises": exercises, "domain": domain, "halo": 5})


def test_halo_from_above_exercise_rejects_plausible_slips():
    from labkit.exercises import ch10 as exercises

    check = _notebook_cell('exercises.check_function("halo_from_above"')

    def first_rows_of_band_above(bands, rank, width):
        return torch.zeros(width, bands[0].shape[1]) if rank == 0 else bands[rank - 1][:width]

    def last_rows_of_band_below(bands, rank, width):
        return torch.zeros(width, bands[0].shape[1]) if rank == len(bands) - 1 else bands[rank + 1][:width]

    def wraps_around_at_the_top(bands, rank, width):
        return bands[rank - 1][-width:]  # rank 0 gets the bottom band's rows: a periodic boundary

    def right(bands, rank, width):
        return torch.zeros(width, bands[0].shape[1]) if rank == 0 else bands[rank - 1][-width:]

    for wrong in (first_rows_of_band_above, last_rows_of_band_below, wraps_around_at_the_top):
        with pytest.raises(exercises.ExerciseWrong):
            exec(check, {"exercises": exercises, "torch": torch, "halo_from_above": wrong})
    exec(check, {"exercises": exercises, "torch": torch, "halo_from_above": right})


def test_uneven_tiles_split_an_era5_grid_as_evenly_as_it_goes():
    grid = domain.TileGrid(4, 1, 721, 1440)  # ERA5 at 0.25 degrees
    assert [grid.tile_shape(r) for r in range(4)] == [(181, 1440), (180, 1440), (180, 1440), (180, 1440)]
    assert [grid.tile_slices(r)[0] for r in range(4)] == [slice(0, 181), slice(181, 361), slice(361, 541),
                                                          slice(541, 721)]
    assert domain.tile_problems(grid, 1) == []
    assert "does not split" in domain.tile_problems(domain.TileGrid(4, 1, 3, 8), 1)[0]  # fewer rows than tiles


def test_periodic_width_wraps_the_neighbours_and_one_tile_wraps_onto_itself():
    grid = domain.TileGrid(2, 3, 8, 9, periodic_width=True)
    assert grid.neighbours(0)["left"] == 2 and grid.neighbours(2)["right"] == 0  # across the date line
    assert grid.neighbours(0)["up"] is None  # the pole: no wrap in latitude
    torch.manual_seed(0)
    model = domain.build_conv_stack((2, 4, 2), 3, seed=1, periodic_width=True)
    field = torch.randn(1, 2, 7, 10)
    whole = domain.TileGrid(1, 1, 7, 10, periodic_width=True)
    reference = model(field)
    # the reference itself: a circular convolution in longitude, zero-padded in latitude
    assert torch.allclose(reference[..., 0], domain.build_conv_stack((2, 4, 2), 3, seed=1)(
        torch.cat([field[..., -2:], field, field[..., :2]], dim=-1))[..., 2], atol=1e-6)
    for exchange in ("once", "per-layer"):
        tiled = domain.tile_conv_stack(model, field, whole, 0, exchange=exchange)
        assert torch.allclose(tiled, reference, atol=1e-6), exchange
    # the check can fail: the same tile treated as a bounded field (zero padding east-west) is not the globe
    bounded = domain.TileGrid(1, 1, 7, 10)
    assert not torch.allclose(domain.tile_conv_stack(model, field, bounded, 0), reference, atol=1e-3)
