"""GatedDeltaNet: a gated-delta-rule token mixer, the linear-attention layer of hybrid models.

The layer of Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024) as Qwen3-Next uses it, without the
short convolution: from ``x (B, T, E)``::

    q, k = silu(W_q x), silu(W_k x)            (B, Hk, T, D), L2-normalized inside the rule
    v    = silu(W_v x)                         (B, Hv, T, D)
    β    = sigmoid(W_b x)                      (B, Hv, T)      the delta rule's step size
    g    = -exp(A_log) · softplus(W_a x + dt)  (B, Hv, T)      log-decay <= 0 (Mamba2's)
    o    = gated_linear_attention(q, k, v, g, β, qk_l2norm=True)
    out  = W_o (RMSNorm(o) ⊙ silu(W_z x))                      per-head norm, output gate

Value heads are ``config.num_heads``, key heads ``config.num_kv_heads`` (a key head serves
``Hv // Hk`` value heads, as Qwen3-Next), ``config.dim_per_head`` wide. Causal by construction;
decoding carries the state ``(B, Hv, D, D)`` in a :class:`~attnkit.cache.StateCache` built by
:meth:`GatedDeltaNet.make_state`, so a chunked prefill and token-by-token decoding give the full
forward's outputs. Parameter names: ``qkv_proj``, ``ab_proj``, ``gate_proj``, ``out_proj``,
``norm``, ``A_log``, ``dt_bias``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends.kernelized.gated import GatedLinearState, gated_linear_attention
from ..cache import BaseLayerCache, StateCache
from ..masks import Mask, as_mask

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(nn.Module):
    """Gated-delta-rule mixer over ``(B, T, embed_dim)`` (see the module docstring); ``config`` is a
    :class:`~attnkit.nn.TransformerConfig`."""

    def __init__(self, config) -> None:
        super().__init__()
        att = config.attention_config()
        self.num_value_heads, self.num_key_heads, self.head_dim = att.num_heads, att.kv_heads, att.dim_per_head
        E, Hv, Hk, D = config.embed_dim, self.num_value_heads, self.num_key_heads, self.head_dim
        self.qkv_proj = nn.Linear(E, (2 * Hk + Hv) * D, bias=config.bias)
        self.ab_proj = nn.Linear(E, 2 * Hv, bias=config.bias)  # [β logits | decay input]
        self.gate_proj = nn.Linear(E, Hv * D, bias=config.bias)
        self.out_proj = nn.Linear(Hv * D, E, bias=config.bias)
        self.norm = nn.RMSNorm(D, eps=config.layer_norm_eps)
        # Mamba2's decay parameters: A in [1, 16], softplus(dt_bias) log-uniform in [1e-3, 1e-1]
        gen = torch.Generator().manual_seed(0)
        self.A_log = nn.Parameter(torch.empty(Hv).uniform_(1, 16, generator=gen).log())
        dt = torch.exp(torch.rand(Hv, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)

    def make_state(self) -> GatedLinearState:
        """A fresh decoding state for this layer (``StateCache(layer.make_state)``)."""
        return GatedLinearState(qk_l2norm=True)

    def mix(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """The rule over the whole sequence, ``(B, Hv, T, D)`` (a context-parallel layer overrides it
        to run the rule across the ranks holding the sequence)."""
        return gated_linear_attention(q, k, v, g, beta, qk_l2norm=True, check_gates=False)

    def forward(self, x: Tensor, *, mask: Mask | Tensor | None = None, bias: Tensor | None = None,
                positions: Tensor | None = None, cache: BaseLayerCache | None = None) -> Tensor:
        """``x (B, T, E) -> (B, T, E)``, causal. ``mask`` must be None or plain causal (the rule sees
        the whole prefix; padding and windows need softmax attention); ``positions`` are not used
        (the decay orders the tokens); ``cache``: a :class:`StateCache` from :meth:`make_state`. NaN/Inf
        in ``x`` at a token reach that token's output and the later ones of its row only, so NaN in a
        row's right padding leaves its real tokens and the other rows as they are."""
        if bias is not None:
            raise ValueError("bias: a gated-delta layer takes no attention bias; pass bias=None.")
        if mask is not None and not as_mask(mask, "mask").is_causal():
            raise ValueError(
                f"mask: a gated-delta layer computes causal attention over the whole prefix, got {mask!r}. "
                "Fix: pass mask=None or Causal(); padded batches (attention_mask with zeros) and sliding "
                "windows need softmax layers (layer_pattern 'a')."
            )
        if cache is not None and not isinstance(cache, StateCache):
            raise TypeError(f"cache: a gated-delta layer keeps a state, expected a StateCache(layer.make_state), "
                            f"got {type(cache).__name__}. Fix: model.make_cache(...) builds the right one per layer.")
        B, T, _ = x.shape
        Hv, Hk, D = self.num_value_heads, self.num_key_heads, self.head_dim
        qkv = F.silu(self.qkv_proj(x)).view(B, T, 2 * Hk + Hv, D).transpose(1, 2)  # (B, 2Hk+Hv, T, D)
        q, k, v = qkv.split([Hk, Hk, Hv], dim=1)
        b_logit, a = self.ab_proj(x).transpose(1, 2).float().split(Hv, dim=1)  # (B, Hv, T) each
        beta = torch.sigmoid(b_logit)
        g = -self.A_log.float().exp()[:, None] * F.softplus(a + self.dt_bias.float()[:, None])
        o = self.mix(q, k, v, g, beta) if cache is None else cache.step(q, k, v, g=g, beta=beta)
        o = self.norm(o.transpose(1, 2)) * F.silu(self.gate_proj(x).view(B, T, Hv, D))  # (B, T, Hv, D)
        return self.out_proj(o.reshape(B, T, Hv * D))
