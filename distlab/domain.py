"""Domain parallelism: a grid too big for one device, split into tiles, with halos exchanged between them.

A weather or climate model's input is a field on a grid (channels x height x width). When one field does not
fit, or one device is too slow, the grid itself is split: each rank holds a tile. A convolution (any stencil)
needs, at the edge of a tile, the values just across the edge: the **halo**. Before the stencil runs, each
rank sends the rows next to each edge to the neighbour on that side and receives that neighbour's rows.

This module holds the pieces the chapter-10 scripts share:

* :class:`TileGrid`: which rank holds which tile (``rows x cols`` ranks, row-major), and its neighbours;
* :func:`receptive_radius`: how far a stack of convolutions sees, hence how wide a halo it needs;
* :func:`halo_exchange`: the exchange as an autograd function, so gradients flow back across tile edges
  (the halo's gradient is sent back to the rank that owns those cells and added there);
* :func:`tile_conv_stack`: a stack of convolutions evaluated on tiles that equals the one-device stack;
* :func:`pole_halo`: the rows beyond a pole, for a model that crosses it (the course's models pad it with zeros);
* formulas, each tested equal to a measurement: bytes a rank sends per exchange (:func:`halo_send_bytes`) and
  the surface-over-volume ratio of halo to tile (:func:`halo_to_tile_ratio`).

Messages are posted with ``batch_isend_irecv``: a rank both sends to and receives from the same neighbour, which
gloo forgives in any order but NCCL only when the pair is grouped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HEIGHT, WIDTH = 2, 3  # the dims of a (batch, channels, height, width) field


# --------------------------------------------------------------------------------------------------
# Which rank holds which tile
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileGrid:
    """``rows x cols`` ranks over a ``height x width`` field; rank ``r`` holds tile ``(r // cols, r % cols)``.

    A side that does not divide is split as evenly as it goes: the first ``height % rows`` rows of tiles hold one
    row more (ERA5's 0.25-degree grid is 721 x 1440; 721 rows over 4 ranks are 181, 180, 180, 180). Tiles of one
    row of the grid share their height and tiles of one column their width, so neighbours' edges always match.

    ``periodic_width``: the field wraps east-west, as a global latitude-longitude grid does: the first column's
    west neighbour is the last column (with one column of tiles, the tile itself), and the halo across the edge
    comes from the other side of the globe instead of zeros. The height (latitude) keeps zero padding.
    """

    rows: int
    cols: int
    height: int
    width: int
    periodic_width: bool = False

    @property
    def size(self) -> int:
        return self.rows * self.cols

    @property
    def tile_height(self) -> int:
        """The smallest tile's height (every tile's, when the rows divide the height)."""
        return self.height // self.rows

    @property
    def tile_width(self) -> int:
        """The smallest tile's width (every tile's, when the columns divide the width)."""
        return self.width // self.cols

    @staticmethod
    def _edges(length: int, parts: int) -> list[int]:
        base, extra = divmod(length, parts)
        edges = [0]
        for i in range(parts):
            edges.append(edges[-1] + base + (i < extra))
        return edges

    def coords(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.cols)

    def rank_of(self, row: int, col: int) -> int | None:
        """The rank at (row, col), or None off the grid (the field's edge: no neighbour, zero padding); with
        ``periodic_width`` the columns wrap around."""
        if self.periodic_width:
            col %= self.cols
        if 0 <= row < self.rows and 0 <= col < self.cols:
            return row * self.cols + col
        return None

    def neighbours(self, rank: int) -> dict[str, int | None]:
        row, col = self.coords(rank)
        return {"up": self.rank_of(row - 1, col), "down": self.rank_of(row + 1, col),
                "left": self.rank_of(row, col - 1), "right": self.rank_of(row, col + 1)}

    def tile_slices(self, rank: int) -> tuple[slice, slice]:
        """The rows and columns of the global field that ``rank`` holds."""
        row, col = self.coords(rank)
        rows, cols = self._edges(self.height, self.rows), self._edges(self.width, self.cols)
        return slice(rows[row], rows[row + 1]), slice(cols[col], cols[col + 1])

    def tile_shape(self, rank: int) -> tuple[int, int]:
        rows, cols = self.tile_slices(rank)
        return rows.stop - rows.start, cols.stop - cols.start

    def tile(self, field: torch.Tensor, rank: int) -> torch.Tensor:
        rows, cols = self.tile_slices(rank)
        return field[..., rows, cols]


def grid_shape(split: str, ranks: int) -> tuple[int, int]:
    """Ranks as (rows, cols): ``h`` splits the height only; ``hw`` makes the grid as square as the count allows."""
    if split == "h":
        return ranks, 1
    rows = max(d for d in range(1, math.isqrt(ranks) + 1) if ranks % d == 0)
    return rows, ranks // rows


def tile_problems(grid: TileGrid, halo: int) -> list[str]:
    """What stops a field from splitting into this grid with this halo (empty list: it splits). A side that does
    not divide is fine (uneven tiles); a side with fewer cells than tiles is not."""
    problems = []
    if grid.height < grid.rows:
        problems.append(f"height {grid.height} does not split into {grid.rows} rows of tiles")
    if grid.width < grid.cols:
        problems.append(f"width {grid.width} does not split into {grid.cols} columns of tiles")
    if not problems:
        # A halo wider than the neighbour's tile would need cells from two ranks away (a second hop).
        if grid.rows > 1 and halo > grid.tile_height:
            problems.append(f"a halo of {halo} rows is wider than a tile ({grid.tile_height} rows): use fewer "
                            "ranks along the height, a larger field or a shallower stack")
        if grid.cols > 1 and halo > grid.tile_width:
            problems.append(f"a halo of {halo} columns is wider than a tile ({grid.tile_width} columns): use "
                            "fewer ranks along the width, a larger field or a shallower stack")
    return problems


# --------------------------------------------------------------------------------------------------
# How wide a halo
# --------------------------------------------------------------------------------------------------


def receptive_radius(kernel_sizes, dilations=None) -> int:
    """Cells on each side that the output at one point depends on: the sum of each layer's reach.

    A k x k convolution with dilation d reaches d * (k - 1) / 2 cells each way; stacked layers add up. That
    is the halo a tile needs when it exchanges once before the whole stack.
    """
    dilations = dilations or [1] * len(kernel_sizes)
    for k in kernel_sizes:
        if k % 2 == 0:
            raise ValueError(f"kernel size {k} is even: a centred stencil needs an odd kernel")
    return sum(d * (k - 1) // 2 for k, d in zip(kernel_sizes, dilations))


# --------------------------------------------------------------------------------------------------
# The exchange
# --------------------------------------------------------------------------------------------------


def _global_rank(group, rank: int | None) -> int | None:
    if rank is None or group is None:
        return rank
    return dist.get_global_rank(group, rank)


def _swap(sends: list, recvs: list, group) -> None:
    """Post every send and receive of one exchange together (one ``batch_isend_irecv``), then wait.

    ``sends``/``recvs`` are ``(tensor, peer)`` pairs; peers are ranks of ``group``. Grouping matters on NCCL:
    a rank that sends to a neighbour and receives from the same neighbour must post both at once.
    """
    ops = [dist.P2POp(dist.isend, t, _global_rank(group, peer), group) for t, peer in sends if peer is not None]
    ops += [dist.P2POp(dist.irecv, t, _global_rank(group, peer), group) for t, peer in recvs if peer is not None]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


class HaloExchange(torch.autograd.Function):
    """Pad ``x`` along ``dim`` with ``width`` cells from the previous and the next rank (zeros at the edge).

    Forward: my first ``width`` cells go to ``prev``, my last to ``next``; theirs come back as my halo.
    Backward: the gradient that landed on my halo belongs to the cells the neighbours own: send it back,
    and add what they send me onto my own edge cells.
    """

    @staticmethod
    def _receives(first, last, prev_rank, next_rank):
        """The receives, in the order the peers' sends arrive. Each rank sends its first cells, then its last. When
        one peer is both neighbours (two columns of tiles around a periodic width) its first message is its first
        cells, which lie east of me: they are my ``next`` halo, so that receive is posted first."""
        if prev_rank is not None and prev_rank == next_rank:
            return [(last, next_rank), (first, prev_rank)]
        return [(first, prev_rank), (last, next_rank)]

    @staticmethod
    def forward(ctx, x, dim: int, width: int, prev_rank, next_rank, group):
        ctx.dim, ctx.width, ctx.peers, ctx.group = dim, width, (prev_rank, next_rank), group
        n = x.size(dim)
        from_prev = x.new_zeros(x.narrow(dim, 0, width).shape)
        from_next = torch.zeros_like(from_prev)
        _swap(sends=[(x.narrow(dim, 0, width).contiguous(), prev_rank),
                     (x.narrow(dim, n - width, width).contiguous(), next_rank)],
              recvs=HaloExchange._receives(from_prev, from_next, prev_rank, next_rank), group=group)
        return torch.cat([from_prev, x, from_next], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        dim, width, (prev_rank, next_rank) = ctx.dim, ctx.width, ctx.peers
        n = grad.size(dim) - 2 * width
        grad_x = grad.narrow(dim, width, n).clone()
        for_my_first = torch.zeros_like(grad.narrow(dim, 0, width))
        for_my_last = torch.zeros_like(for_my_first)
        _swap(sends=[(grad.narrow(dim, 0, width).contiguous(), prev_rank),
                     (grad.narrow(dim, n + width, width).contiguous(), next_rank)],
              recvs=HaloExchange._receives(for_my_first, for_my_last, prev_rank, next_rank), group=ctx.group)
        grad_x.narrow(dim, 0, width).add_(for_my_first)
        grad_x.narrow(dim, n - width, width).add_(for_my_last)
        return grad_x, None, None, None, None, None


def halo_exchange(tile: torch.Tensor, grid: TileGrid, rank: int, width: int, group=None) -> torch.Tensor:
    """``tile`` with a halo of ``width`` cells on all four sides, from the neighbours (zeros at the field's edge).

    Height first, then width on the height-padded tile, so the corner cells (needed by a 3 x 3 stencil at a
    tile's corner) arrive too: the left/right neighbour received them from the diagonal tile in its own up/down
    exchange, and its columns carry them on to me.
    ``rank`` and the neighbours are ranks of ``group`` (the domain group; the world when None).
    """
    if width == 0:
        return tile
    near = grid.neighbours(rank)
    padded = HaloExchange.apply(tile, HEIGHT, width, near["up"], near["down"], group)
    if grid.periodic_width and grid.cols == 1:  # the tile spans the globe: its own other edge is the halo
        return torch.cat([padded[..., -width:], padded, padded[..., :width]], dim=WIDTH)
    return HaloExchange.apply(padded, WIDTH, width, near["left"], near["right"], group)


# --------------------------------------------------------------------------------------------------
# A convolution stack on tiles
# --------------------------------------------------------------------------------------------------


class ConvStack(nn.Module):
    """``len(channels) - 1`` same-size convolutions with GELU between: the one-device model."""

    def __init__(self, channels=(4, 16, 16, 4), kernel_size: int = 3, periodic_width: bool = False):
        super().__init__()
        self.kernel_size, self.periodic_width = kernel_size, periodic_width
        self.convs = nn.ModuleList(nn.Conv2d(c_in, c_out, kernel_size, padding=_padding(kernel_size, periodic_width))
                                   for c_in, c_out in zip(channels[:-1], channels[1:]))

    @property
    def radius(self) -> int:
        return receptive_radius([c.kernel_size[0] for c in self.convs])

    def forward(self, x):
        for i, conv in enumerate(self.convs):
            x = conv(_wrap_width(x, self.kernel_size // 2) if self.periodic_width else x)
            if i < len(self.convs) - 1:
                x = F.gelu(x)
        return x


def _padding(kernel_size: int, periodic_width: bool):
    """A same-size convolution's zero padding: both sides, or (with a periodic width) the height only."""
    return (kernel_size // 2, 0) if periodic_width else kernel_size // 2


def _wrap_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """The one-device model's periodic padding east-west: the other edge's columns (a circular pad of the width)."""
    return F.pad(x, (width, width, 0, 0), mode="circular")


def pole_halo(rows: torch.Tensor, width: int, *, pole_row: bool = False) -> torch.Tensor:
    """The ``width`` halo rows beyond the north pole of a latitude-longitude field, outermost first (ready to be
    concatenated above row 0). The course's models pad the poles with zeros; this is what crossing the pole means.

    Beyond the pole lie the near side's rows seen from 180 degrees of longitude away, mirrored in order: the halo row
    next to the pole is the first row, the next one out the second, and so on, each shifted by half the longitudes.
    ``pole_row``: row 0 sits on the pole itself (ERA5's 721 rows), so the mirror starts at row 1. For the south pole,
    flip the field upside down first. (Vector fields, such as wind, also flip the sign of their components.)
    """
    longitudes = rows.size(WIDTH)
    if longitudes % 2:
        raise ValueError(f"a pole halo shifts by half the longitudes: {longitudes} do not halve")
    first = 1 if pole_row else 0
    near_side = rows[..., first:first + width, :]
    return torch.roll(near_side.flip(HEIGHT), shifts=longitudes // 2, dims=WIDTH)


def build_conv_stack(channels, kernel_size: int, seed: int, device="cpu", periodic_width: bool = False) -> ConvStack:
    """The same weights on every rank and in the one-device reference, from the seed alone."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = ConvStack(channels, kernel_size, periodic_width).to(device)
    torch.random.set_rng_state(generator_state)
    return model


def _outside_field_mask(grid: TileGrid, rank: int, margin: int, device) -> torch.Tensor:
    """1 where a cell of the tile padded by ``margin`` lies inside the field, 0 where it lies beyond its edge."""
    rows, cols = grid.tile_slices(rank)
    r = torch.arange(rows.start - margin, rows.stop + margin, device=device)
    c = torch.arange(cols.start - margin, cols.stop + margin, device=device)
    inside_r = ((r >= 0) & (r < grid.height)).float()
    inside_c = torch.ones_like(c, dtype=torch.float) if grid.periodic_width else ((c >= 0) & (c < grid.width)).float()
    return inside_r[:, None] * inside_c[None, :]


def tile_conv_stack(model: ConvStack, tile: torch.Tensor, grid: TileGrid, rank: int, *, exchange: str = "once",
                    group=None) -> torch.Tensor:
    """The stack's output on this rank's tile, equal to the same cells of the one-device output.

    ``exchange="once"``: one halo of the stack's full receptive radius, then every layer as a valid
    (unpadded) convolution that eats ``k // 2`` cells of halo per side; cells beyond the field's edge are set
    back to zero after each layer, as the one-device model's zero padding would have them. Fewer messages,
    some halo cells computed twice (by their owner and by the neighbour).
    ``exchange="per-layer"``: a halo of ``k // 2`` before every layer. More, smaller messages; no duplicate
    compute.
    """
    x = tile
    last = len(model.convs) - 1
    if exchange == "once":
        margin = model.radius
        x = halo_exchange(x, grid, rank, margin, group)
        for i, conv in enumerate(model.convs):
            x = F.conv2d(x, conv.weight, conv.bias)  # valid: the halo is the padding
            margin -= conv.kernel_size[0] // 2
            if i < last:
                x = F.gelu(x) * _outside_field_mask(grid, rank, margin, x.device)
        return x
    if exchange != "per-layer":
        raise ValueError(f"exchange must be 'once' or 'per-layer', not {exchange!r}")
    for i, conv in enumerate(model.convs):
        x = F.conv2d(halo_exchange(x, grid, rank, conv.kernel_size[0] // 2, group), conv.weight, conv.bias)
        if i < last:
            x = F.gelu(x)
    return x


# --------------------------------------------------------------------------------------------------
# Formulas (each tested equal to a measurement)
# --------------------------------------------------------------------------------------------------


def halo_send_bytes(grid: TileGrid, rank: int, width: int, channels: int, batch: int,
                    element_size: int = 4) -> int:
    """Bytes ``rank`` sends in one forward halo exchange of ``width`` cells (the backward sends as many back).

    Up and down: ``width`` rows of the tile's width each. Left and right: ``width`` columns of the tile's
    height plus the halo rows just received (that is how the corners travel).
    """
    if width == 0:
        return 0
    near = grid.neighbours(rank)
    tile_height, tile_width = grid.tile_shape(rank)
    vertical = sum(p is not None for p in (near["up"], near["down"]))
    # one column of tiles around a periodic width wraps inside the tile: nothing sent
    horizontal = 0 if grid.periodic_width and grid.cols == 1 else sum(
        p is not None for p in (near["left"], near["right"]))
    cells = (vertical * width * tile_width + horizontal * width * (tile_height + 2 * width))
    return batch * channels * cells * element_size


def stack_send_bytes(model: ConvStack, grid: TileGrid, rank: int, batch: int, exchange: str,
                     element_size: int = 4) -> int:
    """Bytes ``rank`` sends in one forward pass of the stack: one exchange, or one per layer."""
    if exchange == "once":
        return halo_send_bytes(grid, rank, model.radius, model.convs[0].in_channels, batch, element_size)
    return sum(halo_send_bytes(grid, rank, conv.kernel_size[0] // 2, conv.in_channels, batch, element_size)
               for conv in model.convs)


def halo_to_tile_ratio(tile_height: int, tile_width: int, width: int, split: str) -> float:
    """Halo cells per tile cell: communication over computation, surface over volume.

    Split along the height only, a tile receives ``2 * width`` rows of its width; split both ways, a ring
    around the tile. Doubling the tile's side halves the ratio: bigger tiles communicate relatively less.
    """
    if split == "h":
        halo = 2 * width * tile_width
    else:
        halo = (tile_height + 2 * width) * (tile_width + 2 * width) - tile_height * tile_width
    return halo / (tile_height * tile_width)


# --------------------------------------------------------------------------------------------------
# A model to train on tiles: convolutions and group norms (chapter 10's domain_train.py)
# --------------------------------------------------------------------------------------------------


class FieldCNN(nn.Module):
    """conv -> GroupNorm -> GELU, twice, then a conv back to the field's channels: predicts the next field."""

    def __init__(self, channels: int = 2, hidden: int = 8, groups: int = 2, kernel_size: int = 3,
                 periodic_width: bool = False):
        super().__init__()
        pad = _padding(kernel_size, periodic_width)
        self.kernel_size, self.periodic_width = kernel_size, periodic_width
        self.convs = nn.ModuleList([nn.Conv2d(channels, hidden, kernel_size, padding=pad),
                                    nn.Conv2d(hidden, hidden, kernel_size, padding=pad),
                                    nn.Conv2d(hidden, channels, kernel_size, padding=pad)])
        self.norms = nn.ModuleList([nn.GroupNorm(groups, hidden), nn.GroupNorm(groups, hidden)])

    def _conv(self, conv, x):
        return conv(_wrap_width(x, self.kernel_size // 2) if self.periodic_width else x)

    def forward(self, x):
        for conv, norm in zip(self.convs, self.norms):
            x = F.gelu(norm(self._conv(conv, x)))
        return self._conv(self.convs[-1], x)


def build_field_cnn(seed: int, device="cpu", **sizes) -> FieldCNN:
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = FieldCNN(**sizes).to(device)
    torch.random.set_rng_state(generator_state)
    return model


class SummedOverGroup(torch.autograd.Function):
    """An all-reduce (sum) that autograd can go through: every rank's output depends on every rank's input, so
    the gradient of each input is the sum of every rank's output gradient, one all-reduce again. (What the
    deprecated ``torch.distributed.nn.functional.all_reduce`` did, written out.)"""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        summed = tensor.clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad):
        summed = grad.clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


def tile_group_norm(x: torch.Tensor, norm: nn.GroupNorm, group=None, field_cells: int | None = None) -> torch.Tensor:
    """``norm(x)`` for the whole field, computed on one tile: the statistics are summed over the domain group.

    GroupNorm normalises each sample's channel group by the mean and variance over all its cells, the cells of
    every tile. Each tile sums its own cells; one all-reduce over the domain group gives the field's mean, a
    second the variance around it: two passes, where torch's GroupNorm kernel makes one, with Welford's algorithm
    (ATen/native/cpu/moments_utils.h:113, RowwiseMoments); the one-pass E[x^2] - E[x]^2 would cancel badly. The all-reduce is the autograd-aware one, so the backward pass reduces the gradients of the
    statistics too. ``group=None``: no reduction, each tile normalised on its own (wrong; the script shows by
    how much).
    """
    batch, channels = x.shape[:2]
    grouped = x.reshape(batch, norm.num_groups, -1)
    # the cells a statistic averages: the whole field's (``field_cells``: height x width, since tiles may differ in
    # size), or, without it, the tile's times the ranks (equal tiles)
    per_cell = channels // norm.num_groups
    if group is None:
        count = grouped.shape[-1]
    elif field_cells is not None:
        count = per_cell * field_cells
    else:
        count = grouped.shape[-1] * dist.get_world_size(group)

    def field_sum(t):
        return SummedOverGroup.apply(t, group) if group is not None else t

    mean = field_sum(grouped.sum(-1)) / count
    centred = grouped - mean[..., None]
    variance = field_sum((centred * centred).sum(-1)) / count
    normalised = (centred / torch.sqrt(variance[..., None] + norm.eps)).reshape_as(x)
    return normalised * norm.weight[None, :, None, None] + norm.bias[None, :, None, None]


def tile_field_cnn(model: FieldCNN, tile: torch.Tensor, grid: TileGrid, rank: int, group=None,
                   reduce_statistics: bool = True) -> torch.Tensor:
    """``model``'s output on this rank's tile: a halo of ``k // 2`` before each convolution. (The simple form:
    the norms between the convolutions would also allow one halo for the whole stack, their statistics summed over
    the tile's own cells only, the halo ring being copies of the neighbours' cells.)"""
    x = tile
    for i, conv in enumerate(model.convs):
        x = F.conv2d(halo_exchange(x, grid, rank, conv.kernel_size[0] // 2, group), conv.weight, conv.bias)
        if i < len(model.norms):
            x = F.gelu(tile_group_norm(x, model.norms[i], group if reduce_statistics else None,
                                       field_cells=grid.height * grid.width))
    return x


def field_batch(step: int, batch: int, channels: int, height: int, width: int, seed: int = 0):
    """(inputs, targets): smooth random fields and the same fields one time step later.

    Each field is a sum of a few waves; the target moves it one cell east and smooths it a little (advection
    and diffusion, the two things a weather model's step does). Deterministic in (seed, step): every rank and
    the one-device reference draw the same global batch.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    y = torch.linspace(0, 2 * math.pi, height)[:, None]
    x = torch.linspace(0, 2 * math.pi, width)[None, :]
    waves = torch.randint(1, 4, (batch, channels, 3, 2), generator=g).float()
    phase = torch.rand(batch, channels, 3, generator=g) * 2 * math.pi
    amplitude = torch.randn(batch, channels, 3, generator=g)
    fields = sum(amplitude[..., k, None, None] * torch.sin(waves[..., k, 0, None, None] * y
                                                           + waves[..., k, 1, None, None] * x
                                                           + phase[..., k, None, None]) for k in range(3))
    moved = torch.roll(fields, shifts=1, dims=-1)
    smoothed = (moved + 0.25 * (torch.roll(moved, 1, -2) + torch.roll(moved, -1, -2))) / 1.5
    return fields, smoothed


def surface_to_volume_rows(height: int, width: int, rank_counts, radius: int) -> list[dict]:
    """For each rank count and split: the tile, and halo cells per tile cell (communication over computation)."""
    rows = []
    for ranks in rank_counts:
        for split in ("h", "hw"):
            grid = TileGrid(*grid_shape(split, ranks), height, width)
            if tile_problems(grid, radius):
                continue
            rows.append({"ranks": ranks, "split": split, "grid": (grid.rows, grid.cols),
                         "tile": (grid.tile_height, grid.tile_width),
                         "ratio": halo_to_tile_ratio(grid.tile_height, grid.tile_width, radius, split)})
    return rows
