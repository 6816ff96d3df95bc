"""Context parallelism for gated linear attention: each rank exchanges a state summary, not K/V.

The rules of :func:`~attnkit.gated_linear_attention` are linear in their state: a stretch of
tokens maps the state before it, ``S (Dk, Dv)``, to the state after it as ``A S + U``, where the
*transition* ``A (Dk, Dk)`` is the product of the tokens' ``(I - β k kᵀ) Diag(exp(g))`` (SSD and
GLA: a diagonal of decays) and ``U (Dk, Dv)`` is the state the stretch builds from zero. Each rank
computes ``(A, U)`` for each of its segments of the sequence, the ranks all-gather them, and every
rank runs the same prefix over the segments in position order (the same products on the same
values, so every rank holds bitwise the same states)::

    rank 0: tokens [0, 4)    rank 1: tokens [4, 8)     local runs, in parallel: (A0, U0), (A1, U1)
                  │  all-gather (A, U): B·Hv·Dk·(Dk+Dv) numbers per segment, whatever T
                  ▼
    S_in(seg 0) = S0 (initial_state or 0)
    S_in(seg 1) = A0 S_in(seg 0) + U0      ...      final state = A1 S_in(seg 1) + U1

One local run gives both the summary and the output: for the delta rules (gated delta, KDA) the
run starts from ``[0 | I]`` with the values widened to ``[v | 0]``, so the extra ``Dk`` state columns
carry ``A_t`` (the transition up to token ``t``) and the extra output columns ``A_tᵀ q_t``; once the
segment's incoming state ``S_in`` is known, ``o_t = o_t(from 0) + S_inᵀ A_tᵀ q_t`` is one small
matmul. No second pass, no recompute. Without the delta rule (SSD, GLA) ``A_t`` is the diagonal
``exp(g_1 + ... + g_t)``, computed directly: the run is the plain one, from zero.
The sequence's first segment, without an ``initial_state``, starts from a known zero state: it is
the plain run (no extra columns) and sends its final state with a zero transition.

The backward is autograd's: the local run's gradients (with respect to its initial state
included), the prefix, and the all-gather, whose backward sends each rank the gradients of its
summaries from every rank (an all-to-all) and sums them in rank order. Any
:class:`~attnkit.distributed.SequenceLayout` works (contiguous, uneven, zigzag: a rank with two
segments sends two summaries).
"""

from __future__ import annotations

import struct

import torch
import torch.distributed as dist
from torch import Tensor

from .._validate import score_scale
from ..backends.kernelized.gated.rule import check_inputs, gated_linear_attention, prepare, rule_name
from .comm import Ring, agree, digest_ints, exchange_checks, resolve_timeout, wait_all
from .layout import SequenceLayout, check_layout

__all__ = ["context_parallel_gated_linear_attention"]

_WHAT = "context_parallel_gated_linear_attention"
_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_RULES = ("gated_delta", "kda", "ssd", "gla")


class _AllGather(torch.autograd.Function):
    """``(n, *S)`` per rank -> ``(P, n, *S)`` in rank order; the backward returns to each rank the
    sum, in rank order, of every rank's gradient for its slot (an all-to-all, then a fixed-order sum)."""

    @staticmethod
    def forward(ctx, mine: Tensor, ring: Ring) -> Tensor:
        ctx.ring = ring
        out = [torch.empty_like(mine) for _ in range(ring.world)]
        wait_all([dist.all_gather(out, mine.contiguous(), group=ring.group, async_op=True)], ring)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ring = ctx.ring
        received = torch.empty_like(grad)  # received[r] = rank r's gradient for our slot
        wait_all([dist.all_to_all_single(received, grad.contiguous(), group=ring.group, async_op=True)], ring)
        total = received[0]
        for r in range(1, ring.world):
            total = total + received[r]
        return total, None


class _Joined(torch.autograd.Function):
    """``out`` itself, made to depend on ``gathered`` for autograd: a rank whose output never reads
    the exchanged summaries (rank 0 of a contiguous split) still runs the exchange's backward, in which
    every other rank waits for it (zeros: its tokens have no gradient to send)."""

    @staticmethod
    def forward(ctx, out: Tensor, gathered: Tensor) -> Tensor:
        ctx.shape, ctx.dtype = gathered.shape, gathered.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_zeros(ctx.shape, dtype=ctx.dtype)


def _scale_bits(scale: float | None) -> int:
    return -1 if scale is None else struct.unpack("<q", struct.pack("<d", float(scale)))[0]


def _check(ring, q, k, v, g, beta, initial_state, layout, check_gates, timeout, scale, qk_l2norm, return_state):
    """This rank's checks, exchanged so that every rank raises when one rank's inputs are wrong;
    returns the layout (built from every rank's length when None) and the scale."""
    error, mine = None, [0] * 16  # as many ints as a valid descriptor: every rank gathers the same size
    try:
        ring.timeout = resolve_timeout(timeout)
        check_inputs(q, k, v, g, beta, initial_state, None, check_gates=check_gates)
        scale = score_scale(scale, q.shape[-1])
        check_layout(layout, ring.world, ring.rank, q.shape[2])
        B, Hk, T, Dk = q.shape
        digest = digest_ints("none" if layout is None else repr(layout.segments))
        mine = [B, Hk, v.shape[1], Dk, v.shape[-1], _DTYPES.get(q.dtype, 4), _RULES.index(rule_name(g, beta)),
                int(initial_state is None), int(bool(qk_l2norm)), int(bool(return_state)), _scale_bits(scale),
                *digest, T]
        assert len(mine) == 16
    except (TypeError, ValueError) as exc:
        error = exc
    everyone = exchange_checks(ring, error, mine, _WHAT)
    differ = [r for r, d in enumerate(everyone) if d[:-1] != mine[:-1]]
    if differ:
        raise ValueError(
            f"{_WHAT}: ranks disagree on (B, Hk, Hv, Dk, Dv, dtype, rule, initial_state given, qk_l2norm, "
            f"return_state, scale, layout): rank {ring.rank} has {mine[:10]}, rank(s) {differ} have "
            f"{[everyone[r][:10] for r in differ]} (or a different scale or layout). Fix: every rank passes its "
            "slice of the same q, k, v, g, beta, the same options and the same layout (or None on every rank).")
    return (layout if layout is not None else SequenceLayout.contiguous([d[-1] for d in everyone])), scale


def context_parallel_gated_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None = None, *,
    group=None, layout: SequenceLayout | None = None, scale: float | None = None, qk_l2norm: bool = False,
    initial_state: Tensor | None = None, return_state: bool = False, chunk_size: int | None = None,
    recompute_segment: int | None = None, check_gates: bool = True, timeout=None,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`~attnkit.gated_linear_attention` over one sequence split across the ranks of ``group``.

    Args:
        q, k, v, g, beta: this rank's slices (sequence on dim 2) of the whole sequence's tensors,
            the positions ``layout.positions(rank)``; shapes and rules as in
            :func:`~attnkit.gated_linear_attention` (gated delta rule, KDA, SSD, GLA; ``Hv % Hk == 0``).
        group: the ``torch.distributed`` process group holding the sequence (``None``: the default
            group; without an initialized group, one rank: the plain function).
        layout: which positions each rank holds; ``None`` = contiguous slices in rank order, each
            rank's length read from its tensors (lengths may differ).
        scale, qk_l2norm, chunk_size, recompute_segment, check_gates: as in
            :func:`~attnkit.gated_linear_attention`.
        initial_state: ``(B, Hv, Dk, Dv)``, the state before position 0, the same on every rank; the
            gradient each rank gets is its own tokens' share (summed over the ranks it is the whole
            sequence's, as for a parameter).
        return_state: also return the whole sequence's final state ``(B, Hv, Dk, Dv)`` (float32, or
            float64 for float64 inputs), the same bits on every rank.
        timeout: seconds (or a ``timedelta``) any wait for a peer may last; ``None``: the environment
            variable ``ATTNKIT_CP_TIMEOUT`` if set, else the process group's.

    Returns:
        This rank's slice of the output ``(B, Hv, T_local, Dv)`` in q's dtype (and the final state).

    What travels is the state summary of each segment (see the module docstring), ``B·Hv·Dk·(Dk+Dv)``
    numbers whatever the sequence length, once forward and once backward. Every rank must call it
    with the same options and layout, and run backward through its output or the state when any
    rank does (as every rank of DDP must; a rank whose output reads no summary, such as rank 0 of a
    contiguous split, still sends zeros). Input errors on one rank raise on every rank, and a rank whose
    local run fails still takes part in the exchange, then every rank raises
    :class:`~attnkit.distributed.ContextParallelError` naming it. Packed sequences (``cu_seqlens``)
    are not taken: split the packed batch by sequence first.
    """
    ring = Ring(group)
    layout, scale = _check(ring, q, k, v, g, beta, initial_state, layout, check_gates, timeout, scale, qk_l2norm,
                           return_state)
    if ring.world == 1:
        return gated_linear_attention(q, k, v, g, beta, scale=scale, qk_l2norm=qk_l2norm, initial_state=initial_state,
                                      return_state=return_state, chunk_size=chunk_size,
                                      recompute_segment=recompute_segment, check_gates=False)
    B, Hv, Dk, Dv = q.shape[0], v.shape[1], q.shape[-1], v.shape[-1]
    acc = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    ranges = layout.local_ranges(ring.rank)
    most = max(len(layout.segments[r]) for r in range(ring.world))
    error, outs, summaries = None, [], []
    try:
        # the widened start [0 | I] and values [v | 0]: the extra columns carry the transition
        start = torch.cat([q.new_zeros(B, Hv, Dk, Dv, dtype=acc),
                           torch.eye(Dk, dtype=acc, device=q.device).expand(B, Hv, Dk, Dk)], dim=-1)
        lengths = [b - a for a, b, _, _ in ranges]
        # q in the compute dtype, so the uncorrected output keeps its precision (the rule computes in
        # it anyway); split, not slices, so autograd joins the pieces' gradients once
        pieces = [x.split(lengths, dim=2) for x in (q.to(acc), k, v, g)]
        pieces.append(beta.split(lengths, dim=2) if beta is not None else [None] * len(lengths))
        options = dict(scale=scale, qk_l2norm=qk_l2norm, return_state=True, chunk_size=chunk_size,
                       recompute_segment=recompute_segment, check_gates=False)
        for (_, _, first, _), q_s, k_s, v_s, g_s, b_s in zip(ranges, *pieces):
            if first == 0 and initial_state is None:
                # the sequence's first segment starts from zero: the plain run, nothing to correct later,
                # and the prefix takes its final state as it is (no transition: [U | 0])
                o_s, final = gated_linear_attention(q_s, k_s, v_s, g_s, b_s, **options)
                outs.append((o_s, None))
                summaries.append(torch.cat([final.to(acc), final.new_zeros(B, Hv, Dk, Dk, dtype=acc)], dim=-1))
                continue
            if b_s is None:  # SSD, GLA: A_t = Diag(exp(g_1 + ... + g_t)), no extra columns
                o_s, final = gated_linear_attention(q_s, k_s, v_s, g_s, None, **options)
                q_hat = prepare(q_s, k_s, v_s[..., :1], g_s, None, scale=scale, qk_l2norm=qk_l2norm)[0]
                decay = g_s.to(acc).cumsum(2).exp()  # (B, Hv, T_s) or (B, Hv, T_s, Dk)
                decay = (decay if decay.dim() == 4 else decay[..., None]).expand(q_hat.shape)
                outs.append((o_s, q_hat * decay))  # A_tᵀ q_t
                summaries.append(torch.cat([final.to(acc), torch.diag_embed(decay[:, :, -1])], dim=-1))
                continue
            wide = torch.cat([v_s, v_s.new_zeros(*v_s.shape[:-1], Dk)], dim=-1)  # (B, Hv, T_s, Dv + Dk)
            o_s, final = gated_linear_attention(q_s, k_s, wide, g_s, b_s, initial_state=start, **options)
            outs.append(o_s.split([Dv, Dk], dim=-1))  # (o from 0, A_tᵀ q_t)
            summaries.append(final.to(acc))  # [U | A]
        summaries += [summaries[0].new_zeros(summaries[0].shape)] * (most - len(summaries))
        mine = torch.stack(summaries)  # (most, B, Hv, Dk, Dv + Dk)
    except Exception as exc:  # noqa: BLE001 - every rank raises it after the exchange (agree)
        error, mine = exc, q.new_zeros(most, B, Hv, Dk, Dv + Dk, dtype=acc)
    gathered = _AllGather.apply(mine, ring)  # (P, most, B, Hv, Dk, Dv + Dk)
    agree(ring, error, _WHAT)
    # the prefix over every segment in position order: the same products, in the same order, on every rank
    order = sorted((a, r, i) for r in range(ring.world) for i, (a, _) in enumerate(layout.segments[r]))
    state = None if initial_state is None else initial_state.to(acc)  # None: zero, the plain first segment's
    incoming = {}
    for _, r, i in order:
        incoming[r, i] = state
        U, A = gathered[r, i].split([Dv, Dk], dim=-1)
        state = U if state is None else A @ state + U
    o = torch.cat([o0 if qa is None else o0 + qa @ incoming[ring.rank, i] for i, (o0, qa) in enumerate(outs)],
                  dim=2).to(q.dtype)
    if gathered.requires_grad:
        o = _Joined.apply(o, gathered)
    return (o, state) if return_state else o
