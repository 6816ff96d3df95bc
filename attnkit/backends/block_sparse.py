"""Block-sparse attention: only the active blocks of a ``BlockSparse`` layout, forward and backward.

Equals ``naive`` for a ``BlockSparse`` mask, alone or ``And``-ed with other masks (``Causal()`` for
the causal Sparse-Transformer patterns, ``KeyPadding``, ...), which are evaluated on the active
blocks only. Query block rows are grouped by their number of active key blocks ``r``; each group
gathers its ``r`` key/value blocks into ``(rows, r * bs, D)`` tiles and runs one batched matmul,
so the work and memory are proportional to the number of active blocks (no padding: a global row
with every block on forms its own group). Backward is PyTorch autograd through the gathers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..inputs import AttentionInputs
from ..masks import And, Mask
from ..masks import BlockSparse
from ..registry import Backend, register_backend
from ._common import grouped, mask_on, safe, softmax_parts, upcast_on_cpu, zero_keys


def block_sparse_part(mask: Mask | None) -> BlockSparse | None:
    """The ``BlockSparse`` that bounds ``mask`` (itself, or one part of an ``And``), or None."""
    parts = mask.parts if isinstance(mask, And) else (mask,)
    found = [p for p in parts if isinstance(p, BlockSparse)]
    return found[0] if found else None


@register_backend
class BlockSparseBackend(Backend):
    name = "block_sparse"
    summary = "gathers only the active blocks of a BlockSparse layout (BigBird, Longformer, Sparse Transformer)"
    supports_lse = True

    @classmethod
    def extra_reasons(cls, inp: AttentionInputs) -> list[str]:
        if inp.mask is None or block_sparse_part(inp.mask) is None:
            return ["needs a BlockSparse mask (alone or in an And), e.g. BlockSparse.bigbird(...)"]
        return []

    @classmethod
    def forward(cls, inp: AttentionInputs, options: None):
        dtype, inp = inp.dtype, upcast_on_cpu(inp)
        pattern = block_sparse_part(inp.mask)
        bs = pattern.block_size
        B, Hq, Tq, D = inp.q.shape
        Hkv, Tk, Dv, G = inp.Hkv, inp.Tk, inp.Dv, inp.groups
        dev = inp.device
        # Block grid covering the call: query blocks r0..r1-1, key blocks c0..c1-1 (absolute).
        r0, r1 = inp.q_offset // bs, -(-(inp.q_offset + Tq) // bs)
        c0, c1 = inp.kv_offset // bs, -(-(inp.kv_offset + Tk) // bs)
        nR, nK = r1 - r0, c1 - c0
        layout = torch.zeros(nR, nK, dtype=torch.bool)  # union over heads; mask_mod is per head
        first = max(0, -r0)  # query blocks before position 0 (Tq > Tk) stay empty
        layout[first:] = pattern.layout.any(0)[r0 + first : r1, c0:c1]
        layout = layout.to(dev)
        qs, ks = inp.q_offset - r0 * bs, inp.kv_offset - c0 * bs  # leading padding of q and k
        inplace = not inp.requires_grad
        q = F.pad(inp.q * inp.scale, (0, 0, qs, nR * bs - Tq - qs)).view(B, Hkv, G, nR, bs, D).transpose(2, 3)
        k = F.pad(inp.k, (0, 0, ks, nK * bs - Tk - ks)).view(B, Hkv, nK, bs, D)
        v = F.pad(inp.v, (0, 0, ks, nK * bs - Tk - ks)).view(B, Hkv, nK, bs, Dv)
        offs = torch.arange(bs, device=dev)
        counts = layout.sum(1)
        outs, lses, rows_done = [], [], []
        for r in counts.unique().tolist():
            if r == 0:
                continue  # rows with no active block stay 0 (LSE -inf)
            rows = (counts == r).nonzero()[:, 0]  # (n,)
            cols = layout[rows].nonzero()[:, 1].view(-1, r)  # (n, r) active key blocks per row
            n = rows.numel()
            q_pos = (r0 + rows)[:, None] * bs + offs  # (n, bs) absolute
            k_pos = ((c0 + cols)[:, :, None] * bs + offs).view(n, r * bs)  # (n, r*bs)
            # Padding positions are clamped into the call (their results are masked or dropped),
            # so masks indexed by position (Document) are only evaluated inside it.
            q_in = q_pos.clamp(inp.q_offset, inp.q_offset + Tq - 1)
            keep = mask_on(inp.mask, inp, q_in, k_pos.clamp(inp.kv_offset, inp.kv_offset + Tk - 1))
            in_call = (k_pos >= inp.kv_offset) & (k_pos < inp.kv_offset + Tk)
            keep = grouped(keep & in_call[:, None, :], Hkv)  # (B|1, Hkv|1, n, G|1, bs, r*bs)
            kg = k[:, :, cols].view(B, Hkv, n, r * bs, D)
            vg = v[:, :, cols].view(B, Hkv, n, r * bs, Dv)
            # zero keys that no query of the row attends: NaN there must not leak
            kg, vg = zero_keys(kg, vg, ~keep.any(dim=4).any(dim=3))
            qg = q[:, :, rows].reshape(B, Hkv, n, G * bs, D)
            s = torch.matmul(qg, kg.transpose(-2, -1)).to(torch.promote_types(inp.dtype, torch.float32))
            s = s.view(B, Hkv, n, G, bs, r * bs)
            s = s.masked_fill_(~keep, float("-inf")) if inplace else s.masked_fill(~keep, float("-inf"))
            p, denom, lse = softmax_parts(s, inplace)
            o = torch.matmul(p.to(inp.dtype).view(B, Hkv, n, G * bs, r * bs), vg)
            outs.append((o / safe(denom).view(B, Hkv, n, G * bs, 1)).to(inp.dtype))
            lses.append(lse)
            rows_done.append(rows)
        acc = torch.promote_types(inp.dtype, torch.float32)
        out = inp.q.new_zeros(B, Hkv, nR, G * bs, Dv)
        lse = torch.full((B, Hkv, nR, G, bs), float("-inf"), dtype=acc, device=dev)
        if rows_done:
            rows = torch.cat(rows_done)
            out = out.index_copy(2, rows, torch.cat(outs, dim=2))
            lse = lse.index_copy(2, rows, torch.cat(lses, dim=2))
        out = out.view(B, Hkv, nR, G, bs, Dv).transpose(2, 3).reshape(B, Hq, nR * bs, Dv)[:, :, qs : qs + Tq]
        lse = lse.transpose(2, 3).reshape(B, Hq, nR * bs)[:, :, qs : qs + Tq]
        out = out.to(dtype)
        return (out, lse) if inp.return_lse else out
