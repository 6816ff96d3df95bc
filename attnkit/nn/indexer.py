"""DeepSeek-V3.2's lightning indexer: which keys each query attends under DeepSeek Sparse Attention.

A small multi-head scorer (DeepSeek-V3.2: 64 heads of 128 dims, one key per token shared by every
head) rates every past key for each query::

    score[b, i, j] = Σ_h  weights[b, h, i] · ReLU(scale · q[b, h, i] · k[b, j])

and the query attends its ``topk`` best keys (2048 in DeepSeek-V3.2). :func:`lightning_indexer`
returns those as the key lists of a :class:`~attnkit.masks.TopK` mask, so ``attention(q, k, v,
mask=TopK(idx) & Causal())`` runs on the ``topk`` gather backend::

    idx = lightning_indexer(iq, ik, w, topk=2048)               # (B, 1, Tq, 2048), -1 padded
    out = attnkit.attention(q, k, v, mask=TopK(idx) & Causal())

``scale`` defaults to ``D ** -0.5`` of the indexer's head dim, as in the reference; DeepSeek's
weights are ``weights_proj(x) * H ** -0.5`` (transformers' ``DeepseekV32Indexer`` multiplies the
projection by the head count's inverse square root before calling its scorer): pass them so scaled.
Scores are computed in float32 (float64 for float64 inputs), a block of queries at a time, so
memory is O(block · H · Tk), never ``(Tq, Tk)`` per head. For decoding, :class:`~attnkit.cache.IndexerKeyCache`
keeps the indexer's keys next to the model's KV cache.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._validate import positive_int
from ..masks import Causal, Mask
from ..varlen import check_packed_offsets

__all__ = ["indexer_scores", "lightning_indexer", "varlen_lightning_indexer"]

#: Elements of one block's per-head scores ``(B, H, block, Tk)``: the block follows from the shapes.
BLOCK_ELEMENTS = 1 << 24


def _check(q, k, weights) -> None:
    for name, x, dims, shape in (("q", q, 4, "(B, H, Tq, D)"), ("k", k, 4, "(B, 1, Tk, D)"),
                                 ("weights", weights, 3, "(B, H, Tq)")):
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor {shape}, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}.")
        if x.dim() != dims:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}.")
    B, H, Tq, D = q.shape
    if k.shape[0] != B or k.shape[1] != 1 or k.shape[3] != D:
        raise ValueError(f"k: expected the indexer's keys (B, 1, Tk, D) = ({B}, 1, Tk, {D}) (one key per token, shared "
                         f"by every indexer head), got {tuple(k.shape)}. Fix: k.view(B, 1, Tk, D).")
    if tuple(weights.shape) != (B, H, Tq):
        raise ValueError(f"weights: expected one weight per query and indexer head (B, H, Tq) = ({B}, {H}, {Tq}), "
                         f"got {tuple(weights.shape)}. Fix: transpose a (B, Tq, H) projection: w.transpose(1, 2).")


def _scores(q: Tensor, k: Tensor, weights: Tensor, scale: float, rows: slice) -> Tensor:
    """Scores ``(B, rows, Tk)`` of the queries ``rows`` in the accumulation dtype."""
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q[:, :, rows].to(acc), k.to(acc).transpose(-1, -2)).mul_(scale).relu_()  # (B, H, c, Tk)
    return torch.einsum("bhc,bhct->bct", weights[:, :, rows].to(acc), s)


def _blocks(q: Tensor, Tk: int):
    B, H, Tq, _ = q.shape
    block = max(1, BLOCK_ELEMENTS // max(1, B * H * Tk))
    return (slice(a, min(a + block, Tq)) for a in range(0, Tq, block))


def indexer_scores(q: Tensor, k: Tensor, weights: Tensor, *, scale: float | None = None) -> Tensor:
    """``Σ_h weights[b, h, i] · ReLU(scale · q[b, h, i] · k[b, 0, j])``: ``(B, Tq, Tk)`` in float32
    (float64 for float64 inputs), for ``q (B, H, Tq, D)``, ``k (B, 1, Tk, D)``, ``weights (B, H, Tq)``.
    ``scale`` defaults to ``D ** -0.5``."""
    _check(q, k, weights)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.cat([_scores(q, k, weights, scale, rows) for rows in _blocks(q, k.shape[2])], dim=1)


def lightning_indexer(
    q: Tensor, k: Tensor, weights: Tensor, topk: int, *, causal: bool = True, mask: Mask | None = None,
    scale: float | None = None, q_offset: int | None = None, kv_offset: int = 0,
) -> Tensor:
    """The ``topk`` best-scoring keys of each query (:func:`indexer_scores`) as ``TopK`` lists:
    ``(B, 1, Tq, min(topk, Tk))`` int64 absolute key positions (``kv_offset + j``), ``-1`` where a
    query may see fewer keys than that. Queries sit at ``q_offset ..`` (default: the last query
    aligned with the last key, as every attnkit mask); ``causal=True`` excludes later keys, and
    ``mask`` (any attnkit mask, e.g. ``KeyPadding``) excludes more. Ties go to ``torch.topk``."""
    _check(q, k, weights)
    topk = positive_int(topk, "topk", owner="lightning_indexer", fix="pass the number of keys per query, e.g. 2048")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {type(causal).__name__} {causal!r}.")
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    q_offset = kv_offset + Tk - Tq if q_offset is None else q_offset
    scale = D ** -0.5 if scale is None else float(scale)
    allowed = mask if not causal else Causal() if mask is None else mask & Causal()
    width = min(topk, Tk)
    out = torch.full((B, 1, Tq, width), -1, dtype=torch.long, device=q.device)
    if width == 0:
        return out
    for rows in _blocks(q, Tk):
        s = _scores(q, k, weights, scale, rows)  # (B, c, Tk)
        if allowed is not None:
            keep = allowed.evaluate((q_offset + rows.start, q_offset + rows.stop), (kv_offset, kv_offset + Tk),
                                    q_offset=q_offset, kv_offset=kv_offset, device=q.device, batch_size=B,
                                    num_heads=1)  # (B|1, 1, c, Tk)
            s = s.masked_fill(~keep[:, 0], float("-inf"))
        best, idx = s.topk(width, dim=-1)
        out[:, 0, rows] = torch.where(best == float("-inf"), -1, idx + kv_offset)
    return out


def varlen_lightning_indexer(
    q: Tensor, k: Tensor, weights: Tensor, topk: int, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
    causal: bool = True, scale: float | None = None,
) -> Tensor:
    """:func:`lightning_indexer` over packed sequences (flash-attn's varlen layout): ``q (total_q, H, D)``,
    ``k (total_k, D)``, ``weights (total_q, H)``; sequence ``i`` holds query rows
    ``cu_seqlens_q[i] ..`` and key rows ``cu_seqlens_k[i] ..``, its last query aligned with its last
    key. Returns ``(total_q, min(topk, longest key sequence))`` int64 **packed key rows** (rows of
    ``k``), ``-1`` padded: each query lists keys of its own sequence only, so
    ``TopK(idx[None, None])`` over the packed stream needs no document mask."""
    for name, x, dims in (("q", q, 3), ("k", k, 2), ("weights", weights, 2)):
        if not isinstance(x, Tensor) or x.dim() != dims:
            raise ValueError(f"{name}: expected a packed tensor with {dims} dims (q (total_q, H, D), k (total_k, D), "
                             f"weights (total_q, H)), got {tuple(getattr(x, 'shape', ())) or type(x).__name__}.")
    lengths_q = check_packed_offsets(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    lengths_k = check_packed_offsets(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(lengths_q) != len(lengths_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k: expected the same number of sequences, got "
                         f"{len(lengths_q)} and {len(lengths_k)}.")
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    longest = max(lengths_k, default=0)
    width = min(positive_int(topk, "topk", owner="varlen_lightning_indexer"), longest)
    out = torch.full((q.shape[0], width), -1, dtype=torch.long, device=q.device)
    for (q0, q1), (k0, k1) in zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:])):
        if q1 == q0 or k1 == k0:
            continue
        idx = lightning_indexer(q[q0:q1].transpose(0, 1)[None], k[None, None, k0:k1], weights[q0:q1].T[None],
                                topk, causal=causal, scale=scale)[0, 0]  # (Tq_i, min(topk, Tk_i))
        out[q0:q1, : idx.shape[-1]] = torch.where(idx >= 0, idx + k0, -1)
    return out
