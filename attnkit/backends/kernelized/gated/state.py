"""Decoding state for gated linear attention: ``S (B, Hv, Dk, Dv)`` carried across calls.

``state.step(q, k, v, g=g, beta=beta)`` runs :func:`~.rule.gated_linear_attention` from the held
state and keeps the final one, so prefill (chunked), chunked prefill and one-token decode
(recurrent, O(Dk·Dv) per token) give the same outputs as one call over the whole sequence. It plugs
into ``attnkit.cache.StateCache`` (``StateCache(lambda: GatedLinearState(...))``), whose
``step(q, k, v, **gates)`` forwards the gates, and whose ``reorder`` selects batch rows of ``S``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .rule import gated_linear_attention

__all__ = ["GatedLinearState"]


class GatedLinearState:
    """The running state of one gated-linear-attention layer (``scale``, ``qk_l2norm`` as in
    :func:`gated_linear_attention`). Outside autograd, ``step`` updates the held float32 ``state``
    tensor in place (no copy per token): ``state.clone()`` keeps a snapshot."""

    def __init__(self, *, scale: float | None = None, qk_l2norm: bool = False) -> None:
        self.scale = scale
        self.qk_l2norm = qk_l2norm
        self.state: Tensor | None = None  # (B, Hv, Dk, Dv), float32
        self.seq_len = 0

    def step(self, q: Tensor, k: Tensor, v: Tensor, *, g: Tensor, beta: Tensor | None = None) -> Tensor:
        """Attend ``T`` new tokens ``(B, H, T, ·)`` over everything seen, and absorb them."""
        # decoding outside autograd writes the held state in place (no copy of it per token)
        in_place = self.state is not None and self.state.dtype == torch.float32 and not (
            torch.is_grad_enabled() and self.state.requires_grad)
        o, self.state = gated_linear_attention(q, k, v, g, beta, scale=self.scale, qk_l2norm=self.qk_l2norm,
                                               initial_state=self.state, return_state=True, state_in_place=in_place)
        self.seq_len += q.shape[2]
        return o

    def reset(self) -> None:
        """Forget everything (a new sequence)."""
        self.state = None
        self.seq_len = 0
