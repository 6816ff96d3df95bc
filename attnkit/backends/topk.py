"""Top-k sparse attention: each query attends only the keys its ``TopK`` list names, forward and backward.

Equals ``naive`` for a ``TopK`` mask, alone or ``And``-ed with other masks (``Causal()``,
``KeyPadding``, ...), which are evaluated on the listed pairs only. Per block of queries it gathers
each query's ``k`` listed keys and values into ``(c, k, D)`` tiles and runs batched products on
them, so time and memory are O(Tq·k·D), never O(Tq·Tk): the ``(Tq, Tk)`` mask and scores are never
built. A list shared by every head (DeepSeek-V3.2's indexer) is gathered once per key/value head and
read by all the query heads of its group in one product.

The backward pass is FlashAttention's, on the gathered tiles: it recomputes each block's
probabilities from the saved log-sum-exp and scatter-adds the keys' and values' gradients back
(``index_add_``), so training needs no stored ``(Tq, k)`` tensor either. Scores, statistics and
products run in float32 (float64 for float64 inputs); a query whose list keeps nothing gives 0
(LSE ``-inf``) with zero, finite gradients. Lists are deduplicated once per mask
(:meth:`attnkit.masks.TopK.lists`): a key listed twice counts once, as in the mask's evaluation.

On the CPU, with the ``sparse`` kernel family built (``attnkit build``), the same computation runs
in C++ (``attnkit/csrc/sparse.cpp``): one pass per query over its listed keys, each key row loaded
once for every query head sharing the list, and a backward pass that needs no gathered tiles at all.
The PyTorch gather above is its twin and its fallback; ``TopKOptions(native=False)`` forces the twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._validate import check_bool
from ..csrc import loader
from ..inputs import AttentionInputs
from ..masks import And, MaskSupport
from ..registry import Backend, Work, register_backend
from ._common import connected, safe
from ._tiles import empty_batch

#: Elements of the gathered key/value tiles and score tiles per block of queries (about 64 MiB in
#: float32): the block size follows from the shapes alone, never from a timing.
BLOCK_ELEMENTS = 1 << 24


def _layout(t: Tensor, Hkv: int, Gm: int) -> Tensor:
    """``(B|1, Hq|1, Tq, X)`` as ``(B|1, Hkv|1, Gm|1, Tq, G'|1, X)``: the product layout, where query
    head ``h = kv_head * G + g`` sits at ``[kv_head, g]`` (``Gm = G``: per-head lists) or at
    ``[kv_head, 0, :, g]`` (``Gm = 1``: one list per kv head shared by its group)."""
    Bt, Ht, Tq, X = t.shape
    if Ht == 1:
        return t.view(Bt, 1, 1, Tq, 1, X)
    t = t.reshape(Bt, Hkv, Ht // Hkv, Tq, X)  # reshape: q may be strided
    return t.unsqueeze(4) if Gm > 1 else t.permute(0, 1, 3, 2, 4).unsqueeze(2)


def _unlayout(t: Tensor, Hq: int, Gm: int) -> Tensor:
    """The inverse of :func:`_layout` for a full ``(B, Hkv, Gm, c, G', X)`` tensor: ``(B, Hq, c, X)``."""
    B, Hkv, _, c, _, X = t.shape
    t = t.squeeze(4) if Gm > 1 else t.squeeze(2).permute(0, 1, 3, 2, 4)
    return t.reshape(B, Hq, c, X)


@dataclass(frozen=True)
class TopKOptions:
    """``native``: None (default) runs the C++ kernel where it can (CPU, ``sparse`` family built) and
    the PyTorch gather elsewhere; False always the PyTorch gather; True the kernel or an error."""

    native: bool | None = None

    def __post_init__(self):
        check_bool(self.native, "native", owner="TopKOptions", allow_none=True)


_KERNEL: list = []  # [""] once the sparse family loaded, [reason] when it cannot


def kernel_unavailable() -> str:
    """Why the sparse kernel family cannot be loaded (``""`` when it is): loaded once, with fake kernels
    registered so ``torch.compile`` traces its ops; a constant to ``torch.compile``."""
    if not _KERNEL:
        reason = loader.load_library("sparse")
        if reason is None:  # shapes from the inputs alone
            torch.library.register_fake("attnkit_sparse::forward")(_forward_fake)
            torch.library.register_fake("attnkit_sparse::backward")(_backward_fake)
        _KERNEL.append(reason or "")
    return _KERNEL[0]


kernel_unavailable._dynamo_marked_constant = True  # as attnkit._compat.assume_constant_result marks it


def kernel_reason(inp: AttentionInputs) -> str | None:
    """Why the C++ kernel cannot run ``inp`` (None: it can)."""
    if inp.device.type != "cpu":
        return f"the sparse kernel runs on the CPU, not {inp.device.type}"
    return kernel_unavailable() or None


def _forward_fake(q, k, v, index, scale):
    B, Hq, Tq, _ = q.shape
    return q.new_empty(B, Hq, Tq, v.shape[-1]), q.new_empty(B, Hq, Tq)


def _backward_fake(dout, q, k, v, out, lse, index, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _pairs(inp: AttentionInputs) -> tuple[Tensor, Tensor | None]:
    """``(lists, keep)``: the deduplicated lists ``(B|1, 1|Hq, Tq, k)`` (absolute positions, -1 =
    nothing) and, when the mask has other conjuncts, which listed pairs they keep ``(B|1, Hq|1, Tq, k)``
    (None: every listed pair). The other conjuncts are evaluated on the listed pairs only."""
    mask = inp.mask
    top = mask.topk()
    lists = top.lists(inp.device)
    others = [p for p in mask.conjuncts() if p is not top]
    if not others:
        return lists, None
    rest = others[0] if len(others) == 1 else And(*others)
    b, h = rest.batch_head_index(inp.B, inp.Hq, device=inp.device)
    q_pos = torch.arange(inp.Tq, device=inp.device).view(1, 1, -1, 1) + inp.q_offset
    k_pos = lists.clamp(min=inp.kv_offset)  # padding read at a real position (its pair is dropped anyway)
    keep = rest.mask_mod(b, h, q_pos, k_pos, q_offset=inp.q_offset, kv_offset=inp.kv_offset) & (lists >= 0)
    return lists, keep


def _listed_rows(inp: AttentionInputs, lists: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(k, v, lists)`` with only the listed keys read, ``(B, Hkv, U, D)`` for the ``U`` distinct
    positions listed anywhere in the call, and the lists renumbered to them (-1 stays): for K/V in a
    cache handle (int8, paged), or strided (values that are a view of the keys, as MLA's latent
    rows): O(Tq·k) reads instead of a copy of the whole cache."""
    listed = lists >= 0
    positions = torch.unique(lists[listed])  # sorted
    if positions.numel() == 0:
        positions = torch.full((1,), inp.kv_offset, dtype=torch.long, device=lists.device)
    if inp.kv_format != "dense":
        k, v = inp.k.gather(positions, dtype)
    else:
        rows = positions - inp.kv_offset
        k, v = inp.k[:, :, rows], inp.v[:, :, rows]
    return k, v, torch.where(listed, torch.searchsorted(positions, lists.clamp(min=0)), -1)


class _Plan:
    """The PyTorch gather's plan: key indices relative to the call ``(B|1, 1|Hkv, Gm, Tq, k)``, the
    keep of each listed pair in the product layout, and the query block size."""

    def __init__(self, inp: AttentionInputs, lists: Tensor, keep: Tensor | None, kv_offset: int):
        keep = lists >= 0 if keep is None else keep
        self.Gm = inp.groups if lists.shape[1] > 1 else 1
        j = (lists - kv_offset).clamp(min=0)
        Bi, Hi, Tq, k = j.shape
        self.index = j.view(Bi, 1, 1, Tq, k) if Hi == 1 else j.view(Bi, inp.Hkv, self.Gm, Tq, k)
        self.keep = _layout(keep, inp.Hkv, self.Gm)  # (B|1, Hkv|1, Gm|1, Tq, G'|1, k)
        per_row = inp.B * inp.Hkv * self.Gm * k * (inp.D + inp.Dv) + 4 * inp.B * inp.Hq * k
        self.block = max(1, min(inp.Tq, BLOCK_ELEMENTS // max(per_row, 1)))


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """Rows of ``x (B, Hkv, Tk, X)`` at ``index (B|1, Hkv|1, Gm, c, k)``: ``(B, Hkv, Gm, c, k, X)``."""
    B, Hkv = x.shape[:2]
    b = torch.arange(B, device=x.device).view(B, 1, 1, 1, 1)
    h = torch.arange(Hkv, device=x.device).view(1, Hkv, 1, 1, 1)
    return x[b, h, index]


def _flat(index: Tensor, B: int, Hkv: int, Tk: int) -> Tensor:
    """``index`` as row numbers of ``x.view(B * Hkv * Tk, X)``, broadcast to ``(B, Hkv, Gm, c, k)``."""
    b = torch.arange(B, device=index.device).view(B, 1, 1, 1, 1)
    h = torch.arange(Hkv, device=index.device).view(1, Hkv, 1, 1, 1)
    return ((b * Hkv + h) * Tk + index).reshape(-1)


class _TopKAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: _Plan, scale: float, acc: torch.dtype):
        B, Hq, Tq, _ = q.shape
        Hkv, Gm = k.shape[1], plan.Gm
        out = q.new_empty(B, Hq, Tq, v.shape[-1], dtype=acc)
        lse = q.new_empty(B, Hq, Tq, dtype=acc)
        for a in range(0, Tq, plan.block):
            e = min(a + plan.block, Tq)
            index, keep = plan.index[:, :, :, a:e], plan.keep[:, :, :, a:e]
            kg, vg = _gather(k, index).to(acc), _gather(v, index).to(acc)  # (B, Hkv, Gm, c, k, D|Dv)
            x = _layout(q[:, :, a:e].to(acc), Hkv, Gm)  # (B, Hkv, Gm|1, c, G', D)
            s = torch.matmul(x, kg.transpose(-1, -2)).mul_(scale).masked_fill_(~keep, float("-inf"))
            m = s.amax(-1, keepdim=True)
            m = m.masked_fill_(torch.isinf(m), 0.0)
            p = s.sub_(m).exp_()
            denom = p.sum(-1, keepdim=True)
            o = torch.matmul(p, vg).div_(safe(denom))
            out[:, :, a:e] = _unlayout(o, Hq, Gm)
            lse[:, :, a:e] = _unlayout(denom.log().add_(m), Hq, Gm).squeeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.acc = plan, scale, acc
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale, acc = ctx.plan, ctx.scale, ctx.acc
        B, Hq, Tq, D = q.shape
        Hkv, Tk, Dv, Gm = k.shape[1], k.shape[2], v.shape[-1], plan.Gm
        dq = torch.zeros(B, Hq, Tq, D, dtype=acc, device=q.device)
        dk = torch.zeros(B * Hkv * Tk, D, dtype=acc, device=q.device)
        dv = torch.zeros(B * Hkv * Tk, Dv, dtype=acc, device=q.device)
        delta = (dout.to(acc) * out).sum(-1, keepdim=True)  # (B, Hq, Tq, 1)
        for a in range(0, Tq, plan.block):
            e = min(a + plan.block, Tq)
            index, keep = plan.index[:, :, :, a:e], plan.keep[:, :, :, a:e]
            kg, vg = _gather(k, index).to(acc), _gather(v, index).to(acc)
            x = _layout(q[:, :, a:e].to(acc), Hkv, Gm)
            do = _layout(dout[:, :, a:e].to(acc), Hkv, Gm)  # (B, Hkv, Gm|1, c, G', Dv)
            rows = _layout(lse[:, :, a:e, None], Hkv, Gm)
            rows = rows.masked_fill(torch.isinf(rows), 0.0)  # rows that keep nothing: every score is -inf
            s = torch.matmul(x, kg.transpose(-1, -2)).mul_(scale).masked_fill_(~keep, float("-inf"))
            p = s.sub_(rows).exp_()  # (B, Hkv, Gm, c, G', k)
            flat = _flat(index, B, Hkv, Tk)
            dv.index_add_(0, flat, torch.matmul(p.transpose(-1, -2), do).reshape(-1, Dv))
            ds = torch.matmul(do, vg.transpose(-1, -2)).sub_(_layout(delta[:, :, a:e], Hkv, Gm)).mul_(p).mul_(scale)
            dq[:, :, a:e] = _unlayout(torch.matmul(ds, kg), Hq, Gm)
            dk.index_add_(0, flat, torch.matmul(ds.transpose(-1, -2), x).reshape(-1, D))
        return (dq.to(q.dtype), dk.view(B, Hkv, Tk, D).to(k.dtype), dv.view(B, Hkv, Tk, Dv).to(v.dtype),
                None, None, None)


class _SparseKernel(torch.autograd.Function):
    """The C++ kernel's forward and backward (``torch.ops.attnkit_sparse``) on contiguous float32/64."""

    @staticmethod
    def forward(ctx, q, k, v, index: Tensor, scale: float):
        out, lse = torch.ops.attnkit_sparse.forward(q, k, v, index, scale)
        ctx.save_for_backward(q, k, v, out, lse, index)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, index = ctx.saved_tensors
        dq, dk, dv = torch.ops.attnkit_sparse.backward(dout.contiguous(), q, k, v, out, lse, index, ctx.scale)
        return dq, dk, dv, None, None


def _kernel(q, k, v, lists: Tensor, keep: Tensor | None, kv_offset: int, scale: float,
            acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """The C++ kernel (half precision upcast: the kernel computes in float32/64)."""
    index = torch.where(lists >= 0, lists - kv_offset, -1) if kv_offset else lists  # relative to the call
    if keep is not None:
        index = torch.where(keep, index, -1)  # (B|1, Hq|1, Tq, k)
    q, k, v = (x.to(acc).contiguous() for x in (q, k, v))
    return _SparseKernel.apply(q, k, v, index.contiguous(), scale)


@register_backend
class TopKBackend(Backend):
    name = "topk"
    work = Work(loop_ops=12)  # the PyTorch twin: a Python loop over blocks of queries, O(Tq * k) per call
    summary = "top-k sparse attention: each query's listed keys only (TopK), O(Tq*k*D) fwd+bwd, C++ kernel on CPU"
    supports_lse = True
    mask_support = MaskSupport("key_lists")
    kv_formats = frozenset({"dense", "int8", "paged", "paged-int8"})  # a handle's listed rows read in place
    Options = TopKOptions

    @classmethod
    def describe(cls, inp: AttentionInputs) -> str:
        top = inp.mask.topk()
        shared = "one list per query shared by every head" if top.num_heads == 1 else "one list per query head"
        how = "the C++ sparse kernel" if kernel_reason(inp) is None else f"a PyTorch gather ({kernel_reason(inp)})"
        return f"reads k={top.k} keys per query ({shared}) with {how}, never the (Tq, Tk) scores"

    @classmethod
    def forward(cls, inp: AttentionInputs, options: TopKOptions | None):
        if inp.B == 0:
            return empty_batch(inp)
        acc = torch.promote_types(inp.dtype, torch.float32)
        native = None if options is None else options.native
        reason = kernel_reason(inp) if native is not False else None
        if native and reason is not None:
            raise RuntimeError(f"topk: TopKOptions(native=True), but {reason}. Fix: run `attnkit build`, or pass "
                               "native=None to fall back to the PyTorch gather.")
        lists, keep = _pairs(inp)
        k, v, kv_offset = inp.k, inp.v, inp.kv_offset
        if inp.Tq == 0 or inp.Tk == 0 or lists.shape[-1] == 0:  # nothing listed: every row is 0, LSE -inf
            out = inp.q.new_zeros(inp.B, inp.Hq, inp.Tq, inp.Dv)
            out = out if inp.kv_format != "dense" else connected(out, inp.q, inp.k, inp.v)
            lse = torch.full((inp.B, inp.Hq, inp.Tq), float("-inf"), dtype=acc, device=inp.device)
            return (out, lse) if inp.return_lse else out
        # Read the listed rows only from a cache handle, and where K/V would be copied whole (strided, or
        # in half precision for the float32 kernel) while the lists name fewer rows than K/V hold (decoding).
        few = lists.shape[-2] * lists.shape[-1] <= inp.Tk
        if inp.kv_format != "dense" or (few and (k.dtype != acc or v.dtype != acc or not k.is_contiguous()
                                                 or not v.is_contiguous())):
            k, v, lists = _listed_rows(inp, lists, acc)
            kv_offset = 0
        if native is not False and reason is None:
            out, lse = _kernel(inp.q, k, v, lists, keep, kv_offset, inp.scale, acc)
        else:
            out, lse = _TopKAttention.apply(inp.q, k, v, _Plan(inp, lists, keep, kv_offset), inp.scale, acc)
        out = out.to(inp.dtype)
        return (out, lse) if inp.return_lse else out
