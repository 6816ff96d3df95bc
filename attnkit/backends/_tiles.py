"""Tile grids from a mask's structure, shared by the fused backends (``flex``, ``native``).

:func:`tile_grid` gives the :class:`~attnkit.masks.BlockStatus` of every (query tile × key tile)
of a call as one ``uint8`` tensor (0 EMPTY, 1 PARTIAL, 2 FULL), the AND of its conjuncts' grids.
Positional conjuncts (``Causal``, ``SlidingWindow``, ``KeyPadding``, ``Padding``, ``Document``)
are answered with a few tensor operations on the tile bounds, with no per-element evaluation;
any other conjunct is asked tile by tile through its own ``block_status``.

:func:`empty_batch` is the result of a call with an empty batch, for the backends whose
reshapes cannot run on zero elements.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..masks import BlockStatus, Causal, Document, KeyPadding, Mask, Padding, SlidingWindow

EMPTY, PARTIAL, FULL = BlockStatus.EMPTY.value, BlockStatus.PARTIAL.value, BlockStatus.FULL.value


def _bounds(offset: int, length: int, block: int) -> tuple[Tensor, Tensor]:
    """First and last absolute position of each tile (int64 tensors of ``ceil(length / block)``)."""
    start = torch.arange(0, length, block, dtype=torch.long) + offset
    return start, torch.clamp(start + block, max=offset + length) - 1


def _status(full: Tensor, empty: Tensor) -> Tensor:
    return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.uint8)


def _band_grid(left, right, q: tuple[Tensor, Tensor], k: tuple[Tensor, Tensor]) -> Tensor:
    """``-left <= pos(k) - pos(q) <= right`` per tile (``None`` = unbounded)."""
    dmin = k[0][None, :] - q[1][:, None]  # smallest pos(k) - pos(q) in the tile
    dmax = k[1][None, :] - q[0][:, None]
    full = torch.ones_like(dmin, dtype=torch.bool)
    empty = torch.zeros_like(dmin, dtype=torch.bool)
    if left is not None:
        full &= dmin >= -left
        empty |= dmax < -left
    if right is not None:
        full &= dmax <= right
        empty |= dmin > right
    return _status(full, empty)


def _per_tile(values: Tensor, start: int, length: int, block: int, fill) -> Tensor:
    """``values[:, start:start+length]`` as ``(rows, tiles, block)``, the ragged end padded with ``fill``."""
    tiles = -(-length // block)
    # One filled buffer, no branch on the padding: a traced length (torch.compile, dynamic shapes)
    # then needs no guard on it (a 0- or 1-wide padding piece would specialize the graph).
    out = values.new_full((values.shape[0], tiles * block), fill)
    out[:, :length] = values[:, start : start + length]
    return out.view(values.shape[0], tiles, block)


def _key_grid(valid: Tensor, nq: int, kv_offset: int, Tk: int, block_k: int) -> Tensor:
    """Grid of a query-independent mask given as ``valid (B, positions)`` bool over key positions."""
    tiles = _per_tile(valid, kv_offset, Tk, block_k, True)  # padding: neither empties nor breaks FULL
    real = _per_tile(torch.ones_like(valid), kv_offset, Tk, block_k, False)
    full = tiles.all(-1).all(0)
    empty = ~((tiles & real).any(-1).any(0))
    return _status(full, empty)[None, :].expand(nq, -1)


def _document_grid(ids: Tensor, q_offset, Tq, block_q, kv_offset, Tk, block_k) -> Tensor:
    """FULL where every query and key of the tile share one id, EMPTY where the tile's query id
    range and key id range are disjoint (in every batch row)."""
    big = torch.iinfo(torch.long)
    qt = _per_tile(ids, q_offset, Tq, block_q, big.max)
    qmin = qt.amin(-1)
    qmax = _per_tile(ids, q_offset, Tq, block_q, big.min).amax(-1)  # (B, nQ)
    kmin = _per_tile(ids, kv_offset, Tk, block_k, big.max).amin(-1)
    kmax = _per_tile(ids, kv_offset, Tk, block_k, big.min).amax(-1)  # (B, nK)
    full = ((qmin == qmax)[:, :, None] & (kmin == kmax)[:, None, :] & (qmin[:, :, None] == kmin[:, None, :])).all(0)
    empty = ((qmax[:, :, None] < kmin[:, None, :]) | (kmax[:, None, :] < qmin[:, :, None])).all(0)
    return _status(full, empty)


def _conjunct_grid(part: Mask, q_offset, Tq, block_q, kv_offset, Tk, block_k, batch_size=None, num_heads=None) -> Tensor:
    if isinstance(part, (Causal, SlidingWindow)):
        band = part.band()
        return _band_grid(band.left, band.right, _bounds(q_offset, Tq, block_q), _bounds(kv_offset, Tk, block_k))
    nq = -(-Tq // block_q)
    if isinstance(part, KeyPadding):
        positions = torch.arange(kv_offset + Tk)
        return _key_grid(positions[None, :] < part.lengths[:, None], nq, kv_offset, Tk, block_k)
    if isinstance(part, Padding):
        return _key_grid(part.valid.cpu(), nq, kv_offset, Tk, block_k)
    if isinstance(part, Document) and q_offset >= 0:
        return _document_grid(part.ids.cpu(), q_offset, Tq, block_q, kv_offset, Tk, block_k)
    grid = torch.empty(nq, -(-Tk // block_k), dtype=torch.uint8)
    for i, q0 in enumerate(range(0, Tq, block_q)):
        qr = (q_offset + q0, q_offset + min(q0 + block_q, Tq))
        for j, k0 in enumerate(range(0, Tk, block_k)):
            kr = (kv_offset + k0, kv_offset + min(k0 + block_k, Tk))
            grid[i, j] = part.block_status(qr, kr, q_offset=q_offset, kv_offset=kv_offset, batch_size=batch_size,
                                           num_heads=num_heads).value
    return grid


def tile_grid(mask: Mask | None, Tq: int, Tk: int, q_offset: int, kv_offset: int, block_q: int, block_k: int,
              batch_size: int | None = None, num_heads: int | None = None) -> Tensor:
    """``(ceil(Tq / block_q), ceil(Tk / block_k))`` uint8 on the CPU: the status of each tile over
    every batch and head (EMPTY < PARTIAL < FULL, so the AND of conjuncts is the elementwise min)."""
    shape = (-(-Tq // block_q), -(-Tk // block_k))
    if mask is None:
        return torch.full(shape, FULL, dtype=torch.uint8)
    grid = None
    for part in mask.conjuncts():
        g = _conjunct_grid(part, q_offset, Tq, block_q, kv_offset, Tk, block_k, batch_size, num_heads)
        grid = g if grid is None else torch.minimum(grid, g)
    return grid.contiguous()


def empty_batch(inp) -> Tensor | tuple[Tensor, Tensor]:
    """The result of a call with ``B = 0`` (nothing to compute): ``out (0, Hq, Tq, Dv)``, and the LSE
    with ``return_lse``, in the autograd graph of q, k and v (their gradients are empty too). For
    backends whose reshapes cannot infer a dimension from zero elements."""
    connect = (inp.q.sum() + inp.k.sum() + inp.v.sum()) * 0  # a sum over nothing: 0
    out = inp.q.new_zeros(0, inp.Hq, inp.Tq, inp.Dv) + connect.to(inp.dtype)
    if not inp.return_lse:
        return out
    return out, torch.zeros(0, inp.Hq, inp.Tq, dtype=torch.promote_types(inp.dtype, torch.float32), device=inp.device)
