"""What a quantized or paged KV cache hands to :func:`attnkit.attention` instead of K/V tensors.

A layer cache is storage (:mod:`attnkit.cache`): ``update(k, v)`` writes the new tokens and
returns what attention reads. A contiguous full-precision cache returns views of its buffers; an
int8 or paged cache returns a :class:`KVHandle` describing its storage in place — values, scales,
block table and the keys each batch row holds — and ``attention(q, handle, handle, ...)`` runs on
it like on tensors. Backends declare the KV formats they read (``Backend.kv_formats``): the
``decode`` backend reads every format here in place; for any other backend the dispatcher applies
the one declared conversion, :meth:`KVHandle.dense` (a contiguous copy in the query dtype), and
``explain()`` says so.

Formats (``KVHandle.format``):

* ``"int8"``: ``k (B, Hkv, Tk, D)``, ``v (B, Hkv, Tk, Dv)`` int8 with float32 scales
  ``(B, Hkv, Tk)``; key ``j`` is ``k[..., j, :] * k_scale[..., j]``.
* ``"paged"`` / ``"paged-int8"``: pools ``(Hkv, N, bs, D)`` (int8 plus scales ``(Hkv, N, bs)``
  for ``paged-int8``) and ``block_table (B, nb)``: key ``j`` of row ``b`` is slot ``j % bs`` of
  block ``block_table[b, j // bs]``.

Row ``b`` holds ``lengths[b]`` keys at absolute positions ``0 .. lengths[b] - 1``; the key axis
is ``Tk = max(lengths)`` long and key slots past a row's length are never read as data (they are
hidden from every query). Rows of different lengths are *ragged* (continuous batching):
``attention()`` evaluates the mask and score modifiers at each row's own positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .masks import BlockStatus, Dense, Mask

__all__ = ["KVHandle", "KV_FORMATS", "dequantize_int8"]

#: Every format a handle may carry; ``"dense"`` is plain K/V tensors.
KV_FORMATS = frozenset({"dense", "int8", "paged", "paged-int8"})


def dequantize_int8(values: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """int8 ``values (..., D)`` times float32 ``scale (...)`` per vector, in ``dtype``."""
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


@dataclass(frozen=True, eq=False)
class KVHandle:
    """A KV cache read in place; see the module docstring for the formats. ``dtype`` is the dtype
    of the keys the cache was given (queries must match it); ``finite`` is True when every slot the
    handle exposes holds finite values (the cache checked each token as it was written)."""

    format: str
    k: Tensor
    v: Tensor
    lengths: tuple[int, ...]
    dtype: torch.dtype
    finite: bool
    k_scale: Tensor | None = None
    v_scale: Tensor | None = None
    block_table: Tensor | None = None
    #: Per-step results shared by the layers of one forward (the block table's keep mask).
    memo: Callable | None = field(default=None, repr=False)

    def __post_init__(self):
        assert self.format in KV_FORMATS - {"dense"}, self.format
        assert self.lengths and min(self.lengths) >= 1, self.lengths

    # -- shape -----------------------------------------------------------------------------------
    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, Hkv, Tk, D)`` as K would have (``Tk = max(lengths)``)."""
        if self.paged:
            return (self.block_table.shape[0], self.k.shape[0], max(self.lengths), self.k.shape[-1])
        return (self.k.shape[0], self.k.shape[1], max(self.lengths), self.k.shape[-1])

    #: Stored keys are detached: gradients never flow into a cache.
    requires_grad = False

    @property
    def value_dim(self) -> int:
        return self.v.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def ragged(self) -> bool:
        return len(set(self.lengths)) > 1

    @property
    def slots(self) -> int:
        """Key slots the storage spans per row (``>= Tk``; whole blocks for a paged cache)."""
        return self.block_table.shape[1] * self.k.shape[2] if self.paged else self.k.shape[2]

    def rows(self, index: list[int]) -> KVHandle:
        """The handle of batch rows ``index`` (a view of the same storage)."""
        idx = torch.tensor(index, dtype=torch.long, device=self.device)
        lengths = tuple(self.lengths[i] for i in index)
        if self.paged:
            return KVHandle(self.format, self.k, self.v, lengths, self.dtype, self.finite, self.k_scale,
                            self.v_scale, self.block_table.index_select(0, idx))
        n = max(lengths)
        pick = lambda t: None if t is None else t.index_select(0, idx)[:, :, :n]  # noqa: E731
        return KVHandle(self.format, pick(self.k), pick(self.v), lengths, self.dtype, self.finite,
                        pick(self.k_scale), pick(self.v_scale))

    # -- the declared conversion -----------------------------------------------------------------
    def dense(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """The keys and values as contiguous ``(B, Hkv, Tk, D)`` / ``(B, Hkv, Tk, Dv)`` tensors of
        ``dtype`` (default: the cache's dtype), a copy; slots past a row's length are not data."""
        dtype = self.dtype if dtype is None else dtype
        Tk = max(self.lengths)
        if not self.paged:
            def read(x, s):
                x = x[:, :, :Tk]
                return x.to(dtype) if s is None else dequantize_int8(x, s[:, :, :Tk], dtype)
            return read(self.k, self.k_scale), read(self.v, self.v_scale)
        table = self.block_table
        Hkv, B = self.k.shape[0], table.shape[0]

        def pages(pool, scales):
            x = pool[:, table]  # (Hkv, B, nb, bs, D)
            x = x.to(dtype) if scales is None else dequantize_int8(x, scales[:, table], dtype)
            return x.reshape(Hkv, B, -1, pool.shape[-1])[:, :, :Tk].transpose(0, 1)  # (B, Hkv, Tk, D)

        return pages(self.k, self.k_scale), pages(self.v, self.v_scale)

    def gather(self, positions: Tensor, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """The keys and values at absolute ``positions (U,)`` (int64, each below every row's length)
        of every row, as ``(B, Hkv, U, D)`` / ``(B, Hkv, U, Dv)`` tensors of ``dtype`` (default: the
        cache's dtype): O(U) reads, for a backend that needs a few listed keys of a long cache."""
        dtype = self.dtype if dtype is None else dtype
        if not self.paged:
            def read(x, s):
                x = x[:, :, positions]
                return x.to(dtype) if s is None else dequantize_int8(x, s[:, :, positions], dtype)
            return read(self.k, self.k_scale), read(self.v, self.v_scale)
        bs = self.k.shape[2]
        blocks, slots = self.block_table[:, positions // bs], positions % bs  # (B, U), (U,)

        def pages(pool, scales):
            x = pool[:, blocks, slots]  # (Hkv, B, U, D)
            x = x.to(dtype) if scales is None else dequantize_int8(x, scales[:, blocks, slots], dtype)
            return x.transpose(0, 1)  # (B, Hkv, U, D)

        return pages(self.k, self.k_scale), pages(self.v, self.v_scale)

    # -- ragged rows -----------------------------------------------------------------------------
    def length_keep(self, slots: int | None = None) -> Tensor | None:
        """``(B, 1, 1, slots)`` bool: True on each row's keys ``0 .. lengths[b] - 1`` (None when
        every row fills all ``slots``, default ``Tk``)."""
        slots = max(self.lengths) if slots is None else slots
        if min(self.lengths) == slots:
            return None
        lengths = torch.tensor(self.lengths, device=self.device)
        return (torch.arange(slots, device=self.device) < lengths[:, None]).view(len(self.lengths), 1, 1, slots)

    def row_keep(self, mask: Mask | None, Tq: int) -> Tensor | None:
        """``(B, H|1, Tq, Tk)`` bool for queries at ``lengths[b] - Tq .. lengths[b] - 1`` of each
        row (the last queries of the row: its new tokens) under ``mask``, with every slot past
        the row's length hidden; None when nothing is hidden. Rows of equal length are evaluated
        together; the result is memoized per mask object when the cache shares one step's work
        across layers (masks are immutable values)."""
        if self.memo is None:
            return self._row_keep(mask, Tq)
        # The mask is held in the entry, so its id cannot be reused while the entry lives.
        key = ("keep", id(mask), Tq, self.lengths, self.device)
        return self.memo(key, lambda: (mask, self._row_keep(mask, Tq)))[1]

    def row_mask(self, mask: Mask | None, Tq: int) -> Mask | None:
        """:meth:`row_keep` as a ``Dense`` mask, one object per step when memoized: the layers of
        one forward share it (and with it the dispatcher's cached choice)."""
        if self.memo is None:
            keep = self._row_keep(mask, Tq)
            return None if keep is None else Dense(keep)
        key = ("mask", id(mask), Tq, self.lengths, self.device)

        def build():
            keep = self.row_keep(mask, Tq)
            return mask, None if keep is None else Dense(keep)

        return self.memo(key, build)[1]

    def _row_keep(self, mask: Mask | None, Tq: int) -> Tensor | None:
        lengths, slots, device = self.lengths, max(self.lengths), self.device
        B = len(lengths)
        groups: dict[int, list[int]] = {}
        for row, L in enumerate(lengths):
            groups.setdefault(L, []).append(row)
        if len(groups) == 1 and (mask is None or mask.block_status(
                (slots - Tq, slots), (0, slots), q_offset=slots - Tq, kv_offset=0) is BlockStatus.FULL):
            return None
        parts, rows = [], []
        for L, members in groups.items():
            keep = (torch.arange(slots, device=device) < L).view(1, 1, 1, slots).expand(1, 1, Tq, slots)
            if mask is not None:
                inner = mask.materialize(Tq, L, q_offset=L - Tq, kv_offset=0, device=device)  # (B|1, H|1, Tq, L)
                if inner.shape[0] > 1:
                    inner = inner[members]
                pad = inner.new_zeros(*inner.shape[:3], slots - L)
                keep = torch.cat([inner, pad], dim=-1) & keep
            parts.append(keep.expand(len(members) if keep.shape[0] == 1 else keep.shape[0], *keep.shape[1:]))
            rows += members
        H = max(p.shape[1] for p in parts)
        keep = torch.cat([p.expand(p.shape[0], H, Tq, slots) for p in parts])
        if rows == list(range(B)):
            return keep
        order = torch.empty(B, dtype=torch.long)
        order[torch.tensor(rows)] = torch.arange(B)
        return keep.index_select(0, order.to(device))

    def __repr__(self) -> str:
        return (f"KVHandle({self.format}, B={self.shape[0]}, Hkv={self.shape[1]}, lengths={list(self.lengths)}, "
                f"D={self.shape[3]}, Dv={self.value_dim}, {self.dtype}, finite={self.finite})")
