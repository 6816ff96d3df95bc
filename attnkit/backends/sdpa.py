"""PyTorch's fused kernels through ``F.scaled_dot_product_attention``.

Equals ``naive`` (without the LSE). Takes the ``is_causal`` fast path when the causal mask is
aligned like SDPA's (``q_offset == kv_offset``), drops a causal mask that hides nothing (e.g. a
one-token decode step), and otherwise passes the materialized mask (and bias) as ``attn_mask``.
GQA is native (``enable_gqa``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dispatch import mask_needs_materializing
from ..inputs import AttentionInputs
from ..masks import Causal
from ..registry import Backend, register_backend


@register_backend
class SDPABackend(Backend):
    name = "sdpa"
    summary = "torch.nn.functional.scaled_dot_product_attention (fused flash/efficient/math kernels)"
    supports_dropout = True
    supports_bias = True

    @classmethod
    def describe(cls, inp: AttentionInputs) -> str:
        if inp.mask is None:
            how = "no mask"
        elif not mask_needs_materializing(inp):
            how = "is_causal=True (no mask tensor)" if inp.q_offset == inp.kv_offset and inp.Tk > 1 else (
                "no mask: the causal mask hides nothing for these positions")
        else:
            how = f"a materialized ({inp.Tq}, {inp.Tk}) bool mask"
        gqa = f", enable_gqa for {inp.Hq}/{inp.Hkv} heads" if inp.groups > 1 else ""
        return f"F.scaled_dot_product_attention with {how}{gqa}"

    @classmethod
    def forward(cls, inp: AttentionInputs, options: None):
        k, v = inp.k, inp.v
        attn_mask = None
        is_causal = False
        if inp.mask is not None and not mask_needs_materializing(inp):
            # A Causal mask SDPA can express itself: top-left aligned, or hiding nothing.
            if inp.q_offset == inp.kv_offset and inp.Tk > 1:
                is_causal = True
                if inp.Tk > inp.Tq:  # keys after the last query are never seen: drop them
                    k, v = k[:, :, : inp.Tq], v[:, :, : inp.Tq]
        elif inp.mask is not None:
            keep = inp.materialize_mask()
            k, v = inp.kv_for(keep, k, v)
            attn_mask = keep
        if inp.bias is not None:
            bias = inp.bias.to(inp.dtype)
            if is_causal:  # SDPA takes either is_causal or attn_mask: fold the causal mask in
                keep = Causal().materialize(inp.Tq, k.shape[2], q_offset=inp.q_offset, kv_offset=inp.kv_offset, device=inp.device)
                is_causal, attn_mask = False, keep
            attn_mask = bias if attn_mask is None else bias.masked_fill(~attn_mask, float("-inf"))
        return F.scaled_dot_product_attention(
            inp.q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=inp.dropout_p,
            is_causal=is_causal,
            scale=inp.scale,
            enable_gqa=inp.groups > 1,
        )
