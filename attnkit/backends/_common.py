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


def nonfinite_keys(inp: AttentionInputs) -> Tensor | None:
    """``(B, Hkv, Tk)`` bool, True where a key's K or V row holds NaN/Inf; None when every query sees
    every key (no mask, or causal with every query at or after the last key), where such a key
    poisons every row anyway. Computed on the device, without a host sync.

    Backends attend the zeroed K/V of :func:`finite_kv` and set the rows that do attend a non-finite
    key to NaN with :func:`poison_rows`: NaN/Inf in what a row attends gives NaN in that row only,
    NaN/Inf in what it may not see changes nothing (``0 * NaN`` never reaches ``p @ v``)."""
    mask = inp.mask
    if mask is None or (mask.is_causal() and inp.q_offset >= inp.kv_offset + inp.Tk - 1):
        return None
    return ~(torch.isfinite(inp.k).all(-1) & torch.isfinite(inp.v).all(-1))


def finite_kv(inp: AttentionInputs, bad: Tensor | None) -> AttentionInputs:
    """``inp`` with the keys flagged by :func:`nonfinite_keys` zeroed in K and V."""
    if bad is None:
        return inp
    return dataclasses.replace(inp, k=inp.k.masked_fill(bad[..., None], 0), v=inp.v.masked_fill(bad[..., None], 0))


def poison_rows(out: Tensor, lse: Tensor, rows: Tensor | None) -> tuple[Tensor, Tensor]:
    """``out (B, Hq, Tq, Dv)`` and ``lse (B, Hq, Tq)`` set to NaN where ``rows (B|1, Hq|1, Tq)`` is True."""
    if rows is None:
        return out, lse
    return out.masked_fill(rows[..., None], float("nan")), lse.masked_fill(rows, float("nan"))


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
    return keep.expand(torch.broadcast_shapes(keep.shape, (1, 1, *q_pos.shape, k_pos.shape[-1])))


def upcast_on_cpu(inp: AttentionInputs) -> AttentionInputs:
    """float16/bfloat16 inputs on CPU as float32 (half-precision matmuls without hardware support
    run ~100x slower there, and float32 products round less); the caller casts the output back."""
    if inp.device.type != "cpu" or inp.dtype not in (torch.float16, torch.bfloat16):
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


def with_sink_column(inp: AttentionInputs, scores: Tensor) -> Tensor:
    """Gathered scores ``(B, Hkv, N, G, c, L)`` with one more column holding each head's sink logit
    (it joins the softmax normaliser; the caller gives it no value)."""
    B, Hkv, N, G, c, _ = scores.shape
    sink = inp.sinks.to(scores.dtype).view(1, Hkv, 1, G, 1, 1).expand(B, Hkv, N, G, c, 1)
    return torch.cat([scores, sink], dim=-1)
