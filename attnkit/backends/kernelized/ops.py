"""The arithmetic of kernelized attention: prefix sums over ``[v, 1]`` and the quadratic twin.

``out_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i`` with ``S_i = Σ_j φ(k_j) v_jᵀ`` and ``z_i = Σ_j φ(k_j)`` over
the keys ``j`` that query ``i`` may see. The naive twin is the quadratic form ``A = φ(Q) φ(K)ᵀ``
masked, row-normalized, times ``V`` (:func:`quadratic_attention`). Causal attention never
materializes an ``(n, M, Dv)`` tensor: chunks of ``chunk`` tokens use the quadratic form against
themselves and an exclusive prefix sum of per-chunk states for the earlier chunks
(:func:`causal_segment`). Values carry a column of ones (``[v, 1]``) so one matmul yields
numerator and normalizer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

def safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` for kernel sums ``den >= 0``. Rows with ``den = 0`` (nothing visible) give 0;
    ``den`` is floored at ``sqrt(tiny)`` (1e-19 in float32) so a row whose features underflowed
    (extreme norms in Performer) stays finite, in the output and in its gradient."""
    return num / den.clamp_min(torch.finfo(den.dtype).tiny ** 0.5)


# -- the quadratic twin ---------------------------------------------------------------------------
def quadratic_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
    """The naive twin: ``A = φ(Q) φ(K)ᵀ`` (masked by ``keep``), rows normalized, times ``V``.
    O(Tq · Tk) memory; rows with nothing kept give 0."""
    a = torch.matmul(phi_q, phi_k.transpose(-2, -1))  # (B, H, Tq, Tk)
    if keep is not None:
        a = a.masked_fill(~keep, 0.0)
    return safe_divide(torch.matmul(a, v), a.sum(-1, keepdim=True))


def with_ones(v: Tensor) -> Tensor:
    """``[v, 1]`` (…, Dv + 1): one matmul with it gives numerator and normalizer together."""
    return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)


def normalize(num_den: Tensor) -> Tensor:
    """``(…, Dv + 1)`` numerator | normalizer -> ``(…, Dv)`` output."""
    return safe_divide(num_den[..., :-1], num_den[..., -1:])


def causal_segment(phi_q: Tensor, phi_k: Tensor, v1: Tensor, state: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Causal attention of aligned queries/keys ``(B, H, T, ·)`` (query ``i`` sees keys ``<= i``)
    on top of earlier keys summarized by ``state = Σ φ(k) [v, 1]ᵀ (B, H, M, Dv + 1)``.

    ``v1`` is ``[v, 1]``. Returns the unnormalized ``(B, H, T, Dv + 1)`` and this segment's
    ``Σ φ(k) [v, 1]ᵀ`` (to add to the state)."""
    B, H, T, M = phi_q.shape
    E = v1.shape[-1]
    chunk = min(chunk, T)  # a decode step (T = 1) is one 1x1 chunk, not a padded block
    pad = (-T) % chunk
    if pad:  # zero features: padded keys add nothing, padded queries are dropped below
        phi_q, phi_k, v1 = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, v1))
    N = (T + pad) // chunk
    qc = phi_q.reshape(B, H, N, chunk, M)
    kc = phi_k.reshape(B, H, N, chunk, M)
    vc = v1.reshape(B, H, N, chunk, E)
    # Earlier chunks: exclusive prefix sum of per-chunk states, plus the carried state.
    chunk_kv = torch.matmul(kc.transpose(-2, -1), vc)  # (B, H, N, M, Dv + 1)
    inclusive = torch.cumsum(chunk_kv, dim=2)
    out = torch.matmul(qc, inclusive - chunk_kv + state[:, :, None])  # (B, H, N, chunk, Dv + 1)
    # Inside a chunk: the masked quadratic form.
    a = torch.matmul(qc, kc.transpose(-2, -1))  # (B, H, N, chunk, chunk)
    a = a.masked_fill(torch.ones(chunk, chunk, dtype=torch.bool, device=a.device).triu(1), 0.0)
    out = out + torch.matmul(a, vc)
    return out.reshape(B, H, N * chunk, E)[:, :, :T], inclusive[:, :, -1]
