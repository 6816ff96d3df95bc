"""MultiHeadAttention: projections around :func:`attnkit.attention`, configured by a dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from .._validate import check_bool, finite_float, positive_int
from ..functional import attention
from ..cache import BaseLayerCache, StateCache
from ..masks import Mask, as_mask
from ..registry import get_backend
from ..score_mods import ALiBi, RelativeBias, SoftCap
from ..varlen import packed_positions, varlen_attention
from .positional import RotaryEmbedding

__all__ = ["AttentionConfig", "MultiHeadAttention"]


@dataclass(frozen=True)
class AttentionConfig:
    """Configuration of a :class:`MultiHeadAttention` layer.

    ``head_dim`` defaults to ``embed_dim // num_heads`` (which must then divide evenly);
    ``num_kv_heads`` below ``num_heads`` gives grouped-query (or, at 1, multi-query) attention.
    ``kv_dim`` is the width of the memory for cross-attention (default ``embed_dim``).
    ``backend``/``backend_options`` are resolved at call time, so ``use_backend()`` also applies
    when ``backend == "auto"``."""

    embed_dim: int = field(metadata={"help": "model width"})
    num_heads: int = field(metadata={"help": "query heads"})
    num_kv_heads: int | None = field(default=None, metadata={"help": "key/value heads (default: num_heads)"})
    head_dim: int | None = field(default=None, metadata={"help": "per-head width (default: embed_dim // num_heads)"})
    dropout: float = field(default=0.0, metadata={"help": "attention-weight dropout while training"})
    bias: bool = field(default=True, metadata={"help": "biases in the projections"})
    cross_attention: bool = field(default=False, metadata={"help": "separate query and key/value projections"})
    kv_dim: int | None = field(default=None, metadata={"help": "memory width for cross-attention"})
    backend: str = field(default="auto", metadata={"help": "attention backend name or 'auto'"})
    backend_options: object | None = field(default=None, metadata={"help": "the backend's Options dataclass"})
    position: str = field(default="none",
                          metadata={"help": "positions inside attention: 'none', 'rope', 'alibi' or 't5'"})
    rope_base: float = field(default=10000.0, metadata={"help": "RoPE frequency base"})
    rotary_dim: int | None = field(default=None, metadata={"help": "channels rotated by RoPE (default: head_dim)"})
    softcap: float | None = field(default=None, metadata={"help": "soft-cap the attention logits: c * tanh(s / c)"})
    sinks: bool = field(default=False, metadata={"help": "a learned sink logit per head (gpt-oss)"})
    relative_buckets: int = field(default=32, metadata={"help": "T5 relative-position buckets (position='t5')"})
    relative_max_distance: int = field(default=128, metadata={"help": "T5 distance of the last bucket"})
    bidirectional: bool = field(default=True, metadata={"help": "T5 buckets distinguish left and right"})

    def __post_init__(self):
        for name in ("embed_dim", "num_heads"):
            positive_int(getattr(self, name), name, owner="AttentionConfig")
        for name in ("num_kv_heads", "head_dim", "kv_dim", "rotary_dim"):
            positive_int(getattr(self, name), name, owner="AttentionConfig", allow_none=True)
        for name in ("bias", "cross_attention"):
            check_bool(getattr(self, name), name, owner="AttentionConfig")
        kv = self.kv_heads
        if self.num_heads % kv:
            raise ValueError(
                f"AttentionConfig.num_kv_heads: expected a positive divisor of num_heads={self.num_heads}, got {kv!r}."
            )
        if self.head_dim is None and self.embed_dim % self.num_heads:
            raise ValueError(
                f"AttentionConfig: embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}. "
                f"Fix: choose num_heads dividing {self.embed_dim}, or set head_dim explicitly."
            )
        finite_float(self.dropout, "dropout", low=0.0, high=1.0, high_inclusive=False, owner="AttentionConfig")
        finite_float(self.rope_base, "rope_base", low=0.0, low_inclusive=False, owner="AttentionConfig",
                     fix="RoPE's usual base is 10000.0")
        if self.backend != "auto":
            get_backend(self.backend).check_options(self.backend_options)
        if self.softcap is not None:
            SoftCap(self.softcap)  # ValueError unless a positive finite number
        if not isinstance(self.sinks, bool):
            raise TypeError(f"AttentionConfig.sinks: expected a bool, got {self.sinks!r}.")
        if self.position not in ("none", "rope", "alibi", "t5"):
            raise ValueError(
                f"AttentionConfig.position: expected 'none', 'rope', 'alibi' or 't5', got {self.position!r}. "
                "Fix: absolute (learned/sinusoidal) positions belong to the embeddings, not the attention layer."
            )
        if self.position == "rope" and self.cross_attention:
            raise ValueError(
                "AttentionConfig.position: RoPE applies to self-attention; use position='none' for cross-attention."
            )

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def dim_per_head(self) -> int:
        return self.embed_dim // self.num_heads if self.head_dim is None else self.head_dim


class MultiHeadAttention(nn.Module):
    """Multi-head (grouped-query) attention over ``(B, T, embed_dim)`` inputs.

    Self-attention uses one fused QKV projection; cross-attention (``config.cross_attention``)
    projects queries from ``x`` and keys/values from ``memory``. ``forward`` returns
    ``(B, Tq, embed_dim)``, or ``(out, weights (B, Hq, Tq, Tk))`` with ``need_weights=True``
    (computed by the naive backend, the only one that forms the weights)."""

    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = config
        hd, Hq, Hkv = config.dim_per_head, config.num_heads, config.kv_heads
        if config.cross_attention:
            self.q_proj = nn.Linear(config.embed_dim, Hq * hd, bias=config.bias)
            self.kv_proj = nn.Linear(config.kv_dim or config.embed_dim, 2 * Hkv * hd, bias=config.bias)
        else:
            self.qkv_proj = nn.Linear(config.embed_dim, (Hq + 2 * Hkv) * hd, bias=config.bias)
        self.out_proj = nn.Linear(Hq * hd, config.embed_dim, bias=config.bias)
        self.rotary = None
        if config.position == "rope":
            self.rotary = RotaryEmbedding(hd, base=config.rope_base, rotary_dim=config.rotary_dim)
        slopes = ALiBi.geometric(Hq).slopes if config.position == "alibi" else None
        self.register_buffer("alibi_slopes", slopes, persistent=False)
        self.relative_bias = None
        if config.position == "t5":  # a learned (Hq, buckets) table; zeros = no bias at the start
            self.relative_bias = nn.Parameter(torch.zeros(Hq, config.relative_buckets))
        self.sinks = nn.Parameter(torch.zeros(Hq)) if config.sinks else None

    def project(self, x: Tensor, memory: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``(B, Hq, Tq, hd)`` and keys/values ``(B, Hkv, Tk, hd)`` for ``x`` (and ``memory``)."""
        cfg = self.config
        hd, Hq, Hkv = cfg.dim_per_head, cfg.num_heads, cfg.kv_heads
        B, Tq, _ = x.shape
        if cfg.cross_attention:
            if memory is None:
                raise ValueError("memory: a cross-attention layer needs memory=(B, Tk, kv_dim); got None.")
            q = self.q_proj(x).view(B, Tq, Hq, hd).transpose(1, 2)  # (B, Hq, Tq, hd)
            kv = self.kv_proj(memory).view(B, memory.shape[1], 2 * Hkv, hd).transpose(1, 2)  # (B, 2Hkv, Tk, hd)
            k, v = kv.split(Hkv, dim=1)
        else:
            if memory is not None:
                raise ValueError("memory: this is a self-attention layer; build it with cross_attention=True.")
            qkv = self.qkv_proj(x).view(B, Tq, Hq + 2 * Hkv, hd).transpose(1, 2)  # (B, Hq+2Hkv, T, hd)
            q, k, v = qkv.split([Hq, Hkv, Hkv], dim=1)
        return q, k, v

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        mask: Mask | Tensor | None = None,
        bias: Tensor | None = None,
        q_offset: int | None = None,
        kv_offset: int = 0,
        need_weights: bool = False,
        cache: BaseLayerCache | None = None,
        positions: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
    ):
        """Attend ``x (B, Tq, embed_dim)`` to itself (or to ``memory (B, Tk, kv_dim)``).

        ``cu_seqlens``: ``x (1, total, embed_dim)`` holds packed sequences at these offsets
        (:func:`attnkit.varlen_attention`): each attends only its own tokens under ``mask`` (band
        masks, in its own positions); with a paged ``cache`` each is appended to the selected sequence
        of the same index in one call (``update_packed``) and attends all that sequence holds.

        ``cache``: a layer cache (:mod:`attnkit.cache`). Self-attention writes the new keys with
        ``cache.update(k, v)`` and attends over what it returns (K/V views, or an int8/paged
        handle) with the queries at the last positions of each row, so decoding equals the full
        forward with every cache, bias, score modifier and sinks; cross-attention memoizes the projected memory
        in ``cache.cross_kv``. ``positions``: absolute positions ``(Tq,)`` or ``(B, Tq)`` used by
        RoPE (default ``q_offset + arange(Tq)``; left-padded batches pass per-row positions).
        ALiBi uses the absolute key/query positions of the call."""
        cfg = self.config
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != cfg.embed_dim:
            raise ValueError(
                f"x: expected a tensor (B, T, embed_dim={cfg.embed_dim}), got "
                f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}."
            )
        if cache is not None and not isinstance(cache, BaseLayerCache):
            raise TypeError(f"cache: expected a layer cache (e.g. kv_cache[i]), got {type(cache).__name__}.")
        if cfg.cross_attention:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: packed sequences are for self-attention; this layer is cross-attention.")
            if cache is not None and cache.cross_kv is not None:
                q = self.project_queries(x)
                k, v = cache.cross_kv
            else:
                q, k, v = self.project(x, memory)
                if cache is not None:
                    cache.cross_kv = (k, v)
            return self._finish(q, k, v, mask, bias, q_offset, kv_offset, need_weights)
        q, k, v = self.project(x, memory)
        Tq = q.shape[2]
        kv_finite = None
        if cache is not None:
            if q_offset is not None:
                raise ValueError("q_offset: with cache= the cache sets the positions (its length); pass q_offset=None.")
            if self.rotary is not None and positions is None and cu_seqlens is None:
                positions = cache.next_positions(Tq, device=x.device)  # (Tq,), or (B, Tq) for ragged rows
        elif q_offset is None:
            q_offset = kv_offset  # self-attention: Tq == Tk, so the bottom-right default is kv_offset
        if self.rotary is not None:
            if positions is None and cu_seqlens is not None:  # each packed sequence's own positions
                start = None if cache is None else torch.tensor(cache.row_lengths(), device=x.device)
                positions = packed_positions(cu_seqlens, Tq, start)
            elif positions is None:
                positions = torch.arange(q_offset, q_offset + Tq, device=x.device)
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if cu_seqlens is not None:
            return self._packed(q, k, v, mask, cu_seqlens, cache, need_weights or bias is not None)
        if isinstance(cache, StateCache):  # a recurrent state, not keys: it computes attention itself
            if mask is not None and not as_mask(mask).is_causal():
                raise ValueError(
                    f"mask: a recurrent StateCache computes causal attention only, got {mask!r}. "
                    "Fix: pass mask=None or Causal(); padding needs a KV cache and an exact backend."
                )
            out = cache.step(q, k, v)  # (B, Hq, Tq, Dv)
            return self.out_proj(out.transpose(1, 2).reshape(x.shape[0], Tq, -1))
        if cache is not None:
            # Every KV cache: what update() returns (views, or an int8/paged handle) is what attention
            # reads; the queries are the last Tq positions of each row (bottom-right).
            k, v, kv_offset = cache.update(k, v)
            kv_finite = cache.finite
        return self._finish(q, k, v, mask, bias, q_offset, kv_offset, need_weights, kv_finite)

    def _packed(self, q, k, v, mask, cu_seqlens, cache, unsupported: bool):
        """Packed sequences ``(1, H, total, hd)`` through :func:`attnkit.varlen_attention`."""
        if q.shape[0] != 1 or unsupported:
            raise ValueError(f"cu_seqlens: packed sequences need x of shape (1, total, embed_dim) (got batch "
                             f"{q.shape[0]}), no bias and need_weights=False. Fix: concatenate the sequences "
                             "along the token axis, or pad them into a batch without cu_seqlens.")
        q, k, v = (x[0].transpose(0, 1) for x in (q, k, v))  # (total, H, hd)
        cu_k = cu_seqlens
        if cache is not None:
            k, v, cu_k = cache.update_packed(k, v, cu_seqlens)  # a TypeError but on a paged cache
        cfg = self.config
        out = varlen_attention(q, k, v, cu_seqlens, cu_k, mask=mask, dropout_p=cfg.dropout if self.training else 0.0,
                               score_mod=self.score_mod(), sinks=self.sinks, backend=cfg.backend,
                               options=cfg.backend_options)
        return self.out_proj(out.reshape(1, q.shape[0], -1))  # (1, total, Hq*hd)

    def project_queries(self, x: Tensor) -> Tensor:
        """Queries ``(B, Hq, Tq, hd)`` of a cross-attention layer (the memory's K/V come from a cache)."""
        cfg = self.config
        B, Tq, _ = x.shape
        return self.q_proj(x).view(B, Tq, cfg.num_heads, cfg.dim_per_head).transpose(1, 2)  # (B, Hq, Tq, hd)

    def score_mod(self):
        """The layer's score modifiers in the order they apply (positions, then soft-capping), or
        None: ALiBi and T5 biases are functions of absolute positions, never (Tq, Tk) tensors.
        Built once and reused while the tensors they read stay the same (moved or cast: rebuilt)."""
        key = tuple((id(t), t.data_ptr(), t.dtype, t.device) for t in (self.alibi_slopes, self.relative_bias)
                    if t is not None)
        cached = self.__dict__.get("_score_mod_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        mods = self._build_score_mod()
        self.__dict__["_score_mod_cache"] = (key, mods)
        return mods

    def _build_score_mod(self):
        cfg, mods = self.config, []
        if self.alibi_slopes is not None:
            mods.append(ALiBi(self.alibi_slopes))
        if self.relative_bias is not None:
            mods.append(RelativeBias(self.relative_bias, max_distance=cfg.relative_max_distance,
                                     bidirectional=cfg.bidirectional))
        if cfg.softcap is not None:
            mods.append(SoftCap(cfg.softcap))
        return mods or None

    def _finish(self, q, k, v, mask, bias, q_offset, kv_offset, need_weights, kv_finite=None):
        out, weights = self.attend(q, k, v, mask=mask, bias=bias, q_offset=q_offset, kv_offset=kv_offset,
                                   need_weights=need_weights, kv_finite=kv_finite)
        return (out, weights) if need_weights else out

    def attend(self, q, k, v, *, mask=None, bias=None, q_offset=None, kv_offset=0, need_weights=False,
               kv_finite=None):
        """Attention over projected heads and the output projection: ``(B, Tq, embed_dim)`` and the
        weights (or None). ``k``/``v`` are tensors or a KV cache's handle (what ``update`` returned).
        Subclasses and caches call this after adjusting ``k``/``v``."""
        cfg = self.config
        dropout_p = cfg.dropout if self.training else 0.0
        backend, options = cfg.backend, cfg.backend_options
        weights = None
        if need_weights:
            from ..backends.naive import NaiveOptions

            out, weights = attention(q, k, v, mask=mask, bias=bias, dropout_p=dropout_p, q_offset=q_offset,
                                     kv_offset=kv_offset, backend="naive", options=NaiveOptions(return_weights=True),
                                     score_mod=self.score_mod(), sinks=self.sinks, kv_finite=kv_finite)
        else:
            out = attention(q, k, v, mask=mask, bias=bias, dropout_p=dropout_p, q_offset=q_offset,
                            kv_offset=kv_offset, backend=backend, options=options, score_mod=self.score_mod(),
                            sinks=self.sinks, kv_finite=kv_finite)
        B, _, Tq, _ = out.shape
        out = out.transpose(1, 2).reshape(B, Tq, -1)  # (B, Tq, Hq*hd)
        return self.out_proj(out), weights

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, **config_overrides) -> MultiHeadAttention:
        """Build an equivalent layer from ``torch.nn.MultiheadAttention`` (same outputs).

        Only packed self-attention projections (``kdim == vdim == embed_dim``) without
        ``add_bias_kv``/``add_zero_attn`` are supported. Note the conventions: attnkit takes
        ``(B, T, E)`` inputs and masks with True = attend (convert a ``key_padding_mask`` with
        :func:`attnkit.from_key_padding_mask`, and a boolean ``attn_mask`` with ``~attn_mask``)."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module: expected torch.nn.MultiheadAttention, got {type(module).__name__}.")
        if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
            raise ValueError(
                "module: only nn.MultiheadAttention with kdim == vdim == embed_dim, add_bias_kv=False and "
                "add_zero_attn=False can be converted."
            )
        config = AttentionConfig(embed_dim=module.embed_dim, num_heads=module.num_heads, dropout=module.dropout,
                                 bias=module.in_proj_bias is not None)
        config = replace(config, **config_overrides)
        layer = cls(config).to(module.in_proj_weight.device, module.in_proj_weight.dtype)
        with torch.no_grad():
            layer.qkv_proj.weight.copy_(module.in_proj_weight)  # rows [q; k; v], like ours
            layer.out_proj.weight.copy_(module.out_proj.weight)
            if config.bias:
                layer.qkv_proj.bias.copy_(module.in_proj_bias)
                layer.out_proj.bias.copy_(module.out_proj.bias)
        return layer
