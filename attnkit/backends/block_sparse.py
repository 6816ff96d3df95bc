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

from .._compat import assume_constant_result
from ..inputs import AttentionInputs
from ..masks import MaskSupport
from ..registry import Backend, Work, register_backend
from ._common import (
    connected, grouped, mask_on, modify_gathered, safe, softmax_parts,
    gathered_sink, upcast_on_cpu,
)
from ._tiles import empty_batch


@assume_constant_result
def _row_groups(pattern, r0: int, r1: int, c0: int, c1: int) -> tuple:
    """The call's block rows grouped by their number of active key blocks (union over heads;
    ``mask_mod`` applies the per-head layout): ``((rows, cols_per_row), ...)`` as plain ints,
    planned on the host from the layout so no device data decides control flow (and
    ``torch.compile`` treats the plan as a constant)."""
    first = max(0, -r0)  # query blocks before position 0 (Tq > Tk) stay empty
    layout = pattern.layout.any(0)[r0 + first : r1, c0:c1].tolist()
    by_count: dict[int, tuple[list[int], list[list[int]]]] = {}
    for i, row in enumerate(layout):
        cols = [c for c, on in enumerate(row) if on]
        if cols:
            rows, col_lists = by_count.setdefault(len(cols), ([], []))
            rows.append(first + i)
            col_lists.append(cols)
    return tuple((rows, col_lists) for _, (rows, col_lists) in sorted(by_count.items()))


@register_backend
class BlockSparseBackend(Backend):
    name = "block_sparse"
    work = Work()
    summary = "gathers only the active blocks of a BlockSparse layout (BigBird, Longformer, Sparse Transformer)"
    supports_lse = True
    supports_score_mod = True
    supports_sinks = True

    mask_support = MaskSupport("layout")

    @classmethod
    def forward(cls, inp: AttentionInputs, options: None):
        if inp.B == 0:
            return empty_batch(inp)
        dtype, inp = inp.dtype, upcast_on_cpu(inp)
        pattern = inp.mask.block_layout()
        bs = pattern.block_size
        B, Hq, Tq, D = inp.q.shape
        Hkv, Tk, Dv, G = inp.Hkv, inp.Tk, inp.Dv, inp.groups
        dev = inp.device
        # Block grid covering the call: query blocks r0..r1-1, key blocks c0..c1-1 (absolute).
        r0, r1 = inp.q_offset // bs, -(-(inp.q_offset + Tq) // bs)
        c0, c1 = inp.kv_offset // bs, -(-(inp.kv_offset + Tk) // bs)
        nR, nK = r1 - r0, c1 - c0
        groups = _row_groups(pattern, r0, r1, c0, c1)
        qs, ks = inp.q_offset - r0 * bs, inp.kv_offset - c0 * bs  # leading padding of q and k
        inplace = not inp.requires_grad
        # reshape, not view: q/k/v may be non-contiguous or expanded (e.g. from MultiHeadAttention)
        q = F.pad(inp.q * inp.scale, (0, 0, qs, nR * bs - Tq - qs)).reshape(B, Hkv, G, nR, bs, D).transpose(2, 3)
        k = F.pad(inp.k, (0, 0, ks, nK * bs - Tk - ks)).reshape(B, Hkv, nK, bs, D)
        v = F.pad(inp.v, (0, 0, ks, nK * bs - Tk - ks)).reshape(B, Hkv, nK, bs, Dv)
        offs = torch.arange(bs, device=dev)
        outs, lses, rows_done = [], [], []
        for row_list, col_lists in groups:  # rows with no active block are in no group: 0, LSE -inf
            rows = torch.tensor(row_list, device=dev)  # (n,)
            cols = torch.tensor(col_lists, device=dev)  # (n, r) active key blocks per row
            n, r = cols.shape
            q_pos = (r0 + rows)[:, None] * bs + offs  # (n, bs) absolute
            k_pos = ((c0 + cols)[:, :, None] * bs + offs).view(n, r * bs)  # (n, r*bs)
            # Padding positions are clamped into the call (their results are masked or dropped),
            # so masks indexed by position (Document) and score modifiers are only evaluated inside
            # it: a padding query row scores like a real one (a modifier that is NaN only where the
            # mask hides the pair would otherwise fill it with NaN, which reaches dK and dV).
            q_in = q_pos.clamp(inp.q_offset, inp.q_offset + Tq - 1)
            k_in = k_pos.clamp(inp.kv_offset, inp.kv_offset + Tk - 1)
            keep = mask_on(inp.mask, inp, q_in, k_in)
            in_call = (k_pos >= inp.kv_offset) & (k_pos < inp.kv_offset + Tk)
            keep = grouped(keep & in_call[:, None, :], Hkv)  # (B|1, Hkv|1, n, G|1, bs, r*bs)
            kg = k[:, :, cols].reshape(B, Hkv, n, r * bs, D)  # reshape: a strided k gathers strided
            vg = v[:, :, cols].reshape(B, Hkv, n, r * bs, Dv)
            qg = q[:, :, rows].reshape(B, Hkv, n, G * bs, D)
            s = torch.matmul(qg, kg.transpose(-2, -1)).to(torch.promote_types(inp.dtype, torch.float32))
            s = s.view(B, Hkv, n, G, bs, r * bs)
            if inp.score_mod is not None:
                s = modify_gathered(inp, s, q_in, k_in)
            s = s.masked_fill_(~keep, float("-inf")) if inplace else s.masked_fill(~keep, float("-inf"))
            p, denom, lse = softmax_parts(s, inplace, sink=gathered_sink(inp, s.dtype))
            o = torch.matmul(p.to(inp.dtype).reshape(B, Hkv, n, G * bs, r * bs), vg)
            outs.append((o / safe(denom).view(B, Hkv, n, G * bs, 1)).to(inp.dtype))
            lses.append(lse)
            rows_done.append(rows)
        acc = torch.promote_types(inp.dtype, torch.float32)
        out = inp.q.new_zeros(B, Hkv, nR, G * bs, Dv)
        lse = torch.full((B, Hkv, nR, G, bs), float("-inf"), dtype=acc, device=dev)
        if inp.sinks is not None:  # a row that attends nothing keeps only its sink
            lse = inp.sinks.to(acc).view(1, Hkv, 1, G, 1).expand_as(lse).clone()
        if rows_done:
            rows = torch.cat(rows_done)
            out = out.index_copy(2, rows, torch.cat(outs, dim=2))
            lse = lse.index_copy(2, rows, torch.cat(lses, dim=2))
        else:  # every block is off: nothing computed, but backward must still work (zero gradients)
            out = connected(out, inp.q, inp.k, inp.v)
        out = out.view(B, Hkv, nR, G, bs, Dv).transpose(2, 3).reshape(B, Hq, nR * bs, Dv)[:, :, qs : qs + Tq]
        lse = lse.transpose(2, 3).reshape(B, Hq, nR * bs)[:, :, qs : qs + Tq]
        out = out.to(dtype)
        return (out, lse) if inp.return_lse else out
