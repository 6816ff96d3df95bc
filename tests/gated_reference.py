"""The test oracle for gated linear attention, written independently of attnkit: the recurrence in
matrix form, in float64 (the truth) or in the inputs' own dtype (the low-precision yardstick).

Per token: ``S <- Diag(a) S`` then ``S <- S - β k (kᵀ S) + β k vᵀ`` (delta rule) or ``S <- S + k vᵀ``;
``o = Sᵀ q``. Key heads are shared by ``Hv // Hk`` consecutive value heads.
"""

from __future__ import annotations

import torch


def gated_reference(q, k, v, g, beta=None, *, scale=None, qk_l2norm=False, initial_state=None, dtype=torch.float64):
    """``(o (B, Hv, T, Dv), S (B, Hv, Dk, Dv))`` in ``dtype`` (returned as float64)."""
    q, k, v, g = (x.detach().to(dtype) for x in (q, k, v, g))
    beta = None if beta is None else beta.detach().to(dtype)
    if qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    rep = v.shape[1] // k.shape[1]
    q = torch.repeat_interleave(q, rep, dim=1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    k = torch.repeat_interleave(k, rep, dim=1)
    B, H, T, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=dtype) if initial_state is None else initial_state.detach().to(dtype)
    out = torch.zeros(B, H, T, v.shape[-1], dtype=dtype)
    for t in range(T):
        a = torch.exp(g[:, :, t])
        S = S * (a.unsqueeze(-1) if g.dim() == 4 else a[..., None, None])
        kt, vt = k[:, :, t, :, None], v[:, :, t, None, :]  # (B, H, Dk, 1), (B, H, 1, Dv)
        if beta is None:
            S = S + kt @ vt
        else:
            b = beta[:, :, t, None, None]
            S = S - b * kt @ (kt.transpose(-1, -2) @ S) + b * kt @ vt
        out[:, :, t] = (S.transpose(-1, -2) @ q[:, :, t, :, None])[..., 0]
    return out.double(), S.double()
