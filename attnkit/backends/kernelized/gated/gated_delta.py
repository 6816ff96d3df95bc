"""The gated delta rule (Gated DeltaNet: Yang, Kautz, Hatamizadeh 2024; Qwen3-Next, Qwen3.5), chunked.

One scalar log-decay ``g_t <= 0`` per head and token; the recurrence and its naive twin are in
``recurrence``. Within a chunk of ``C`` tokens, with ``G`` the cumulative log-decay from the chunk's
start and ``Γ_ij = exp(G_i - G_j)`` for ``j <= i`` (0 above: never an exp of a positive number),
the ``C`` delta updates collapse by the WY / UT transform (Yang et al. 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length") into::

    A   = strict_lower(diag(β) K Kᵀ ⊙ Γ)                      (C, C)
    u   = (I + A)⁻¹ diag(β) V                                  pseudo-values
    w   = (I + A)⁻¹ diag(β) (K ⊙ exp(G))                       what the old state predicts
    A_qk = lower(Q Kᵀ ⊙ Γ)

then one pass over the chunks carries the state (see :class:`_ChunkedGatedDelta`, which also has
the hand-written backward). Cumulative gates and their differences are taken in float64 (only
``(B, H, T)`` and ``(B, H, T, C)`` numbers), so decays near 0 (``g`` of -1e4) next to decays near 1
lose no precision; every exponent is <= 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .scan import chunk_gates, forgetting_gates, pad_chunks

__all__ = ["chunk_gated_delta_rule", "ut_transform", "unit_lower_inverse"]


def unit_lower_inverse(a: Tensor) -> Tensor:
    """``(I + strict_lower(a))⁻¹`` for ``a (..., C, C)``, by recursive 2x2 block inversion::

        [L11  0 ]⁻¹   [ L11⁻¹             0    ]
        [L21 L22]   = [-L22⁻¹ L21 L11⁻¹  L22⁻¹ ]

    all blocks of one size at once, so log2(C) levels of batched matmuls (CPU batched triangular
    solves run one small LAPACK call per matrix, many times slower). Block triangular inversion is
    as stable as substitution (Du Croz & Higham 1992). ``C`` is padded to a power of two with
    identity rows."""
    C = a.shape[-1]
    P = 1 << (C - 1).bit_length()
    a = a.tril(-1)
    if P != C:
        a = torch.nn.functional.pad(a, (0, P - C, 0, P - C))
    batch = a.shape[:-2]
    inv = a.new_ones(batch + (P, 1, 1))  # the diagonal blocks of size s = 1
    s = 1
    while s < P:
        nb = P // (2 * s)
        blocks = a.reshape(batch + (nb, 2 * s, nb, 2 * s)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
        l21 = blocks[..., s:, :s]  # (..., nb, s, s)
        pair = inv.reshape(batch + (nb, 2, s, s))
        i11, i22 = pair[..., 0, :, :], pair[..., 1, :, :]
        low = -(i22 @ (l21 @ i11))
        inv = torch.cat([torch.cat([i11, torch.zeros_like(i11)], dim=-1), torch.cat([low, i22], dim=-1)], dim=-2)
        s *= 2
    return inv[..., 0, :C, :C]


def ut_transform(k: Tensor, beta: Tensor, kk_gamma: Tensor, rhs: list[Tensor]) -> list[Tensor]:
    """``(I + strict_lower(diag(β) K Kᵀ ⊙ Γ))⁻¹ @ r`` for each ``r`` in ``rhs``."""
    inv = unit_lower_inverse(kk_gamma * beta[..., None])
    return [inv @ r for r in rhs]


def _to_chunks(x: Tensor, C: int) -> Tensor:
    """``(B, H, T, ...)`` -> ``(B·H, N, C, ...)``, zero-padded to whole chunks (inert: see
    ``scan.pad_chunks``); a view when ``x`` is contiguous and ``T`` a multiple of ``C``."""
    return pad_chunks(x, C, x.shape[2]).flatten(0, 1)


def _from_chunks(x: Tensor, B: int, H: int, T: int) -> Tensor:
    """The inverse of :func:`_to_chunks`: ``(B·H, N, C, ...)`` -> ``(B, H, T, ...)`` (a view)."""
    N, C = x.shape[1:3]
    return x.view(B, H, N * C, *x.shape[3:])[:, :, :T]


class _ChunkedGatedDelta(torch.autograd.Function):
    """The chunked gated delta rule with a hand-written backward, in segments of chunks.

    Forward, per segment of ``seg`` chunks (a few MiB, so its temporaries stay in cache and are
    reused): the intra-chunk parts (``K Kᵀ``, the UT transform, ``Q Kᵀ``) as one batched matmul over
    the segment's chunks; the only sequential loop carries the state across chunks (two matmuls per
    chunk) and keeps each chunk's starting state ``S_n``; the outputs ``o = q_g S_n + A_qk v_new``
    are one batched matmul again. Saved: the inputs, ``(I + M)⁻¹``, ``v_new`` and the ``S_n``
    (``(T / C)·Dk·Dv`` numbers per head: O(T)). Backward runs the segments in reverse with the same
    shape: one loop carries ``dS`` (two matmuls per chunk), the rest is batched and recomputed.
    With ``M = strict_lower(diag(β) K Kᵀ ⊙ Γ)``, ``u = (I + M)⁻¹ diag(β) V`` and
    ``w = (I + M)⁻¹ diag(β) (K ⊙ exp(G))``, the gradient through the inverse is
    ``dM = -strict_lower(((I + M)⁻ᵀ du) uᵀ + ((I + M)⁻ᵀ dw) wᵀ)``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, C, seg):
        B, H, T, Dk = k.shape
        Dv = v.shape[-1]
        qc, kc, vc = (_to_chunks(x, C) for x in (q, k, v))  # (BH, N, C, D)
        G = _to_chunks(g.to(torch.float64)[..., None], C)[..., 0].cumsum(-1)  # (BH, N, C)
        bc = _to_chunks(beta[..., None], C)  # (BH, N, C, 1)
        BH, N = qc.shape[:2]
        # What backward needs is kept for every chunk; inference keeps one segment's worth.
        keep = any(ctx.needs_input_grad)
        kept = N if keep else min(seg, N)
        states = qc.new_empty(BH, kept, Dk, Dv)  # S_n: the state before chunk n
        v_new, inv_all = qc.new_empty(BH, kept, C, Dv), qc.new_empty(BH, kept, C, C)
        o = qc.new_empty(BH, N, C, Dv)
        S = qc.new_zeros(BH, Dk, Dv) if initial_state is None else initial_state.reshape(BH, Dk, Dv).to(qc.dtype)
        for a in range(0, N, seg):
            s = slice(a, min(a + seg, N))
            here = s if keep else slice(0, s.stop - a)  # where this segment's kept tensors go
            gamma, e_g, e_rest, decay = chunk_gates(G[:, s], qc.dtype)
            q_s, k_s, b_s = qc[:, s], kc[:, s], bc[:, s]
            kk, qk = (torch.cat([k_s, q_s], -2) @ k_s.transpose(-1, -2)).split(C, -2)  # one matmul
            inv = unit_lower_inverse(kk * gamma * b_s)
            inv_all[:, here] = inv
            u, w = (inv @ torch.cat([vc[:, s] * b_s, k_s * (b_s * e_g[..., None])], -1)).split([Dv, Dk], -1)
            kd_t = (k_s * e_rest[..., None]).transpose(-1, -2)  # (BH, n, Dk, C)
            for i in range(s.stop - a):
                states[:, here.start + i] = S
                vn = torch.baddbmm(u[:, i], w[:, i], S, alpha=-1)
                v_new[:, here.start + i] = vn
                S = torch.baddbmm(S * decay[:, i, None, None], kd_t[:, i], vn)
            o[:, s] = (qk * gamma) @ v_new[:, here] + (q_s * e_g[..., None]) @ states[:, here]
        if keep:
            ctx.save_for_backward(q, k, v, g, beta, inv_all, states, v_new)
        ctx.C, ctx.seg, ctx.has_state = C, seg, initial_state is not None
        return _from_chunks(o, B, H, T), S.view(B, H, Dk, Dv)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_final):
        q, k, v, g, beta, inv_all, states, v_new = ctx.saved_tensors
        C, seg = ctx.C, ctx.seg
        B, H, T, Dk = k.shape
        Dv = v.shape[-1]
        qc, kc, vc = (_to_chunks(x, C) for x in (q, k, v))
        G = _to_chunks(g.to(torch.float64)[..., None], C)[..., 0].cumsum(-1)
        bc = _to_chunks(beta[..., None], C)
        BH, N = qc.shape[:2]
        d_o = torch.zeros_like(v_new) if d_o is None else _to_chunks(d_o.to(qc.dtype), C)
        dS = qc.new_zeros(BH, Dk, Dv) if d_final is None else d_final.reshape(BH, Dk, Dv).to(qc.dtype)
        dq, dk, dv = (qc.new_empty(BH, N, C, x.shape[-1]) for x in (qc, kc, vc))
        dG, dbeta = qc.new_empty(BH, N, C), qc.new_empty(BH, N, C)
        for a in reversed(range(0, N, seg)):
            s = slice(a, min(a + seg, N))
            gamma, e_g, e_rest, decay = chunk_gates(G[:, s], qc.dtype)
            q_s, k_s, v_s, b_s, inv, st, vn_s, do_s = (x[:, s] for x in (qc, kc, vc, bc, inv_all, states, v_new, d_o))
            qg, kd, bk = q_s * e_g[..., None], k_s * e_rest[..., None], k_s * (b_s * e_g[..., None])
            uw = inv @ torch.cat([v_s * b_s, bk], -1)  # [u | w]: one matmul
            w = uw[..., Dv:]
            kk, qk = (torch.cat([k_s, q_s], -2) @ k_s.transpose(-1, -2)).split(C, -2)
            # the reverse scan; d_after[i] is the gradient of the state after chunk a + i
            dv_new = (qk * gamma).transpose(-1, -2) @ do_s  # the part from the outputs
            dS_from_o = qg.transpose(-1, -2) @ do_s  # (BH, n, Dk, Dv)
            d_after = torch.empty_like(st)
            for i in reversed(range(s.stop - a)):
                d_after[:, i] = dS
                dvn = torch.baddbmm(dv_new[:, i], kd[:, i], dS)
                dv_new[:, i] = dvn
                dS = torch.baddbmm(torch.addcmul(dS_from_o[:, i], dS, decay[:, i, None, None]),
                                   w[:, i].transpose(-1, -2), dvn, alpha=-1)
            st_t = st.transpose(-1, -2)  # (BH, n, Dv, Dk)
            dqg = do_s @ st_t
            d_a = (do_s @ vn_s.transpose(-1, -2)) * gamma  # dA ⊙ Γ: zero above the diagonal
            dkd = vn_s @ d_after.transpose(-1, -2)  # (BH, n, C, Dk)
            dw = -(dv_new @ st_t)
            d_decay = (st * d_after).sum((-1, -2)) * decay  # d/dG_C through exp(G_C)
            inv_t = inv.transpose(-1, -2)
            dbvk = inv_t @ torch.cat([dv_new, dw], -1)  # [d(βV) | d(βK exp(G))]
            dbv, dbk = dbvk.split([Dv, Dk], -1)
            dm = (dbvk @ uw.transpose(-1, -2)).tril(-1).neg_()  # du uᵀ + dw wᵀ in one matmul
            kk_gamma = kk * gamma
            d_kk = dm * b_s * gamma
            d_gamma = d_kk * kk + d_a * qk  # dΓ ⊙ Γ
            dq[:, s] = torch.addcmul(d_a @ k_s, dqg, e_g[..., None])
            dk[:, s] = d_a.transpose(-1, -2) @ q_s + (d_kk + d_kk.transpose(-1, -2)) @ k_s \
                + dkd * e_rest[..., None] + dbk * (b_s * e_g[..., None])
            dv[:, s] = dbv * b_s
            dbeta[:, s] = (dm * kk_gamma).sum(-1) + (dbv * v_s).sum(-1) + (dbk * k_s * e_g[..., None]).sum(-1)
            to_rest = (dkd * kd).sum(-1)  # d/d(G_C - G_i)
            dG_s = d_gamma.sum(-1) - d_gamma.sum(-2) + (dqg * qg).sum(-1) + (dbk * bk).sum(-1) - to_rest
            dG_s[..., -1] += to_rest.sum(-1) + d_decay
            dG[:, s] = dG_s
        dg = dG.flip(-1).cumsum(-1).flip(-1)  # G = cumsum(g) within each chunk
        def unc(x: Tensor) -> Tensor:
            return _from_chunks(x, B, H, T)

        return (unc(dq), unc(dk), unc(dv), unc(dg[..., None])[..., 0].to(g.dtype),
                unc(dbeta[..., None])[..., 0].to(beta.dtype), dS.view(B, H, Dk, Dv) if ctx.has_state else None,
                None, None)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, chunk_size: int = 64,
                           initial_state: Tensor | None = None, segment: int | None = None) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule; equals ``recurrent_rule(q, k, v, g, beta)``.

    ``q, k (B, H, T, Dk)`` (q already scaled), ``v (B, H, T, Dv)``, ``g, beta (B, H, T)``, all in
    the compute dtype (float32/64), heads matched. Returns ``(o (B, H, T, Dv), S_T (B, H, Dk, Dv))``;
    gradients flow to every input and the initial state (a hand-written backward, see
    :class:`_ChunkedGatedDelta`). ``segment``: chunks batched together (default: about 2 MiB of
    ``(B·H, tokens, D)`` per segment); it changes the speed only."""
    C = max(1, min(chunk_size, q.shape[2]))
    if segment is None:
        per_chunk = q.shape[0] * q.shape[1] * C * (q.shape[-1] + v.shape[-1]) * q.element_size()
        segment = max(1, (2 << 20) // max(1, per_chunk))
    return _ChunkedGatedDelta.apply(q, k, v, forgetting_gates(g), beta, initial_state, C, segment)
