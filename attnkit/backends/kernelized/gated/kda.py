"""Kimi Delta Attention (KDA, Kimi-Linear 2025): the gated delta rule with one gate per key channel.

``S_t = (I - β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ`` with ``g_t (Dk,) <= 0``; the
naive twin is ``recurrence.recurrent_rule`` with 4-D gates. Chunked as the gated delta rule
(``gated_delta``), except that the pairwise decay is a vector per pair,
``Γ_ijd = exp(G_id - G_jd)`` (``j <= i``), so the within-chunk products are
``A_ij = β_i Σ_d k_id k_jd Γ_ijd`` and ``(A_qk)_ij = Σ_d q_id k_jd Γ_ijd``. ``Γ`` costs
``C²·Dk`` numbers per chunk, hence the smaller default chunk (16). Exponents are differences of
float64 cumulative gates, all <= 0.

Without ``β`` the same chunks give gated linear attention with per-channel gates (GLA: Yang et al.
2023), ``S_t = Diag(exp(g_t)) S_{t-1} + k_t v_tᵀ``: no UT transform, ``u = V`` and no ``w``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .gated_delta import ut_transform
from .scan import chunk_scan, exp_nonpositive, forgetting_gates, pad_chunks

__all__ = ["chunk_kda"]


def chunk_kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, *, chunk_size: int = 16,
              initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Chunked KDA; equals ``recurrent_rule(q, k, v, g, beta)`` for ``g (B, H, T, Dk)`` (``beta`` None:
    GLA, no delta rule).

    Inputs as :func:`~.gated_delta.chunk_gated_delta_rule`; returns ``(o, S_T)``."""
    B, H, T, Dk = k.shape
    C = max(1, min(chunk_size, T))
    G = pad_chunks(forgetting_gates(g).to(torch.float64), C, T).cumsum(-2)  # (B, H, N, C, Dk)
    lower = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()[..., None]  # (C, C, 1)
    dt = q.dtype
    gamma = exp_nonpositive(G[..., :, None, :] - G[..., None, :, :], lower).to(dt)  # (B, H, N, C, C, Dk)
    last = G[..., -1:, :]
    e_g, e_rest, chunk_decay = G.exp().to(dt), (last - G).exp().to(dt), last[..., 0, :].exp().to(dt)
    qc, kc, vc = (pad_chunks(x, C, T) for x in (q, k, v))
    if beta is None:
        u, w = vc, None
    else:
        bc = pad_chunks(beta[..., None], C, T)  # (B, H, N, C, 1)
        kk = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", kc, kc, gamma)
        u, w = ut_transform(kc, bc[..., 0], kk, [vc * bc, kc * bc * e_g])
    a_qk = torch.einsum("bhnid,bhnjd,bhnijd->bhnij", qc, kc, gamma)
    o, S = chunk_scan(qc * e_g, kc * e_rest, a_qk, chunk_decay, u, w, initial_state)
    return o.reshape(B, H, o.shape[2] * C, v.shape[-1])[:, :, :T], S
