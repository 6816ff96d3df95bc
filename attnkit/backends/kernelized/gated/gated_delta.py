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

then ``scan.chunk_scan``. Cumulative gates and their differences are taken in float64 (only
``(B, H, T)`` and ``(B, H, T, C)`` numbers), so decays near 0 (``g`` of -1e4) next to decays near 1
lose no precision; every exponent is <= 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .scan import chunk_scan, pad_chunks, scalar_chunk_gates

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


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, chunk_size: int = 64,
                           initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule; equals ``recurrent_rule(q, k, v, g, beta)``.

    ``q, k (B, H, T, Dk)`` (q already scaled), ``v (B, H, T, Dv)``, ``g, beta (B, H, T)``, all in
    the compute dtype (float32/64), heads matched. Returns ``(o (B, H, T, Dv), S_T (B, H, Dk, Dv))``."""
    B, H, T, Dk = k.shape
    C = max(1, min(chunk_size, T))
    e_g, e_rest, gamma, chunk_decay = scalar_chunk_gates(g, C, T, q.dtype)
    qc, kc, vc = (pad_chunks(x, C, T) for x in (q, k, v))  # (B, H, N, C, D)
    bc = pad_chunks(beta[..., None], C, T)  # (B, H, N, C, 1)
    u, w = ut_transform(kc, bc[..., 0], (kc @ kc.transpose(-1, -2)) * gamma, [vc * bc, kc * (bc * e_g[..., None])])
    a_qk = (qc @ kc.transpose(-1, -2)) * gamma
    o, S = chunk_scan(qc * e_g[..., None], kc * e_rest[..., None], a_qk, chunk_decay, u, w, initial_state)
    return o.reshape(B, H, -1, v.shape[-1])[:, :, :T], S
