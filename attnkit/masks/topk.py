"""Top-k sparse attention as a mask: each query lists the keys it attends (DeepSeek Sparse Attention).

``TopK(indices)`` keeps the pair (query ``i`` of the call, key at absolute position ``p``) when
``p`` is one of ``indices[b, h, i, :]``. ``indices`` is an integer tensor ``(B|1, H|1, Tq, k)``:

* row ``i`` is the call's ``i``-th query (like ``Dense``, relative to the call);
* the values are **absolute key positions** (``kv_offset + j`` for the call's ``j``-th key; with
  ``kv_offset = 0``, the usual case, simply key indices), so lists made over a whole cache stay
  right;
* ``-1`` pads a list that holds fewer than ``k`` keys; a row of ``-1`` keeps nothing (its output is 0);
* the order within a list does not matter and a key listed twice counts once: the mask is the
  *set* of listed keys (``softmax`` over a duplicated key would otherwise weigh it twice);
* the head dimension is 1 (one list per query shared by every head, DeepSeek-V3.2's indexer) or
  ``Hq`` (one list per query head).

Combine it with other masks by intersection: ``TopK(idx) & Causal()`` keeps the listed keys that
are not in the future (an indexer that pads its lists with future positions needs nothing else).
With ``Tq = 3``, ``Tk = 5`` and lists ``[[4, 0], [1, -1], [3, 3]]``, ``TopK`` alone and
``& Causal()`` keep::

    █···█        █····
    ·█···        ·█···
    ···█·        ···█·

Every backend that takes a dense mask computes it (its evaluation scatters the lists into the keep
tensor, the naive twin); the ``topk`` backend gathers the ``k`` listed keys per query instead, in
O(Tq·k·D) time and memory, forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .base import Mask
from .export import EMPTY, FULL, PARTIAL, evaluated_grid

__all__ = ["TopK"]


@dataclass(frozen=True, eq=False)
class TopK(Mask):
    """Per-query key lists: ``indices (B|1, H|1, Tq, k)`` integer, absolute key positions, ``-1``
    padded, unsorted and with duplicates allowed (a set: see the module docstring)."""

    indices: Tensor
    _low: int = field(init=False, repr=False)  # smallest listed position (-1 padding excluded), or None
    _high: int = field(init=False, repr=False)  # largest listed position, or -1 when nothing is listed

    def __post_init__(self):
        idx = self.indices
        if not isinstance(idx, Tensor):
            raise TypeError(f"TopK(indices): expected an integer tensor (B|1, H|1, Tq, k), got {type(idx).__name__}. "
                            "Fix: pass the indexer's top-k indices as a tensor, e.g. TopK(scores.topk(k).indices).")
        if idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex():
            raise TypeError(f"TopK(indices): expected an integer dtype (int32 or int64), got {idx.dtype}. "
                            "Fix: pass indices.long() of integral key positions.")
        if idx.dim() != 4:
            hint = " Fix: add the head dimension, TopK(indices[:, None])." if idx.dim() == 3 else ""
            raise ValueError(f"TopK(indices): expected shape (B|1, H|1, Tq, k), got {tuple(idx.shape)}.{hint}")
        idx = idx.long()
        object.__setattr__(self, "indices", idx)
        object.__setattr__(self, "batch_size", idx.shape[0])
        object.__setattr__(self, "num_heads", idx.shape[1])
        if torch.compiler.is_compiling() or idx.numel() == 0:
            object.__setattr__(self, "_low", None)
            object.__setattr__(self, "_high", -1)
            return
        low = int(idx.min())
        if low < -1:
            raise ValueError(f"TopK(indices): expected key positions >= 0 or -1 (padding), got {low}. "
                             "Fix: pad short lists with -1; positions count from the first key (0).")
        listed = idx[idx >= 0]
        object.__setattr__(self, "_low", int(listed.min()) if listed.numel() else None)
        object.__setattr__(self, "_high", int(idx.max()))

    # -- structure ----------------------------------------------------------------------------
    def topk(self) -> TopK:
        return self

    @property
    def k(self) -> int:
        """The list length (padding included)."""
        return self.indices.shape[-1]

    def lists(self, device: torch.device | str | None = None) -> Tensor:
        """The lists ``(B|1, H|1, Tq, k)`` int64, each sorted ascending with every repeat of a key
        replaced by ``-1``: the padding first, then each listed key once. Computed once per device
        and kept on the mask (masks are immutable values)."""
        device = self.indices.device if device is None else torch.device(device)
        cached = self.__dict__.get("_lists")
        if cached is not None and cached.device == device:
            return cached
        srt = self.indices.to(device).sort(dim=-1).values
        dup = torch.zeros_like(srt, dtype=torch.bool)
        dup[..., 1:] = srt[..., 1:] == srt[..., :-1]
        out = srt.masked_fill(dup, -1).sort(dim=-1).values
        if not torch.compiler.is_compiling():
            object.__setattr__(self, "_lists", out)
        return out

    # -- evaluation ---------------------------------------------------------------------------
    def _scatter(self, rows: tuple[int, int], keys: tuple[int, int], device) -> Tensor:
        """Keep ``(B|1, H|1, rows, keys)`` for call rows ``rows[0]..rows[1]-1`` and absolute key
        positions ``keys[0]..keys[1]-1`` (rows outside the lists keep nothing)."""
        (r0, r1), (k0, k1) = rows, keys
        B, H, Tq, _ = self.indices.shape
        width = max(k1 - k0, 0)
        keep = torch.zeros(B, H, max(r1 - r0, 0), width + 1, dtype=torch.bool, device=device)
        a, b = max(r0, 0), min(r1, Tq)
        if b > a and width:
            idx = self.indices[:, :, a:b].to(device) - k0
            idx = torch.where((idx >= 0) & (idx < width), idx, width)  # out of range: the spare column
            keep[:, :, a - r0 : b - r0].scatter_(3, idx, True)
        return keep[..., :width]

    def evaluate(self, q_range, kv_range, *, q_offset, kv_offset, device=None, batch_size=None, num_heads=None):
        rows = (q_range[0] - q_offset, q_range[1] - q_offset)
        return self._scatter(rows, kv_range, self.indices.device if device is None else device)

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        table = self._table(q_idx.device)  # (B|1, H|1, Tq, P): every listed position
        B, H, Tq, P = table.shape
        b = b if B > 1 else b * 0  # broadcast dims: And() may pass indices of a larger batch
        h = h if H > 1 else h * 0
        i, j = q_idx - q_offset, kv_idx
        inside = (i >= 0) & (i < Tq) & (j >= 0) & (j < P)
        return table[b, h, i.clamp(0, Tq - 1), j.clamp(0, P - 1)] & inside

    def _table(self, device) -> Tensor:
        cached = self.__dict__.get("_table_cache")
        if cached is not None and cached.device == torch.device(device):
            return cached
        P = self._high + 1 if not torch.compiler.is_compiling() else None
        if P is None:
            P = int(self.indices.max()) + 1
        table = self._scatter((0, self.indices.shape[2]), (0, max(P, 1)), device)
        if not torch.compiler.is_compiling():
            object.__setattr__(self, "_table_cache", table)
        return table

    def validate(self, B, H, Tq, Tk, q_offset, kv_offset):
        super().validate(B, H, Tq, Tk, q_offset, kv_offset)
        if self.indices.shape[2] != Tq:
            raise ValueError(
                f"TopK(indices) of shape {tuple(self.indices.shape)} lists keys for {self.indices.shape[2]} queries, "
                f"but the call has Tq={Tq}. Fix: give one list per query of the call (rows are the call's queries)."
            )
        if self._high >= kv_offset + Tk or (self._low is not None and self._low < kv_offset):
            raise ValueError(
                f"TopK(indices) lists key positions {self._low}..{self._high}, but the call's keys sit at positions "
                f"{kv_offset}..{kv_offset + Tk - 1}. Fix: list absolute positions of the call's keys (0-based with "
                "kv_offset=0), and pad with -1."
            )

    # -- exported structure -------------------------------------------------------------------
    def tile_grid(self, tiles):
        if tiles.Tq != self.indices.shape[2]:
            return evaluated_grid(self, tiles)
        lists = self.lists(torch.device("cpu"))
        Bm, Hm, Tq, k = lists.shape
        rows, cols = tiles.shape
        j = lists - tiles.kv_offset
        listed = (lists >= 0) & (j >= 0) & (j < tiles.Tk)
        qt = (torch.arange(Tq) // tiles.block_q).view(1, 1, Tq, 1).expand_as(j)
        kt = j.clamp(0, max(tiles.Tk - 1, 0)) // tiles.block_k
        bh = torch.arange(Bm * Hm).view(Bm, Hm, 1, 1).expand_as(j)
        cell = (bh * rows + qt) * cols + kt
        counts = torch.zeros(Bm * Hm * rows * cols, dtype=torch.long)
        counts.index_add_(0, cell[listed], torch.ones_like(cell[listed]))
        counts = counts.view(Bm * Hm, rows, cols)
        (qa, qb), (ka, kb) = tiles.q_bounds(), tiles.k_bounds()
        area = ((qb - qa + 1).clamp(min=0))[:, None] * ((kb - ka + 1).clamp(min=0))[None, :]
        full = (counts == area).all(0) & (area > 0)
        empty = (counts == 0).all(0)
        return torch.where(empty, EMPTY, torch.where(full, FULL, PARTIAL)).to(torch.uint8)

    def export_params(self, params, batch_size):
        # Listed in ``rest`` too, so a kernel that does not read the lists still evaluates the mask
        # (the intersection is idempotent: a kernel that reads both keeps the same pairs).
        if params.topk is not None:
            return params.with_rest(self)
        return replace(params, topk=self.lists(torch.device("cpu"))).with_rest(self)

    def __repr__(self):
        return f"TopK(indices=<{tuple(self.indices.shape)}>)"
