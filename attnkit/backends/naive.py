"""The reference backend: textbook attention on the materialized mask.

``softmax(q kᵀ · scale + bias, masked) v`` computed in float32 (float64 for float64 inputs), the
output rounded once to the input dtype — the semantics every other backend must equal. For float16
and bfloat16 inputs both products run in float32, so the backward's ``dP = dO·Vᵀ`` and ``dS`` are
never rounded to 8 bits before ``dK = dSᵀ·q`` sums them over every query (the fused kernels keep
them in float32 too; rounded, dK over a thousand queries drifts ~8 bfloat16 steps). It supports everything: any
mask, bias, dropout, GQA, offsets, the log-sum-exp and the attention weights, at O(Tq · Tk)
memory. It keeps the NaN/Inf contract of ``attention()`` through :mod:`attnkit.backends.nonfinite`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validate import check_bool
from ..inputs import AttentionInputs
from ..registry import Backend, Work, register_backend
from ._common import finite_rows, finite_values, poison_rows, safe, softmax_parts


@dataclass(frozen=True)
class NaiveOptions:
    """``return_weights=True`` makes the call return the attention weights ``(B, Hq, Tq, Tk)``
    (after dropout) as its last element."""

    return_weights: bool = False

    def __post_init__(self):
        check_bool(self.return_weights, "return_weights", owner="NaiveOptions")


def probabilities(inp: AttentionInputs) -> tuple[Tensor, Tensor, Tensor]:
    """``(probs, lse, v)``: the attention weights ``(B, Hq, Tq, Tk)`` and the log-sum-exp
    ``(B, Hq, Tq)`` in the accumulation dtype, and V ``(B, Hq, Tk, Dv)``. Fully masked rows get
    weights 0 and LSE ``-inf`` (never NaN, finite grads). NaN/Inf in q, K, V are the caller's
    (:mod:`attnkit.backends.nonfinite`, applied by ``attention()``).

    float16 and bfloat16 ``q·kᵀ`` run in float32 (float16's products overflow its range, 65504,
    long before the softmax would: inputs of 256.0 at D=80 give inf, then NaN), and V comes back
    in the accumulation dtype for ``P·V`` (see the module docstring)."""
    acc = torch.promote_types(inp.dtype, torch.float32)
    keep = inp.materialize_mask()
    q = inp.q
    k, v = inp.expand_kv()  # (B, Hq, Tk, D), (B, Hq, Tk, Dv)
    if inp.dtype in (torch.float16, torch.bfloat16):
        q, k = q.float(), k.float()
    scores = torch.matmul(q, k.transpose(-2, -1)).to(acc) * inp.scale  # (B, Hq, Tq, Tk)
    if inp.bias is not None:
        scores = scores + inp.bias.to(acc)
    if inp.score_mod is not None:
        q0, k0 = inp.q_offset, inp.kv_offset
        scores = inp.score_mod.evaluate(scores, (q0, q0 + inp.Tq), (k0, k0 + inp.Tk), inp.B, inp.Hq)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    sink = None if inp.sinks is None else inp.sinks.to(acc).view(1, -1, 1, 1)
    e, denom, lse = softmax_parts(scores, inplace=False, sink=sink)
    return e / safe(denom), lse, v.to(acc)


@register_backend
class NaiveBackend(Backend):
    name = "naive"
    work = Work(materializes=True)
    summary = "reference: materialized mask, fp32 softmax, supports everything, O(Tq*Tk) memory"
    supports_dropout = True
    supports_bias = True
    supports_lse = True
    supports_score_mod = True
    supports_sinks = True
    Options = NaiveOptions

    @classmethod
    def forward(cls, inp: AttentionInputs, options: NaiveOptions | None):
        probs, lse, v = probabilities(inp)
        poisoned = None
        if inp.dropout_p > 0:
            probs = F.dropout(probs, p=inp.dropout_p, training=True)
        p = probs
        if inp.dtype in (torch.float16, torch.bfloat16):
            # Some CPU GEMMs carry a NaN row of p into its neighbour (bfloat16 packs rows in pairs
            # for long inner dimensions): multiply finite rows only, set the others after.
            nan_rows = ~finite_rows(probs)
            p = finite_values(p)
            poisoned = nan_rows if poisoned is None else poisoned | nan_rows
        out = torch.matmul(p, v).to(inp.dtype)  # (B, Hq, Tq, Dv)
        out, lse = poison_rows(out, lse, poisoned)
        result = (out, lse) if inp.return_lse else (out,)
        if options is not None and options.return_weights:
            result = result + (probs.to(inp.dtype),)
        return result if len(result) > 1 else out
