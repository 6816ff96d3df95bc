"""Which absolute positions of one long sequence each rank holds.

A :class:`SequenceLayout` lists, for every rank of a context-parallel group, the half-open ranges
``[start, stop)`` of absolute positions its local tensors hold, in local order. Two layouts cover
what matters in practice::

    SequenceLayout.contiguous([5, 3])   # rank 0: [0, 5)            rank 1: [5, 8)
    SequenceLayout.zigzag(8, 2)         # rank 0: [0, 2) + [6, 8)   rank 1: [2, 6)

Zigzag (Striped/ring-flash-attention's load balancing) splits the sequence into ``2 * world``
chunks and gives rank ``r`` chunks ``r`` and ``2 * world - 1 - r``: under a causal mask every rank
then owns the same amount of work (one early and one late chunk), while a contiguous split leaves
the last rank with ``world`` times the work of the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validate import check_int_at_least as _check_count

__all__ = ["SequenceLayout", "check_layout"]

Range = tuple[int, int]


def _even_bounds(total: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries splitting ``total`` into near-equal pieces (larger ones first)."""
    base, extra = divmod(total, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


@dataclass(frozen=True)
class SequenceLayout:
    """Absolute position ranges held by each rank: ``segments[rank]`` is a tuple of ``(start,
    stop)`` ranges, concatenated in that order along the local sequence axis.

    The ranges of all ranks together must cover ``0 .. total_len - 1`` exactly once."""

    segments: tuple[tuple[Range, ...], ...]

    def __post_init__(self):
        try:
            segments = tuple(tuple((int(a), int(b)) for a, b in rank) for rank in self.segments)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"SequenceLayout(segments): expected one tuple of (start, stop) ranges per rank, got {self.segments!r}."
            ) from exc
        if not segments:
            raise ValueError("SequenceLayout(segments): expected at least one rank, got none.")
        covered = sorted(r for rank in segments for r in rank)
        position = 0
        for start, stop in covered:
            if start != position or stop <= start:
                raise ValueError(
                    f"SequenceLayout(segments): the ranges {covered} must tile 0 .. T-1 exactly once with non-empty "
                    f"ranges (gap, overlap or empty range at position {position}). "
                    "Fix: build layouts with SequenceLayout.contiguous(...) or SequenceLayout.zigzag(...)."
                )
            position = stop
        for r, rank in enumerate(segments):
            if not rank:
                raise ValueError(f"SequenceLayout(segments): rank {r} holds no positions; "
                                 "every rank needs at least one.")
        object.__setattr__(self, "segments", segments)

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def contiguous(cls, lengths: Sequence[int]) -> SequenceLayout:
        """Rank ``r`` holds the ``lengths[r]`` positions after those of ranks ``0 .. r-1``."""
        lengths = list(lengths)
        for r, n in enumerate(lengths):
            _check_count(f"SequenceLayout.contiguous(lengths[{r}])", n, 1)
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        return cls(tuple(((bounds[r], bounds[r + 1]),) for r in range(len(lengths))))

    @classmethod
    def even(cls, total_len: int, world: int) -> SequenceLayout:
        """A contiguous split of ``total_len`` positions into ``world`` near-equal pieces."""
        _check_count("SequenceLayout.even(world)", world, 1)
        _check_count("SequenceLayout.even(total_len)", total_len, world)
        bounds = _even_bounds(total_len, world)
        return cls.contiguous([bounds[r + 1] - bounds[r] for r in range(world)])

    @classmethod
    def zigzag(cls, total_len: int, world: int) -> SequenceLayout:
        """``2 * world`` near-equal chunks; rank ``r`` holds chunks ``r`` and ``2 * world - 1 - r``
        (equal causal work per rank). ``total_len`` must be at least ``2 * world``."""
        _check_count("SequenceLayout.zigzag(world)", world, 1)
        _check_count("SequenceLayout.zigzag(total_len)", total_len, 2 * world)
        b = _even_bounds(total_len, 2 * world)
        chunk = [(b[c], b[c + 1]) for c in range(2 * world)]
        return cls(tuple((chunk[r], chunk[2 * world - 1 - r]) for r in range(world)))

    @classmethod
    def build(cls, kind: str, total_len: int, world: int) -> SequenceLayout:
        """``"contiguous"`` (:meth:`even`) or ``"zigzag"`` by name (for configs and the command line)."""
        if kind == "contiguous":
            return cls.even(total_len, world)
        if kind == "zigzag":
            return cls.zigzag(total_len, world)
        raise ValueError(f"layout: expected 'contiguous' or 'zigzag', got {kind!r}.")

    # -- queries -----------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return len(self.segments)

    @property
    def total_len(self) -> int:
        return sum(b - a for rank in self.segments for a, b in rank)

    def local_len(self, rank: int) -> int:
        return sum(b - a for a, b in self.segments[rank])

    def local_ranges(self, rank: int) -> list[tuple[int, int, int, int]]:
        """``(local_start, local_stop, abs_start, abs_stop)`` for each segment of ``rank``."""
        out, pos = [], 0
        for a, b in self.segments[rank]:
            out.append((pos, pos + b - a, a, b))
            pos += b - a
        return out

    def positions(self, rank: int, device: torch.device | str | None = None) -> Tensor:
        """The absolute positions ``(local_len,)`` held by ``rank``, in local order."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.segments[rank]])

    def order(self, device: torch.device | str | None = None) -> Tensor:
        """Absolute positions of the ranks' local sequences concatenated in rank order."""
        return torch.cat([self.positions(r, device) for r in range(self.world)])

    # -- moving data -------------------------------------------------------------------------
    def shard(self, x: Tensor, rank: int, dim: int = 2) -> Tensor:
        """The part of a full-sequence tensor ``x`` (sequence along ``dim``) that ``rank`` holds."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank: expected 0 <= rank < {self.world}, got {rank}.")
        if x.shape[dim] != self.total_len:
            raise ValueError(
                f"x: dim {dim} has length {x.shape[dim]}, but the layout covers {self.total_len} positions. "
                "Fix: pass the full sequence, or build the layout for its length."
            )
        return torch.cat([x.narrow(dim, a, b - a) for a, b in self.segments[rank]], dim=dim)

    def unshard(self, parts: Sequence[Tensor], dim: int = 2) -> Tensor:
        """Reassemble the full sequence (natural order) from every rank's local part."""
        if len(parts) != self.world:
            raise ValueError(f"parts: expected one tensor per rank ({self.world}), got {len(parts)}.")
        full = torch.cat(list(parts), dim=dim)
        return full.index_select(dim, torch.argsort(self.order(full.device)))


def check_layout(layout, world: int, rank: int, local_len: int) -> None:
    """``TypeError``/``ValueError`` unless ``layout`` is None or a :class:`SequenceLayout` for
    ``world`` ranks that gives ``rank`` the ``local_len`` positions its tensors hold."""
    if layout is None:
        return
    if not isinstance(layout, SequenceLayout):
        raise TypeError(f"layout: expected a SequenceLayout or None, got {type(layout).__name__}.")
    if layout.world != world:
        raise ValueError(f"layout: built for {layout.world} ranks, but the group has {world}. "
                         f"Fix: SequenceLayout.zigzag(T, {world}) or similar.")
    if layout.local_len(rank) != local_len:
        raise ValueError(f"q: rank {rank} holds {local_len} positions, but the layout gives it "
                         f"{layout.local_len(rank)}. Fix: pass layout.shard(x, rank) of the full tensors.")
