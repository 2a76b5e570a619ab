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


def _on_the_sphere(latitudes_deg, longitudes_deg):
    """A smooth function of the point on the sphere, evaluated at any (latitude, longitude) angles, beyond 90 too."""
    lat, lon = torch.deg2rad(latitudes_deg)[:, None], torch.deg2rad(longitudes_deg)[None, :]
    x, y, z = torch.cos(lat) * torch.cos(lon), torch.cos(lat) * torch.sin(lon), torch.sin(lat)
    return (x + 2 * y + 3 * z + x * z)[None, None].double()


@pytest.mark.parametrize("pole_row", [False, True])
def test_pole_halo_is_the_near_side_mirrored_and_turned_half_way_round(pole_row):
    # 12 longitudes of 30 degrees; rows 10 degrees apart, either centred between the pole and 80 (85, 75, ...) or
    # with row 0 on the pole itself (90, 80, ...), as ERA5's 721 rows. The halo rows lie at 95, 105, 115 (or 100,
    # 110, 120) degrees "latitude": the same points as 85, 75, 65 (80, 70, 60) seen from the other side
    step, width = 10.0, 3
    longitudes = torch.arange(12, dtype=torch.float64) * 30
    offset = 0.0 if pole_row else step / 2
    rows = torch.arange(6, dtype=torch.float64)
    field = _on_the_sphere(90 - offset - step * rows, longitudes)
    outward = torch.arange(width, 0, -1, dtype=torch.float64) if pole_row else torch.arange(width - 1, -1, -1)
    beyond = 90 + offset + step * outward  # outermost first
    halo = domain.pole_halo(field, width, pole_row=pole_row)
    assert torch.allclose(halo, _on_the_sphere(beyond, longitudes), atol=1e-12)
    # the check can fail: the rows shifted but not mirrored (the outermost halo row taken from row 0), or mirrored
    # but not shifted, are other points of the sphere
    first = 1 if pole_row else 0
    unmirrored = torch.roll(field[..., first:first + width, :], 6, dims=-1)
    unshifted = field[..., first:first + width, :].flip(-2)
    for wrong in (unmirrored, unshifted):
        assert not torch.allclose(wrong, _on_the_sphere(beyond, longitudes), atol=1e-3)
    with pytest.raises(ValueError, match="do not halve"):
        domain.pole_halo(field[..., :11], 1)


def test_a_corner_arrives_from_the_horizontal_neighbour_which_got_it_vertically(monkeypatch):
    """Four threads stand in for the four ranks of a 2 x 2 grid; a stand-in for ``_swap`` delivers every message
    and notes who sent it. Rank 0's bottom-right halo corner holds cells of rank 3 (the diagonal tile) and reached
    rank 0 in a message from rank 1, its right neighbour, which had them from rank 3 in its up/down exchange."""
    import queue
    import threading

    grid, width = domain.TileGrid(2, 2, 8, 8), 1
    field = torch.arange(64.0).reshape(1, 1, 8, 8)
    boxes = {(s, d): queue.Queue() for s in range(4) for d in range(4)}
    seen, padded, local = [], {}, threading.local()

    def swap(sends, recvs, group):
        for tensor, peer in sends:
            if peer is not None:
                boxes[(local.rank, peer)].put(tensor.clone())
        for buffer, peer in recvs:
            if peer is not None:
                message = boxes[(peer, local.rank)].get(timeout=10)
                buffer.copy_(message)
                seen.append((peer, local.rank, message))

    def run(rank):
        local.rank = rank
        padded[rank] = domain.halo_exchange(grid.tile(field, rank), grid, rank, width)

    monkeypatch.setattr(domain, "_swap", swap)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    corner = padded[0][0, 0, -1, -1].item()
    assert corner == field[0, 0, 4, 4].item()  # the first cell of rank 3's tile
    senders = {src for src, dst, message in seen if dst == 0 and (message == corner).any()}
    assert senders == {1}, senders  # from the right neighbour only, never from rank 2 or the diagonal rank 3
    assert all(not (src == 3 and dst == 0) for src, dst, _ in seen)  # no diagonal message at all
    assert torch.equal(padded[0][..., 1:-1, 1:-1], grid.tile(field, 0))
