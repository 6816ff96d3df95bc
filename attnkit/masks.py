"""Masks: where attention is allowed (True = attend), over absolute positions.

A query sits at absolute position ``q_offset + i`` and a key at ``kv_offset + j``. The default
``q_offset = kv_offset + Tk - Tq`` aligns the last query with the last key (bottom-right), so one
``Causal()`` serves prefill, chunked prefill and cached decode alike::

    >>> print(Causal().to_string(2, 5))     # Tq=2, Tk=5: keeps [[1,1,1,1,0],[1,1,1,1,1]]
    ████·
    █████
    >>> print(Causal().to_string(5, 2))     # Tq=5, Tk=2: the first three rows see nothing
    ··
    ··
    ··
    █·
    ██

Every mask can

* ``mask_mod(b, h, q_idx, kv_idx)`` — evaluate on broadcasting index tensors (absolute positions);
* ``materialize(Tq, Tk, ...)`` — a boolean tensor broadcastable to ``(B, H, Tq, Tk)``;
* ``block_status(q_range, kv_range)`` — FULL / PARTIAL / EMPTY for a tile, so tiled and sparse
  backends skip work (conservative: PARTIAL is always a correct answer);
* ``to_string(Tq, Tk)`` — draw itself.

Masks combine with ``&`` and ``|``. A raw bool tensor passed as ``mask=`` becomes ``Dense(keep)``.
Additive biases (ALiBi, relative positions) are not masks: pass them as ``bias=``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "BlockStatus",
    "Mask",
    "Causal",
    "SlidingWindow",
    "KeyPadding",
    "Padding",
    "Document",
    "Dense",
    "Custom",
    "And",
    "Or",
    "as_mask",
    "from_key_padding_mask",
]


class BlockStatus(enum.Enum):
    """What a mask keeps inside a (query range × key range) tile."""

    EMPTY = 0  # nothing kept: skip the tile
    PARTIAL = 1  # some kept: evaluate the mask
    FULL = 2  # everything kept: no mask needed


Range = tuple[int, int]  # half-open [start, stop) of absolute positions


class Mask:
    """Base class of all masks. Subclasses implement :meth:`mask_mod`.

    ``mask_mod(b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0)`` receives broadcasting integer
    tensors: ``b`` of shape ``(B, 1, 1, 1)``, ``h`` ``(1, H, 1, 1)``, ``q_idx`` ``(1, 1, Tq, 1)``
    and ``kv_idx`` ``(1, 1, 1, Tk)`` holding *absolute* positions, and returns a bool tensor that
    broadcasts against them. ``q_offset``/``kv_offset`` are the positions of the call's first
    query and key; only masks defined relative to the call (``Dense``) need them.
    """

    #: True when the mask depends on the batch index (its ``batch_size`` must match ``B``).
    batch_size: int | None = None
    #: Number of heads the mask distinguishes (None: same for all heads).
    num_heads: int | None = None

    def mask_mod(
        self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, *, q_offset: int = 0, kv_offset: int = 0
    ) -> Tensor:
        raise NotImplementedError

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(
        self,
        q_range: Range,
        kv_range: Range,
        *,
        q_offset: int,
        kv_offset: int,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Boolean keep-tensor ``(B|1, H|1, len(q_range), len(kv_range))`` for absolute ranges."""
        b = torch.arange(self.batch_size or 1, device=device).view(-1, 1, 1, 1)
        h = torch.arange(self.num_heads or 1, device=device).view(1, -1, 1, 1)
        q_idx = torch.arange(q_range[0], q_range[1], device=device).view(1, 1, -1, 1)
        kv_idx = torch.arange(kv_range[0], kv_range[1], device=device).view(1, 1, 1, -1)
        keep = self.mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        if keep.dtype != torch.bool:
            raise TypeError(
                f"{type(self).__name__}.mask_mod returned dtype {keep.dtype}; expected torch.bool. "
                "Fix: return a comparison such as `q_idx >= kv_idx`."
            )
        shape = torch.broadcast_shapes(keep.shape, (1, 1, q_idx.shape[2], kv_idx.shape[3]))
        return keep.expand(shape)

    def materialize(
        self,
        Tq: int,
        Tk: int,
        *,
        q_offset: int | None = None,
        kv_offset: int = 0,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """The whole mask for a call as a bool tensor broadcastable to ``(B, H, Tq, Tk)``."""
        if q_offset is None:
            q_offset = kv_offset + Tk - Tq
        return self.evaluate(
            (q_offset, q_offset + Tq), (kv_offset, kv_offset + Tk), q_offset=q_offset, kv_offset=kv_offset, device=device
        )

    def block_status(self, q_range: Range, kv_range: Range, *, q_offset: int = 0, kv_offset: int = 0) -> BlockStatus:
        """FULL / PARTIAL / EMPTY for a tile of absolute positions, over every batch and head.

        The base version evaluates the tile; structured masks answer in O(1)."""
        keep = self.evaluate(q_range, kv_range, q_offset=q_offset, kv_offset=kv_offset)
        if bool(keep.all()):
            return BlockStatus.FULL
        if not bool(keep.any()):
            return BlockStatus.EMPTY
        return BlockStatus.PARTIAL

    def validate(self, B: int, H: int, Tq: int, Tk: int, q_offset: int, kv_offset: int) -> None:
        """Raise ``ValueError`` if the mask cannot describe a call of this size."""
        if self.batch_size not in (None, 1, B):
            raise ValueError(
                f"mask {self!r} is built for batch size {self.batch_size}, but q has batch size {B}. "
                "Fix: build the mask from per-example data of the same batch."
            )
        if self.num_heads not in (None, 1, H):
            raise ValueError(
                f"mask {self!r} distinguishes {self.num_heads} heads, but q has {H} heads. "
                "Fix: give the mask one entry per query head, or 1 to share it."
            )

    def to_string(self, Tq: int, Tk: int, *, q_offset: int | None = None, kv_offset: int = 0) -> str:
        """Draw the mask (batch 0, head 0): '█' = attend, '·' = masked."""
        keep = self.materialize(Tq, Tk, q_offset=q_offset, kv_offset=kv_offset)[0, 0]
        return "\n".join("".join("█" if x else "·" for x in row.tolist()) for row in keep)

    def density(self, Tq: int, Tk: int, *, q_offset: int | None = None, kv_offset: int = 0) -> float:
        """Fraction of (query, key) pairs kept."""
        keep = self.materialize(Tq, Tk, q_offset=q_offset, kv_offset=kv_offset)
        return float(keep.float().mean())

    # -- combination ------------------------------------------------------------------------
    def __and__(self, other: Mask) -> Mask:
        return And(self, as_mask(other, "other"))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, as_mask(other, "other"))


def _status_from_bounds(full: bool, empty: bool) -> BlockStatus:
    if empty:
        return BlockStatus.EMPTY
    return BlockStatus.FULL if full else BlockStatus.PARTIAL


@dataclass(frozen=True)
class Causal(Mask):
    """Key ``j`` is visible from query ``i`` when ``pos(j) <= pos(i)`` (absolute positions).

    With the default bottom-right alignment, ``Tq=2, Tk=5`` keeps::

        ████·
        █████
    """

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        return q_idx >= kv_idx

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0):
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

    def __post_init__(self):
        for name in ("left", "right"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(
                    f"SlidingWindow({name}={value!r}): expected a non-negative int or None (unbounded). "
                    f"Fix: pass e.g. SlidingWindow(left=256, right=0) for causal local attention."
                )

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        keep = torch.ones((), dtype=torch.bool, device=q_idx.device)
        if self.left is not None:
            keep = keep & (kv_idx >= q_idx - self.left)
        if self.right is not None:
            keep = keep & (kv_idx <= q_idx + self.right)
        return keep

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0):
        (q0, q1), (k0, k1) = q_range, kv_range
        inf = float("inf")
        left = inf if self.left is None else self.left
        right = inf if self.right is None else self.right
        full = k0 >= (q1 - 1) - left and (k1 - 1) <= q0 + right
        empty = (k1 - 1) < q0 - left or k0 > (q1 - 1) + right
        return _status_from_bounds(full, empty)


def _as_long_tensor(values, name: str) -> Tensor:
    if isinstance(values, Tensor):
        if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
            raise TypeError(f"{name}: expected an integer tensor, got dtype {values.dtype}. Fix: pass .long() values.")
        return values.long()
    try:
        return torch.as_tensor(list(values), dtype=torch.long)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected a sequence of ints or an integer tensor, got {values!r}.") from exc


@dataclass(frozen=True, eq=False)
class KeyPadding(Mask):
    """Keys at absolute positions ``>= lengths[b]`` are padding and never attended.

    ``lengths`` holds one valid length per batch element (ints or a 1-D integer tensor)."""

    lengths: Tensor | Sequence[int]
    _min: int = field(init=False, repr=False)
    _max: int = field(init=False, repr=False)

    def __post_init__(self):
        lengths = _as_long_tensor(self.lengths, "KeyPadding(lengths)")
        if lengths.dim() != 1 or lengths.numel() == 0:
            raise ValueError(
                f"KeyPadding(lengths): expected a non-empty 1-D sequence with one length per batch element, "
                f"got shape {tuple(lengths.shape)}."
            )
        if bool((lengths < 0).any()):
            raise ValueError(f"KeyPadding(lengths): expected lengths >= 0, got {lengths.tolist()}.")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "_min", int(lengths.min()))
        object.__setattr__(self, "_max", int(lengths.max()))
        object.__setattr__(self, "batch_size", lengths.numel())

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        return kv_idx < self.lengths.to(kv_idx.device)[b]

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0):
        k0, k1 = kv_range
        return _status_from_bounds(full=k1 <= self._min, empty=k0 >= self._max)

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
        return valid[b, kv_idx.clamp(0, valid.shape[1] - 1)]

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

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        keep = self.keep.to(q_idx.device)
        b = b if keep.shape[0] > 1 else b * 0  # broadcast dims: And() may pass indices of a larger batch
        h = h if keep.shape[1] > 1 else h * 0
        i = (q_idx - q_offset).clamp(max=keep.shape[2] - 1) if keep.shape[2] > 1 else q_idx * 0
        j = (kv_idx - kv_offset).clamp(max=keep.shape[3] - 1) if keep.shape[3] > 1 else kv_idx * 0
        return keep[b, h, i, j]

    def evaluate(self, q_range, kv_range, *, q_offset, kv_offset, device=None):
        if q_range == (q_offset, q_offset + self.keep.shape[2]) and kv_range == (kv_offset, kv_offset + self.keep.shape[3]):
            return self.keep if device is None else self.keep.to(device)  # the whole call: no gather
        return super().evaluate(q_range, kv_range, q_offset=q_offset, kv_offset=kv_offset, device=device)

    def validate(self, B, H, Tq, Tk, q_offset, kv_offset):
        super().validate(B, H, Tq, Tk, q_offset, kv_offset)
        if self.keep.shape[2] not in (1, Tq) or self.keep.shape[3] not in (1, Tk):
            raise ValueError(
                f"mask: a bool tensor of shape {tuple(self.keep.shape)} does not broadcast to (B, H, Tq, Tk) = "
                f"({B}, {H}, {Tq}, {Tk}). Fix: give its last two dims as (Tq, Tk) = ({Tq}, {Tk}) or 1."
            )

    def __repr__(self):
        return f"Dense(keep=<{tuple(self.keep.shape)}>)"


@dataclass(frozen=True)
class Custom(Mask):
    """Escape hatch: ``fn(b, h, q_idx, kv_idx) -> bool tensor`` over absolute positions,
    FlexAttention's ``mask_mod`` convention. Backends can only evaluate it, never skip work
    from its structure unless ``block_status`` finds a tile FULL or EMPTY by evaluation."""

    fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    name: str = "custom"

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"Custom(fn): expected a callable fn(b, h, q_idx, kv_idx), got {type(self.fn).__name__}.")

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        return self.fn(b, h, q_idx, kv_idx)

    def __repr__(self):
        return f"Custom({self.name})"


class _Combination(Mask):
    parts: tuple[Mask, ...]

    def __init__(self, *parts: Mask):
        if len(parts) < 2:
            raise ValueError(f"{type(self).__name__}: expected at least two masks, got {len(parts)}.")
        flat: list[Mask] = []
        for i, part in enumerate(parts):
            part = as_mask(part, f"{type(self).__name__} part {i}")
            flat.extend(part.parts if type(part) is type(self) else (part,))
        self.parts = tuple(flat)
        sizes = [p.batch_size for p in self.parts if p.batch_size not in (None, 1)]
        heads = [p.num_heads for p in self.parts if p.num_heads not in (None, 1)]
        if len(set(sizes)) > 1 or len(set(heads)) > 1:
            raise ValueError(
                f"{type(self).__name__}: parts disagree on batch size {sizes} or heads {heads}. "
                "Fix: build every per-example mask for the same batch."
            )
        self.batch_size = sizes[0] if sizes else None
        self.num_heads = heads[0] if heads else None

    def validate(self, B, H, Tq, Tk, q_offset, kv_offset):
        for part in self.parts:
            part.validate(B, H, Tq, Tk, q_offset, kv_offset)

    def __eq__(self, other):
        return type(self) is type(other) and self.parts == other.parts

    def __hash__(self):
        return hash((type(self), self.parts))

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(map(repr, self.parts))})"


class And(_Combination):
    """Keep where every part keeps."""

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        keep = self.parts[0].mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        for part in self.parts[1:]:
            keep = keep & part.mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        return keep

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0):
        states = [p.block_status(q_range, kv_range, q_offset=q_offset, kv_offset=kv_offset) for p in self.parts]
        if BlockStatus.EMPTY in states:
            return BlockStatus.EMPTY
        if all(s is BlockStatus.FULL for s in states):
            return BlockStatus.FULL
        return BlockStatus.PARTIAL


class Or(_Combination):
    """Keep where any part keeps."""

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        keep = self.parts[0].mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        for part in self.parts[1:]:
            keep = keep | part.mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        return keep

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0):
        states = [p.block_status(q_range, kv_range, q_offset=q_offset, kv_offset=kv_offset) for p in self.parts]
        if BlockStatus.FULL in states:
            return BlockStatus.FULL
        if all(s is BlockStatus.EMPTY for s in states):
            return BlockStatus.EMPTY
        return BlockStatus.PARTIAL


def as_mask(mask, name: str = "mask") -> Mask:
    """Return ``mask`` as a :class:`Mask`; a bool tensor becomes ``Dense(keep)``."""
    if isinstance(mask, Mask):
        return mask
    if isinstance(mask, Tensor):
        if mask.dtype != torch.bool:
            raise TypeError(
                f"{name}: a tensor mask must have dtype torch.bool (True = attend), got {mask.dtype}. "
                "Fix: pass additive float masks as bias=, or convert with `keep = m.bool()`."
            )
        return Dense(mask)
    raise TypeError(
        f"{name}: expected an attnkit Mask (Causal(), SlidingWindow(...), ...) or a bool tensor, "
        f"got {type(mask).__name__}."
    )


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
