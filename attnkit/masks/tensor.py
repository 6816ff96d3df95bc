"""Masks given as data: an explicit bool tensor (``Dense``) or a function (``Custom``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Mask

__all__ = ["Dense", "Custom", "from_key_padding_mask"]


@dataclass(frozen=True, eq=False)
class Dense(Mask):
    """An explicit boolean keep-tensor broadcastable to ``(B, H, Tq, Tk)`` (True = attend).

    Unlike the positional masks it is relative to the call: row ``i`` is the call's ``i``-th query."""

    keep: Tensor

    def __post_init__(self):
        keep = self.keep
        if not isinstance(keep, Tensor):
            raise TypeError(f"Dense(keep): expected a torch.bool tensor, got {type(keep).__name__}.")
        if keep.dtype != torch.bool:
            raise TypeError(
                f"Dense(keep): expected dtype torch.bool (True = attend), got {keep.dtype}. Fix: for an additive "
                "float mask pass it as bias=; for nn.MultiheadAttention's True=ignore masks use "
                "attnkit.from_key_padding_mask or `~mask`."
            )
        if keep.dim() < 2 or keep.dim() > 4:
            raise ValueError(
                f"Dense(keep): expected 2 to 4 dims broadcastable to (B, H, Tq, Tk), got shape {tuple(keep.shape)}."
            )
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        object.__setattr__(self, "keep", keep)
        object.__setattr__(self, "batch_size", keep.shape[0])
        object.__setattr__(self, "num_heads", keep.shape[1])
        object.__setattr__(self, "query_independent", keep.shape[2] == 1)

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        keep = self.keep.to(q_idx.device)
        b = b if keep.shape[0] > 1 else b * 0  # broadcast dims: And() may pass indices of a larger batch
        h = h if keep.shape[1] > 1 else h * 0
        i = (q_idx - q_offset).clamp(max=keep.shape[2] - 1) if keep.shape[2] > 1 else q_idx * 0
        j = (kv_idx - kv_offset).clamp(max=keep.shape[3] - 1) if keep.shape[3] > 1 else kv_idx * 0
        return keep[b, h, i, j]

    def evaluate(self, q_range, kv_range, *, q_offset, kv_offset, device=None, batch_size=None, num_heads=None):
        if q_range == (q_offset, q_offset + self.keep.shape[2]) and kv_range == (kv_offset, kv_offset + self.keep.shape[3]):
            return self.keep if device is None else self.keep.to(device)  # the whole call: no gather
        return super().evaluate(q_range, kv_range, q_offset=q_offset, kv_offset=kv_offset, device=device,
                                batch_size=batch_size, num_heads=num_heads)

    def validate(self, B, H, Tq, Tk, q_offset, kv_offset):
        super().validate(B, H, Tq, Tk, q_offset, kv_offset)
        if self.keep.shape[2] not in (1, Tq) or self.keep.shape[3] not in (1, Tk):
            raise ValueError(
                f"mask: a bool tensor of shape {tuple(self.keep.shape)} does not broadcast to (B, H, Tq, Tk) = "
                f"({B}, {H}, {Tq}, {Tk}). Fix: give its last two dims as (Tq, Tk) = ({Tq}, {Tk}) or 1."
            )

    def __repr__(self):
        return f"Dense(keep=<{tuple(self.keep.shape)}>)"


@dataclass(frozen=True, eq=False)
class Custom(Mask):
    """Escape hatch: ``fn(b, h, q_idx, kv_idx) -> bool tensor`` over absolute positions,
    FlexAttention's ``mask_mod`` convention: ``b (B, 1, 1, 1)`` and ``h (1, Hq, 1, 1)`` hold every
    batch row and query head of the call, so ``Custom(lambda b, h, q, k: k < lengths[b])`` equals
    ``KeyPadding(lengths)`` and per-head masks work. Backends can only evaluate it, never skip work
    from its structure unless ``block_status`` finds a tile FULL or EMPTY by evaluation.

    A ``Custom`` value assumes ``fn`` is pure for the value's life: the same inputs give the same
    keep every time. Backends cache what they derive from a mask (its materialized keep, a
    kernel's tile plan) on that assumption, so a function that reads mutable state (a bound
    method reading ``self.lengths``) must be wrapped in a new ``Custom`` whenever that state
    changes, e.g. once per forward pass. Equality is identity: two ``Custom`` values are equal
    only when they are the same object, never because they wrap the same function, so a new
    ``Custom`` never reuses a plan built for another."""

    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    name: str = "custom"
    depends_on_batch = True  # fn may read b and h: it is evaluated for every one of the call's
    depends_on_head = True

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Custom(fn): expected a callable fn(b, h, q_idx, kv_idx), got {type(self.fn).__name__}.")

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        return self.fn(b, h, q_idx, kv_idx)

    def __repr__(self):
        return f"Custom({self.name})"


def from_key_padding_mask(key_padding_mask: Tensor) -> Dense:
    """Convert ``nn.MultiheadAttention``'s ``key_padding_mask`` (``(B, Tk)``, True = *ignore*)
    into an attnkit mask (True = attend) of shape ``(B, 1, 1, Tk)``."""
    if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
        raise TypeError(
            "key_padding_mask: expected a bool tensor (B, Tk) with True = ignore, got "
            f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}."
        )
    if key_padding_mask.dim() != 2:
        raise ValueError(f"key_padding_mask: expected shape (B, Tk), got {tuple(key_padding_mask.shape)}.")
    return Dense(~key_padding_mask[:, None, None, :])
