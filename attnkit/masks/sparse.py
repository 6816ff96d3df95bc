"""Structured sparsity: ``BlockSparse`` layouts with seeded pattern builders, and ``GlobalTokens``.

``BlockSparse(layout, block_size)`` keeps query position ``i`` and key position ``j`` (absolute)
when ``layout[h, i // block_size, j // block_size]`` is True. Builders (all classmethods, seeded
where random, ``causal=True`` returns ``BlockSparse(...) & Causal()``):

* ``BlockSparse.window_global`` — window of blocks + global blocks (Longformer's pattern at block
  granularity, Beltagy et al. 2020)
* ``BlockSparse.bigbird``     — window + global + random blocks (Zaheer et al. 2020)
* ``BlockSparse.fixed`` / ``BlockSparse.strided`` — Sparse Transformer (Child et al. 2019)
* ``BlockSparse.random``      — each block on with a given probability

``to_string(blocks=True)`` draws one character per block, ``density()`` is the kept fraction. For
exact element-level Longformer use :func:`longformer` = ``SlidingWindow(w, w) | GlobalTokens(ids)``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .._validate import finite_float, non_negative_int, positive_int
from .base import Mask
from .structure import BlockStatus, _as_long_tensor
from .export import EMPTY, PARTIAL, box_counts, status
from .positional import Causal, SlidingWindow

__all__ = ["BlockSparse", "GlobalTokens", "longformer"]


@dataclass(frozen=True, eq=False)
class BlockSparse(Mask):
    """Block-level mask: ``layout`` is bool ``(nQB, nKB)`` or ``(H, nQB, nKB)``; block ``(r, c)``
    covers absolute query positions ``r*bs .. r*bs+bs-1`` and keys ``c*bs .. c*bs+bs-1``.
    ``block_status`` answers in O(1) from summed-area tables of the layout."""

    layout: Tensor
    block_size: int
    _any: Tensor = field(init=False, repr=False)  # summed-area table of layout.any(heads)
    _all: Tensor = field(init=False, repr=False)  # summed-area table of layout.all(heads)
    _tables: tuple[Tensor, Tensor] = field(init=False, repr=False)  # both as tensors, for tile_grid

    def __post_init__(self):
        layout = self.layout
        if not isinstance(layout, Tensor) or layout.dtype != torch.bool:
            raise TypeError(
                f"BlockSparse(layout): expected a torch.bool tensor (nQB, nKB) or (H, nQB, nKB), got "
                f"{getattr(layout, 'dtype', type(layout).__name__)}. Fix: pass layout.bool()."
            )
        if layout.dim() not in (2, 3) or layout.numel() == 0:
            raise ValueError(
                f"BlockSparse(layout): expected shape (nQB, nKB) or (H, nQB, nKB), got {tuple(layout.shape)}."
            )
        positive_int(self.block_size, "block_size", owner="BlockSparse", fix="pass e.g. block_size=64")
        layout = layout.reshape((1,) * (3 - layout.dim()) + tuple(layout.shape)).cpu()
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "num_heads", layout.shape[0])
        tables = (_summed_area_tensor(layout.any(0)), _summed_area_tensor(layout.all(0)))
        object.__setattr__(self, "_tables", tables)
        object.__setattr__(self, "_any", tables[0].tolist())  # plain lists: O(1) Python lookups in block_status
        object.__setattr__(self, "_all", tables[1].tolist())

    # -- Mask interface ---------------------------------------------------------------------
    def block_layout(self):
        return self

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        layout = self.layout.to(q_idx.device)
        h = h.clamp(max=layout.shape[0] - 1)
        # Queries before position 0 (Tq > Tk, bottom-right aligned) are in no block: nothing kept.
        rows = (q_idx // self.block_size).clamp(min=0)
        return layout[h, rows, kv_idx // self.block_size] & (q_idx >= 0)

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0, batch_size=None, num_heads=None):
        bs = self.block_size
        r0, r1 = q_range[0] // bs, (q_range[1] - 1) // bs + 1
        c0, c1 = kv_range[0] // bs, (kv_range[1] - 1) // bs + 1
        area = (r1 - r0) * (c1 - c0)
        if q_range[0] < 0:  # queries before position 0 keep nothing
            return BlockStatus.EMPTY if q_range[1] <= 0 or _box(self._any, 0, r1, c0, c1) == 0 else BlockStatus.PARTIAL
        if _box(self._any, r0, r1, c0, c1) == 0:
            return BlockStatus.EMPTY
        return BlockStatus.FULL if _box(self._all, r0, r1, c0, c1) == area else BlockStatus.PARTIAL

    def tile_grid(self, tiles):
        bs = self.block_size
        (qa, qb), (ka, kb) = tiles.q_bounds(), tiles.k_bounds()  # first and last position per tile
        r0, r1 = qa.div(bs, rounding_mode="floor"), qb.div(bs, rounding_mode="floor") + 1
        c0, c1 = ka.div(bs, rounding_mode="floor"), kb.div(bs, rounding_mode="floor") + 1
        any_ = box_counts(self._tables[0], r0, r1, c0, c1)
        all_ = box_counts(self._tables[1], r0, r1, c0, c1)
        grid = status(all_ == (r1 - r0)[:, None] * (c1 - c0)[None, :], any_ == 0)
        before = qa < 0  # query tiles reaching before position 0 keep nothing there: never FULL
        if bool(before.any()):
            from_zero = box_counts(self._tables[0], torch.zeros_like(r1), r1, c0, c1)
            grid[before] = torch.where((qb[before, None] < 0) | (from_zero[before] == 0), EMPTY, PARTIAL).to(grid.dtype)
        return grid

    def export_params(self, params, batch_size):
        if params.layout is not None:
            return params.with_rest(self)
        return replace(params, layout=self.layout, layout_block_size=self.block_size)

    def validate(self, B, H, Tq, Tk, q_offset, kv_offset):
        super().validate(B, H, Tq, Tk, q_offset, kv_offset)
        nQB, nKB = self.layout.shape[1:]
        if kv_offset < 0 or q_offset + Tq > nQB * self.block_size or kv_offset + Tk > nKB * self.block_size:
            raise ValueError(
                f"BlockSparse layout {tuple(self.layout.shape)} with block_size {self.block_size} covers query "
                f"positions 0..{nQB * self.block_size - 1} and keys 0..{nKB * self.block_size - 1}, but the call uses "
                f"queries {q_offset}..{q_offset + Tq - 1} and keys {kv_offset}..{kv_offset + Tk - 1}. "
                "Fix: build the layout with ceil(length / block_size) blocks per side."
            )

    def density(self, Tq: int | None = None, Tk: int | None = None, **kwargs) -> float:
        """Fraction of (query, key) pairs kept; without sizes, over the whole layout (which equals
        the fraction of blocks that are on, averaged over heads)."""
        if Tq is None and Tk is None and not kwargs:
            return float(self.layout.float().mean())
        return super().density(Tq, Tk, **kwargs)

    def to_string(self, Tq: int | None = None, Tk: int | None = None, *, blocks: bool = False, head: int = 0,
                  **kwargs) -> str:
        """Draw the mask like every mask (``Tq``, ``Tk``), or with ``blocks=True`` its layout, one
        character per block: '█' on, '·' off."""
        if blocks:
            return "\n".join("".join("█" if x else "·" for x in row) for row in self.layout[head].tolist())
        if Tq is None or Tk is None:
            raise ValueError(
                f"BlockSparse.to_string(Tq={Tq!r}, Tk={Tk!r}): expected both sizes, or blocks=True to draw the layout."
            )
        return super().to_string(Tq, Tk, head=head, **kwargs)

    def __repr__(self):
        return (f"BlockSparse(layout=<{tuple(self.layout.shape)}>, block_size={self.block_size}, "
                f"density={self.density():.3f})")

    # -- pattern builders -------------------------------------------------------------------
    @classmethod
    def window_global(
        cls, num_blocks: int, block_size: int, *, window: int = 1, global_blocks=(0,), causal: bool = False
    ) -> Mask:
        """Longformer's pattern at block granularity: each block attends ``window`` blocks on either
        side; ``global_blocks`` attend and are attended everywhere. ``num_blocks=6, window=1,
        global_blocks=(0,)``::

            ██████
            ███···
            ████··
            █·███·
            █··███
            █···██
        """
        idx = torch.arange(positive_int(num_blocks, "num_blocks"))
        layout = (idx[:, None] - idx[None, :]).abs() <= non_negative_int(window, "window")
        layout |= _global(num_blocks, global_blocks)
        return cls._finish(layout, block_size, causal)

    @classmethod
    def bigbird(
        cls, num_blocks: int, block_size: int, *, window: int = 1, global_blocks: int = 1, random_blocks: int = 2,
        seed: int = 0, causal: bool = False,
    ) -> Mask:
        """Window of ``window`` blocks per side, the first ``global_blocks`` blocks global, plus
        ``random_blocks`` random key blocks per query block row (``torch.Generator`` seeded by ``seed``)."""
        n = positive_int(num_blocks, "num_blocks")
        idx = torch.arange(n)
        layout = (idx[:, None] - idx[None, :]).abs() <= non_negative_int(window, "window")
        layout |= _global(n, range(min(non_negative_int(global_blocks, "global_blocks"), n)))
        gen = torch.Generator().manual_seed(seed)
        r = min(non_negative_int(random_blocks, "random_blocks"), n)
        for row in range(n):
            layout[row, torch.randperm(n, generator=gen)[:r]] = True
        return cls._finish(layout, block_size, causal)

    @classmethod
    def fixed(cls, num_blocks: int, block_size: int, *, stride: int = 4, summary: int = 1, causal: bool = True) -> Mask:
        """Sparse Transformer "fixed": blocks attend within their segment of ``stride`` blocks and to
        the last ``summary`` blocks of every segment."""
        idx = torch.arange(positive_int(num_blocks, "num_blocks"))
        stride = positive_int(stride, "stride")
        layout = (idx[:, None] // stride) == (idx[None, :] // stride)
        layout |= (idx[None, :] % stride) >= stride - min(positive_int(summary, "summary"), stride)
        return cls._finish(layout, block_size, causal)

    @classmethod
    def strided(cls, num_blocks: int, block_size: int, *, stride: int = 4, causal: bool = True) -> Mask:
        """Sparse Transformer "strided": blocks attend the ``stride`` nearest blocks (a local window)
        and every block at a distance that is a multiple of ``stride``."""
        idx = torch.arange(positive_int(num_blocks, "num_blocks"))
        stride = positive_int(stride, "stride")
        dist = idx[:, None] - idx[None, :]
        layout = (dist.abs() < stride) | (dist % stride == 0)
        return cls._finish(layout, block_size, causal)

    @classmethod
    def random(cls, num_blocks: int, block_size: int, *, density: float = 0.1, seed: int = 0,
               causal: bool = False) -> Mask:
        """Each block on with probability ``density`` (seeded); the diagonal is always on."""
        n = positive_int(num_blocks, "num_blocks")
        finite_float(density, "density", owner="BlockSparse.random", low=0.0, high=1.0,
                     fix="pass a probability such as 0.1")
        gen = torch.Generator().manual_seed(seed)
        layout = (torch.rand(n, n, generator=gen) < density) | torch.eye(n, dtype=torch.bool)
        return cls._finish(layout, block_size, causal)

    @classmethod
    def _finish(cls, layout: Tensor, block_size: int, causal: bool) -> Mask:
        if causal:
            layout = layout & torch.ones_like(layout).tril()
            return cls(layout, block_size) & Causal()
        return cls(layout, block_size)


def _summed_area_tensor(x: Tensor) -> Tensor:
    sat = torch.zeros(x.shape[0] + 1, x.shape[1] + 1, dtype=torch.long)
    sat[1:, 1:] = x.long().cumsum(0).cumsum(1)
    return sat


def _box(sat, r0, r1, c0, c1) -> int:
    r1, c1 = min(r1, len(sat) - 1), min(c1, len(sat[0]) - 1)
    r0, c0 = max(r0, 0), max(c0, 0)
    if r1 <= r0 or c1 <= c0:
        return 0
    return sat[r1][c1] - sat[r0][c1] - sat[r1][c0] + sat[r0][c0]


def _global(n: int, blocks) -> Tensor:
    g = torch.zeros(n, dtype=torch.bool)
    for b in blocks:
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < n:
            raise ValueError(f"global block {b!r}: expected an int in 0..{n - 1}.")
        g[b] = True
    return g[:, None] | g[None, :]


@dataclass(frozen=True, eq=False)
class GlobalTokens(Mask):
    """Global tokens (Longformer): a query at a position in ``positions`` attends every key, and a
    key there is attended by every query. Positions are absolute. Alone it keeps only those rows
    and columns; combine with a window: ``SlidingWindow(w, w) | GlobalTokens([0])``."""

    positions: Tensor
    _sorted: tuple[int, ...] = field(init=False, repr=False)  # for block_status without tensor reads

    def __post_init__(self):
        pos = _as_long_tensor(self.positions, "GlobalTokens(positions)").flatten().unique()
        if pos.numel() and int(pos.min()) < 0:
            raise ValueError(f"GlobalTokens(positions): expected non-negative positions, got {pos.tolist()}.")
        object.__setattr__(self, "positions", pos)
        object.__setattr__(self, "_sorted", tuple(pos.tolist()))

    def global_positions(self) -> Tensor:
        return self.positions

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        pos = self.positions.to(q_idx.device)
        return torch.isin(q_idx, pos) | torch.isin(kv_idx, pos)

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0, batch_size=None, num_heads=None):
        pos = self._sorted
        inside = lambda r: bisect.bisect_left(pos, r[0]) < bisect.bisect_left(pos, r[1])  # noqa: E731  any in [r0, r1)
        if inside(q_range) and q_range[1] - q_range[0] == 1 or inside(kv_range) and kv_range[1] - kv_range[0] == 1:
            return BlockStatus.FULL
        return BlockStatus.PARTIAL if inside(q_range) or inside(kv_range) else BlockStatus.EMPTY

    def tile_grid(self, tiles):
        (qa, qb), (ka, kb) = tiles.q_bounds(), tiles.k_bounds()
        pos = self.positions.cpu()
        q_in = torch.searchsorted(pos, qb + 1) > torch.searchsorted(pos, qa)  # a global query in the tile
        k_in = torch.searchsorted(pos, kb + 1) > torch.searchsorted(pos, ka)
        full = (q_in & (qa == qb))[:, None] | (k_in & (ka == kb))[None, :]  # a whole row or column is global
        return status(full, ~(q_in[:, None] | k_in[None, :]))

    def __repr__(self):
        return f"GlobalTokens({self.positions.tolist()})"


def longformer(window: int, global_positions, *, causal: bool = False) -> Mask:
    """Element-level Longformer (Beltagy et al. 2020): a sliding window plus global tokens.

    ``SlidingWindow(window, window) | GlobalTokens(global_positions)``; with ``causal=True``,
    ``(SlidingWindow(window, 0) | GlobalTokens(global_positions)) & Causal()``: no query sees a
    later key, global ones included (a global query sees every earlier key)."""
    window = non_negative_int(window, "window", owner="longformer", fix="pass the window width, e.g. 256")
    mask = SlidingWindow(window, 0 if causal else window) | GlobalTokens(global_positions)
    return mask & Causal() if causal else mask
