"""Flash-style tiled attention in pure PyTorch: O(Tq + Tk) memory, forward and backward.

Equals ``naive``: ``softmax(q kᵀ · scale + bias, masked) v``, computed one (query tile × key tile)
at a time with the online softmax of FlashAttention (Dao et al. 2022, https://arxiv.org/abs/2205.14135):
a running row max ``m``, row sum ``l`` and output accumulator, all in float32. The mask is asked
per tile through ``mask.block_status``: EMPTY tiles are skipped, FULL tiles run unmasked, PARTIAL
tiles evaluate ``mask.evaluate`` on the tile only. The backward pass is a custom autograd function
that recomputes each tile's probabilities from the saved log-sum-exp, so training needs O(Tq + Tk)
memory too (plus the gradient of a full-size ``bias`` when one is given).

GQA is native: the ``Hq // Hkv`` query heads that share a key/value head are stacked into one
``(G * tile_q, D)`` matrix, so every tile is one batched matmul over all heads and K/V are never
repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._validate import check_bool, positive_int
from ..inputs import AttentionInputs
from ..masks import BlockStatus, Mask
from ..score_mods import ScoreMod
from ..registry import Backend, Work, register_backend
from ._common import half_tiles_on_cpu

NEG_INF = float("-inf")


@dataclass(frozen=True)
class TiledOptions:
    """Tile sizes (large tiles keep CPU matmuls efficient; one tile's scores are
    ``B * Hq * block_q * block_k`` floats: 4 MiB at B=1, Hq=8 and the defaults, measured best of
    256..1024 x 512..4096 at n=4096 on a 2-core CPU).

    ``upcast``: run the tile matmuls of float16/bfloat16 inputs in float32 (``None``: as
    :func:`attnkit.backends._common.half_tiles_on_cpu` decides from the CPU's features: always for
    float16, whose range cannot hold every score; for bfloat16 where the CPU lacks half-precision
    matmul instructions or gradients are needed). ``upcast=False`` with float16 inputs may overflow."""

    block_q: int = 256
    block_k: int = 512
    upcast: bool | None = None

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            positive_int(getattr(self, name), name, owner="TiledOptions", fix=f"pass e.g. {name}=256")
        check_bool(self.upcast, "upcast", owner="TiledOptions", allow_none=True)


@dataclass(frozen=True, eq=False)
class _Plan:
    """Everything the tile loops need besides the tensors (hashable-free, passed to autograd)."""

    mask: Mask | None
    scale: float
    q_offset: int
    kv_offset: int
    block_q: int
    block_k: int
    score_mod: ScoreMod | None = None
    batch_size: int | None = None  # the call's B and Hq: a mask may depend on every b and h (Custom);
    num_heads: int | None = None  # None makes such a mask refuse to evaluate rather than guess

    def modified(self, s5: Tensor, q0, q1, k0, k1) -> Tensor:
        """The score modifier applied to a tile's scores ``(B, Hkv, G, n, m)`` (out of place)."""
        B, Hkv, G, n, m = s5.shape
        q_range = (self.q_offset + q0, self.q_offset + q1)
        kv_range = (self.kv_offset + k0, self.kv_offset + k1)
        return self.score_mod.evaluate(s5.reshape(B, Hkv * G, n, m), q_range, kv_range,
                                       B, Hkv * G).view(B, Hkv, G, n, m)

    def tiles(self, Tq: int, Tk: int):
        """Yield ``(q0, q1, [(k0, k1, status), ...])`` per query tile, EMPTY key tiles left out."""
        for q0 in range(0, Tq, self.block_q):
            q1 = min(q0 + self.block_q, Tq)
            row = []
            for k0 in range(0, Tk, self.block_k):
                k1 = min(k0 + self.block_k, Tk)
                status = BlockStatus.FULL
                if self.mask is not None:
                    status = self.mask.block_status(
                        (self.q_offset + q0, self.q_offset + q1),
                        (self.kv_offset + k0, self.kv_offset + k1),
                        q_offset=self.q_offset,
                        kv_offset=self.kv_offset,
                        batch_size=self.batch_size,
                        num_heads=self.num_heads,
                    )
                if status is not BlockStatus.EMPTY:
                    row.append((k0, k1, status))
            yield q0, q1, row

    def keep(self, q0, q1, k0, k1, Hkv: int, device) -> Tensor:
        """The tile's keep-tensor shaped ``(B|1, Hkv|1, G|1, n, m)`` to match the grouped scores."""
        keep = self.mask.evaluate(
            (self.q_offset + q0, self.q_offset + q1),
            (self.kv_offset + k0, self.kv_offset + k1),
            q_offset=self.q_offset,
            kv_offset=self.kv_offset,
            device=device,
            batch_size=self.batch_size,
            num_heads=self.num_heads,
        )
        return _group(keep, Hkv)


def _group(x: Tensor, Hkv: int) -> Tensor:
    """``(B|1, Hq|1, n, m)`` -> ``(B|1, Hkv|1, G|1, n, m)`` (query head h = kv head h // G)."""
    if x.shape[1] == 1:
        return x.unsqueeze(2)
    return x.reshape(x.shape[0], Hkv, x.shape[1] // Hkv, x.shape[2], x.shape[3])


def _bias_tile(bias: Tensor | None, q0, q1, k0, k1, Hkv: int) -> Tensor | None:
    if bias is None:
        return None
    b = bias[:, :, q0:q1] if bias.shape[2] > 1 else bias
    b = b[..., k0:k1] if bias.shape[3] > 1 else b
    return _group(b, Hkv)


def _scores(qt, kt, acc_dtype, scale: float):
    """Scaled scores ``(B, Hkv, G*n, m)`` in ``acc_dtype``."""
    s = torch.matmul(qt, kt.transpose(-2, -1)).to(acc_dtype)  # (B, Hkv, G*n, m)
    return s.mul_(scale) if scale != 1.0 else s


def _forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, sinks: Tensor | None):
    """``(out (B, Hq, Tq, Dv), lse (B, Hq, Tq))``. ``sinks (Hq,)`` join every row's normaliser: the
    running max starts at the sink logit."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    q5 = q.view(B, Hkv, G, Tq, D)
    # In float32/64, append a column of ones to V: p @ [V, 1] yields the row sums with the output,
    # saving one pass over each score tile. (Low-precision V would round the sums; sum separately.)
    fused_sum = v.dtype == acc_dtype
    v_ext = torch.cat([v, v.new_ones(B, Hkv, Tk, 1)], dim=-1) if fused_sum else v
    E = v_ext.shape[-1]
    out = q.new_zeros(B, Hkv, G, Tq, Dv)
    lse = torch.full((B, Hkv, G, Tq), NEG_INF, dtype=acc_dtype, device=q.device)
    sink = None if sinks is None else sinks.to(acc_dtype).view(1, Hkv, G, 1)
    if sink is not None:
        lse = lse.copy_(sink.expand_as(lse))  # a row that attends nothing keeps only its sink
    for q0, q1, row in plan.tiles(Tq, Tk):
        if not row:
            continue  # every key masked for these queries: output 0, LSE -inf (or the sink)
        n = q1 - q0
        qt = q5[:, :, :, q0:q1].reshape(B, Hkv, G * n, D) * plan.scale  # scale q, not the scores
        m_run = torch.full((B, Hkv, G, n), NEG_INF, dtype=acc_dtype, device=q.device)
        if sink is not None:  # a +inf sink starts the max at the largest finite value: the keys then
            # get weight 0 and the sink term below makes the row's sum +inf (output 0, LSE +inf, as
            # the other backends), where +inf - +inf would give NaN
            m_run = m_run.copy_(sink.clamp(max=torch.finfo(acc_dtype).max).expand_as(m_run))
        l_run = torch.zeros((B, Hkv, G, n), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((B, Hkv, G * n, E), dtype=acc_dtype, device=q.device)
        for k0, k1, status in row:
            keep = plan.keep(q0, q1, k0, k1, Hkv, q.device) if status is BlockStatus.PARTIAL else None
            s = _scores(qt, k[:, :, k0:k1], acc_dtype, 1.0)
            s5 = s.view(B, Hkv, G, n, k1 - k0)
            bias_t = _bias_tile(bias, q0, q1, k0, k1, Hkv)
            if bias_t is not None:
                s5.add_(bias_t)
            if plan.score_mod is not None:
                s5 = plan.modified(s5, q0, q1, k0, k1)
                s = s5.view(B, Hkv, G * n, k1 - k0)
            if keep is not None:
                s5.masked_fill_(~keep, NEG_INF)
            m_new = torch.maximum(m_run, s5.amax(dim=-1))
            # A row with nothing kept so far has max -inf: shift by 0 instead, so exp() sees
            # exp(-inf - 0) = 0 rather than exp(-inf - (-inf)) = NaN.
            m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)
            s5.sub_(m_safe[..., None]).exp_()  # s5 now holds p
            alpha = torch.exp(m_run - m_safe)  # 0 where m_run = -inf
            if not fused_sum:
                l_run.mul_(alpha).add_(s5.sum(dim=-1))
            acc.view(B, Hkv, G, n, E).mul_(alpha[..., None])
            acc.add_(torch.matmul(s.to(v.dtype), v_ext[:, :, k0:k1]))  # p in the input dtype, accumulated in fp32
            m_run = m_new
        if fused_sum:
            l_run = acc[..., Dv].view(B, Hkv, G, n)
            acc = acc[..., :Dv]
        if sink is not None:  # m_run >= sink, so this never overflows
            l_run = l_run + torch.exp(sink - m_run)
        l_safe = torch.where(l_run == 0, 1.0, l_run)
        out[:, :, :, q0:q1] = (acc.reshape(B, Hkv, G, n, Dv) / l_safe[..., None]).to(q.dtype)
        lse[:, :, :, q0:q1] = torch.where(l_run == 0, NEG_INF, m_run + torch.log(l_safe))
    return out.view(B, Hq, Tq, Dv), lse.view(B, Hq, Tq)


def _backward(plan: _Plan, q, k, v, bias, sinks, out, lse, dout, dlse, need_dbias: bool, mod_params: tuple):
    """Gradients of q, k, v, bias, sinks and the score modifier's tensors (None where not needed)."""
    B, Hq, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    acc_dtype = lse.dtype
    # delta_i = sum_j p_ij dp_ij = rowsum(dout * out); the LSE's own gradient enters as -dlse
    # (d lse_i / d s_ij = p_ij), so ds = p * (dp - delta + dlse).
    delta = (dout.to(acc_dtype) * out.to(acc_dtype)).sum(-1)  # (B, Hq, Tq)
    if dlse is not None:
        delta = delta - dlse.to(acc_dtype)
    # d loss / d sink_h = sum over h's rows of p_sink * (dlse - delta), p_sink = exp(sink - lse).
    dsinks = None
    if sinks is not None:
        p_sink = torch.exp(sinks.to(acc_dtype).view(1, Hq, 1) - lse)
        dsinks = -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
    dparams = [torch.zeros_like(t, dtype=acc_dtype) for t in mod_params]  # only the ones requiring grad
    lse_safe = lse.masked_fill(lse == NEG_INF, 0.0).view(B, Hkv, G, Tq)
    delta = delta.view(B, Hkv, G, Tq)
    q5, do5 = q.view(B, Hkv, G, Tq, D), dout.reshape(B, Hkv, G, Tq, Dv)
    dq = torch.zeros((B, Hkv, G, Tq, D), dtype=acc_dtype, device=q.device)
    dk = torch.zeros((B, Hkv, Tk, D), dtype=acc_dtype, device=q.device)
    dv = torch.zeros((B, Hkv, Tk, Dv), dtype=acc_dtype, device=q.device)
    dbias = torch.zeros(bias.shape, dtype=acc_dtype, device=q.device) if need_dbias else None
    for q0, q1, row in plan.tiles(Tq, Tk):
        n = q1 - q0
        qt = q5[:, :, :, q0:q1].reshape(B, Hkv, G * n, D)
        dot = do5[:, :, :, q0:q1].reshape(B, Hkv, G * n, Dv)
        dqt = torch.zeros((B, Hkv, G * n, D), dtype=acc_dtype, device=q.device)
        for k0, k1, status in row:
            m = k1 - k0
            keep = plan.keep(q0, q1, k0, k1, Hkv, q.device) if status is BlockStatus.PARTIAL else None
            kt, vt = k[:, :, k0:k1], v[:, :, k0:k1]
            s = _scores(qt, kt, acc_dtype, plan.scale)
            s5 = s.view(B, Hkv, G, n, m)
            bias_t = _bias_tile(bias, q0, q1, k0, k1, Hkv)
            if bias_t is not None:
                s5.add_(bias_t)
            raw = None
            if plan.score_mod is not None and plan.score_mod.additive and not mod_params:
                s5 = plan.modified(s5, q0, q1, k0, k1)  # d(mod)/d(score) = 1: nothing to differentiate
                s = s5.view(B, Hkv, G * n, m)
            elif plan.score_mod is not None:  # differentiate the modifier locally, one tile at a time
                raw = s5.detach().requires_grad_()
                with torch.enable_grad():
                    modded = plan.modified(raw, q0, q1, k0, k1)
                s5 = modded.detach().clone()
                s = s5.view(B, Hkv, G * n, m)
            if keep is not None:
                s5.masked_fill_(~keep, NEG_INF)
            s5.sub_(lse_safe[:, :, :, q0:q1, None]).exp_()  # p; 0 for masked keys and rows
            p = s.to(q.dtype)
            dv[:, :, k0:k1] += torch.matmul(p.transpose(-2, -1), dot).to(acc_dtype)
            # dp in the accumulation dtype: ds = p * (dp - delta) cancels, and a half-precision dp
            # would leave its rounding in ds (dk = 0 exactly when Tk = 1 came out ~1e-2 in bf16).
            dp = torch.matmul(dot.to(acc_dtype), vt.to(acc_dtype).transpose(-2, -1)).view(B, Hkv, G, n, m)
            ds5 = dp.sub_(delta[:, :, :, q0:q1, None]).mul_(s5)  # (B, Hkv, G, n, m)
            if raw is not None:  # chain rule through the modifier: to the raw scores and its tensors
                grads = torch.autograd.grad(modded, [raw, *mod_params], ds5)
                ds5 = grads[0]
                for g, extra in zip(dparams, grads[1:]):
                    g += extra.to(acc_dtype)
            if dbias is not None:
                _add_bias_grad(dbias, ds5.view(B, Hq, n, m), q0, q1, k0, k1)
            ds = ds5.view(B, Hkv, G * n, m).to(q.dtype)
            dqt += torch.matmul(ds, kt).to(acc_dtype)
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-2, -1), qt).to(acc_dtype)
        dq[:, :, :, q0:q1] = dqt.view(B, Hkv, G, n, D)
    dq = (dq * plan.scale).view(B, Hq, Tq, D).to(q.dtype)
    dk = (dk * plan.scale).to(k.dtype)
    dparams = [g.to(t.dtype) for t, g in zip(mod_params, dparams)]
    return dq, dk, dv.to(v.dtype), None if dbias is None else dbias.to(bias.dtype), dsinks, dparams


def _add_bias_grad(dbias: Tensor, ds: Tensor, q0, q1, k0, k1) -> None:
    """Add the tile's ``ds (B, Hq, n, m)`` into ``dbias``, summed over its broadcast dims."""
    qs = slice(q0, q1) if dbias.shape[2] > 1 else slice(None)
    ks = slice(k0, k1) if dbias.shape[3] > 1 else slice(None)
    dims = [d for d in range(4) if dbias.shape[d] == 1 and ds.shape[d] > 1]
    dbias[:, :, qs, ks] += ds.sum(dim=dims, keepdim=True) if dims else ds


def _flat_params(score_mod: ScoreMod | None) -> Tensor | None:
    """The score modifier's learnable tensors as one flat tensor (an input of :class:`_TiledFunction`,
    so autograd routes their gradients), or None when none requires grad."""
    params = [] if score_mod is None else [t for t in score_mod.parameters() if t.requires_grad]
    return torch.cat([t.reshape(-1) for t in params]) if params else None


class _TiledFunction(torch.autograd.Function):
    """``(out, lse) = f(q, k, v, bias, sinks, plan, mod_flat)``; differentiable in q, k, v,
    bias, sinks and ``mod_flat`` (:func:`_flat_params`: the modifier reads its own tensors, the
    backward returns their gradients concatenated). ``setup_context`` and a ``vmap`` rule make
    ``torch.func`` transforms work."""

    @staticmethod
    def forward(q, k, v, bias, sinks, plan, mod_flat):
        return _forward(plan, q, k, v, bias, sinks)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, bias, sinks, plan, mod_flat = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, bias, sinks, out, lse)
        ctx.plan = plan

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, bias, sinks, out, lse = ctx.saved_tensors
        plan = ctx.plan
        need_dbias = bias is not None and ctx.needs_input_grad[3]
        params = () if plan.score_mod is None or not ctx.needs_input_grad[6] else tuple(
            t for t in plan.score_mod.parameters() if t.requires_grad)
        dq, dk, dv, dbias, dsinks, dparams = _backward(plan, q, k, v, bias, sinks, out, lse, dout, dlse, need_dbias,
                                                       params)
        dflat = torch.cat([g.reshape(-1) for g in dparams]) if params else None
        return dq, dk, dv, dbias, dsinks if ctx.needs_input_grad[4] else None, None, dflat

    @staticmethod
    def vmap(info, in_dims, q, k, v, bias, sinks, plan, mod_flat):
        """Fold the mapped dimension into the batch (one call over ``V * B`` rows); a mask that
        depends on the batch index keeps its per-example meaning, so it maps one slice at a time."""
        V = info.batch_size
        moved = [None if x is None else x.movedim(d, 0) if d is not None else x.expand(V, *x.shape)
                 for x, d in zip((q, k, v, bias), in_dims[:4])]  # (V, B|1, ...)
        if (sinks is not None and in_dims[4] is not None) or (mod_flat is not None and in_dims[6] is not None):
            raise NotImplementedError("tiled: vmap over sinks or score-modifier tensors is not supported")
        B = moved[0].shape[1]
        if plan.mask is not None and plan.mask.depends_on_batch:
            outs = []
            for i in range(V):
                qi, ki, vi, bi = (None if x is None else x[i] for x in moved)
                outs.append(_TiledFunction.apply(qi, ki, vi, bi, sinks, plan, mod_flat))
            out, lse = torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
        else:
            flat = [None if x is None else x.expand(V, B, *x.shape[2:]).reshape(V * B, *x.shape[2:]).contiguous()
                    for x in moved]
            qf, kf, vf, bf = flat
            out, lse = _TiledFunction.apply(qf, kf, vf, bf, sinks, plan, mod_flat)
            out, lse = out.view(V, B, *out.shape[1:]), lse.view(V, B, *lse.shape[1:])
        return (out, lse), (0, 0)


@register_backend
class TiledBackend(Backend):
    name = "tiled"
    work = Work(loop_ops=12)
    summary = "flash-style online softmax over tiles in PyTorch: any mask, O(n) memory fwd+bwd, skips empty tiles"
    supports_bias = True
    supports_lse = True
    supports_score_mod = True
    supports_sinks = True
    Options = TiledOptions

    @classmethod
    def forward(cls, inp: AttentionInputs, options: TiledOptions | None):
        options = options or TiledOptions()
        bias = inp.bias
        if bias is not None:
            bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        plan = _Plan(inp.mask, inp.scale, inp.q_offset, inp.kv_offset, options.block_q, options.block_k, inp.score_mod,
                     inp.B, inp.Hq)
        q, k, v = inp.q.contiguous(), inp.k.contiguous(), inp.v.contiguous()
        upcast = options.upcast
        if upcast is None:
            upcast = inp.device.type == "cpu" and inp.dtype in (torch.float16, torch.bfloat16) and (
                not half_tiles_on_cpu(inp.dtype, inp.requires_grad))
        if upcast and inp.dtype in (torch.float16, torch.bfloat16):
            q, k, v = q.float(), k.float(), v.float()  # O(n) copies; autograd casts the grads back
        out, lse = _TiledFunction.apply(q, k, v, bias, inp.sinks, plan, _flat_params(inp.score_mod))
        out = out.to(inp.dtype)
        return (out, lse) if inp.return_lse else out
