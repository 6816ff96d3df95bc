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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..inputs import AttentionInputs
from ..masks import And, Causal, Mask, Or, SlidingWindow
from ..masks import GlobalTokens
from ..registry import Backend, register_backend
from ._common import grouped, mask_on, safe, softmax_parts, upcast_on_cpu, zero_keys

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SlidingWindowOptions:
    """``chunk``: queries per band chunk (None: a quarter of the window, 16..128). Each chunk
    computes ``chunk + left + right`` scores per query, so smaller chunks waste less work but
    make smaller matmuls."""

    chunk: int | None = None

    def __post_init__(self):
        if self.chunk is not None and (not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk < 1):
            raise ValueError(f"SlidingWindowOptions(chunk={self.chunk!r}): expected a positive int or None.")


def band_of(mask: Mask | None) -> tuple[int, int, Tensor | None] | None:
    """``(left, right, global_positions)`` bounding every kept pair of ``mask``, or None if unbounded."""
    glob = None
    if isinstance(mask, Or):
        others = [p for p in mask.parts if not isinstance(p, GlobalTokens)]
        globs = [p for p in mask.parts if isinstance(p, GlobalTokens)]
        if len(others) != 1 or len(globs) != 1:
            return None
        mask, glob = others[0], globs[0].positions
    parts = mask.parts if isinstance(mask, And) else (mask,)
    left = right = None
    for part in parts:
        if isinstance(part, SlidingWindow):
            if part.left is not None:
                left = part.left if left is None else min(left, part.left)
            if part.right is not None:
                right = part.right if right is None else min(right, part.right)
        elif isinstance(part, Causal):
            right = 0 if right is None else min(right, 0)
    if left is None or right is None:
        return None
    return left, right, glob


def _banded(inp: AttentionInputs, band_mask: Mask, left: int, right: int, chunk: int, glob: Tensor | None):
    B, Hq, Tq, D = inp.q.shape
    Hkv, Tk, Dv, G = inp.Hkv, inp.Tk, inp.Dv, inp.groups
    dev, acc = inp.device, torch.promote_types(inp.dtype, torch.float32)
    c = chunk
    nC = -(-Tq // c)
    L = c + left + right
    start0 = inp.q_offset - inp.kv_offset - left  # index into k of chunk 0's first key
    pad_l = max(0, -start0)
    pad_r = max(0, start0 + pad_l + (nC - 1) * c + L - (Tk + pad_l))
    kidx = start0 + c * torch.arange(nC, device=dev)[:, None] + torch.arange(L, device=dev)  # (nC, L)
    qpos = inp.q_offset + torch.arange(nC * c, device=dev).view(nC, c)
    k5 = (inp.kv_offset + kidx).view(1, 1, nC, 1, L)
    # Padding queries/keys get a clamped position (their result is discarded or masked below), so
    # masks indexed by position (Document) are only evaluated inside the call.
    qpos = qpos.clamp(max=inp.q_offset + Tq - 1)
    keep = mask_on(band_mask, inp, qpos, inp.kv_offset + kidx.clamp(0, Tk - 1))
    keep = keep & ((kidx >= 0) & (kidx < Tk)).view(1, 1, nC, 1, L)
    if glob is not None:  # global keys are scored in their own columns: drop them from the band
        keep = keep & ~torch.isin(k5, glob.to(dev))
    keep = grouped(keep, Hkv)  # (B|1, Hkv|1, nC, G|1, c, L)

    def windows(x: Tensor) -> Tensor:  # (B, Hkv, Tk, E) -> (B, Hkv, nC, L, E), a strided view
        x = F.pad(x, (0, 0, pad_l, pad_r))[:, :, start0 + pad_l :]
        return x.unfold(2, L, c)[:, :, :nC].transpose(-2, -1)

    kw, vw = windows(inp.k), windows(inp.v)
    # zero keys that no query of a chunk attends: NaN there must not leak
    kw, vw = zero_keys(kw, vw, ~keep.any(dim=4).any(dim=3))  # dead keys (B|1, Hkv|1, nC, L)
    qp = F.pad(inp.q, (0, 0, 0, nC * c - Tq)).view(B, Hkv, G, nC, c, D).transpose(2, 3)  # (B, Hkv, nC, G, c, D)
    qg = qp.reshape(B, Hkv, nC, G * c, D) * inp.scale  # scale q: O(n*D) instead of O(n*L)
    inplace = not inp.requires_grad
    s = torch.matmul(qg, kw.transpose(-2, -1)).to(acc).view(B, Hkv, nC, G, c, L)
    s = s.masked_fill_(~keep, NEG_INF) if inplace else s.masked_fill(~keep, NEG_INF)
    parts = [s]
    if glob is not None:
        gi = glob.to(dev) - inp.kv_offset
        gi = gi[(gi >= 0) & (gi < Tk)]
        kg, vg = inp.k[:, :, gi], inp.v[:, :, gi]  # (B, Hkv, g, D)
        sg = torch.matmul(qg, kg[:, :, None].transpose(-2, -1)).to(acc)
        parts.append(sg.view(B, Hkv, nC, G, c, -1))
    scores = torch.cat(parts, dim=-1) if len(parts) > 1 else s
    p, denom, lse = softmax_parts(scores, inplace)
    p = p.to(inp.dtype)
    out = torch.matmul(p[..., :L].reshape(B, Hkv, nC, G * c, L), vw)  # (B, Hkv, nC, G*c, Dv)
    if glob is not None:
        out = out + torch.matmul(p[..., L:].reshape(B, Hkv, nC, G * c, -1), vg[:, :, None])
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
    summary = "banded local attention (+ Longformer global tokens): O(n*w) time and memory, fwd+bwd"
    supports_lse = True
    Options = SlidingWindowOptions

    @classmethod
    def extra_reasons(cls, inp: AttentionInputs) -> list[str]:
        if inp.mask is None or band_of(inp.mask) is None:
            return [
                "needs a banded mask: SlidingWindow(left, right) with finite bounds (or with Causal()), "
                "optionally & other masks and | GlobalTokens(...)"
            ]
        return []

    @classmethod
    def forward(cls, inp: AttentionInputs, options: SlidingWindowOptions | None):
        dtype, inp = inp.dtype, upcast_on_cpu(inp)
        left, right, glob = band_of(inp.mask)
        band_mask = inp.mask if glob is None else next(p for p in inp.mask.parts if not isinstance(p, GlobalTokens))
        chunk = (options.chunk if options and options.chunk else None) or max(16, min(128, (left + right + 1) // 4))
        chunk = min(chunk, inp.Tq)
        out, lse = _banded(inp, band_mask, left, right, chunk, glob)
        out = out.to(dtype)
        return (out, lse) if inp.return_lse else out
