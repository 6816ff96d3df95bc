"""Helpers shared by the backends: the softmax parts, grouped views, and the NaN/Inf pieces that
:mod:`attnkit.backends.nonfinite` (the one place that keeps the contract) and the ``native``
kernel use: finding non-finite rows and keys, zeroing keys, setting rows to NaN.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .._validate import broadcast_shapes
from ..hardware import half_matmul_is_fast
from ..inputs import AttentionInputs


def grouped(x: Tensor, Hkv: int) -> Tensor:
    """``(B|1, Hq|1, N, c, L)`` -> ``(B|1, Hkv|1, N, G|1, c, L)`` (query head h uses kv head h // G)."""
    if x.shape[1] == 1:
        return x.unsqueeze(3)
    return x.view(x.shape[0], Hkv, -1, *x.shape[2:]).transpose(2, 3)


def softmax_parts(scores: Tensor, inplace: bool, sink: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(e, denom, lse)`` for masked (``-inf``) scores: ``e = exp(scores - rowmax)`` (unnormalized:
    divide ``e @ v`` by ``safe(denom)`` — one pass over Dv instead of over the keys), the row sums
    and the log-sum-exp. Rows with nothing kept give ``e = 0``, ``denom = 0``, LSE ``-inf`` and
    finite gradients (the max is detached and 0 there). ``inplace`` reuses ``scores`` (no autograd).

    ``sink`` (logits broadcastable to ``scores[..., :1]``) joins every row's normaliser and max
    without a value of its own (attention sinks): a row that keeps nothing then has LSE = sink."""
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    if sink is not None:
        row_max = torch.maximum(row_max, sink.detach())
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    e = scores.sub_(row_max).exp_() if inplace else torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    return e, denom, (torch.log(denom) + row_max).squeeze(-1)


def safe(denom: Tensor) -> Tensor:
    """``denom`` with zeros (fully masked rows) replaced by 1, so their output stays 0."""
    return torch.where(denom == 0, 1.0, denom)


def finite_rows(x: Tensor) -> Tensor:
    """``(..., N, D) -> (..., N)`` bool: the row holds no NaN/Inf. Two reductions (max and min
    propagate NaN and keep ±Inf, and cannot overflow the way a sum can), no full-size temporary."""
    return torch.isfinite(x.amax(dim=-1)) & torch.isfinite(x.amin(dim=-1))


def zero_keys(k: Tensor, v: Tensor, drop: Tensor) -> tuple[Tensor, Tensor]:
    """K and V with the keys flagged in ``drop`` (bool, broadcastable to ``k.shape[:-1]``) set to 0,
    so NaN/Inf there cannot reach a row through ``0 * NaN`` in ``p @ v`` (or in the gradients)."""
    drop = drop[..., None]
    return k.masked_fill(drop, 0), v.masked_fill(drop, 0)


def finite_values(x: Tensor) -> Tensor:
    """``x`` with every NaN/Inf entry replaced by 0 (one pass; finite entries unchanged)."""
    return x.nan_to_num(0.0, posinf=0.0, neginf=0.0)


def poison_rows(out: Tensor, lse: Tensor | None, rows: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``out (B, H, Tq, Dv)`` and ``lse (B, H, Tq)`` (or None) set to NaN where ``rows (B|1, H|1, Tq|1)``
    is True. Adding a per-row 0/NaN column is one cheap broadcast pass; a broadcast ``masked_fill``
    over the row is several times slower. Out of place throughout, so ``torch.func`` transforms work."""
    if rows is None:
        return out, lse
    nan_or_zero = torch.zeros((), dtype=out.dtype, device=out.device).masked_fill(rows, float("nan"))
    out = out + nan_or_zero[..., None]  # out of place: torch.func transforms (vmap) and autograd alike
    return out, None if lse is None else lse.masked_fill(rows, float("nan"))


def nonfinite_queries(q: Tensor) -> Tensor:
    """``(B, H, Tq)`` bool: the query row holds a NaN/Inf."""
    return ~finite_rows(q)


def nonfinite_keys(inp: AttentionInputs) -> Tensor | None:
    """``(B, Hkv, Tk)`` bool, True where a key's K or V row holds NaN/Inf; None when K/V are known
    finite (``inp.kv_finite``: the caller vouches, or :mod:`attnkit.backends.nonfinite` has zeroed
    them) or when every query sees every key (no mask, or causal with every query at or after the
    last key), where such a key poisons every row anyway. Computed on the device, without a host sync."""
    mask = inp.mask
    if inp.kv_finite or mask is None or (mask.is_causal() and inp.q_offset >= inp.kv_offset + inp.Tk - 1):
        return None
    return ~(finite_rows(inp.k) & finite_rows(inp.v))


def connected(out: Tensor, *inputs: Tensor) -> Tensor:
    """``out`` unchanged but in the autograd graph of ``inputs`` with zero gradients, for a call whose
    every row is masked (it computes nothing, yet ``backward()`` must work and give zeros)."""
    never = torch.zeros((), dtype=torch.bool, device=out.device)
    for t in inputs:
        if t is not None and t.requires_grad and t.numel():
            out = out + torch.where(never, t.reshape(-1)[:1].to(out.dtype), 0.0)  # 0, never NaN
    return out


def mask_on(mask, inp: AttentionInputs, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``mask.mask_mod`` on gathered absolute positions ``q_pos (N, c)`` × ``k_pos (N, L)``:
    a bool tensor ``(B|1, Hq|1, N, c, L)``."""
    b, h = mask.batch_head_index(inp.B, inp.Hq, device=q_pos.device)
    b, h = b[..., None], h[..., None]  # (B|1, 1, 1, 1, 1), (1, Hq|1, 1, 1, 1)
    keep = mask.mask_mod(b, h, q_pos[None, None, :, :, None], k_pos[None, None, :, None, :],
                         q_offset=inp.q_offset, kv_offset=inp.kv_offset)
    return keep.expand(broadcast_shapes(keep.shape, (1, 1, *q_pos.shape, k_pos.shape[-1])))


def half_tiles_on_cpu(dtype: torch.dtype, requires_grad: bool) -> bool:
    """Whether a PyTorch-op backend multiplies ``dtype`` tiles in ``dtype`` on a CPU (else in float32).

    bfloat16: where the CPU has half-precision matmul instructions (its features:
    :func:`attnkit.hardware.half_matmul_is_fast`; without them such matmuls run ~100x slower), and
    only without gradients (the backward's cancellations need float32 tiles). float16: never, since a
    float16 matmul rounds its result to float16, whose range (65504) holds neither every q·kᵀ
    (q = k = 256 at D = 80 gives 5.2e6, 5.9e5 even after scaling) nor a tile's p·v sums."""
    return dtype == torch.bfloat16 and not requires_grad and half_matmul_is_fast(dtype)


def upcast_on_cpu(inp: AttentionInputs) -> AttentionInputs:
    """float16/bfloat16 inputs as float32 unless :func:`half_tiles_on_cpu` keeps them; the caller
    casts the output back."""
    if inp.device.type != "cpu" or inp.dtype not in (torch.float16, torch.bfloat16):
        return inp
    if half_tiles_on_cpu(inp.dtype, inp.requires_grad):
        return inp
    return dataclasses.replace(inp, q=inp.q.float(), k=inp.k.float(), v=inp.v.float())


def modify_gathered(inp: AttentionInputs, s: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``inp.score_mod`` on gathered scores ``s (B, Hkv, N, G, c, L)`` whose queries sit at absolute
    positions ``q_pos (N, c)`` and keys at ``k_pos (N, L)`` (query head ``h = kv_head * G + g``)."""
    B, Hkv, _, G = s.shape[:4]
    dev = s.device
    b = torch.arange(B, device=dev).view(-1, 1, 1, 1, 1, 1)
    h = (torch.arange(Hkv, device=dev).view(-1, 1) * G + torch.arange(G, device=dev)).view(1, Hkv, 1, G, 1, 1)
    return inp.score_mod.apply(s, b, h, q_pos[None, None, :, None, :, None], k_pos[None, None, :, None, None, :])


def gathered_sink(inp: AttentionInputs, dtype: torch.dtype) -> Tensor | None:
    """``inp.sinks`` shaped ``(1, Hkv, 1, G, 1, 1)`` for gathered scores ``(B, Hkv, N, G, c, L)``."""
    return None if inp.sinks is None else inp.sinks.to(dtype).view(1, inp.Hkv, 1, inp.groups, 1, 1)
