"""The vocabulary of mask structure: what a tile holds (:class:`BlockStatus`), bounds on
``pos(k) - pos(q)`` (:class:`Band`) and position ranges. Plain values below every mask module, so the
masks (``base``) and their exported data (``export``) both build on them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BlockStatus", "Band", "Range", "UNBOUNDED"]


class BlockStatus(enum.Enum):
    """What a mask keeps inside a (query range × key range) tile."""

    EMPTY = 0  # nothing kept: skip the tile
    PARTIAL = 1  # some kept: evaluate the mask
    FULL = 2  # everything kept: no mask needed


Range = tuple[int, int]  # half-open [start, stop) of absolute positions


@dataclass(frozen=True)
class Band:
    """Bounds on ``pos(k) - pos(q)`` that every kept pair satisfies: ``-left <= pos(k) - pos(q) <= right``
    (inclusive; ``None`` = unbounded on that side). ``Causal()`` is ``Band(None, 0)``."""

    left: int | None
    right: int | None

    @property
    def bounded(self) -> bool:
        """True when both sides are finite (a sliding window that a banded kernel can exploit)."""
        return self.left is not None and self.right is not None

    def __and__(self, other: Band) -> Band:
        tighter = lambda a, b: b if a is None else a if b is None else min(a, b)  # noqa: E731
        return Band(tighter(self.left, other.left), tighter(self.right, other.right))


UNBOUNDED = Band(None, None)


def _status_from_bounds(full: bool, empty: bool) -> BlockStatus:
    if empty:
        return BlockStatus.EMPTY
    return BlockStatus.FULL if full else BlockStatus.PARTIAL


def _as_long_tensor(values, name: str) -> Tensor:
    """``values`` (ints, nested lists of ints, an integer tensor) as a long tensor; floats and bools
    are refused (a length of 2.7 or True is a bug upstream, not something to round)."""
    if isinstance(values, Tensor):
        tensor = values
    else:
        try:
            tensor = torch.as_tensor(values if isinstance(values, (list, tuple)) else list(values))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name}: expected a sequence of ints or an integer tensor, got {values!r}.") from exc
    if tensor.numel() == 0:  # no values: nothing to round (torch.as_tensor([]) is float32)
        return tensor.long()
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        shown = repr(values.tolist() if isinstance(values, Tensor) else values)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(
            f"{name}={shown}: expected integers, got dtype {tensor.dtype}. "
            "Fix: pass whole numbers (e.g. `lengths.long()` after checking they are integral)."
        )
    return tensor.long()
