"""The oracle: attention in float64 from the materialized mask, written independently of the
backends (no shared helpers), plus the flash-attn comparison rule."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.masks import as_mask


def reference_attention(q, k, v, *, mask=None, bias=None, scale=None, q_offset=None, kv_offset=0):
    """float64 attention: ``(out (B, Hq, Tq, Dv), lse (B, Hq, Tq))``, fully masked rows 0 / -inf."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(Hq // Hkv, dim=1)
    v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = D**-0.5 if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if bias is not None:
        scores = scores + bias.double()
    if mask is not None:
        keep = as_mask(mask).materialize(Tq, Tk, q_offset=q_offset, kv_offset=kv_offset, device=q.device,
                                         batch_size=B, num_heads=Hq)
        keep = keep.expand(B, Hq, Tq, Tk)
    else:
        keep = torch.ones(B, Hq, Tq, Tk, dtype=torch.bool, device=q.device)
    # Keys no query may see are dropped from V too, so NaN there cannot leak (0 * NaN).
    seen = keep.any(dim=2, keepdim=True).transpose(-1, -2)  # (B, Hq, Tk, 1)
    v = torch.where(seen, v, 0.0)
    scores = torch.where(keep, scores, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    dead = torch.isinf(lse)[..., None]
    probs = torch.where(dead, 0.0, torch.exp(scores - torch.where(dead, 0.0, lse[..., None])))
    out = torch.einsum("bhqk,bhkd->bhqd", probs, v)
    return out, lse


def max_error(x: Tensor, ref: Tensor) -> float:
    return float((x.double() - ref.double()).abs().max()) if x.numel() else 0.0


def flash_rule_ok(err: float, naive_err: float, *, factor: float, dtype: torch.dtype) -> bool:
    """flash-attn's rule: error at most ``factor`` x the naive backend's error in the same dtype,
    plus a floor for the (near) exact cases where naive's error is ~0."""
    floor = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-3, torch.float16: 2e-4}[dtype]
    return err <= factor * naive_err + floor
