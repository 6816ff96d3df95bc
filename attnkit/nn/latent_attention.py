"""MultiHeadLatentAttention: DeepSeek-V2/V3's multi-head latent attention (MLA) layer.

Each token is compressed to a latent ``c`` (``kv_lora_rank``, RMS-normalized) plus one rotary key
``k_pe`` (``qk_rope_head_dim``) shared by every head; head ``h``'s key and value are
up-projections of the latent (``kv_b_proj``)::

    x ─ kv_a_proj_with_mqa ─┬─ c (kv_lora_rank) ─ kv_a_layernorm ─ kv_b_proj ─┬─ k_nope_h (qk_nope_head_dim)
                            │                                                  └─ v_h (v_head_dim)
                            └─ k_pe (qk_rope_head_dim) ─ RoPE ─────────────────── shared by every head
    x ─ q_proj (or q_a_proj ─ q_a_layernorm ─ q_b_proj) ─┬─ q_nope_h
                                                         └─ q_pe_h ─ RoPE

Two equal forms of the same attention (:mod:`attnkit.mla`):

* **non-absorbed** (prefill, training): per-head keys ``[k_nope_h | k_pe]`` (``Dk = qk_nope_head_dim +
  qk_rope_head_dim``, 192 in DeepSeek) and values ``v_h`` (``Dv = v_head_dim``, 128) through
  :func:`attnkit.attention`;
* **absorbed** (decoding with a cache): the cache holds the rows ``[c | k_pe]`` (576 numbers per
  token, :mod:`attnkit.cache.latent`); ``W_UK`` is folded into the queries and ``W_UV`` into the
  output, and :func:`attnkit.mla_decode` attends over the rows (values: their first
  ``kv_lora_rank`` columns).

The parameter names are DeepSeek's (and transformers' ``DeepseekV3Attention``'s), so its
``state_dict`` loads as it is. RoPE follows ``rope_interleave`` (DeepSeek's checkpoints pair
channels ``(0, 1), (2, 3), ...``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._validate import check_bool, finite_float, positive_int
from ..backends.decode_native import KERNEL_MAX_QUERIES
from ..cache import BaseLayerCache, LatentLayerCache, LayerCache, latent_update
from ..functional import attention
from ..masks import Mask
from ..mla import mla_decode
from .positional import RotaryEmbedding

__all__ = ["LatentAttentionConfig", "MultiHeadLatentAttention"]


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Configuration of a :class:`MultiHeadLatentAttention` layer (DeepSeek-V3's names and
    defaults but the model width and heads)."""

    embed_dim: int = field(metadata={"help": "model width (hidden_size)"})
    num_heads: int = field(metadata={"help": "query heads"})
    kv_lora_rank: int = field(default=512, metadata={"help": "latent width cached per token"})
    q_lora_rank: int | None = field(default=None, metadata={"help": "query low-rank width (None: one q_proj)"})
    qk_nope_head_dim: int = field(default=128, metadata={"help": "per-head key/query width without RoPE"})
    qk_rope_head_dim: int = field(default=64, metadata={"help": "rotary key/query width, shared key"})
    v_head_dim: int = field(default=128, metadata={"help": "per-head value width"})
    bias: bool = field(default=False, metadata={"help": "biases in kv_a_proj, q_a_proj and o_proj"})
    rope_base: float = field(default=10000.0, metadata={"help": "RoPE frequency base"})
    rope_interleave: bool = field(default=True, metadata={"help": "RoPE pairs adjacent channels (DeepSeek)"})
    norm_eps: float = field(default=1e-6, metadata={"help": "epsilon of the latent RMS norms"})
    scale: float | None = field(default=None, metadata={"help": "score scale (default: (nope + rope) ** -0.5)"})
    backend: str = field(default="auto", metadata={"help": "attention backend of the non-absorbed form"})
    backend_options: object | None = field(default=None, metadata={"help": "the backend's Options dataclass"})

    def __post_init__(self):
        for name in ("embed_dim", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            positive_int(getattr(self, name), name, owner="LatentAttentionConfig")
        positive_int(self.q_lora_rank, "q_lora_rank", owner="LatentAttentionConfig", allow_none=True)
        if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: expected an even int >= 2 (64 in DeepSeek-V3), got "
                             f"{self.qk_rope_head_dim!r}.")
        for name in ("bias", "rope_interleave"):
            check_bool(getattr(self, name), name, owner="LatentAttentionConfig")
        if self.scale is not None:
            finite_float(self.scale, "scale", low=0.0, low_inclusive=False, owner="LatentAttentionConfig")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 if self.scale is None else self.scale


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (see the module docstring). ``forward(x, mask=..., cache=...)``
    runs the non-absorbed form without a cache (and for a long prompt written into an empty
    one), the absorbed form over the latent cache otherwise; both are the same attention."""

    def __init__(self, config: LatentAttentionConfig):
        super().__init__()
        self.config = c = config
        H = c.num_heads
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.embed_dim, H * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.embed_dim, c.q_lora_rank, bias=c.bias)
            self.q_a_layernorm = nn.RMSNorm(c.q_lora_rank, eps=c.norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.embed_dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.bias)
        self.kv_a_layernorm = nn.RMSNorm(c.kv_lora_rank, eps=c.norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * c.v_head_dim, c.embed_dim, bias=c.bias)
        self.rotary = RotaryEmbedding(c.qk_rope_head_dim, base=c.rope_base)

    # -- pieces ------------------------------------------------------------------------------------
    def rope(self, x: Tensor, positions: Tensor) -> Tensor:
        """RoPE on ``x (B, H, T, qk_rope_head_dim)``; interleaved pairs are first gathered into halves
        (as DeepSeek's checkpoints expect: the dot products of q and k are what matter)."""
        if self.config.rope_interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return self.rotary(x, positions)

    def queries(self, x: Tensor) -> Tensor:
        """``(B, H, T, qk_head_dim)`` queries before RoPE."""
        c = self.config
        B, T, _ = x.shape
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(B, T, c.num_heads, c.qk_head_dim).transpose(1, 2)  # (B, H, T, qk_head_dim)

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """``W_UK (H, qk_nope_head_dim, kv_lora_rank)`` and ``W_UV (H, v_head_dim, kv_lora_rank)``: views of
        ``kv_b_proj.weight``."""
        c = self.config
        w = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    # -- the two forms -----------------------------------------------------------------------------
    def expanded(self, q_nope: Tensor, q_pe: Tensor, rows: Tensor, *, mask, q_offset, kv_offset) -> Tensor:
        """Non-absorbed attention over latent ``rows (B, 1, Tk, kv_lora_rank + rope)``: per-head keys
        ``(B, H, Tk, qk_head_dim)`` and values ``(B, H, Tk, v_head_dim)``; returns ``(B, H, Tq, v_head_dim)``."""
        c = self.config
        B, _, Tk, _ = rows.shape
        latent, k_pe = rows[:, 0, :, :c.kv_lora_rank], rows[..., c.kv_lora_rank:]
        kv = self.kv_b_proj(latent).view(B, Tk, c.num_heads, -1).transpose(1, 2)  # (B, H, Tk, nope + v)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, c.num_heads, Tk, c.qk_rope_head_dim)], dim=-1)  # (B, H, Tk, Dk)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, H, Tq, Dk)
        return attention(q, k, v, mask=mask, scale=c.softmax_scale, q_offset=q_offset, kv_offset=kv_offset,
                         backend=c.backend, options=c.backend_options)

    def absorbed(self, q_nope: Tensor, q_pe: Tensor, rows, *, mask, kv_offset, kv_finite=None) -> Tensor:
        """Absorbed attention over the cached ``rows`` (a tensor or a latent cache's handle):
        ``W_UK`` folded into the queries, ``W_UV`` into the output; returns ``(B, H, Tq, v_head_dim)``."""
        c = self.config
        w_uk, w_uv = self.up_weights()
        q_latent = torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk)  # (B, H, Tq, kv_lora_rank)
        q = torch.cat([q_latent, q_pe], dim=-1)  # (B, H, Tq, kv_lora_rank + rope)
        out = mla_decode(q, rows, kv_lora_rank=c.kv_lora_rank, scale=c.softmax_scale, mask=mask,
                         kv_offset=kv_offset, kv_finite=kv_finite)  # (B, H, Tq, kv_lora_rank)
        return torch.einsum("bhtr,hvr->bhtv", out, w_uv)  # (B, H, Tq, v_head_dim)

    def forward(self, x: Tensor, *, mask: Mask | Tensor | None = None, cache: BaseLayerCache | None = None,
                positions: Tensor | None = None, q_offset: int | None = None) -> Tensor:
        """Attend ``x (B, T, embed_dim)`` to itself; returns ``(B, T, embed_dim)``.

        ``mask``: e.g. ``Causal()`` (absolute positions, so the same mask serves prefill and
        decoding). ``cache``: a :class:`~attnkit.cache.LatentLayerCache`, or a layer of any
        :class:`~attnkit.cache.KVCache` / :class:`~attnkit.cache.PagedKVCache` (``cache[i]``),
        used as latent storage. ``positions``: RoPE positions ``(T,)`` or ``(B, T)`` (default:
        the cache's next positions, or ``q_offset + arange(T)``)."""
        c = self.config
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != c.embed_dim:
            raise ValueError(f"x: expected a tensor (B, T, embed_dim={c.embed_dim}), got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}.")
        if cache is not None and not isinstance(cache, LayerCache):
            raise TypeError(f"cache: expected a layer cache holding keys (kv_cache[i] or a LatentLayerCache), got "
                            f"{type(cache).__name__}.")
        B, T, _ = x.shape
        if cache is not None and q_offset is not None:
            raise ValueError("q_offset: with cache= the cache sets the positions (its length); pass q_offset=None.")
        if positions is None:
            positions = (cache.next_positions(T, device=x.device) if cache is not None
                         else torch.arange(q_offset or 0, (q_offset or 0) + T, device=x.device))
        q_nope, q_pe = self.queries(x).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).view(B, 1, T, c.kv_lora_rank)
        k_pe = self.rope(k_pe.view(B, 1, T, c.qk_rope_head_dim), positions)
        q_pe = self.rope(q_pe, positions)
        rows = torch.cat([latent, k_pe], dim=-1)  # (B, 1, T, kv_lora_rank + rope): what the cache holds
        if cache is None:
            out = self.expanded(q_nope, q_pe, rows, mask=mask, q_offset=q_offset, kv_offset=0)
        else:
            if isinstance(cache, LatentLayerCache):
                k_all, _, kv_offset = cache.update(rows)
            else:
                k_all, _, kv_offset = latent_update(cache, rows, c.kv_lora_rank)
            if isinstance(k_all, Tensor) and T > KERNEL_MAX_QUERIES:  # a prompt: the per-head form is cheaper
                out = self.expanded(q_nope, q_pe, k_all, mask=mask, q_offset=None, kv_offset=kv_offset)
            else:
                out = self.absorbed(q_nope, q_pe, k_all, mask=mask, kv_offset=kv_offset, kv_finite=cache.finite)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, c.num_heads * c.v_head_dim))
