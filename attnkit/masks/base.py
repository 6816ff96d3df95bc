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

* answer structural questions through one API (the only place that walks ``And``/``Or``):
  :meth:`Mask.leaves`, :meth:`Mask.conjuncts`, :meth:`Mask.band`, :meth:`Mask.split_globals`,
  :meth:`Mask.block_layout`, :meth:`Mask.topk`, :meth:`Mask.is_causal`, :attr:`Mask.query_independent` and
  :meth:`Mask.structure_key`; backends decide what they can skip or fuse from these answers;
* ``mask_mod(b, h, q_idx, kv_idx)`` — evaluate on broadcasting index tensors (absolute positions);
* ``materialize(Tq, Tk, ...)`` — a boolean tensor broadcastable to ``(B, H, Tq, Tk)``;
* ``block_status(q_range, kv_range)`` — FULL / PARTIAL / EMPTY for a tile, so tiled and sparse
  backends skip work (conservative: PARTIAL is always a correct answer);
* ``to_string(Tq, Tk)`` — draw itself.

Masks combine with ``&`` and ``|``. A raw bool tensor passed as ``mask=`` becomes ``Dense(keep)``.
Additive biases (ALiBi, relative positions) are not masks: pass them as ``bias=``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validate import broadcast_shapes, non_negative_int, positive_int
from .export import evaluated_grid
from .structure import UNBOUNDED, Band, BlockStatus, Range

__all__ = ["BlockStatus", "Band", "Mask", "Dense", "And", "Or", "as_mask"]



#: Largest keep-tensor (bytes) that ``materialize`` keeps on the mask for the next call.
_CACHE_BYTES = 2**24


class Mask:
    """Base class of all masks. Subclasses implement :meth:`mask_mod`.

    ``mask_mod(b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0)`` receives broadcasting integer
    tensors: ``b`` of shape ``(B, 1, 1, 1)``, ``h`` ``(1, Hq, 1, 1)``, ``q_idx`` ``(1, 1, Tq, 1)``
    and ``kv_idx`` ``(1, 1, 1, Tk)`` holding *absolute* positions, and returns a bool tensor that
    broadcasts against them. ``b`` and ``h`` hold every batch row and query head of the call when
    the mask :attr:`depends_on_batch` / :attr:`depends_on_head` (``Custom`` always may), else just
    ``0``; so evaluation takes the call's sizes (``batch_size=``, ``num_heads=``) and refuses to
    guess them. ``q_offset``/``kv_offset`` are the positions of the call's first query and key;
    only masks defined relative to the call (``Dense``) need them.
    """

    #: Batch size the mask is built for (None: the same for every batch row; otherwise it must be 1 or ``B``).
    batch_size: int | None = None
    #: Number of heads the mask distinguishes (None: same for all heads).
    num_heads: int | None = None

    def mask_mod(
        self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, *, q_offset: int = 0, kv_offset: int = 0
    ) -> Tensor:
        raise NotImplementedError

    #: True when the mask keeps or drops whole key columns: the same keep for every query of a row
    #: (``KeyPadding``, ``Padding``, a ``Dense`` of shape ``(B|1, H|1, 1, Tk)``).
    query_independent: bool = False

    @property
    def depends_on_batch(self) -> bool:
        """True when the keep may differ between batch rows: evaluation then passes every ``b``
        of the call (a ``Custom`` mask always may; a per-example mask of batch size 1 broadcasts)."""
        return self.batch_size not in (None, 1)

    @property
    def depends_on_head(self) -> bool:
        """True when the keep may differ between heads: evaluation then passes every ``h``."""
        return self.num_heads not in (None, 1)

    def index_sizes(self, batch_size: int | None = None, num_heads: int | None = None) -> tuple[int, int]:
        """How many batch and head indices to evaluate this mask on for a call with ``batch_size``
        rows and ``num_heads`` query heads: 1 where the mask does not depend on them, else the
        call's size (or the mask's own). ``ValueError`` when a size the mask needs is unknown."""
        sizes = []
        for depends, given, own, what, arg in (
            (self.depends_on_batch, batch_size, self.batch_size, "batch index b", "batch_size"),
            (self.depends_on_head, num_heads, self.num_heads, "head index h", "num_heads"),
        ):
            if not depends:
                sizes.append(1)
            elif given is not None:
                sizes.append(non_negative_int(given, arg))  # 0: an empty batch
            elif own not in (None, 1):
                sizes.append(own)
            else:
                raise ValueError(
                    f"{arg}=None: the mask {self!r} may depend on the {what}, so it must be evaluated for "
                    f"every one of the call's. Fix: pass {arg}= (the call's B and Hq; attention() does)."
                )
        return sizes[0], sizes[1]

    def batch_head_index(
        self, batch_size: int | None = None, num_heads: int | None = None, *, device: torch.device | str | None = None
    ) -> tuple[Tensor, Tensor]:
        """The index tensors ``b (B|1, 1, 1, 1)`` and ``h (1, H|1, 1, 1)`` to pass to
        :meth:`mask_mod` for a call with ``batch_size`` rows and ``num_heads`` query heads
        (FlexAttention's contract: every ``b`` and ``h`` the mask may depend on)."""
        nb, nh = self.index_sizes(batch_size, num_heads)
        return (torch.arange(nb, device=device).view(-1, 1, 1, 1), torch.arange(nh, device=device).view(1, -1, 1, 1))

    # -- structure (the one API every backend and the dispatcher reads) -----------------------
    def leaves(self) -> tuple[Mask, ...]:
        """Every primitive mask of the tree, ``And``/``Or`` flattened, in order (duplicates kept)."""
        return (self,)

    def conjuncts(self) -> tuple[Mask, ...]:
        """Masks whose intersection is this mask: the parts of an ``And``, else ``(self,)``."""
        return (self,)

    def band(self) -> Band:
        """The tightest :class:`Band` implied by the conjuncts (``Causal``, ``SlidingWindow``).
        ``UNBOUNDED`` when nothing bounds ``pos(k) - pos(q)``; always a correct over-approximation."""
        return UNBOUNDED

    def split_globals(self) -> tuple[Mask, Mask | None]:
        """``(core, globals)`` for ``core | GlobalTokens(...)`` (Longformer), else ``(self, None)``."""
        return self, None

    def global_positions(self) -> Tensor | None:
        """The positions of the global tokens when this mask is a set of global tokens (their rows and
        columns kept), else None."""
        return None

    def block_layout(self) -> Mask | None:
        """The ``BlockSparse`` conjunct that bounds this mask, or None."""
        return None

    def topk(self) -> Mask | None:
        """The ``TopK`` conjunct (per-query key lists) that bounds this mask, or None."""
        return None

    def is_causal(self) -> bool:
        """True when the mask is exactly ``Causal()`` (possibly repeated, or ``SlidingWindow(None, 0)``)."""
        return False

    #: True when ``mask_mod`` reads absolute positions only, never the call's offsets (positional
    #: masks): a caller may evaluate it in any frame (context parallelism hands it on as it is).
    offset_free: bool = False

    def tile_grid(self, tiles) -> Tensor:
        """The ``(nQ, nK)`` uint8 :class:`BlockStatus` grid of a :class:`~attnkit.masks.export.Tiles`
        tiling, over every batch row and head. The base version evaluates strips of query tiles;
        structured masks compute it from their parameters with a few tensor operations."""
        return evaluated_grid(self, tiles)

    def export_params(self, params, batch_size: int):
        """``params`` (a :class:`~attnkit.masks.export.MaskParams`) with this conjunct's positional
        parameters added; the base version lists the mask in ``rest`` (evaluated by ``mask_mod``)."""
        return params.with_rest(self)

    def structure_key(self) -> str:
        """A short stable name of the mask's structure, e.g. ``"Causal"`` or ``"And(Causal,KeyPadding)"``
        (for measured tables: masks of the same structure share measurements)."""
        return type(self).__name__

    def content_digest(self, Tq: int, Tk: int, *, batch_size: int | None = None, num_heads: int | None = None) -> str:
        """A hex digest of what the mask keeps for a call of ``Tq`` queries and ``Tk`` keys at
        positions ``0 ..``, equal in any two processes that hold equal masks (context parallelism
        compares the ranks' masks with it). Masks given by data digest their type, parameters and
        tensors' contents (exact); a mask given by a function (``Custom``) digests its keep
        evaluated at up to 64 evenly spaced query rows against every key, every batch row and
        head, so a difference confined to rows between them can go unseen."""
        nb, nh = self.index_sizes(batch_size, num_heads)
        key = (Tq, Tk, nb, nh)
        cached = self.__dict__.get("_digest")
        if cached is not None and cached[0] == key:
            return cached[1]
        digest = hashlib.sha256(repr(self._content(Tq, Tk, nb, nh)).encode()).hexdigest()
        object.__setattr__(self, "_digest", (key, digest))
        return digest

    def _content(self, Tq: int, Tk: int, nb: int, nh: int) -> tuple:
        """What :meth:`content_digest` hashes (see there)."""
        if dataclasses.is_dataclass(self):
            values = [getattr(self, f.name) for f in dataclasses.fields(self) if f.init]
            if not any(callable(v) and not isinstance(v, Tensor) for v in values):
                return (type(self).__name__, *(_tensor_digest(v) if isinstance(v, Tensor) else repr(v) for v in values))
        b, h = self.batch_head_index(nb, nh)
        rows = torch.linspace(0, max(Tq - 1, 0), min(Tq, 64)).round().long().view(1, 1, -1, 1)
        keep = self.mask_mod(b, h, rows, torch.arange(Tk).view(1, 1, 1, -1))
        return (type(self).__name__, repr(self), _tensor_digest(keep.expand(nb, nh, rows.shape[2], Tk)))

    # -- evaluation -------------------------------------------------------------------------
    def evaluate(
        self,
        q_range: Range,
        kv_range: Range,
        *,
        q_offset: int,
        kv_offset: int,
        device: torch.device | str | None = None,
        batch_size: int | None = None,
        num_heads: int | None = None,
    ) -> Tensor:
        """Boolean keep-tensor ``(B|1, H|1, len(q_range), len(kv_range))`` for absolute ranges of a
        call with ``batch_size`` rows and ``num_heads`` query heads (see :meth:`index_sizes`)."""
        b, h = self.batch_head_index(batch_size, num_heads, device=device)
        q_idx = torch.arange(q_range[0], q_range[1], device=device).view(1, 1, -1, 1)
        kv_idx = torch.arange(kv_range[0], kv_range[1], device=device).view(1, 1, 1, -1)
        keep = self.mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
            raise TypeError(
                f"{type(self).__name__}.mask_mod returned {getattr(keep, 'dtype', type(keep).__name__)}; expected a "
                "torch.bool tensor. Fix: return a comparison such as `q_idx >= kv_idx`."
            )
        shape = broadcast_shapes(keep.shape, (b.shape[0], h.shape[1], q_idx.shape[2], kv_idx.shape[3]))
        return keep.expand(shape)

    def materialize(
        self,
        Tq: int,
        Tk: int,
        *,
        q_offset: int | None = None,
        kv_offset: int = 0,
        device: torch.device | str | None = None,
        batch_size: int | None = None,
        num_heads: int | None = None,
    ) -> Tensor:
        """The whole mask for a call as a bool tensor broadcastable to ``(B, H, Tq, Tk)``.

        Masks are immutable values, so the result is cached on the instance (the last two calls'
        sizes, offsets, device and batch/head counts; up to 16 MiB each): a model that builds its
        mask once per forward pass materializes it once however many layers use it. Treat the
        result as read-only."""
        if q_offset is None:
            q_offset = kv_offset + Tk - Tq
        nb, nh = self.index_sizes(batch_size, num_heads)
        span = dict(q_offset=q_offset, kv_offset=kv_offset, device=device, batch_size=nb, num_heads=nh)
        if torch.compiler.is_compiling():  # a traced graph keeps no Python-side cache (nor reads one)
            return self.evaluate((q_offset, q_offset + Tq), (kv_offset, kv_offset + Tk), **span)
        key = (Tq, Tk, q_offset, kv_offset, None if device is None else torch.device(device), nb, nh,
               torch.is_inference_mode_enabled())
        cached = self.__dict__.get("_prepared", ())
        for entry in cached:
            if entry[0] == key:
                return entry[1]
        keep = self.evaluate((q_offset, q_offset + Tq), (kv_offset, kv_offset + Tk), **span)
        # A traced graph must not capture Python-side state, nor may a torch.func transform's wrapped
        # tensor outlive its transform; a long-lived mask (a module's default Causal()) must not pin
        # a huge tensor: past _CACHE_BYTES it is rebuilt on every call.
        if (not torch._C._functorch.is_functorch_wrapped_tensor(keep)
                and keep.numel() * keep.element_size() <= _CACHE_BYTES):
            object.__setattr__(self, "_prepared", ((key, keep),) + cached[:1])
        return keep

    def block_status(
        self, q_range: Range, kv_range: Range, *, q_offset: int = 0, kv_offset: int = 0,
        batch_size: int | None = None, num_heads: int | None = None,
    ) -> BlockStatus:
        """FULL / PARTIAL / EMPTY for a tile of absolute positions, over every batch and head of a
        call with ``batch_size`` rows and ``num_heads`` query heads.

        The base version evaluates the tile; structured masks answer in O(1)."""
        keep = self.evaluate(
            q_range, kv_range, q_offset=q_offset, kv_offset=kv_offset, batch_size=batch_size, num_heads=num_heads
        )
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

    def to_string(
        self, Tq: int, Tk: int, *, q_offset: int | None = None, kv_offset: int = 0, batch: int = 0, head: int = 0
    ) -> str:
        """Draw the mask for one batch row and head: '█' = attend, '·' = masked."""
        keep = self.materialize(
            Tq, Tk, q_offset=q_offset, kv_offset=kv_offset, batch_size=batch + 1, num_heads=head + 1
        )
        keep = keep[min(batch, keep.shape[0] - 1), min(head, keep.shape[1] - 1)]
        return "\n".join("".join("█" if x else "·" for x in row.tolist()) for row in keep)

    def density(
        self, Tq: int, Tk: int, *, q_offset: int | None = None, kv_offset: int = 0, rows: int | None = None,
        batch_size: int | None = None, num_heads: int | None = None,
    ) -> float:
        """Fraction of (query, key) pairs kept, over every batch row and head the mask distinguishes.

        ``rows``: estimate from that many evenly spaced query rows (exact when ``rows >= Tq``), so
        the cost is O(rows * Tk) at any length."""
        if q_offset is None:
            q_offset = kv_offset + Tk - Tq
        if rows is None or positive_int(rows, "rows") >= Tq:
            keep = self.materialize(Tq, Tk, q_offset=q_offset, kv_offset=kv_offset, batch_size=batch_size,
                                    num_heads=num_heads)
            return float(keep.float().mean())
        b, h = self.batch_head_index(batch_size, num_heads)
        q_idx = q_offset + torch.linspace(0, Tq - 1, rows).round().long().view(1, 1, -1, 1)
        kv_idx = torch.arange(kv_offset, kv_offset + Tk).view(1, 1, 1, -1)
        keep = self.mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        return float(keep.expand(b.shape[0], h.shape[1], rows, Tk).float().mean())

    # -- combination ------------------------------------------------------------------------
    def __and__(self, other: Mask) -> Mask:
        return And(self, as_mask(other, "other"))

    def __or__(self, other: Mask) -> Mask:
        return Or(self, as_mask(other, "other"))


def _tensor_digest(t: Tensor) -> tuple:
    """``(dtype, shape, two position-weighted sums of the elements' bits)``: equal for equal tensors in
    any process (integer arithmetic wraps identically in any summation order)."""
    x = t.detach().reshape(-1).cpu()
    if x.is_floating_point():
        x = x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    sums = [0, 0]
    for start in range(0, x.numel(), 1 << 22):  # chunks: a long Dense mask never becomes one int64 copy
        part = x[start:start + (1 << 22)].to(torch.int64)
        i = torch.arange(start, start + part.numel(), dtype=torch.int64)
        sums[0] += int((part * (i * 2654435761 + 1)).sum())
        sums[1] += int((part * ((i * i) % 1000003 + 7)).sum())
    return (str(t.dtype), tuple(t.shape), sums[0] % (1 << 64), sums[1] % (1 << 64))


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
        whole_q = q_range == (q_offset, q_offset + self.keep.shape[2])
        if whole_q and kv_range == (kv_offset, kv_offset + self.keep.shape[3]):
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

    def leaves(self):
        return tuple(leaf for part in self.parts for leaf in part.leaves())

    @property
    def depends_on_batch(self):  # type: ignore[override]
        return any(p.depends_on_batch for p in self.parts)

    @property
    def depends_on_head(self):  # type: ignore[override]
        return any(p.depends_on_head for p in self.parts)

    @property
    def query_independent(self):  # type: ignore[override]
        return all(p.query_independent for p in self.parts)

    @property
    def offset_free(self):  # type: ignore[override]
        return all(p.offset_free for p in self.parts)

    def structure_key(self):
        return f"{type(self).__name__}({','.join(sorted({p.structure_key() for p in self.parts}))})"

    def _content(self, Tq, Tk, nb, nh):
        return (type(self).__name__, *(p._content(Tq, Tk, nb, nh) for p in self.parts))

    def __eq__(self, other):
        return type(self) is type(other) and self.parts == other.parts

    def __hash__(self):
        return hash((type(self), self.parts))

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(map(repr, self.parts))})"


class And(_Combination):
    """Keep where every part keeps."""

    def conjuncts(self):
        return self.parts  # already flat: nested Ands are merged at construction

    def band(self):
        band = UNBOUNDED
        for part in self.parts:
            band = band & part.band()
        return band

    def block_layout(self):
        found = [p for p in self.parts if p.block_layout() is not None]
        return found[0].block_layout() if found else None

    def is_causal(self):
        return all(p.is_causal() for p in self.parts)

    def topk(self):
        found = [p for p in self.parts if p.topk() is not None]
        return found[0].topk() if found else None

    def tile_grid(self, tiles):
        grid = self.parts[0].tile_grid(tiles)
        for part in self.parts[1:]:  # EMPTY < PARTIAL < FULL: the AND is the min
            grid = torch.minimum(grid, part.tile_grid(tiles))
        return grid

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        keep = self.parts[0].mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        for part in self.parts[1:]:
            keep = keep & part.mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        return keep

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0, batch_size=None, num_heads=None):
        states = [
            p.block_status(q_range, kv_range, q_offset=q_offset, kv_offset=kv_offset, batch_size=batch_size,
                           num_heads=num_heads)
            for p in self.parts
        ]
        if BlockStatus.EMPTY in states:
            return BlockStatus.EMPTY
        if all(s is BlockStatus.FULL for s in states):
            return BlockStatus.FULL
        return BlockStatus.PARTIAL


class Or(_Combination):
    """Keep where any part keeps."""

    def is_causal(self):
        return all(p.is_causal() for p in self.parts)  # Causal() | Causal() is Causal()

    def band(self):
        bands = [p.band() for p in self.parts]
        loosest = lambda xs: None if any(x is None for x in xs) else max(xs)  # noqa: E731
        return Band(loosest([b.left for b in bands]), loosest([b.right for b in bands]))

    def split_globals(self):
        globs = [p for p in self.parts if p.global_positions() is not None]
        others = [p for p in self.parts if p.global_positions() is None]
        if not globs or not others:
            return self, None
        union = torch.cat([g.global_positions() for g in globs])
        glob = globs[0] if len(globs) == 1 else type(globs[0])(union)  # the global tokens of every part
        return (others[0] if len(others) == 1 else Or(*others)), glob

    def tile_grid(self, tiles):
        grid = self.parts[0].tile_grid(tiles)
        for part in self.parts[1:]:  # the OR is the max
            grid = torch.maximum(grid, part.tile_grid(tiles))
        return grid

    def mask_mod(self, b, h, q_idx, kv_idx, *, q_offset=0, kv_offset=0):
        keep = self.parts[0].mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        for part in self.parts[1:]:
            keep = keep | part.mask_mod(b, h, q_idx, kv_idx, q_offset=q_offset, kv_offset=kv_offset)
        return keep

    def block_status(self, q_range, kv_range, *, q_offset=0, kv_offset=0, batch_size=None, num_heads=None):
        states = [
            p.block_status(q_range, kv_range, q_offset=q_offset, kv_offset=kv_offset, batch_size=batch_size,
                           num_heads=num_heads)
            for p in self.parts
        ]
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
                "Fix: an additive float mask (0 = attend, -inf = blocked) goes to bias= (or attn_mask= of "
                "attention()); a 0/1 float mask with 1 = attend becomes `mask=(m == 1)`."
            )
        return Dense(mask)
    raise TypeError(
        f"{name}: expected an attnkit Mask (Causal(), SlidingWindow(...), ...) or a bool tensor, "
        f"got {type(mask).__name__}."
    )


