"""Helpers shared by the gathered backends (sliding_window, block_sparse)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..inputs import AttentionInputs


def grouped(x: Tensor, Hkv: int) -> Tensor:
    """``(B|1, Hq|1, N, c, L)`` -> ``(B|1, Hkv|1, N, G|1, c, L)`` (query head h uses kv head h // G)."""
    if x.shape[1] == 1:
        return x.unsqueeze(3)
    return x.view(x.shape[0], Hkv, -1, *x.shape[2:]).transpose(2, 3)


def softmax_parts(scores: Tensor, inplace: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(e, denom, lse)`` for masked (``-inf``) scores: ``e = exp(scores - rowmax)`` (unnormalized:
    divide ``e @ v`` by ``safe(denom)`` — one pass over Dv instead of over the keys), the row sums
    and the log-sum-exp. Rows with nothing kept give ``e = 0``, ``denom = 0``, LSE ``-inf`` and
    finite gradients (the max is detached and 0 there). ``inplace`` reuses ``scores`` (no autograd)."""
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    e = scores.sub_(row_max).exp_() if inplace else torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    return e, denom, (torch.log(denom) + row_max).squeeze(-1)


def safe(denom: Tensor) -> Tensor:
    """``denom`` with zeros (fully masked rows) replaced by 1, so their output stays 0."""
    return torch.where(denom == 0, 1.0, denom)


def kv_finite(inp: AttentionInputs) -> bool:
    """True when K and V hold no NaN/Inf, so dead keys need no zeroing."""
    return bool(torch.isfinite(inp.k).all()) and bool(torch.isfinite(inp.v).all())


def mask_on(mask, inp: AttentionInputs, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``mask.mask_mod`` on gathered absolute positions ``q_pos (N, c)`` × ``k_pos (N, L)``:
    a bool tensor ``(B|1, Hq|1, N, c, L)``."""
    b, h = mask.batch_head_index(inp.B, inp.Hq, device=q_pos.device)
    b, h = b[..., None], h[..., None]  # (B|1, 1, 1, 1, 1), (1, Hq|1, 1, 1, 1)
    keep = mask.mask_mod(b, h, q_pos[None, None, :, :, None], k_pos[None, None, :, None, :],
                         q_offset=inp.q_offset, kv_offset=inp.kv_offset)
    return keep.expand(torch.broadcast_shapes(keep.shape, (1, 1, *q_pos.shape, k_pos.shape[-1])))


def upcast_on_cpu(inp: AttentionInputs) -> AttentionInputs:
    """float16/bfloat16 inputs on CPU as float32 (half-precision matmuls without hardware support
    run ~100x slower there, and float32 products round less); the caller casts the output back."""
    if inp.device.type != "cpu" or inp.dtype not in (torch.float16, torch.bfloat16):
        return inp
    return dataclasses.replace(inp, q=inp.q.float(), k=inp.k.float(), v=inp.v.float())
