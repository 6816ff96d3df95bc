"""Mamba2's state-space duality (SSD, Dao & Gu 2024) as gated linear attention: scalar decay, no delta.

``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ q_t`` — in Mamba2's names ``q = C``, ``k = B``,
``v = x · dt`` and ``g = A · dt`` (the ``D`` skip term and gating stay in the model). Naive twin:
``recurrence.recurrent_rule`` with ``beta=None``. Chunked: ``A_qk = lower(Q Kᵀ ⊙ Γ)`` within a chunk
and ``scan.chunk_scan`` with ``u = V`` and no ``w`` across chunks.
"""

from __future__ import annotations

from torch import Tensor

from .scan import chunk_scan, forgetting_gates, pad_chunks, scalar_chunk_gates

__all__ = ["chunk_ssd"]


def chunk_ssd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, chunk_size: int = 64,
              initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Chunked SSD; equals ``recurrent_rule(q, k, v, g, None)``. ``g (B, H, T)``; returns ``(o, S_T)``."""
    B, H, T, Dk = k.shape
    C = max(1, min(chunk_size, T))
    e_g, e_rest, gamma, chunk_decay = scalar_chunk_gates(forgetting_gates(g), C, T, q.dtype)
    qc, kc, vc = (pad_chunks(x, C, T) for x in (q, k, v))
    a_qk = (qc @ kc.transpose(-1, -2)) * gamma
    o, S = chunk_scan(qc * e_g[..., None], kc * e_rest[..., None], a_qk, chunk_decay, vc, None, initial_state)
    return o.reshape(B, H, o.shape[2] * C, v.shape[-1])[:, :, :T], S
