"""Transformer layers configured by one dataclass: feed-forward, encoder and decoder layers.

Residual + normalization in both placements (``config.norm_first``)::

    Pre-LN  (GPT-2, ViT):  x = x + drop(sublayer(norm(x)))
    Post-LN (BERT, 2017):  x = norm(x + drop(sublayer(x)))

Parameter names (stable; the HF interop code maps onto them): ``self_attn`` (a
:class:`~attnkit.nn.MultiHeadAttention` with ``qkv_proj``/``out_proj``), ``cross_attn``
(``q_proj``/``kv_proj``/``out_proj``), ``ffn.fc1``/``ffn.fc2`` (gated: ``ffn.fc_gate`` too), and
``norm1`` (self-attention), ``norm2`` (feed-forward), ``norm3`` (cross-attention, decoder only).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import Tensor, nn

from .._validate import check_int_at_least, finite_float
from ..masks import Causal, Mask, SlidingWindow
from .attention import AttentionConfig, MultiHeadAttention
from .gated_delta import GatedDeltaNet

__all__ = ["TransformerConfig", "FeedForward", "EncoderLayer", "DecoderLayer", "make_norm"]

ACTIVATIONS = {
    "gelu": F.gelu,  # exact (erf) GELU: BERT, ViT
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's gelu_new
    "relu": F.relu,
    "silu": F.silu,  # with gated=True: SwiGLU (Llama)
}
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "t5", "none")
LAYER_KINDS = {"a": "attention", "g": "gated_delta"}


@dataclass
class TransformerConfig:
    """Everything a Transformer model needs; passed whole to every layer and model."""

    vocab_size: int = field(default=256, metadata={"help": "token vocabulary size"})
    max_len: int = field(default=1024, metadata={"help": "longest sequence (learned positions only)"})
    embed_dim: int = field(default=256, metadata={"help": "model width"})
    num_layers: int = field(default=4, metadata={"help": "number of layers"})
    num_heads: int = field(default=4, metadata={"help": "query heads"})
    num_kv_heads: int | None = field(default=None, metadata={"help": "key/value heads (GQA; default num_heads)"})
    ffn_dim: int | None = field(default=None, metadata={"help": "feed-forward width (default 4 * embed_dim)"})
    activation: str = field(default="gelu", metadata={"help": "gelu | gelu_tanh | relu | silu"})
    gated: bool = field(default=False, metadata={"help": "GLU-style gated feed-forward (SwiGLU with silu)"})
    norm_first: bool = field(default=True, metadata={"help": "Pre-LN (True) or Post-LN (False, BERT)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on embeddings and residual branches"})
    attention_dropout: float = field(default=0.0, metadata={"help": "dropout on attention weights"})
    layer_norm_eps: float = field(default=1e-5, metadata={"help": "normalization epsilon"})
    position: str = field(default="learned", metadata={"help": "learned | sinusoidal | rope | alibi | t5 | none"})
    type_vocab_size: int = field(default=0, metadata={"help": ">0: token-type (segment) embeddings (BERT)"})
    embedding_norm: bool = field(default=False, metadata={"help": "LayerNorm after the embeddings (BERT)"})
    final_norm: bool = field(default=True, metadata={"help": "LayerNorm after the last layer (Pre-LN models)"})
    tie_embeddings: bool = field(default=True, metadata={"help": "share the LM head with the token embeddings"})
    bias: bool = field(default=True, metadata={"help": "biases in linear and norm layers"})
    backend: str = field(default="auto", metadata={"help": "attention backend name or 'auto'"})
    backend_options: object | None = field(default=None, metadata={"help": "the backend's Options dataclass"})
    # Beyond the shared API contract:
    head_dim: int | None = field(default=None, metadata={"help": "per-head width (default embed_dim // num_heads)"})
    norm: str = field(default="layernorm", metadata={"help": "layernorm | rmsnorm"})
    sliding_window: int | None = field(default=None, metadata={"help": "causal local attention: keys <= this far back"})
    rope_base: float = field(default=10000.0, metadata={"help": "RoPE frequency base"})
    rotary_dim: int | None = field(default=None, metadata={"help": "channels rotated by RoPE (default head_dim)"})
    softcap: float | None = field(default=None,
                                  metadata={"help": "soft-cap attention logits: c * tanh(s / c) (Gemma-2)"})
    sinks: bool = field(default=False, metadata={"help": "a learned attention-sink logit per head (gpt-oss)"})
    initializer_range: float = field(default=0.02, metadata={"help": "std of the normal weight init"})
    layer_pattern: str = field(default="", metadata={
        "help": "GPT token mixers, cycled over the layers: 'a' softmax attention, 'g' gated delta rule "
                "(e.g. 'ggga': three gated-delta layers per softmax layer, as Qwen3-Next); empty: all softmax"})

    def __post_init__(self):
        for name in ("vocab_size", "max_len", "embed_dim", "num_layers", "num_heads"):
            check_int_at_least(f"TransformerConfig.{name}", getattr(self, name))
        for name in ("num_kv_heads", "ffn_dim", "head_dim", "sliding_window", "rotary_dim"):
            check_int_at_least(f"TransformerConfig.{name}", getattr(self, name), allow_none=True)
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"TransformerConfig.activation: expected one of {sorted(ACTIVATIONS)}, got {self.activation!r}."
            )
        if self.position not in self._positions():
            raise ValueError(f"TransformerConfig.position: expected one of {self._positions()}, got {self.position!r}.")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"TransformerConfig.norm: expected 'layernorm' or 'rmsnorm', got {self.norm!r}.")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"TransformerConfig.{name}: expected a value in [0, 1), got {getattr(self, name)}.")
        finite_float(self.layer_norm_eps, "layer_norm_eps", low=0.0, low_inclusive=False, owner="TransformerConfig",
                     fix="the usual value is 1e-5")
        finite_float(self.rope_base, "rope_base", low=0.0, low_inclusive=False, owner="TransformerConfig",
                     fix="RoPE's usual base is 10000.0")
        finite_float(self.initializer_range, "initializer_range", low=0.0, owner="TransformerConfig",
                     fix="the usual standard deviation is 0.02")
        if self.type_vocab_size < 0:
            raise ValueError(f"TransformerConfig.type_vocab_size: expected >= 0, got {self.type_vocab_size}.")
        if self.position in ("sinusoidal",) and self.embed_dim % 2:
            raise ValueError(f"TransformerConfig: sinusoidal positions need an even embed_dim, got {self.embed_dim}.")
        self.attention_config()  # validates heads, head_dim and backend
        if not isinstance(self.layer_pattern, str) or set(self.layer_pattern) - set(LAYER_KINDS):
            raise ValueError(f"TransformerConfig.layer_pattern: expected a string of {sorted(LAYER_KINDS)} "
                             f"('a' softmax attention, 'g' gated delta rule), got {self.layer_pattern!r}.")

    def layer_kind(self, i: int) -> str:
        """``"attention"`` or ``"gated_delta"``: layer ``i``'s token mixer (``layer_pattern`` cycled)."""
        return LAYER_KINDS[self.layer_pattern[i % len(self.layer_pattern)]] if self.layer_pattern else "attention"

    @property
    def has_gated_layers(self) -> bool:
        return "g" in self.layer_pattern[: self.num_layers]

    def _positions(self) -> tuple[str, ...]:
        return POSITIONS

    @property
    def ffn_width(self) -> int:
        """The feed-forward width in use: ``ffn_dim``, or ``4 * embed_dim`` when that is None."""
        return self.ffn_dim or 4 * self.embed_dim

    @property
    def hidden_dim(self) -> int:
        """Deprecated name of :attr:`ffn_width` (``LSTMConfig.hidden_dim`` is the LSTM state width)."""
        warnings.warn("TransformerConfig.hidden_dim is renamed ffn_width (LSTMConfig.hidden_dim is the LSTM state "
                      "width); the old name will be removed.", DeprecationWarning, stacklevel=2)
        return self.ffn_width

    def attention_config(self, cross: bool = False) -> AttentionConfig:
        """The :class:`AttentionConfig` of a self- (or cross-) attention layer of this model."""
        position = self.position if self.position in ("rope", "alibi", "t5") and not cross else "none"
        return AttentionConfig(
            embed_dim=self.embed_dim, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            dropout=self.attention_dropout, bias=self.bias, cross_attention=cross, backend=self.backend,
            backend_options=self.backend_options, position=position, rope_base=self.rope_base,
            rotary_dim=self.rotary_dim, softcap=self.softcap, sinks=self.sinks and not cross,
        )

    def causal_mask(self) -> Mask:
        """The self-attention mask of a decoder: ``Causal()``, or ``SlidingWindow(sliding_window, 0)``."""
        return Causal() if self.sliding_window is None else SlidingWindow(self.sliding_window, 0)


def make_norm(config: TransformerConfig) -> nn.Module:
    """The configured normalization over ``embed_dim`` (LayerNorm or RMSNorm)."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.embed_dim, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.embed_dim, eps=config.layer_norm_eps, bias=config.bias)


class FeedForward(nn.Module):
    """``fc2(act(fc1(x)))``, or gated ``fc2(act(fc_gate(x)) * fc1(x))`` (GLU variants, Shazeer 2020)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        E, hidden = config.embed_dim, config.ffn_width
        self.fc1 = nn.Linear(E, hidden, bias=config.bias)
        self.fc_gate = nn.Linear(E, hidden, bias=config.bias) if config.gated else None
        self.fc2 = nn.Linear(hidden, E, bias=config.bias)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        if self.fc_gate is not None:
            return self.fc2(self.act(self.fc_gate(x)) * self.fc1(x))
        return self.fc2(self.act(self.fc1(x)))


class _ResidualLayer(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.norm_first = config.norm_first
        self.dropout = nn.Dropout(config.dropout)

    def residual(self, x: Tensor, norm: nn.Module, sublayer) -> Tensor:
        """Pre-LN: ``x + drop(f(norm(x)))``; Post-LN: ``norm(x + drop(f(x)))``."""
        if self.norm_first:
            return x + self.dropout(sublayer(norm(x)))
        return norm(x + self.dropout(sublayer(x)))


class EncoderLayer(_ResidualLayer):
    """Bidirectional self-attention and feed-forward. ``forward(x (B, T, E), *, mask, bias,
    positions) -> (B, T, E)``; ``mask`` defaults to none (every token sees every token)."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.self_attn = MultiHeadAttention(config.attention_config())
        self.norm1 = make_norm(config)
        self.ffn = FeedForward(config)
        self.norm2 = make_norm(config)

    def forward(self, x: Tensor, *, mask: Mask | Tensor | None = None, bias: Tensor | None = None,
                positions: Tensor | None = None) -> Tensor:
        x = self.residual(x, self.norm1, lambda h: self.self_attn(h, mask=mask, bias=bias, positions=positions))
        return self.residual(x, self.norm2, self.ffn)


class DecoderLayer(_ResidualLayer):
    """Causal self-attention (or, with ``kind="gated_delta"``, a :class:`GatedDeltaNet` mixer named
    ``linear_attn`` in place of ``self_attn``), optional cross-attention to an encoder's memory,
    feed-forward.

    ``forward(x (B, T, E), memory=None, *, mask=None, memory_mask=None, positions=None,
    cache=None) -> (B, T, E)``. ``mask`` defaults to ``config.causal_mask()``; ``cache`` is this
    layer's cache (``kv_cache[i]``). Order: self-attention (``norm1``), cross-attention
    (``norm3``), feed-forward (``norm2``)."""

    def __init__(self, config: TransformerConfig, cross_attention: bool = False, kind: str = "attention"):
        super().__init__(config)
        self.default_mask = config.causal_mask()
        if kind not in LAYER_KINDS.values():
            raise ValueError(f"kind: expected one of {sorted(LAYER_KINDS.values())}, got {kind!r}.")
        if kind == "gated_delta":
            self.self_attn, self.linear_attn = None, GatedDeltaNet(config)
        else:
            self.self_attn, self.linear_attn = MultiHeadAttention(config.attention_config()), None
        self.norm1 = make_norm(config)
        if cross_attention:
            self.cross_attn = MultiHeadAttention(config.attention_config(cross=True))
            self.norm3 = make_norm(config)
        else:
            self.cross_attn = self.norm3 = None
        self.ffn = FeedForward(config)
        self.norm2 = make_norm(config)

    def forward(self, x: Tensor, memory: Tensor | None = None, *, mask: Mask | Tensor | None = None,
                memory_mask: Mask | Tensor | None = None, positions: Tensor | None = None, cache=None,
                bias: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        mask = self.default_mask if mask is None else mask
        if self.linear_attn is not None:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: packed sequences are not supported by gated-delta layers yet; "
                                 "pass a padded batch, or use softmax layers (layer_pattern 'a').")
            x = self.residual(x, self.norm1, lambda h: self.linear_attn(h, mask=mask, bias=bias, positions=positions,
                                                                        cache=cache))
        else:
            x = self.residual(x, self.norm1, lambda h: self.self_attn(h, mask=mask, bias=bias, positions=positions,
                                                                      cache=cache, cu_seqlens=cu_seqlens))
        if self.cross_attn is not None:
            if memory is None and (cache is None or cache.cross_kv is None):
                raise ValueError(
                    "memory: this decoder layer has cross-attention; pass the encoder output memory=(B, S, E)."
                )
            x = self.residual(x, self.norm3, lambda h: self.cross_attn(h, memory, mask=memory_mask, cache=cache))
        elif memory is not None:
            raise ValueError("memory: this decoder layer has no cross-attention (built with cross_attention=False).")
        return self.residual(x, self.norm2, self.ffn)
