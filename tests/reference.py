"""The test oracles, written independently of the backends (no shared helpers with attnkit):

* :func:`reference_attention` — attention in float64, the truth;
* :func:`reference_attention_lowp` — the same math in the input's own dtype (flash-attn's
  ``attention_ref(..., upcast=False)``): how much error plain low-precision arithmetic makes, the
  yardstick of the 2x rule for every backend, the ``naive`` one included;
* :func:`flash_rule_ok` — ``err(backend) <= factor * err(lowp) + floor``.

Both references evaluate the mask through ``mask_mod`` on the full batch and head index grids
(FlexAttention's contract), not through ``materialize``, so a mask evaluated for batch 0 / head 0
only is caught too. NaN contract: NaN/Inf in what a row attends makes that row non-finite; NaN/Inf
in a pair the row may not see changes nothing in it; a row that sees nothing is 0 (LSE -inf).
"""

from __future__ import annotations

import datetime
import os

import torch
from torch import Tensor

from attnkit.masks import as_mask

__all__ = ["DEVICE", "HYPOTHESIS_CI", "ROTATING_SEED", "device_unavailable", "exact_backends_taking", "keep_grid",
           "reference_attention", "reference_attention_lowp", "max_error", "flash_rule_ok"]

#: The device the conformance and property suites run on: ``ATTNKIT_TEST_DEVICE=cuda`` for a GPU.
DEVICE = torch.device(os.environ.get("ATTNKIT_TEST_DEVICE", "cpu"))


#: Hypothesis suites: the ``ci`` profile (``CI`` set, as CI services do, or ATTNKIT_HYPOTHESIS_PROFILE=ci)
#: runs the full example counts, a developer's run fewer; the rotating seed changes daily.
HYPOTHESIS_CI = os.environ.get("ATTNKIT_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev") == "ci"
ROTATING_SEED = int(os.environ.get("ATTNKIT_HYPOTHESIS_SEED") or datetime.date.today().strftime("%Y%m%d"))


def device_unavailable() -> str | None:
    """Why :data:`DEVICE` cannot run here (a skip reason), or None when it can."""
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        return "ATTNKIT_TEST_DEVICE=cuda, but torch sees no CUDA device"
    if DEVICE.type == "mps" and not torch.backends.mps.is_available():
        return "ATTNKIT_TEST_DEVICE=mps, but torch sees no MPS device"
    return None


def exact_backends_taking(make_mask, *, B: int = 2, H: int = 4, T: int = 8, D: int = 8) -> list[str]:
    """The available exact backends that report no reasons for a ``(B, H, T, D)`` self-attention
    call with the mask ``make_mask(B, T)``: collect only what runs, rather than skip the rest."""
    import attnkit
    from attnkit.inputs import AttentionInputs

    x = torch.zeros((), device=DEVICE).expand(B, H, T, D)
    inp = AttentionInputs.create(x, x, x, mask=make_mask(B, T))
    return [name for name, impl in attnkit.list_backends().items()
            if impl.exact and impl.available() and not impl.not_supported_reasons(inp)]


def keep_grid(mask, B: int, H: int, Tq: int, Tk: int, *, q_offset: int | None, kv_offset: int, device) -> Tensor:
    """The mask as a bool tensor ``(B, H, Tq, Tk)`` from ``mask_mod`` over every batch and head index."""
    if q_offset is None:
        q_offset = kv_offset + Tk - Tq
    if mask is None:
        return torch.ones(B, H, Tq, Tk, dtype=torch.bool, device=device)
    mask = as_mask(mask)
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.arange(H, device=device).view(1, H, 1, 1)
    qi = torch.arange(q_offset, q_offset + Tq, device=device).view(1, 1, Tq, 1)
    ki = torch.arange(kv_offset, kv_offset + Tk, device=device).view(1, 1, 1, Tk)
    keep = mask.mask_mod(b, h, qi, ki, q_offset=q_offset, kv_offset=kv_offset)
    assert keep.dtype == torch.bool, keep.dtype
    return keep.expand(B, H, Tq, Tk)


def _attention(q, k, v, keep, bias, scale, compute_dtype):
    """Masked softmax attention with every operation in ``compute_dtype``; the NaN contract is
    kept by masking scores with ``where`` and by charging non-finite values only to rows that see them."""
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    B, Hq, Tq, D = q.shape
    Hkv = k.shape[1]
    k = k.repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, Tk, D)
    v = v.repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, Tk, Dv)
    scale = D**-0.5 if scale is None else scale
    # Scale q before the product, as flash-attn's reference does: q·k of large inputs can overflow
    # float16 before scaling although the scaled scores are finite.
    scores = torch.matmul(q * scale, k.transpose(-2, -1))  # (B, Hq, Tq, Tk)
    # a float32 bias on bf16 inputs is added in float32 (type promotion), as in flash-attn's reference
    if bias is not None:
        scores = scores + bias.to(torch.promote_types(compute_dtype, bias.dtype))
    scores = torch.where(keep, scores, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isinf(row_max), 0.0, row_max)  # rows that see nothing (or only +inf)
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    probs = (e / torch.where(denom == 0, 1.0, denom)).to(compute_dtype)
    lse = (torch.log(denom) + row_max).squeeze(-1).to(compute_dtype)  # -inf where nothing is seen
    bad_v = ~torch.isfinite(v.detach())
    out = torch.matmul(probs, torch.where(bad_v, 0.0, v))  # (B, Hq, Tq, Dv)
    # A non-finite value in a kept key poisons that output column of that row, nothing else.
    poisoned = torch.matmul(keep.to(compute_dtype), bad_v.to(compute_dtype)) > 0
    out = torch.where(poisoned, float("nan"), out)
    return out, lse


def reference_attention(q, k, v, *, mask=None, bias=None, scale=None, q_offset=None, kv_offset=0):
    """float64 attention: ``(out (B, Hq, Tq, Dv), lse (B, Hq, Tq))``; rows that see nothing give 0 / -inf."""
    B, Hq, Tq, _ = q.shape
    keep = keep_grid(mask, B, Hq, Tq, k.shape[2], q_offset=q_offset, kv_offset=kv_offset, device=q.device)
    return _attention(q, k, v, keep, bias, scale, torch.float64)


def reference_attention_lowp(q, k, v, *, mask=None, bias=None, scale=None, q_offset=None, kv_offset=0):
    """The same attention with every operation in the input dtype (``upcast=False``): the error a
    straightforward low-precision implementation makes, which a backend may exceed by the rule's factor."""
    B, Hq, Tq, _ = q.shape
    keep = keep_grid(mask, B, Hq, Tq, k.shape[2], q_offset=q_offset, kv_offset=kv_offset, device=q.device)
    out, lse = _attention(q, k, v, keep, bias, scale, q.dtype)
    return out, lse.float() if q.dtype in (torch.float16, torch.bfloat16) else lse


def max_error(x: Tensor, ref: Tensor) -> float:
    """``max |x - ref|`` over the entries where ``ref`` is finite (0 for empty tensors)."""
    if not x.numel():
        return 0.0
    diff = (x.detach().double() - ref.detach().double()).abs()
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    return float(torch.where(finite, diff, 0.0).max().nan_to_num(float("inf")))


FLOOR = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-3, torch.float16: 2e-4}


def flash_rule_ok(err: float, lowp_err: float, *, factor: float, dtype: torch.dtype, magnitude: float = 1.0) -> bool:
    """flash-attn's rule: a backend's error against float64 is at most ``factor`` times the
    low-precision reference's error in the same dtype, plus a floor for the cases where that
    error is ~0: the dtype's rounding at ``magnitude`` (at least 1), the size of the quantities
    the result is computed from (a gradient that is exactly 0 is still a difference of such terms)."""
    return err <= factor * lowp_err + FLOOR[dtype] * max(1.0, magnitude)
