"""The reference backend: textbook attention on the materialized mask.

``softmax(q kᵀ · scale + bias, masked) v`` with the scores and softmax in float32 (float64 for
float64 inputs) and the matrix products in the input dtype — the semantics every other backend
must equal. It supports everything: any mask, bias, dropout, GQA, offsets, the log-sum-exp and the
attention weights, at O(Tq · Tk) memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..inputs import AttentionInputs
from ..registry import Backend, register_backend


@dataclass(frozen=True)
class NaiveOptions:
    """``return_weights=True`` makes the call return the attention weights ``(B, Hq, Tq, Tk)``
    (after dropout) as its last element."""

    return_weights: bool = False


def probabilities(inp: AttentionInputs, k: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
    """Attention weights ``(B, Hq, Tq, Tk)`` in the accumulation dtype and the log-sum-exp
    ``(B, Hq, Tq)``; fully masked rows get weights 0 and LSE ``-inf`` (never NaN, finite grads).

    ``k`` must already have ``Hq`` heads; ``keep`` is the materialized mask (or None)."""
    acc = torch.promote_types(inp.dtype, torch.float32)
    scores = torch.matmul(inp.q, k.transpose(-2, -1)).to(acc) * inp.scale  # (B, Hq, Tq, Tk)
    if inp.bias is not None:
        scores = scores + inp.bias.to(acc)
    if inp.score_mod is not None:
        q0, k0 = inp.q_offset, inp.kv_offset
        scores = inp.score_mod.evaluate(scores, (q0, q0 + inp.Tq), (k0, k0 + inp.Tk), inp.B, inp.Hq)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    # Subtract the row max for stability; a fully masked row has max -inf: use 0 so that every
    # exp() is exp(-inf) = 0 instead of exp(nan). The max carries no gradient (softmax is
    # invariant to it), which keeps fully masked rows' gradients finite.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    sink = None if inp.sinks is None else inp.sinks.to(acc).view(1, -1, 1, 1)
    if sink is not None:  # the sink logit joins the normaliser (and the max) of every row
        row_max = torch.maximum(row_max, sink.detach())
    row_max = row_max.masked_fill(torch.isinf(row_max), 0.0)
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    lse = (torch.log(denom) + row_max).squeeze(-1)  # log(0) = -inf for fully masked rows
    return e / torch.where(denom == 0, 1.0, denom), lse


@register_backend
class NaiveBackend(Backend):
    name = "naive"
    summary = "reference: materialized mask, fp32 softmax, supports everything, O(Tq*Tk) memory"
    supports_dropout = True
    supports_bias = True
    supports_lse = True
    supports_score_mod = True
    supports_sinks = True
    Options = NaiveOptions

    @classmethod
    def forward(cls, inp: AttentionInputs, options: NaiveOptions | None):
        keep = inp.materialize_mask()
        k, v = inp.kv_for(keep, *inp.expand_kv())  # (B, Hq, Tk, D), (B, Hq, Tk, Dv)
        probs, lse = probabilities(inp, k, keep)
        if inp.dropout_p > 0:
            probs = F.dropout(probs, p=inp.dropout_p, training=True)
        out = torch.matmul(probs.to(inp.dtype), v)  # (B, Hq, Tq, Dv)
        result = (out, lse) if inp.return_lse else (out,)
        if options is not None and options.return_weights:
            result = result + (probs.to(inp.dtype),)
        return result if len(result) > 1 else out
