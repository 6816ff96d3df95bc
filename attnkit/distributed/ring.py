"""Ring attention (pass-KV): exact attention over a sequence split across the ranks of a ring.

Forward: every rank keeps its queries; key/value blocks travel one hop per step around the ring
(the transfer of the next block overlaps the computation on the current one). Each (query
segment, key segment) pair is one :func:`attnkit.attention` call with the pair's absolute
``q_offset``/``kv_offset`` and ``return_lse=True``; partial outputs are merged exactly by their
log-sum-exp::

    lse = logaddexp(lse_a, lse_b)      out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

(a row no key may see keeps ``lse = -inf`` and ``out = 0``). Pairs the mask leaves EMPTY are
skipped, and the ring stops after the last step any rank needs (a sliding window over a contiguous
split touches only neighbours).

Backward: the same ring; key/value blocks travel with their dK/dV accumulators, and after the
last step each accumulator is sent home. Per pair the gradient is the flash-attention backward
from the saved output and log-sum-exp (``P = exp(S - lse)``, ``dS = P * (dO Vᵀ - rowsum(dO * O) +
dlse)``), recomputed tile by tile (query chunk × key tile) so memory stays at one tile of
scores; tiles the mask leaves EMPTY are skipped there too.

A rank whose computation raises (a backend error, a mask function that fails, memory) keeps
passing blocks to the end of the pass, so no peer waits on it, and the pass ends with the
failure exchange of :func:`~attnkit.distributed.comm.agree`: every rank raises, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..functional import attention
from ..masks import BlockStatus, Mask
from .comm import Ring, agree, wait_all

__all__ = ["BlockPair", "RingPlan", "ring_attention"]

#: The backward's tiles: at most this many scores (elements of one (B, Hq, cq, ck) tile) ...
_BACKWARD_TILE = 1 << 22
#: ... over at most this many keys, so EMPTY parts of a pair (under a causal diagonal) are skipped.
_KEY_TILE = 512


@dataclass(frozen=True)
class BlockPair:
    """One query segment of this rank against one key segment of the block held at a ring step.

    ``q``/``kv`` are local ``[start, stop)`` slices (of our queries, of the travelling block);
    ``q_abs``/``kv_abs`` the absolute positions they hold."""

    q: tuple[int, int]
    kv: tuple[int, int]
    q_abs: tuple[int, int]
    kv_abs: tuple[int, int]
    status: BlockStatus


@dataclass(frozen=True)
class RingPlan:
    """What one rank computes at each ring step; identical ``steps`` on every rank.

    ``pairs[s]``: the non-EMPTY pairs at step ``s`` (the block of rank ``rank - s`` is here);
    ``block_mask``: the mask handed to :func:`attention` for PARTIAL pairs (absolute positions);
    ``mask``: the caller's mask, evaluated in the whole sequence's frame by the backward."""

    ring: Ring
    steps: int
    pairs: tuple[tuple[BlockPair, ...], ...]
    block_lengths: tuple[int, ...]  # length of the block held at each step
    mask: Mask | None
    block_mask: Mask | None
    scale: float
    backend: str
    options: object


def _merge(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """Merge a partial ``(out, lse)`` into the accumulators in place (exact, -inf safe)."""
    new = torch.logaddexp(lse_acc, lse)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # both -inf: weights 0, not NaN
    out_acc.mul_(torch.exp(lse_acc - safe).unsqueeze(-1)).add_(torch.exp(lse - safe).unsqueeze(-1) * out)
    lse_acc.copy_(new)


def _forward_step(plan: RingPlan, step: int, q: Tensor, k: Tensor, v: Tensor, out_acc: Tensor, lse_acc: Tensor):
    for p in plan.pairs[step]:
        (q0, q1), (k0, k1) = p.q, p.kv
        out, lse = attention(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
            mask=None if p.status is BlockStatus.FULL else plan.block_mask,
            scale=plan.scale, q_offset=p.q_abs[0], kv_offset=p.kv_abs[0],
            backend=plan.backend, options=plan.options, return_lse=True,
        )
        _merge(out_acc[:, :, q0:q1], lse_acc[:, :, q0:q1], out.to(out_acc.dtype), lse.to(lse_acc.dtype))


def _finite(x: Tensor) -> Tensor:
    # A masked-out key holding NaN/Inf (padding, unwritten slots) must not turn 0 * NaN into NaN
    # in dQ/dK; if an attended entry were non-finite the forward output would already be NaN.
    return x if bool(torch.isfinite(x).all()) else torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _pair_backward(plan: RingPlan, p: BlockPair, q, k, v, do, lse, delta, dq, dk, dv) -> None:
    """Accumulate one pair's dQ into ``dq`` and dK/dV into ``dk``/``dv`` (all in the compute dtype).

    The pair is walked in (query chunk × key tile) tiles; tiles the mask leaves EMPTY are skipped
    (half of a causal diagonal block) and FULL ones need no mask. Shapes inside: grouped queries
    ``(B, Hkv, G, cq, D)`` against keys ``(B, Hkv, 1, ck, D)``."""
    (q0, q1), (k0, k1) = p.q, p.kv
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    kb = _finite(k[:, :, k0:k1].to(q.dtype)).unsqueeze(2)  # (B, Hkv, 1, Tk, D)
    vb = _finite(v[:, :, k0:k1].to(q.dtype)).unsqueeze(2)  # (B, Hkv, 1, Tk, Dv)
    Tk = k1 - k0
    ck = min(Tk, _KEY_TILE)
    cq = max(1, min(q1 - q0, _BACKWARD_TILE // max(1, B * Hq * ck)))
    dk_b = torch.zeros_like(kb)
    dv_b = torch.zeros_like(vb)
    for c0 in range(q0, q1, cq):
        c1 = min(q1, c0 + cq)
        n = c1 - c0
        a = p.q_abs[0] + (c0 - q0)
        qc = _finite(q[:, :, c0:c1]).view(B, Hkv, G, n, D)
        doc = do[:, :, c0:c1].view(B, Hkv, G, n, -1)
        lse_c = lse[:, :, c0:c1].view(B, Hkv, G, n, 1)
        lse_c = lse_c.masked_fill(torch.isneginf(lse_c), float("inf"))  # rows that see nothing: P = 0
        delta_c = delta[:, :, c0:c1].view(B, Hkv, G, n, 1)
        dq_c = torch.zeros_like(qc)
        for t0 in range(0, Tk, ck):
            t1 = min(Tk, t0 + ck)
            kv_abs = (p.kv_abs[0] + t0, p.kv_abs[0] + t1)
            status = (p.status if p.status is BlockStatus.FULL
                      else plan.mask.block_status((a, a + n), kv_abs, batch_size=B, num_heads=Hq))
            if status is BlockStatus.EMPTY:
                continue
            kt, vt = kb[:, :, :, t0:t1], vb[:, :, :, t0:t1]
            prob = torch.exp(torch.matmul(qc, kt.transpose(-1, -2)) * plan.scale - lse_c)  # (B, Hkv, G, n, ck)
            if status is not BlockStatus.FULL:
                keep = plan.mask.evaluate((a, a + n), kv_abs, q_offset=0, kv_offset=0, device=q.device, batch_size=B,
                                          num_heads=Hq)
                keep = (keep.reshape(keep.shape[0], Hkv, G, n, t1 - t0) if keep.shape[1] == Hq and G > 1
                        else keep.unsqueeze(2))
                prob = prob.masked_fill(~keep, 0.0)
            dv_b[:, :, :, t0:t1] += torch.matmul(prob.transpose(-1, -2), doc).sum(2, keepdim=True)
            ds = prob * (torch.matmul(doc, vt.transpose(-1, -2)) - delta_c) * plan.scale  # (B, Hkv, G, n, ck)
            dq_c += torch.matmul(ds, kt)
            dk_b[:, :, :, t0:t1] += torch.matmul(ds.transpose(-1, -2), qc).sum(2, keepdim=True)
        dq[:, :, c0:c1] += dq_c.view(B, Hq, n, D)
    dk[:, :, k0:k1] += dk_b.squeeze(2)
    dv[:, :, k0:k1] += dv_b.squeeze(2)


def _pack(k: Tensor, v: Tensor) -> Tensor:
    """K and V in one flat buffer: one message per transfer, and contiguous views on arrival."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(flat: Tensor, B: int, H: int, n: int, D: int, Dv: int) -> tuple[Tensor, Tensor]:
    """``(k (B, H, n, D), v (B, H, n, Dv))`` views of a :func:`_pack` buffer."""
    return flat[: B * H * n * D].view(B, H, n, D), flat[B * H * n * D:].view(B, H, n, Dv)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: RingPlan):
        ring = plan.ring
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        B, Hq, T, _ = q.shape
        Hkv, D, Dv = k.shape[1], k.shape[-1], v.shape[-1]
        out_acc = q.new_zeros(B, Hq, T, Dv, dtype=acc)
        lse_acc = q.new_full((B, Hq, T), float("-inf"), dtype=acc)
        kv = _pack(k, v)
        error = None  # after a failure this rank only passes blocks on (see the module docstring)
        for step in range(plan.steps):
            pending = []
            if step + 1 < plan.steps:
                size = B * Hkv * plan.block_lengths[step + 1] * (D + Dv)
                nxt, pending = ring.shift(kv, kv.new_empty(size), tag=2 * step)
            if error is None:
                try:
                    kb, vb = _unpack(kv, B, Hkv, plan.block_lengths[step], D, Dv)
                    _forward_step(plan, step, q, kb, vb, out_acc, lse_acc)
                except Exception as exc:  # noqa: BLE001 - every rank raises it after the pass (agree)
                    error = exc
            if pending:
                wait_all(pending, ring)
                kv = nxt
        agree(ring, error)
        out = out_acc.to(q.dtype)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse_acc)
        return out, lse_acc

    @staticmethod
    def backward(ctx, dout: Tensor, dlse: Tensor | None):
        plan: RingPlan = ctx.plan
        ring = plan.ring
        q, k, v, out, lse = ctx.saved_tensors
        acc = lse.dtype
        B, Hkv, _, D = k.shape
        Dv = v.shape[-1]
        qf, do = q.to(acc), dout.to(acc)
        delta = (do * out.to(acc)).sum(-1)  # rowsum(dO * O): (B, Hq, T)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        dq = torch.zeros_like(qf)
        kv = _pack(k, v)  # travels in the input dtype; the dK/dV accumulators are in ``acc``
        last = plan.steps - 1
        sends, sent = [], []
        error = None  # after a failure this rank only passes blocks and accumulators on
        for step in range(plan.steps):
            n = plan.block_lengths[step]
            # Per step, the same order on every rank (NCCL matches transfers between two ranks in
            # posting order): receive this block's accumulator, shift K/V, compute, send it on.
            if step > 0:  # the accumulator of this block, from the ranks that held it before us
                incoming = kv.new_empty(B * Hkv * n * (D + Dv), dtype=acc)
                recv_acc = ring.recv(incoming, -1, tag=2 * step + 1)
            pending = []
            if step < last:
                size = B * Hkv * plan.block_lengths[step + 1] * (D + Dv)
                nxt, pending = ring.shift(kv, kv.new_empty(size), tag=2 * step)
            dkv = kv.new_zeros(B * Hkv * n * (D + Dv), dtype=acc)
            kb, vb = _unpack(kv, B, Hkv, n, D, Dv)
            dk, dv = _unpack(dkv, B, Hkv, n, D, Dv)
            if error is None:
                try:
                    for p in plan.pairs[step]:
                        _pair_backward(plan, p, qf, kb, vb, do, lse, delta, dq, dk, dv)
                except Exception as exc:  # noqa: BLE001 - every rank raises it after the pass (agree)
                    error = exc
            if step > 0:
                wait_all([recv_acc], ring)
                dkv += incoming
            if plan.steps > 1:  # pass the accumulator on; after the last step it goes home
                to = 1 if step < last else -last
                sends.append(ring.send(dkv, to, tag=2 * step + 3 if step < last else 2 * plan.steps + 1))
                sent.append(dkv)  # keep the buffer alive until its send completes
            if pending:
                wait_all(pending, ring)
                kv = nxt
        if plan.steps > 1:
            dkv = kv.new_empty(B * Hkv * plan.block_lengths[0] * (D + Dv), dtype=acc)
            wait_all([ring.recv(dkv, last, tag=2 * plan.steps + 1)], ring)
        wait_all(sends, ring)
        agree(ring, error)
        dk, dv = _unpack(dkv, B, Hkv, plan.block_lengths[0], D, Dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, plan: RingPlan) -> tuple[Tensor, Tensor]:
    """``(out (B, Hq, T_local, Dv), lse (B, Hq, T_local))`` of this rank's queries against the
    whole sequence, by the ring in ``plan`` (differentiable in ``q``, ``k``, ``v``)."""
    return _RingAttention.apply(q, k, v, plan)
