"""Decode attention: few queries over a long KV cache, split over the keys with an LSE merge.

Decoding reads the whole cache for every new token, so its speed limit is memory bandwidth. This
kernel (flash-decoding, https://crfm.stanford.edu/2023/10/12/flashdecoding.html) splits the keys
into segments; each segment yields a partial result — its row max ``m``, its softmax mass ``l``
and ``sum_j exp(s_j - m) v_j`` — and the partials are merged exactly with their log-sum-exp.
It computes the same thing as the naive backend::

    softmax(q kᵀ · scale + bias, masked) v      (fully masked rows: 0, LSE -inf)

and differs only in how the keys are read:

* **GQA without expansion**: the ``G = Hq // Hkv`` query heads that share a K/V head are stacked
  into one ``(G·Tq, D)`` block, so every key is read once per K/V head (SDPA reads it ``G`` times).
* **Low-precision caches without a full-precision copy**: bf16/fp16 keys and int8 keys with
  per-token, per-head scales (:mod:`attnkit.cache.quantized`) are converted one segment at a time;
  the int8 scales are folded into the scores (``s = (q · k_int8) · k_scale``) and the
  probabilities (``p · v_scale``), so a segment's conversion is its only extra memory.
* **Paged caches**: the segments are gathered from a block pool through a block table, a bounded
  segment at a time (:mod:`attnkit.cache.paged`); the whole cache is never made contiguous.

Every segment is one batched matmul over ``(batch, K/V head)`` pairs, so PyTorch's intra-op
threads run the split across cores. Accumulation is in float32 (float64 for float64 inputs).

The registered backend ``decode`` runs the contiguous case through :func:`attnkit.attention`
(``backend="decode"``) for up to :data:`MAX_QUERIES` queries; the caches call
:func:`decode_attention` / :func:`paged_decode_attention` directly. Its naive twin is the
``naive`` backend (tests compare both against the float64 oracle).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..inputs import AttentionInputs
from ..registry import Backend, register_backend

__all__ = ["DecodeOptions", "decode_attention", "paged_decode_attention", "MAX_QUERIES"]

#: Above this many queries per call the score block ``(G·Tq, segment)`` stops being small and a
#: tiled prefill kernel is the right tool; the backend declines with a reason.
MAX_QUERIES = 64

# Default segment size: the converted (float32) K and V of one segment for all (batch, head)
# pairs stay near this many bytes, small enough to live in the last-level cache.
_SEGMENT_BYTES = 8 * 2**20


@dataclass(frozen=True)
class DecodeOptions:
    """``segment_tokens``: keys per split (rounded up to whole pages for paged caches); ``None``
    picks about 8 MiB of converted K/V per segment (the whole cache in one split when it is
    already float32 and small)."""

    segment_tokens: int | None = None

    def __post_init__(self):
        s = self.segment_tokens
        if s is not None and (not isinstance(s, int) or isinstance(s, bool) or s < 1):
            raise ValueError(f"DecodeOptions.segment_tokens: expected a positive int or None, got {s!r}.")


@dataclass
class _Segment:
    """One split of the keys, laid out to broadcast against scores ``(P1, P2, G, Tq, C)``."""

    k: Tensor  # (P1, P2, C, D), any dtype
    v: Tensor  # (P1, P2, C, Dv)
    k_scale: Tensor | None  # (P1, P2, C) int8 dequantization scales
    v_scale: Tensor | None
    keep: Tensor | None  # bool, broadcastable to (P1, P2, G, Tq, C)
    bias: Tensor | None  # float, broadcastable to (P1, P2, G, Tq, C)


def _merge_segments(q: Tensor, segments: Iterator[_Segment], G: int, scale: float, acc: torch.dtype):
    """The split-K core: ``q (P1, P2, G·Tq, D)`` against each segment; returns the normalized
    output ``(P1, P2, G·Tq, Dv)`` in ``acc`` and the LSE ``(P1, P2, G·Tq)``."""
    P1, P2, M, _ = q.shape
    Tq = M // G
    qa = q.to(acc)
    m = l = o = None
    for seg in segments:
        k = seg.k if seg.k.dtype == acc else seg.k.to(acc)  # one segment converted at a time
        s = torch.matmul(qa, k.transpose(-2, -1))  # (P1, P2, M, C)
        s = s * (scale if seg.k_scale is None else seg.k_scale.unsqueeze(-2) * scale)
        C = s.shape[-1]
        s5 = s.view(P1, P2, G, Tq, C)
        if seg.bias is not None:
            s5 = s5 + seg.bias
        v = seg.v if seg.v.dtype == acc else seg.v.to(acc)
        if seg.keep is not None:
            s5 = s5.masked_fill(~seg.keep, float("-inf"))
            # Keys no query of a (batch, head) may see are zeroed, so NaN/Inf there cannot reach
            # the output through 0 * NaN in p @ v.
            dead = ~seg.keep.flatten(-3, -2).any(-2)  # (P1|1, P2|1, C)
            v = v.masked_fill(dead.unsqueeze(-1), 0)
        s = s5.reshape(P1, P2, M, C)
        m_seg = s.amax(-1, keepdim=True)  # (P1, P2, M, 1); -inf for a fully masked split
        m_seg = m_seg.masked_fill(torch.isinf(m_seg), 0.0)  # exp(-inf - 0) = 0, never NaN
        p = torch.exp(s - m_seg)
        l_seg = p.sum(-1, keepdim=True)
        if seg.v_scale is not None:
            p = p * seg.v_scale.unsqueeze(-2)
        o_seg = torch.matmul(p, v)  # (P1, P2, M, Dv)
        if o is None:
            m, l, o = m_seg, l_seg, o_seg
            continue
        m_new = torch.maximum(m, m_seg)  # merge two partials exactly (log-sum-exp rescaling)
        a, b = torch.exp(m - m_new), torch.exp(m_seg - m_new)
        m, l, o = m_new, l * a + l_seg * b, o * a + o_seg * b
    out = o / torch.where(l == 0, 1.0, l)
    lse = (torch.log(l) + m).squeeze(-1)  # log(0) = -inf for fully masked rows
    return out, lse


def _segment_tokens(options: DecodeOptions | None, per_token_bytes: int, converts: bool, total: int) -> int:
    if options is not None and options.segment_tokens is not None:
        return options.segment_tokens
    n = max(64, _SEGMENT_BYTES // max(per_token_bytes, 1))
    return total if not converts and total * per_token_bytes <= 4 * _SEGMENT_BYTES else n


def _grouped(x: Tensor | None, Hkv: int, G: int, heads_first: bool) -> Tensor | None:
    """A mask or bias ``(B|1, Hq|1, Tq, Tk)`` as ``(B|1, Hkv|1, G|1, Tq, Tk)`` (view), batch and
    head dims swapped when ``heads_first``."""
    if x is None:
        return None
    while x.dim() < 4:
        x = x.unsqueeze(0)
    B_, H_, Tq_, Tk_ = x.shape
    x = x.reshape(B_, Hkv, G, Tq_, Tk_) if H_ != 1 else x.reshape(B_, 1, 1, Tq_, Tk_)
    return x.transpose(0, 1) if heads_first else x


def _finish(out: Tensor, lse: Tensor, B: int, Hq: int, Tq: int, dtype, heads_first: bool, return_lse: bool):
    if heads_first:
        out, lse = out.transpose(0, 1), lse.transpose(0, 1)  # (B, Hkv, G·Tq, ·)
    out = out.reshape(B, Hq, Tq, out.shape[-1]).to(dtype)  # (B, Hkv, G, Tq, Dv) -> (B, Hq, Tq, Dv)
    return (out, lse.reshape(B, Hq, Tq)) if return_lse else out


def decode_attention(q: Tensor, k: Tensor, v: Tensor, *, keep: Tensor | None = None, bias: Tensor | None = None,
                     scale: float | None = None, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                     options: DecodeOptions | None = None, return_lse: bool = False):
    """Attention of ``q (B, Hq, Tq, D)`` over a contiguous cache ``k (B, Hkv, Tk, D)``,
    ``v (B, Hkv, Tk, Dv)`` of any float dtype, or int8 with ``k_scale``/``v_scale (B, Hkv, Tk)``
    (key ``j`` is ``k[..., j, :] * k_scale[..., j]``). ``keep``: a bool mask broadcastable to
    ``(B, Hq, Tq, Tk)`` (True = attend); ``bias``: additive scores of that shape. Returns
    ``(B, Hq, Tq, Dv)`` in q's dtype (and the float32 LSE ``(B, Hq, Tq)`` with ``return_lse``)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    per_token = B * Hkv * (k.shape[-1] + v.shape[-1]) * torch.finfo(acc).bits // 8
    seg = _segment_tokens(options, per_token, converts=k.dtype != acc, total=Tk)
    keep5, bias5 = _grouped(keep, Hkv, G, False), _grouped(bias, Hkv, G, False)

    def segments() -> Iterator[_Segment]:
        for t0 in range(0, Tk, seg):
            t1 = min(Tk, t0 + seg)
            yield _Segment(k[:, :, t0:t1], v[:, :, t0:t1],
                           None if k_scale is None else k_scale[:, :, t0:t1],
                           None if v_scale is None else v_scale[:, :, t0:t1],
                           None if keep5 is None else keep5[..., t0:t1],
                           None if bias5 is None else bias5[..., t0:t1])

    qg = q.reshape(B, Hkv, G * Tq, D)  # (B, Hkv, G·Tq, D): the query heads sharing a K/V head
    out, lse = _merge_segments(qg, segments(), G, scale, acc)
    return _finish(out, lse, B, Hq, Tq, q.dtype, False, return_lse)


def paged_decode_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, *,
                           keep: Tensor | None = None, scale: float | None = None, k_scale: Tensor | None = None,
                           v_scale: Tensor | None = None, options: DecodeOptions | None = None,
                           return_lse: bool = False):
    """Attention of ``q (B, Hq, Tq, D)`` over a paged cache: pools ``k_pool (Hkv, N, bs, D)``,
    ``v_pool (Hkv, N, bs, Dv)`` (int8 with scales ``(Hkv, N, bs)``), and ``block_table (B, nb)``
    listing each row's blocks in order (key ``j`` of row ``b`` is slot ``j % bs`` of block
    ``block_table[b, j // bs]``). ``keep`` broadcastable to ``(B, Hq, Tq, nb·bs)`` must hide the
    slots past each row's length. Pages are gathered one bounded segment at a time."""
    B, Hq, Tq, D = q.shape
    Hkv, _, bs, _ = k_pool.shape
    G = Hq // Hkv
    nb = block_table.shape[1]
    scale = D**-0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)
    per_token = B * Hkv * (k_pool.shape[-1] + v_pool.shape[-1]) * torch.finfo(acc).bits // 8
    seg_blocks = max(1, -(-_segment_tokens(options, per_token, converts=True, total=nb * bs) // bs))
    keep5 = _grouped(keep, Hkv, G, True)

    def gather(pool: Tensor | None, cols: Tensor) -> Tensor | None:
        if pool is None:
            return None
        pages = pool[:, cols]  # (Hkv, B, n, bs, ...): this segment's pages only
        return pages.reshape(Hkv, B, -1, *pool.shape[3:])

    def segments() -> Iterator[_Segment]:
        for j0 in range(0, nb, seg_blocks):
            cols = block_table[:, j0:j0 + seg_blocks]
            t0, t1 = j0 * bs, (j0 + cols.shape[1]) * bs
            yield _Segment(gather(k_pool, cols), gather(v_pool, cols), gather(k_scale, cols),
                           gather(v_scale, cols), None if keep5 is None else keep5[..., t0:t1], None)

    qg = q.reshape(B, Hkv, G * Tq, D).transpose(0, 1)  # (Hkv, B, G·Tq, D), like the pool
    out, lse = _merge_segments(qg, segments(), G, scale, acc)
    return _finish(out, lse, B, Hq, Tq, q.dtype, True, return_lse)


@register_backend
class Decode(Backend):
    """``attention(..., backend="decode")``: :func:`decode_attention` on contiguous K/V.

    Equals the naive backend (same masked softmax, fp32 statistics); any mask (materialized:
    at most ``B·Hq·MAX_QUERIES·Tk`` booleans), bias, GQA without expanding K/V, offsets, LSE.
    Gradients flow through the PyTorch ops (correct, not memory-optimized)."""

    name = "decode"
    summary = "decode: few queries over long K/V, split-K with LSE merge, GQA without expanding K/V"
    supports_bias = True
    supports_lse = True
    Options = DecodeOptions

    @classmethod
    def extra_reasons(cls, inp: AttentionInputs):
        if inp.Tq > MAX_QUERIES:
            return [f"is for decoding: Tq={inp.Tq} > {MAX_QUERIES} queries (use a prefill backend)"]
        return ()

    @classmethod
    def describe(cls, inp: AttentionInputs) -> str:
        return (f"split-K decode over Tk={inp.Tk} keys, {inp.groups} query head(s) per K/V head read together, "
                "fp32 statistics")

    @classmethod
    def forward(cls, inp: AttentionInputs, options: DecodeOptions | None):
        return decode_attention(inp.q, inp.k, inp.v, keep=inp.materialize_mask(), bias=inp.bias, scale=inp.scale,
                                options=options, return_lse=inp.return_lse)
