"""Banded local attention in O(Tq · w) time and memory, forward and backward (autograd).

Equals ``naive`` for a mask whose kept keys lie in a band ``pos(q) - left <= pos(k) <= pos(q) + right``:
a ``SlidingWindow`` with finite bounds (a ``Causal()`` part sets ``right = 0``), possibly ``And``-ed
with any other masks (evaluated on the band only), and optionally ``| GlobalTokens(...)``
(Longformer). Queries are cut into chunks of ``c``; chunk ``i`` sees the ``c + left + right`` keys
starting at ``pos(q_i0) - left``, taken from K/V with ``unfold`` (a strided view, no copy), so the
scores are ``(B, Hq, Tq, c + left + right)`` instead of ``(B, Hq, Tq, Tk)``. Global keys join every
row's softmax as extra columns; global query rows attend every key and are computed as full rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .._validate import positive_int
from ..inputs import AttentionInputs
from ..masks import Mask, MaskSupport
from ..registry import Backend, Work, register_backend
from ._common import (
    connected, grouped, mask_on, modify_gathered, safe, softmax_parts,
    gathered_sink, upcast_on_cpu,
)
from ._tiles import empty_batch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SlidingWindowOptions:
    """``chunk``: queries per band chunk (None: a quarter of the window, 16..128). Each chunk
    computes ``chunk + left + right`` scores per query, so smaller chunks waste less work but
    make smaller matmuls."""

    chunk: int | None = None

    def __post_init__(self):
        positive_int(self.chunk, "chunk", owner="SlidingWindowOptions", allow_none=True, fix="pass e.g. chunk=64")


def band_of(mask: Mask | None) -> tuple[int, int, Mask, Tensor | None] | None:
    """``(left, right, core, global_positions)`` for ``core | GlobalTokens(...)`` (or a mask without
    globals) whose core has a bounded band ``-left <= pos(k) - pos(q) <= right``, else None."""
    if mask is None:
        return None
    core, glob = mask.split_globals()
    band = core.band()
    if not band.bounded:
        return None
    return band.left, band.right, core, None if glob is None else glob.positions


def _banded(inp: AttentionInputs, band_mask: Mask, left: int, right: int, chunk: int, glob: Tensor | None,
            call: AttentionInputs):
    """``(out, lse)`` of the banded attention. ``inp`` may be a run of the queries of ``call``, the
    whole call, whose offsets masks relative to the call (``Dense``: row i is the call's i-th query)
    are evaluated with."""
    B, Hq, Tq, D = inp.q.shape
    Hkv, Tk, Dv, G = inp.Hkv, inp.Tk, inp.Dv, inp.groups
    dev, acc = inp.device, torch.promote_types(inp.dtype, torch.float32)
    c = chunk
    nC = -(-Tq // c)
    L = c + left + right
    start0 = inp.q_offset - inp.kv_offset - left  # index into k of chunk 0's first key
    if L >= Tk:  # the band spans every key of the call: one chunk over all keys (never more memory than the band)
        c, nC, L, start0 = Tq, 1, Tk, 0
    pad_l = max(0, -start0)
    pad_r = max(0, start0 + pad_l + (nC - 1) * c + L - (Tk + pad_l))
    kidx = start0 + c * torch.arange(nC, device=dev)[:, None] + torch.arange(L, device=dev)  # (nC, L)
    qpos = inp.q_offset + torch.arange(nC * c, device=dev).view(nC, c)
    k5 = (inp.kv_offset + kidx).view(1, 1, nC, 1, L)
    # Padding queries/keys get a clamped position (their result is discarded or masked below), so
    # masks indexed by position (Document) are only evaluated inside the call.
    qpos = qpos.clamp(max=inp.q_offset + Tq - 1)
    keep = mask_on(band_mask, call, qpos, inp.kv_offset + kidx.clamp(0, Tk - 1))
    keep = keep & ((kidx >= 0) & (kidx < Tk)).view(1, 1, nC, 1, L)
    if glob is not None:  # global keys are scored in their own columns: drop them from the band
        keep = keep & ~torch.isin(k5, glob.to(dev))
    keep = grouped(keep, Hkv)  # (B|1, Hkv|1, nC, G|1, c, L)

    def windows(x: Tensor) -> Tensor:  # (B, Hkv, Tk, E) -> (B, Hkv, nC, L, E), a strided view
        x = F.pad(x, (0, 0, pad_l, pad_r))[:, :, start0 + pad_l :]
        return x.unfold(2, L, c)[:, :, :nC].transpose(-2, -1)

    kw, vw = windows(inp.k), windows(inp.v)
    qp = F.pad(inp.q, (0, 0, 0, nC * c - Tq)).view(B, Hkv, G, nC, c, D).transpose(2, 3)  # (B, Hkv, nC, G, c, D)
    qg = qp.reshape(B, Hkv, nC, G * c, D) * inp.scale  # scale q: O(n*D) instead of O(n*L)
    inplace = not inp.requires_grad
    s = torch.matmul(qg, kw.transpose(-2, -1)).to(acc).view(B, Hkv, nC, G, c, L)
    if inp.score_mod is not None:
        s = modify_gathered(inp, s, qpos, inp.kv_offset + kidx)
    s = s.masked_fill_(~keep, NEG_INF) if inplace else s.masked_fill(~keep, NEG_INF)
    parts = [s]
    if glob is not None:
        gi = glob.to(dev) - inp.kv_offset
        gi = gi[(gi >= 0) & (gi < Tk)]
        kg, vg = inp.k[:, :, gi], inp.v[:, :, gi]  # (B, Hkv, g, D)
        sg = torch.matmul(qg, kg[:, :, None].transpose(-2, -1)).to(acc)
        parts.append(sg.view(B, Hkv, nC, G, c, -1))
    scores = torch.cat(parts, dim=-1) if len(parts) > 1 else s
    p, denom, lse = softmax_parts(scores, inplace, sink=gathered_sink(inp, acc))
    p = p.to(inp.dtype)
    out = torch.matmul(p[..., :L].reshape(B, Hkv, nC, G * c, L), vw)  # (B, Hkv, nC, G*c, Dv)
    if glob is not None:
        out = out + torch.matmul(p[..., L : L + vg.shape[2]].reshape(B, Hkv, nC, G * c, -1), vg[:, :, None])
    out = (out / safe(denom).view(B, Hkv, nC, G * c, 1)).to(inp.dtype)
    out = out.view(B, Hkv, nC, G, c, Dv).transpose(2, 3).reshape(B, Hq, nC * c, Dv)[:, :, :Tq]
    lse = lse.view(B, Hkv, nC, G, c).transpose(2, 3).reshape(B, Hq, nC * c)[:, :, :Tq]
    if glob is not None:
        out, lse = _global_rows(inp, glob, out, lse)
    return out, lse


def _global_rows(inp: AttentionInputs, glob: Tensor, out: Tensor, lse: Tensor):
    """Global queries attend every key: recompute their rows in full and write them over the band's."""
    qi = glob.to(inp.device) - inp.q_offset
    qi = qi[(qi >= 0) & (qi < inp.Tq)]
    if qi.numel() == 0:
        return out, lse
    k, v = inp.expand_kv()
    s = torch.matmul(inp.q[:, :, qi], k.transpose(-2, -1)).to(lse.dtype) * inp.scale  # (B, Hq, g, Tk)
    rows_lse = torch.logsumexp(s, dim=-1)
    rows = torch.matmul(torch.softmax(s, dim=-1).to(inp.dtype), v)
    return out.index_copy(2, qi, rows), lse.index_copy(2, qi, rows_lse)


@register_backend
class SlidingWindowBackend(Backend):
    name = "sliding_window"
    work = Work()
    summary = "banded local attention (+ Longformer global tokens): O(n*w) time and memory, fwd+bwd"
    supports_lse = True
    supports_score_mod = True
    supports_sinks = True
    Options = SlidingWindowOptions

    mask_support = MaskSupport("band")

    @classmethod
    def extra_reasons(cls, inp: AttentionInputs) -> list[str]:
        band = None if inp.mask is None else band_of(inp.mask)
        if band is not None and band[3] is not None and (inp.score_mod is not None or inp.sinks is not None):
            return ["applies score_mod and sinks to banded masks only, not with GlobalTokens"]
        return []

    @classmethod
    def forward(cls, inp: AttentionInputs, options: SlidingWindowOptions | None):
        if inp.B == 0:
            return empty_batch(inp)
        dtype, inp = inp.dtype, upcast_on_cpu(inp)
        left, right, band_mask, glob = band_of(inp.mask)
        chunk = (options.chunk if options and options.chunk else None) or max(16, min(128, (left + right + 1) // 4))
        out, lse = _reachable_rows(inp, band_mask, left, right, chunk, glob)
        out = out.to(dtype)
        return (out, lse) if inp.return_lse else out


def _reachable_rows(inp: AttentionInputs, band_mask: Mask, left: int, right: int, chunk: int, glob):
    """Run the band only over the queries whose band reaches a key of the call (a query far from
    every key, e.g. after a large offset gap, keeps nothing): output 0 and LSE -inf elsewhere, so
    memory stays O(Tq · (left + right)) however far apart the positions are."""
    Tq, Tk = inp.Tq, inp.Tk
    B, Hq = inp.B, inp.Hq
    acc = torch.promote_types(inp.dtype, torch.float32)
    # A row that reaches no key keeps only its sink: LSE = the sink (else -inf), as a fully masked row.
    empty_lse = (torch.full((), float("-inf"), dtype=acc, device=inp.device) if inp.sinks is None
                 else inp.sinks.to(acc).view(1, Hq, 1))
    lo = inp.kv_offset - right - inp.q_offset  # first query index whose band reaches key 0
    hi = inp.kv_offset + Tk - 1 + left - inp.q_offset  # last query index whose band reaches key Tk-1
    if glob is not None:
        lo, hi = 0, Tq - 1  # global rows and columns reach everywhere
    q0, q1 = max(0, lo), min(Tq, hi + 1)
    if q0 >= q1:  # nothing reachable: every row is fully masked
        out = connected(inp.q.new_zeros(B, Hq, Tq, inp.Dv), inp.q, inp.k, inp.v, inp.sinks)
        return out, empty_lse.expand(B, Hq, Tq).clone()
    sub = inp if (q0, q1) == (0, Tq) else dataclasses.replace(inp, q=inp.q[:, :, q0:q1], q_offset=inp.q_offset + q0)
    out, lse = _banded(sub, band_mask, left, right, min(chunk, q1 - q0), glob, inp)
    if (q0, q1) == (0, Tq):
        return out, lse
    pad = (q0, Tq - q1)
    out = F.pad(out, (0, 0, *pad))
    lse = torch.cat([empty_lse.expand(B, Hq, q0), lse, empty_lse.expand(B, Hq, Tq - q1)], dim=-1)
    return out, lse
