"""Layer caches that run attention over their own storage (int8, paged).

A contiguous cache hands ``(k_all, v_all)`` to :func:`attnkit.attention`. A quantized or paged
cache would have to build a full-precision, contiguous copy of itself for that, every step; a
:class:`DirectLayerCache` instead appends the new keys and calls the decode kernel
(:mod:`attnkit.backends.decode`) on its int8 values or its pages. ``MultiHeadAttention`` calls
:meth:`DirectLayerCache.attend` instead of ``update`` + ``attention()``.

The kernel runs when the layer's backend is ``"auto"`` or ``"decode"``, nothing needs gradients
and a call has at most ``MAX_QUERIES`` queries (decoding). Otherwise the *gather fallback*
copies the cache into contiguous tensors of the query dtype and calls ``attention()`` with the
named backend. A prefill over an empty cache attends its new keys directly, in full precision
(through ``attention()`` with the layer's backend), on either path.
:meth:`DirectLayerCache.explain` says which path a call takes and why.

These are inference caches: stored keys are detached. Where gradients are enabled and needed,
the gather fallback runs and they reach the queries (and, in a prefill over an empty cache, the
new keys and values).

Rows of a batch may hold different lengths (paged caches: continuous batching). Masks are
evaluated at each row's absolute positions (rows of equal length together), so any mask is exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backends.decode import MAX_QUERIES, DecodeOptions
from ..functional import attention
from ..masks import BlockStatus, Dense, Mask
from .layers import LayerCache

__all__ = ["DirectLayerCache"]


def _check_finite(k: Tensor, v: Tensor, what: str) -> None:
    """Direct caches store finite values only: int8 has no NaN/Inf, and a paged cache's blocks are
    reused by other sequences (so the kernel can skip zeroing the slots a row does not own)."""
    if not (torch.isfinite(k).all() and torch.isfinite(v).all()):
        raise ValueError(
            f"k, v: {what} cannot store NaN or Inf keys/values, got non-finite entries. "
            "Fix: find where the model produced them, or decode with a static or dynamic cache."
        )


def nbytes(*tensors: Tensor | None) -> int:
    """Bytes held by the given buffers (None: not allocated)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class DirectLayerCache(LayerCache):
    """Base of the caches that attend over their own storage. Subclasses implement the storage:
    ``_store(k, v) -> lengths before the append``, ``_kernel``, ``_gather`` and ``_key_slots``."""

    kind: str = "direct"

    # -- storage interface (subclasses) ---------------------------------------------------------
    def row_lengths(self) -> list[int]:
        """Tokens held by each row of the current batch."""
        raise NotImplementedError

    def _store(self, k: Tensor, v: Tensor) -> list[int]:
        raise NotImplementedError

    def _key_slots(self) -> int:
        """Length of the key axis the kernel and the gather see (>= every row's length)."""
        raise NotImplementedError

    def _kernel(self, q: Tensor, keep: Tensor | None, scale: float | None, options) -> Tensor:
        raise NotImplementedError

    def _gather(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The cache as contiguous ``(B, Hkv, _key_slots(), D)`` tensors of ``dtype`` (a copy)."""
        raise NotImplementedError

    # -- shared logic ---------------------------------------------------------------------------
    def positions(self, length: int, device=None) -> Tensor:
        """Absolute positions ``(B, length)`` of the next ``length`` tokens of each row."""
        start = torch.tensor(self.row_lengths(), dtype=torch.long, device=device)
        return start[:, None] + torch.arange(length, device=device)

    def _path(self, q: Tensor, backend: str, requires_grad: bool) -> str | None:
        """None when the decode kernel reads the storage; else why the gather fallback runs."""
        if backend not in ("auto", "decode"):
            return f"backend {backend!r} was named (only 'decode' reads this cache directly)"
        if requires_grad:
            return "the inputs require grad (the direct read is inference-only)"
        if q.shape[2] > MAX_QUERIES:
            return f"Tq={q.shape[2]} > {MAX_QUERIES} queries (a prefill: a dense backend is faster)"
        return None

    def explain(self, q: Tensor, *, backend: str = "auto") -> str:
        """How :meth:`attend` would run queries ``q (B, Hq, Tq, D)`` (one sentence)."""
        why = self._path(q, backend, torch.is_grad_enabled() and q.requires_grad)
        if why is None:
            return f"{self.kind} cache read directly by the decode kernel (split-K, LSE merge, no contiguous copy)"
        return (f"gather fallback: {self.kind} cache copied into contiguous {q.dtype} K/V, then attention(backend="
                f"{backend!r}), because {why}")

    def keep_mask(self, mask: Mask | None, Tq: int, before: list[int], slots: int, device) -> Tensor | None:
        """``(B, H|1, Tq, slots)`` bool for queries at ``before[b] .. before[b] + Tq - 1`` of each
        row over key slots ``0 .. slots - 1`` (slots past a row's length are hidden), or None when
        nothing is hidden."""
        B = len(before)
        groups: dict[int, list[int]] = {}
        for row, L in enumerate(before):
            groups.setdefault(L, []).append(row)
        if len(groups) == 1 and before[0] + Tq == slots and (
            mask is None or mask.block_status((before[0], slots), (0, slots), q_offset=before[0], kv_offset=0)
            is BlockStatus.FULL
        ):
            return None
        parts, rows = [], []
        for L, members in groups.items():
            idx = torch.arange(slots, device=device)
            keep = (idx < L + Tq).view(1, 1, 1, slots).expand(1, 1, Tq, slots)
            if mask is not None:
                inner = mask.materialize(Tq, L + Tq, q_offset=L, kv_offset=0, device=device)  # (B|1, H|1, Tq, L+Tq)
                if inner.shape[0] > 1:
                    inner = inner[members]
                pad = inner.new_zeros(*inner.shape[:3], slots - L - Tq)
                keep = torch.cat([inner, pad], dim=-1) & keep
            parts.append(keep.expand(len(members) if keep.shape[0] == 1 else keep.shape[0], *keep.shape[1:]))
            rows += members
        H = max(p.shape[1] for p in parts)
        keep = torch.cat([p.expand(p.shape[0], H, Tq, slots) for p in parts])
        order = torch.empty(B, dtype=torch.long)
        order[torch.tensor(rows)] = torch.arange(B)
        return keep.index_select(0, order.to(keep.device)) if rows != list(range(B)) else keep

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | None = None, scale: float | None = None,
               backend: str = "auto", options=None) -> Tensor:
        """Append ``k, v (B, Hkv, Tq, ·)`` (the new tokens of ``q (B, Hq, Tq, D)``) and return
        attention of ``q`` over everything cached, ``(B, Hq, Tq, Dv)``; see the module docstring."""
        Tq = q.shape[2]
        requires_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        before = self._store(k.detach(), v.detach())  # an inference cache: stored keys carry no graph
        why = self._path(q, backend, requires_grad)
        fallback = backend if backend != "decode" or why is None else "auto"
        if not any(before):  # a prefill over an empty cache: the new keys are all there is (full precision)
            return attention(q, k, v, mask=mask, scale=scale, q_offset=0, backend=fallback, options=options)
        if why is None:
            slots = self._key_slots()
            keep = self.keep_mask(mask, Tq, before, slots, q.device)
            return self._kernel(q, keep, scale, options if isinstance(options, DecodeOptions) else None)
        if len(set(before)) == 1:
            L = before[0]
            k_all, v_all = self._gather(q.dtype)
            k_all, v_all = k_all[:, :, : L + Tq], v_all[:, :, : L + Tq]
            return attention(q, k_all, v_all, mask=mask, scale=scale, q_offset=L, backend=fallback, options=options)
        slots = self._key_slots()
        keep = self.keep_mask(mask, Tq, before, slots, q.device)
        k_all, v_all = self._gather(q.dtype)
        return attention(q, k_all, v_all, mask=None if keep is None else Dense(keep), scale=scale,
                         backend=fallback, options=options)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """``LayerCache.update`` for code that needs contiguous K/V: appends, then returns a
        full-precision copy of every row's keys (rows must hold equal lengths)."""
        before = self._store(k.detach(), v.detach())
        if len(set(before)) != 1:
            raise ValueError(
                f"update: the rows hold different lengths {before}; contiguous K/V cannot express that. "
                "Fix: call attend() (MultiHeadAttention does)."
            )
        n = before[0] + k.shape[2]
        k_all, v_all = self._gather(k.dtype)
        return k_all[:, :, :n], v_all[:, :, :n], 0
