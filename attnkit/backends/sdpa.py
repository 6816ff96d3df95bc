"""PyTorch's fused kernels through ``F.scaled_dot_product_attention``.

Equals ``naive`` (without the LSE). :meth:`SDPA.plan` decides, from the mask's structure, how the
mask reaches SDPA, and both :meth:`SDPA.forward` and :meth:`SDPA.describe` follow it:

* ``"none"``: no mask, or a causal mask that hides nothing (every query at or after the last key,
  e.g. a one-token decode step) — SDPA runs unmasked;
* ``"causal"``: a causal mask aligned like SDPA's ``is_causal`` (top-left, ``q_offset == kv_offset``);
  keys after the last query are never seen and are dropped (with their bias columns);
* ``"dense"``: anything else — the mask is materialized and passed (with the bias) as ``attn_mask``.

GQA is native (``enable_gqa``). A float32 ``bias`` on float16/bfloat16 inputs is passed as float32
(SDPA accepts it), never rounded to the inputs' dtype first. It keeps the NaN/Inf contract of
``attention()`` through :mod:`attnkit.backends.nonfinite` (it runs on finite inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..inputs import AttentionInputs
from ..masks import Causal
from ..registry import Backend, Work, register_backend

NONE, CAUSAL, DENSE = "none", "causal", "dense"

# The NaN/Inf contract is kept by attnkit.backends.nonfinite (this backend declares "policy"):
# SDPA sees finite q, K, V. Its CPU kernels would otherwise lose an all-NaN row in their scalar
# tail (a max that skips NaN) and, on the math path, let a NaN key reach rows that cannot see it.


@register_backend
class SDPABackend(Backend):
    name = "sdpa"
    # is_causal skips key blocks past the diagonal, whole blocks of PyTorch's CPU flash kernel (32 to
    # 256 queries by 512 keys: kvSplitSize); a dense mask skips nothing
    # gqa: on the CPU, grouped K/V take torch's path that repeats them per query head (a decode step
    # with grouped heads reads its cache far slower per byte than the same bytes with one query head each)
    work = Work(fused=True, gqa="repeats")
    summary = "torch.nn.functional.scaled_dot_product_attention (fused flash/efficient/math kernels)"
    supports_dropout = True
    supports_bias = True

    @classmethod
    def plan(cls, inp: AttentionInputs) -> str:
        """How the mask reaches SDPA: ``"none"``, ``"causal"`` (``is_causal=True``) or ``"dense"``."""
        mask = inp.mask
        if mask is None:
            return NONE
        if mask.is_causal():
            if inp.q_offset >= inp.kv_offset + inp.Tk - 1:
                return NONE  # every query sees every key
            if inp.q_offset == inp.kv_offset:
                return CAUSAL
        return DENSE

    @classmethod
    def dense_mask_elements(cls, inp: AttentionInputs) -> int:
        """Elements of the ``(B, Hq, Tq, Tk)`` mask this backend would materialize (0: none)."""
        return inp.B * inp.Hq * inp.Tq * inp.Tk if cls.plan(inp) == DENSE else 0

    @classmethod
    def describe(cls, inp: AttentionInputs) -> str:
        how = {
            NONE: "no mask" if inp.mask is None else "no mask: the causal mask hides nothing for these positions",
            CAUSAL: "is_causal=True (no mask tensor)" + (
                f", keys after the last query dropped ({inp.Tk} -> {inp.Tq})" if inp.Tk > inp.Tq else ""),
            DENSE: f"a materialized ({inp.Tq}, {inp.Tk}) bool mask",
        }[cls.plan(inp)]
        if inp.bias is not None:
            how += (" and the bias as a float attn_mask" if inp.mask is None or cls.plan(inp) == NONE
                    else " folded with the bias")
        gqa = f", enable_gqa for {inp.Hq}/{inp.Hkv} heads" if inp.groups > 1 else ""
        return f"F.scaled_dot_product_attention with {how}{gqa}"

    @classmethod
    def forward(cls, inp: AttentionInputs, options: None):
        plan = cls.plan(inp)
        q, k, v, bias, scale, G = inp.q, inp.k, inp.v, inp.bias, inp.scale, inp.groups
        if scale <= 0:
            # SDPA's kernels scale the masked scores, so -inf * 0 = NaN and -inf * -1 = +inf: fold
            # the scale into q instead, where a zero or negative scale means what it says.
            q, scale = q * scale, 1.0
        attn_mask, empty, is_causal = None, None, False
        if plan == CAUSAL:
            Tq = inp.Tq
            if inp.Tk > Tq:  # keys after the last query are never seen: drop them
                k, v = k[:, :, :Tq], v[:, :, :Tq]
                if bias is not None and bias.shape[-1] > 1:
                    bias = bias[..., :Tq]
            if bias is None:
                is_causal = True
            else:  # SDPA takes is_causal or attn_mask, not both: fold the causal mask in
                attn_mask = Causal().materialize(Tq, k.shape[2], q_offset=0, kv_offset=0, device=inp.device)
        elif plan == DENSE:
            attn_mask = inp.materialize_mask()  # (B|1, Hq|1, Tq, Tk)
            if inp.device.type != "cpu":  # SDPA's CPU kernels give a row with no allowed key 0 themselves
                empty = ~attn_mask.any(dim=-1)  # (torch's tests: fully masked rows); elsewhere set it
        if bias is not None:
            bias = _bias_dtype(bias, inp.dtype)
            attn_mask = bias if attn_mask is None else bias.masked_fill(~attn_mask, float("-inf"))
        # a plain bool: traced with dynamic shapes, G > 1 is a SymBool, which SDPA's signature refuses
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=inp.dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=True if G > 1 else False,
        )
        if empty is not None:
            out = out.masked_fill(empty[..., None], 0.0)
        return out


def _bias_dtype(bias: Tensor, dtype: torch.dtype) -> Tensor:
    """The bias in the dtype SDPA should see: a float32 (or wider) bias stays float32 on low-precision
    inputs (rounding ALiBi slopes times distances to bf16 costs 10-250x the kernel's own error)."""
    if bias.dtype == dtype:
        return bias
    if dtype in (torch.float16, torch.bfloat16) and bias.dtype in (torch.float32, torch.float64):
        return bias.float()
    return bias.to(dtype)
