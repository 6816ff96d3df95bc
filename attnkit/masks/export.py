"""Masks as data a kernel reads: a vectorized tile grid and the positional parameters.

:func:`tile_grid` gives the :class:`~attnkit.masks.BlockStatus` of every (query tile × key tile) of
a call as one ``uint8`` tensor (0 EMPTY, 1 PARTIAL, 2 FULL). Each mask class computes its own grid
with a few tensor operations (:meth:`Mask.tile_grid`, over a :class:`Tiles`): a band from two
bound vectors, key lengths and validity per key tile, document ids per tile range, a block layout
through its summed-area table; ``And`` is the elementwise min of its parts' grids and ``Or`` the
max (EMPTY < PARTIAL < FULL). A mask with no structure (``Dense``, ``Custom``) is evaluated one
strip of query tiles at a time and reduced per tile. With ``spare=True`` the grid has one more
(EMPTY) tile row and column at the end, so no tensor of the export has a dimension that is 1 for
short calls only: traced with dynamic shapes, a length crossing one tile then needs no new graph
(a kernel reads the grid's row stride from the grid itself).

:func:`mask_params` gives one :class:`MaskParams`: the conjuncts' positional parameters (band
bounds, key lengths, key validity, document ids, a block layout, per-query key lists), which a kernel evaluates per
element from a few integers or index vectors, and the conjuncts it cannot describe that way
(``rest``, evaluated by ``mask_mod``). Each class contributes its own fields
(:meth:`Mask.export_params`); nothing outside ``masks/`` asks which class a mask is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .structure import UNBOUNDED, Band, BlockStatus

if TYPE_CHECKING:
    from .base import Mask

__all__ = ["Tiles", "MaskParams", "tile_grid", "mask_params", "value_keyed", "EMPTY", "PARTIAL", "FULL"]

EMPTY, PARTIAL, FULL = BlockStatus.EMPTY.value, BlockStatus.PARTIAL.value, BlockStatus.FULL.value

#: Elements evaluated at once by the strip fallback (bounds its temporary memory to ~64 MiB of bools).
_STRIP_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Tiles:
    """A call's tiling: queries at absolute positions ``q_offset .. q_offset+Tq-1`` in tiles of
    ``block_q``, keys likewise, for a call with ``batch_size`` rows and ``num_heads`` query heads.
    ``spare``: one more tile past the last, in :attr:`shape` and every per-tile vector (its bounds
    lie past the call's end; :func:`tile_grid` marks it EMPTY)."""

    Tq: int
    Tk: int
    q_offset: int
    kv_offset: int
    block_q: int
    block_k: int
    batch_size: int | None = None
    num_heads: int | None = None
    spare: bool = False

    @property
    def counts(self) -> tuple[int, int]:
        """The call's tiles ``(nQ, nK)``, the spare one not counted."""
        return -(-self.Tq // self.block_q), -(-self.Tk // self.block_k)

    @property
    def shape(self) -> tuple[int, int]:
        """The grid's shape: :attr:`counts`, plus the spare tile row and column."""
        nQ, nK = self.counts
        return nQ + self.spare, nK + self.spare

    def q_bounds(self) -> tuple[Tensor, Tensor]:
        """First and last absolute query position of each query tile (int64, ``shape[0]`` each)."""
        return _bounds(self.q_offset, self.Tq, self.block_q, self.shape[0])

    def k_bounds(self) -> tuple[Tensor, Tensor]:
        return _bounds(self.kv_offset, self.Tk, self.block_k, self.shape[1])

    def per_q_tile(self, values: Tensor, fill) -> Tensor:
        """``values (rows, positions)`` at the call's query positions as ``(rows, shape[0], block_q)``."""
        return _per_tile(values, self.q_offset, self.Tq, self.block_q, fill, self.shape[0])

    def per_k_tile(self, values: Tensor, fill) -> Tensor:
        return _per_tile(values, self.kv_offset, self.Tk, self.block_k, fill, self.shape[1])


# Both take the tile count from Tiles.shape: one expression of the lengths for every per-tile tensor,
# so a tracer sees equal sizes as equal (no guard relating two spellings of one count).
def _bounds(offset: int, length: int, block: int, tiles: int) -> tuple[Tensor, Tensor]:
    start = torch.arange(tiles, dtype=torch.long) * block + offset
    return start, torch.clamp(start + block, max=offset + length) - 1


def _per_tile(values: Tensor, start: int, length: int, block: int, fill, tiles: int) -> Tensor:
    """``values[:, start:start+length]`` as ``(rows, tiles, block)``, the ragged end (and a spare
    tile) filled with ``fill``."""
    # One filled buffer, no branch on the padding: a traced length (torch.compile, dynamic shapes)
    # then needs no guard on it (a 0- or 1-wide padding piece would specialize the graph).
    out = values.new_full((values.shape[0], tiles * block), fill)
    out[:, :length] = values[:, start : start + length]
    return out.view(values.shape[0], tiles, block)


def status(full: Tensor, empty: Tensor) -> Tensor:
    """The uint8 grid from two bool grids (EMPTY wins over FULL)."""
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.uint8)


def band_grid(band: Band, tiles: Tiles) -> Tensor:
    """``-left <= pos(k) - pos(q) <= right`` per tile (``None`` = unbounded)."""
    q, k = tiles.q_bounds(), tiles.k_bounds()
    dmin = k[0][None, :] - q[1][:, None]  # smallest pos(k) - pos(q) in the tile
    dmax = k[1][None, :] - q[0][:, None]
    full = torch.ones_like(dmin, dtype=torch.bool)
    empty = torch.zeros_like(dmin, dtype=torch.bool)
    if band.left is not None:
        full &= dmin >= -band.left
        empty |= dmax < -band.left
    if band.right is not None:
        full &= dmax <= band.right
        empty |= dmin > band.right
    return status(full, empty)


def key_grid(valid: Tensor, tiles: Tiles) -> Tensor:
    """Grid of a query-independent mask given as ``valid (B, positions)`` bool over key positions."""
    kept = tiles.per_k_tile(valid, True)  # padding: neither empties nor breaks FULL
    real = tiles.per_k_tile(torch.ones_like(valid), False)
    full = kept.all(-1).all(0)
    empty = ~((kept & real).any(-1).any(0))
    return status(full, empty)[None, :].expand(tiles.shape[0], -1)


def document_grid(ids: Tensor, tiles: Tiles) -> Tensor:
    """FULL where every query and key of the tile share one id, EMPTY where the tile's query id
    range and key id range are disjoint (in every batch row)."""
    big = torch.iinfo(torch.long)
    qmin = tiles.per_q_tile(ids, big.max).amin(-1)
    qmax = tiles.per_q_tile(ids, big.min).amax(-1)  # (B, nQ)
    kmin = tiles.per_k_tile(ids, big.max).amin(-1)
    kmax = tiles.per_k_tile(ids, big.min).amax(-1)  # (B, nK)
    full = ((qmin == qmax)[:, :, None] & (kmin == kmax)[:, None, :] & (qmin[:, :, None] == kmin[:, None, :])).all(0)
    empty = ((qmax[:, :, None] < kmin[:, None, :]) | (kmax[:, None, :] < qmin[:, :, None])).all(0)
    return status(full, empty)


def box_counts(sat: Tensor, r0: Tensor, r1: Tensor, c0: Tensor, c1: Tensor) -> Tensor:
    """Kept cells of ``[r0, r1) x [c0, c1)`` per (row range, column range) pair from a summed-area
    table ``sat (R+1, C+1)``: ``(len(r0), len(c0))`` int64, ranges clipped to the table."""
    R, C = sat.shape[0] - 1, sat.shape[1] - 1
    r0, r1 = r0.clamp(0, R), r1.clamp(0, R)
    c0, c1 = c0.clamp(0, C), c1.clamp(0, C)
    r1, c1 = torch.maximum(r1, r0), torch.maximum(c1, c0)
    r0, r1, c0, c1 = r0[:, None], r1[:, None], c0[None, :], c1[None, :]  # gather only the (nQ, nK) needed
    return sat[r1, c1] - sat[r0, c1] - sat[r1, c0] + sat[r0, c0]


def evaluated_grid(mask: Mask, tiles: Tiles) -> Tensor:
    """The grid of any mask by evaluation: strips of whole query tiles against every key, reduced
    per tile (one ``evaluate`` per strip, never per tile). Traced by ``torch.compile``, one strip of
    every tile (a loop over a traced tile count would be unrolled, the graph specialized per count)."""
    rows, cols = tiles.shape
    if torch.compiler.is_compiling():  # the spare tile, if any, is padding alone: EMPTY
        return _strip_grid(mask, tiles, 0, rows, cols)
    nQ, nK = tiles.counts
    nb, nh = mask.index_sizes(tiles.batch_size, tiles.num_heads)
    rows_per_strip = max(1, _STRIP_ELEMENTS // max(1, nb * nh * tiles.block_q * nK * tiles.block_k))
    out = torch.full(tiles.shape, EMPTY, dtype=torch.uint8)  # the spare tile (if any) stays EMPTY
    for r0 in range(0, nQ, rows_per_strip):
        r1 = min(r0 + rows_per_strip, nQ)
        out[r0:r1, :nK] = _strip_grid(mask, tiles, r0, r1, nK)
    return out


def _strip_grid(mask: Mask, tiles: Tiles, r0: int, r1: int, cols: int) -> Tensor:
    """The statuses of query tiles ``r0 .. r1-1`` by key tiles ``0 .. cols-1``; tiles past the call's
    end are padding (EMPTY)."""
    bq, bk, Tq, Tk = tiles.block_q, tiles.block_k, tiles.Tq, tiles.Tk
    q0, q1 = r0 * bq, torch.sym_min(r1 * bq, Tq)
    keep = mask.evaluate((tiles.q_offset + q0, tiles.q_offset + q1), (tiles.kv_offset, tiles.kv_offset + Tk),
                         q_offset=tiles.q_offset, kv_offset=tiles.kv_offset, batch_size=tiles.batch_size,
                         num_heads=tiles.num_heads).cpu()
    keep = keep.reshape(-1, q1 - q0, Tk)  # (B*H, n, Tk)
    pad = (0, cols * bk - Tk, 0, (r1 - r0) * bq - (q1 - q0))
    kept = torch.nn.functional.pad(keep, pad, value=True)  # padding: never breaks FULL
    seen = torch.nn.functional.pad(keep, pad, value=False)  # nor makes a tile non-EMPTY
    shape = (keep.shape[0], r1 - r0, bq, cols, bk)
    return status(kept.view(shape).all(4).all(2).all(0), ~seen.view(shape).any(4).any(2).any(0))


def tile_grid(mask: Mask | None, Tq: int, Tk: int, q_offset: int, kv_offset: int, block_q: int, block_k: int,
              batch_size: int | None = None, num_heads: int | None = None, *, spare: bool = False) -> Tensor:
    """``(ceil(Tq / block_q), ceil(Tk / block_k))`` uint8 on the CPU, contiguous: the status of
    each tile over every batch row and head (``FULL`` everywhere without a mask). ``spare=True``
    adds one EMPTY tile row and column at the end (see the module's docstring)."""
    tiles = Tiles(Tq, Tk, q_offset, kv_offset, block_q, block_k, batch_size, num_heads, spare)
    grid = torch.full(tiles.shape, FULL, dtype=torch.uint8) if mask is None else mask.tile_grid(tiles)
    if spare:  # out of place, no branch on the counts: the spare tile is EMPTY whatever a class computed
        (nQ, nK), (rows, cols) = tiles.counts, tiles.shape
        real = (torch.arange(rows) < nQ)[:, None] & (torch.arange(cols) < nK)[None, :]
        grid = torch.where(real, grid, EMPTY).to(torch.uint8)
    return grid.contiguous()


@dataclass(frozen=True, eq=False)
class MaskParams:
    """A mask's positional parameters, the intersection of its conjuncts' (None: no such part):

    * ``band``: ``-left <= pos(k) - pos(q) <= right`` (``Causal``, ``SlidingWindow``);
    * ``lengths (B,)`` int64: ``pos(k) < lengths[b]`` (``KeyPadding``);
    * ``valid (B|1, P)`` bool: ``valid[b, pos(k)]`` (``Padding``);
    * ``doc (B|1, P)`` int64: ``doc[b, pos(q)] == doc[b, pos(k)]`` (``Document``, the first one);
    * ``layout (H|1, nQB, nKB)`` bool with ``layout_block_size`` (``BlockSparse``, the first one);
    * ``topk (B|1, H|1, Tq, k)`` int64: the call's ``i``-th query keeps the absolute key positions
      listed in ``topk[b, h, i]`` (``TopK``, the first one; sorted: the ``-1`` padding first, then each key once).
      ``TopK`` is in ``rest`` as well, so a kernel that does not read the lists still applies them;
    * ``rest``: every other conjunct (and any second ``Document``/``BlockSparse``), as masks;
    * ``beyond_band``: every conjunct the band does not describe alone (for a kernel that takes
      the band as integers and calls ``mask_mod`` for the rest).

    All tensors on the CPU."""

    band: Band = field(default_factory=lambda: UNBOUNDED)
    lengths: Tensor | None = None
    valid: Tensor | None = None
    doc: Tensor | None = None
    layout: Tensor | None = None
    layout_block_size: int = 1
    topk: Tensor | None = None
    rest: tuple[Mask, ...] = field(default=())
    beyond_band: tuple[Mask, ...] = field(default=())

    def with_band(self, band: Band) -> MaskParams:
        return replace(self, band=self.band & band)

    def with_lengths(self, lengths: Tensor) -> MaskParams:
        return replace(self, lengths=lengths if self.lengths is None else torch.minimum(self.lengths, lengths))

    def with_valid(self, valid: Tensor) -> MaskParams:
        return replace(self, valid=valid if self.valid is None else self.valid & valid)

    def with_rest(self, part: Mask) -> MaskParams:
        return replace(self, rest=self.rest + (part,))


_VALUE_HASHED: dict = {}  # mask type -> whether it hashes by value


def value_keyed(mask: Mask) -> bool:
    """True when every leaf of ``mask`` compares and hashes by value (``Causal``, ``SlidingWindow``),
    so a cache keyed on it holds no tensor alive and equal masks share entries; masks that hold
    tensors (padding lengths, layouts, dense bools) hash by identity."""
    for leaf in mask.leaves():
        kind = type(leaf)
        known = _VALUE_HASHED.get(kind)
        if known is None:
            known = _VALUE_HASHED[kind] = kind.__hash__ is not object.__hash__
        if not known:
            return False
    return True


_PARAMS: dict = {}  # (mask, batch size) -> MaskParams, for value-keyed masks whose parameters hold no tensor
_PARAMS_SIZE = 256
_NO_PARAMS = MaskParams()


def mask_params(mask: Mask | None, batch_size: int) -> MaskParams:
    """The :class:`MaskParams` of ``mask`` for a call with ``batch_size`` rows. Computed once per
    batch size for a mask that compares by value and exports no tensor (``Causal``,
    ``SlidingWindow`` and their conjunctions: decoding asks per layer per token); the result is
    immutable and shared."""
    if torch.compiler.is_compiling():  # traced: no global cache (a traced store could not be replayed)
        return MaskParams() if mask is None else _mask_params(mask, batch_size)
    if mask is None:
        return _NO_PARAMS
    keyed = value_keyed(mask)
    if keyed:
        found = _PARAMS.get((mask, batch_size))
        if found is not None:
            return found
    params = _mask_params(mask, batch_size)
    if keyed and params.lengths is None and params.valid is None and params.doc is None and params.layout is None:
        if len(_PARAMS) >= _PARAMS_SIZE:
            _PARAMS.clear()
        _PARAMS[(mask, batch_size)] = params
    return params


def _mask_params(mask: Mask, batch_size: int) -> MaskParams:
    params, beyond = MaskParams(), []
    for part in mask.conjuncts():
        params = part.export_params(params, batch_size)
        alone = part.export_params(MaskParams(), batch_size)
        if (alone.rest or alone.lengths is not None or alone.valid is not None or alone.doc is not None
                or alone.layout is not None or alone.band == UNBOUNDED):
            beyond.append(part)
    return replace(params, beyond_band=tuple(beyond))
