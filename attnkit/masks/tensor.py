"""Masks given as data: an explicit bool tensor (``Dense``) or a function (``Custom``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .base import Dense, Mask

__all__ = ["Dense", "Custom", "from_key_padding_mask"]


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
