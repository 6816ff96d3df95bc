"""Positional masks: defined by absolute query/key positions and a few integers or index vectors."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .._validate import non_negative_int
from .base import Mask
from .structure import Band, _as_long_tensor, _status_from_bounds
from .export import band_grid, document_grid, evaluated_grid, key_grid

__all__ = ["Causal", "SlidingWindow", "KeyPadding", "Padding", "Document"]


@dataclass(frozen=True)
class Causal(Mask):
    """Key ``j`` is visible from query ``i`` when ``pos(j) <= pos(i)`` (absolute positions).

    With the default bottom-right alignment, ``Tq=2, Tk=5`` keeps::

        ████·
        █████
    """

    offset_free = True

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        return q_idx >= kv_idx

    def band(self):
        return Band(None, 0)

    def is_causal(self):
        return True

    def tile_grid(self, tiles):
        return band_grid(self.band(), tiles)

    def export_params(self, params, batch_size):
        return params.with_band(self.band())

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0, batch_size=None, num_heads=None):
        (q0, q1), (k0, k1) = q_range, kv_range
        return _status_from_bounds(full=k1 - 1 <= q0, empty=k0 > q1 - 1)


@dataclass(frozen=True)
class SlidingWindow(Mask):
    """Keep keys with ``pos(q) - left <= pos(k) <= pos(q) + right`` (both bounds inclusive).

    ``left``/``right`` of ``None`` mean unbounded; ``SlidingWindow(2, 0)`` is causal local
    attention over the current token and the two before it. ``Tq=Tk=6``, ``SlidingWindow(2, 1)``::

        ██····
        ███···
        ████··
        ·████·
        ··████
        ···███
    """

    left: int | None = None
    right: int | None = 0

    offset_free = True

    def __post_init__(self):
        for name in ("left", "right"):
            non_negative_int(getattr(self, name), name, owner="SlidingWindow", allow_none=True,
                             fix="pass e.g. SlidingWindow(left=256, right=0) for causal local attention")

    def band(self):
        return Band(self.left, self.right)

    def is_causal(self):
        return self.left is None and self.right == 0

    def tile_grid(self, tiles):
        return band_grid(self.band(), tiles)

    def export_params(self, params, batch_size):
        return params.with_band(self.band())

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        keep = torch.ones((), dtype=torch.bool, device=q_idx.device)
        if self.left is not None:
            keep = keep & (kv_idx >= q_idx - self.left)
        if self.right is not None:
            keep = keep & (kv_idx <= q_idx + self.right)
        return keep

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0, batch_size=None, num_heads=None):
        (q0, q1), (k0, k1) = q_range, kv_range
        inf = float("inf")
        left = inf if self.left is None else self.left
        right = inf if self.right is None else self.right
        full = k0 >= (q1 - 1) - left and (k1 - 1) <= q0 + right
        empty = (k1 - 1) < q0 - left or k0 > (q1 - 1) + right
        return _status_from_bounds(full, empty)


@dataclass(frozen=True, eq=False)
class KeyPadding(Mask):
    """Keys at absolute positions ``>= lengths[b]`` are padding and never attended.

    ``lengths`` holds one valid length per batch element (ints or a 1-D integer tensor)."""

    lengths: Tensor | Sequence[int]
    query_independent = True
    _min: int = field(init=False, repr=False)
    _max: int = field(init=False, repr=False)

    offset_free = True

    def __post_init__(self):
        lengths = _as_long_tensor(self.lengths, "KeyPadding(lengths)")
        if lengths.dim() != 1 or lengths.numel() == 0:
            raise ValueError(
                f"KeyPadding(lengths): expected a non-empty 1-D sequence with one length per batch element, "
                f"got shape {tuple(lengths.shape)}."
            )
        object.__setattr__(self, "lengths", lengths)
        if torch.compiler.is_compiling():
            # Traced, the lengths are data the host does not read (a read breaks the graph): the
            # bounds take the safe answer (every tile PARTIAL to block_status); kernels read the lengths.
            object.__setattr__(self, "_min", 0)
            object.__setattr__(self, "_max", sys.maxsize)
        else:
            if bool((lengths < 0).any()):
                raise ValueError(f"KeyPadding(lengths): expected lengths >= 0, got {lengths.tolist()}.")
            object.__setattr__(self, "_min", int(lengths.min()))
            object.__setattr__(self, "_max", int(lengths.max()))
        object.__setattr__(self, "batch_size", lengths.numel())

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        lengths = self.lengths.to(kv_idx.device)
        return kv_idx < lengths[b.clamp(max=lengths.shape[0] - 1)]  # batch 1 broadcasts over an And's b

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0, batch_size=None, num_heads=None):
        k0, k1 = kv_range
        return _status_from_bounds(full=k1 <= self._min, empty=k0 >= self._max)

    def tile_grid(self, tiles):
        positions = torch.arange(tiles.kv_offset + tiles.Tk)
        return key_grid(positions[None, :] < self.lengths[:, None], tiles)

    def export_params(self, params, batch_size):
        return params.with_lengths(self.lengths.expand(batch_size) if self.lengths.numel() == 1 else self.lengths)

    def __repr__(self):
        return f"KeyPadding(lengths={self.lengths.tolist()})"


@dataclass(frozen=True, eq=False)
class Padding(Mask):
    """Per-position padding over absolute key positions: key ``j`` of row ``b`` is attended only
    where ``valid[b, j]`` (``(B, T)`` bool, True = real token; HF's ``attention_mask.bool()``).

    Unlike ``KeyPadding(lengths)`` it expresses left padding (batched generation) and holes, and
    unlike ``Dense`` it is indexed by absolute position, so it stays right with a KV cache.
    ``T`` must cover every key position of the call."""

    valid: Tensor
    query_independent = True

    offset_free = True

    def __post_init__(self):
        valid = self.valid
        if not isinstance(valid, Tensor) or valid.dtype != torch.bool or valid.dim() != 2:
            raise TypeError(
                f"Padding(valid): expected a bool tensor (B, T) with True = real token, got "
                f"{getattr(valid, 'dtype', type(valid).__name__)} {tuple(getattr(valid, 'shape', ()))}. "
                "Fix: Padding(attention_mask.bool())."
            )
        object.__setattr__(self, "batch_size", valid.shape[0])

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        valid = self.valid.to(kv_idx.device)
        return valid[b.clamp(max=valid.shape[0] - 1), kv_idx.clamp(0, valid.shape[1] - 1)]  # batch 1 broadcasts

    def tile_grid(self, tiles):
        return key_grid(self.valid.cpu(), tiles)

    def export_params(self, params, batch_size):
        return params.with_valid(self.valid.cpu())

    def validate(self, B, H, Tq, Tk, q_offset, kv_offset):
        super().validate(B, H, Tq, Tk, q_offset, kv_offset)
        if kv_offset + Tk > self.valid.shape[1]:
            raise ValueError(
                f"Padding(valid) covers key positions 0..{self.valid.shape[1] - 1}, but the call uses key positions "
                f"{kv_offset}..{kv_offset + Tk - 1}. Fix: give one entry per absolute position (past + new tokens)."
            )

    def __repr__(self):
        return f"Padding(valid=<{tuple(self.valid.shape)}>)"


@dataclass(frozen=True, eq=False)
class Document(Mask):
    """Packed sequences: query and key attend only within the same document.

    ``ids`` is ``(B, T)`` or ``(T,)``: the document id of each absolute position (``T`` must cover
    every query and key position). Combine with ``Causal()`` for packed causal LM training."""

    ids: Tensor

    offset_free = True

    def __post_init__(self):
        ids = _as_long_tensor(self.ids, "Document(ids)")
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2:
            raise ValueError(f"Document(ids): expected shape (B, T) or (T,), got {tuple(ids.shape)}.")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "batch_size", ids.shape[0])

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        ids = self.ids.to(q_idx.device)
        b = b.clamp(max=ids.shape[0] - 1)
        return ids[b, q_idx] == ids[b, kv_idx]

    def tile_grid(self, tiles):
        if tiles.q_offset < 0:  # queries before position 0 (validate refuses them; evaluate says how)
            return evaluated_grid(self, tiles)
        return document_grid(self.ids.cpu(), tiles)

    def export_params(self, params, batch_size):
        return params.with_rest(self) if params.doc is not None else replace(params, doc=self.ids.cpu())

    def validate(self, B, H, Tq, Tk, q_offset, kv_offset):
        super().validate(B, H, Tq, Tk, q_offset, kv_offset)
        last = max(q_offset + Tq, kv_offset + Tk)
        if min(q_offset, kv_offset) < 0 or last > self.ids.shape[1]:
            raise ValueError(
                f"Document(ids) covers positions 0..{self.ids.shape[1] - 1}, but the call uses query positions "
                f"{q_offset}..{q_offset + Tq - 1} and key positions {kv_offset}..{kv_offset + Tk - 1}. "
                "Fix: give one id per absolute position of the whole sequence."
            )

    def __repr__(self):
        return f"Document(ids=<{tuple(self.ids.shape)}>)"
