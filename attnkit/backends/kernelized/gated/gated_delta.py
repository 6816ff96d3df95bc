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

__all__ = ["chunk_gated_delta_rule", "ut_transform"]


def ut_transform(k: Tensor, beta: Tensor, kk_gamma: Tensor, rhs: list[Tensor]) -> list[Tensor]:
    """``(I + strict_lower(diag(β) K Kᵀ ⊙ Γ))⁻¹ @ rhs`` by one unit-lower-triangular solve."""
    a = kk_gamma * beta[..., None]  # only its strict lower triangle is read (unitriangular, lower)
    sizes = [r.shape[-1] for r in rhs]
    x = torch.linalg.solve_triangular(a, torch.cat(rhs, dim=-1), upper=False, unitriangular=True)
    return list(x.split(sizes, dim=-1))


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
