"""The sequential part shared by every chunked gated rule: one pass over chunks carrying ``S``.

Each rule reduces a chunk of ``C`` tokens to a few dense tensors (see ``gated_delta``, ``kda``,
``ssd``), all with decays taken *relative to the chunk's start or end* so every factor is
``exp(x)`` with ``x <= 0``; the scan then does, per chunk (``S`` the state before it)::

    v_new = u - w S                       (delta rules; SSD: v_new = v, no w)
    o     = q_g S + A_qk v_new            q_g = q ⊙ exp(G), A_qk causal within the chunk
    S     = exp(G_C) ⊙ S + k_dᵀ v_new     k_d = k ⊙ exp(G_C - G)

Four small matmuls per chunk. Autograd saves one ``S`` per chunk: ``(T / C) · Dk · Dv`` numbers per
head, O(T) memory.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunk_scan", "pad_chunks", "exp_nonpositive", "chunk_gates", "scalar_chunk_gates", "forgetting_gates"]

#: Log-decays below this are decays of exactly 0 in float64 (``exp`` underflows below about -745).
ZERO_DECAY = -1e3


def forgetting_gates(g: Tensor) -> Tensor:
    """``g`` clamped at :data:`ZERO_DECAY`: the same decays (0 stays 0), but a log-decay such as -1e16
    (or -inf) no longer swallows the gates after it in a chunk's float64 cumulative sum, whose
    differences give the later tokens' decays. The clamp's gradient there is 0, as ``exp``'s is."""
    return g.clamp_min(ZERO_DECAY)


def pad_chunks(x: Tensor, chunk: int, T: int) -> Tensor:
    """``x (B, H, T, ...)`` zero-padded to whole chunks and viewed ``(B, H, N, C, ...)``. Zero
    padding is inert: a padded token has g = 0 (no decay), β = 0 and k = v = 0, and it comes last."""
    pad = (-T) % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(x.shape[:2] + ((T + pad) // chunk, chunk) + x.shape[3:])  # no -1: B may be 0


def exp_nonpositive(x: Tensor, keep: Tensor) -> Tensor:
    """``exp(x)`` where ``keep``, else 0; masked before the exp so ``exp`` of a large positive
    number (an anti-causal decay) is never formed, in the value or its gradient."""
    return x.masked_fill(~keep, float("-inf")).exp()


def chunk_gates(G: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """From float64 cumulative gates ``G (..., C)`` of each chunk (every exponent <= 0):
    ``Γ (..., C, C)`` (``exp(G_i - G_j)``, 0 above the diagonal), ``exp(G)``, ``exp(G_C - G)`` and
    ``exp(G_C) (...)``, in ``dtype``."""
    C = G.shape[-1]
    lower = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    gamma = exp_nonpositive(G[..., :, None] - G[..., None, :], lower)
    last = G[..., -1:]
    return gamma.to(dtype), G.exp().to(dtype), (last - G).exp().to(dtype), last[..., 0].exp().to(dtype)


def scalar_chunk_gates(g: Tensor, C: int, T: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``exp(G)``, ``exp(G_C - G)``, ``Γ`` and ``exp(G_C)`` per chunk from scalar gates ``(B, H, T)``."""
    G = pad_chunks(g.to(torch.float64)[..., None], C, T)[..., 0].cumsum(-1)  # (B, H, N, C)
    gamma, e_g, e_rest, decay = chunk_gates(G, dtype)
    return e_g, e_rest, gamma, decay


def chunk_scan(q_g: Tensor, k_d: Tensor, a_qk: Tensor, chunk_decay: Tensor, u: Tensor, w: Tensor | None,
               initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """``q_g, k_d, w (B, H, N, C, Dk)``, ``a_qk (B, H, N, C, C)``, ``u (B, H, N, C, Dv)``,
    ``chunk_decay (B, H, N)`` or ``(B, H, N, Dk)``. Returns ``o (B, H, N, C, Dv)`` and the last ``S``."""
    B, H, N, C, Dk = q_g.shape
    S = u.new_zeros(B, H, Dk, u.shape[-1]) if initial_state is None else initial_state.to(u.dtype)
    per_channel = chunk_decay.dim() == 4
    reads = q_g if w is None else torch.cat([w, q_g], dim=-2)  # (B, H, N, C or 2C, Dk): one matmul reads S
    # unbind, not x[:, :, n]: autograd stacks the per-chunk gradients once, instead of adding each
    # into a zero-filled full-size tensor (quadratic in the number of chunks).
    chunks = zip(reads.unbind(2), u.unbind(2), a_qk.unbind(2), k_d.transpose(-1, -2).unbind(2),
                 chunk_decay.unbind(2))
    outs = []
    for read_n, u_n, a_n, kt_n, decay_n in chunks:
        read = read_n @ S
        v_new = u_n if w is None else u_n - read[:, :, :C]  # (B, H, C, Dv)
        outs.append(read[:, :, -C:] + a_n @ v_new)
        S = S * (decay_n[..., None] if per_channel else decay_n[..., None, None]) + kt_n @ v_new
    return torch.stack(outs, dim=2), S
