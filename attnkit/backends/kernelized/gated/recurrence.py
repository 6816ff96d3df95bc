"""The naive twin of every gated rule: the recurrence itself, one token at a time.

State ``S`` is ``(B, H, Dk, Dv)`` (flash-linear-attention's and transformers' layout). Per token ``t``,
with ``a_t = exp(g_t)`` a scalar (gated delta rule, SSD) or a ``Dk`` vector (KDA) scaling the rows::

    S' = a_t ⊙ S_{t-1}                                      decay
    S_t = S' + β_t k_t (v_t - S'ᵀ k_t)ᵀ                     delta rule   (β given)
    S_t = S' + k_t v_tᵀ                                     no delta     (β None: Mamba2's SSD)
    o_t = S_tᵀ q_t

i.e. ``S_t = (I - β_t k_t k_tᵀ) Diag(a_t) S_{t-1} + β_t k_t v_tᵀ``. This loop is O(T) Python steps:
it is the decode step (``T`` = 1) and the twin the chunked forms equal; the chunked forms are the
fast path for ``T`` > 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["recurrent_rule"]


def recurrent_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None,
                   initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Token-by-token recurrence. ``q, k (B, H, T, Dk)``, ``v (B, H, T, Dv)``, ``g (B, H, T)`` or
    ``(B, H, T, Dk)`` (log decay, <= 0), ``beta (B, H, T)`` or None; heads already matched and q
    already scaled. Returns ``(o (B, H, T, Dv), S_T (B, H, Dk, Dv))`` in the inputs' dtype."""
    B, H, T, Dk = k.shape
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    per_channel = g.dim() == 4
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, :, t], k[:, :, t], v[:, :, t]  # (B, H, D)
        a = g[:, :, t].exp()
        S = S * (a[..., None] if per_channel else a[..., None, None])
        if beta is None:
            S = S + k_t[..., None] * v_t[..., None, :]
        else:
            delta = (v_t - (S * k_t[..., None]).sum(-2)) * beta[:, :, t, None]  # (B, H, Dv)
            S = S + k_t[..., None] * delta[..., None, :]
        outs.append((S * q_t[..., None]).sum(-2))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(B, H, 0, v.shape[-1])
    return o, S
