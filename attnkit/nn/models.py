"""Models: ``Encoder`` (BERT-style), ``GPT`` (decoder-only LM), ``Decoder`` + ``EncoderDecoder``
(seq2seq) and ``ViT``, all built from :mod:`attnkit.nn.layers` and run by any attention backend
(``config.backend`` or ``attnkit.use_backend``).

Positions are absolute: with a KV cache a call's tokens sit at ``cache.seq_len ..``; with an HF
``attention_mask`` ``(B, past + T)`` (1 = token, 0 = padding) each row's positions count its real
tokens (``cumsum - 1``), so a left-padded prompt gets the same positions as alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._validate import padding_mask
from ..cache import KVCache, PagedKVCache, SlidingWindowLayerCache, StateCache
from ..generation import GenerationMixin
from ..masks import Mask, Padding, as_mask
from ..varlen import packed_positions
from .layers import DecoderLayer, EncoderLayer, TransformerConfig, make_norm
from .positional import LearnedPositionalEmbedding, SinusoidalPositionalEmbedding, sinusoidal_2d
from .pretrained import PretrainedModel

__all__ = [
    "Embeddings", "Encoder", "Decoder", "GPT", "EncoderDecoder", "ViTConfig", "ViT", "positions_from_attention_mask",
]


def init_weights(module: nn.Module, std: float) -> None:
    """GPT-2/BERT init: normal(0, std) linear and embedding weights, zero biases, unit norms."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv2d)):
            nn.init.normal_(m.weight, mean=0.0, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            if m.weight is not None:
                nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)


def positions_from_attention_mask(attention_mask: Tensor, length: int) -> Tensor:
    """Positions ``(B, length)`` of the last ``length`` tokens: each row counts its real tokens
    (``cumsum(attention_mask) - 1``, clamped at 0 on padding), so left padding does not shift them."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)[:, -length:]


def _and(a: Mask | None, b) -> Mask | None:
    if b is None:
        return a
    b = as_mask(b, "mask")
    return b if a is None else a & b


class Embeddings(nn.Module):
    """Token (+ position) (+ token type) embeddings, then optional norm and dropout.

    ``tokens`` (nn.Embedding), ``positions`` (LearnedPositionalEmbedding — an nn.Embedding — or
    SinusoidalPositionalEmbedding; None for rope/alibi/none), ``token_types``, ``norm``."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        E = config.embed_dim
        self.tokens = nn.Embedding(config.vocab_size, E)
        if config.position == "learned":
            self.positions = LearnedPositionalEmbedding(config.max_len, E)
        elif config.position == "sinusoidal":
            self.positions = SinusoidalPositionalEmbedding(E)
        else:
            self.positions = None
        self.token_types = nn.Embedding(config.type_vocab_size, E) if config.type_vocab_size > 0 else None
        self.norm = make_norm(config) if config.embedding_norm else None
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: Tensor | None = None, *, positions: Tensor, inputs_embeds: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids, inputs_embeds: pass exactly one of them.")
        x = self.tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, E)
        if self.positions is not None:
            pos = self.positions(positions)
            x = x + (pos.to(x.dtype) if pos.dtype != x.dtype else pos)
        if self.token_types is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
            x = x + self.token_types(token_type_ids)
        elif token_type_ids is not None:
            raise ValueError("token_type_ids: this model has no token-type embeddings (type_vocab_size=0).")
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def _input_shape(input_ids, inputs_embeds) -> tuple[int, int, torch.device]:
    x = input_ids if input_ids is not None else inputs_embeds
    if not isinstance(x, Tensor) or x.dim() < 2:
        got = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"input_ids: expected a tensor (B, T) of token ids, got {got}.")
    return x.shape[0], x.shape[1], x.device


class Encoder(PretrainedModel, nn.Module):
    """Bidirectional Transformer encoder (BERT with ``norm_first=False, embedding_norm=True,
    type_vocab_size=2, final_norm=False``). Returns hidden states ``(B, T, E)``."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.embed = Embeddings(config)
        _softmax_only(config, "Encoder")
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        self.final_norm = make_norm(config) if config.final_norm else nn.Identity()
        init_weights(self, config.initializer_range)

    def forward(self, input_ids: Tensor | None = None, *, inputs_embeds: Tensor | None = None,
                token_type_ids: Tensor | None = None, mask: Mask | Tensor | None = None,
                attention_mask: Tensor | None = None, positions: Tensor | None = None,
                output_hidden_states: bool = False):
        """``mask``: an attnkit Mask or bool keep-tensor (True = attend); ``attention_mask``: HF
        ``(B, T)`` with 1 = token, 0 = padding. Both may be given (they are combined)."""
        B, T, device = _input_shape(input_ids, inputs_embeds)
        if positions is None:
            positions = torch.arange(T, device=device)
        full_mask = _and(None, mask)
        if attention_mask is not None:
            valid = padding_mask(attention_mask, B, T, "T")
            # no padding, no mask: backends keep their unmasked fast path (as HF); traced, the host does
            # not look (a Padding that keeps every key is the same attention)
            if torch.compiler.is_compiling() or not bool(valid.all()):
                full_mask = _and(full_mask, Padding(valid))
        x = self.embed(input_ids, positions=positions, inputs_embeds=inputs_embeds, token_type_ids=token_type_ids)
        hidden = [x]
        for layer in self.layers:
            x = layer(x, mask=full_mask, positions=positions)
            hidden.append(x)
        x = self.final_norm(x)
        if output_hidden_states:
            hidden[-1] = x
            return x, hidden
        return x


def _softmax_only(config: TransformerConfig, owner: str) -> None:
    if config.has_gated_layers:
        raise ValueError(f"TransformerConfig.layer_pattern: {owner} layers are softmax attention only, got "
                         f"{config.layer_pattern!r}. Fix: gated-delta layers belong to GPT; leave layer_pattern empty.")


def _check_cache(cache, config: TransformerConfig) -> None:
    if cache is None:
        return
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache: expected an attnkit.cache.KVCache, got {type(cache).__name__}.")
    if len(cache) != config.num_layers:
        raise ValueError(
            f"cache: has {len(cache)} layers, the model has {config.num_layers}. "
            f"Fix: model.make_cache(...) or KVCache.dynamic({config.num_layers})."
        )
    for layer in cache:
        if isinstance(layer, SlidingWindowLayerCache) and (
            config.sliding_window is None or layer.window < config.sliding_window
        ):
            raise ValueError(
                f"cache: a SlidingWindowLayerCache(window={layer.window}) keeps too few keys for this model "
                f"(sliding_window={config.sliding_window}); decoding would differ from the full forward. "
                "Fix: window >= config.sliding_window, or a dynamic/static cache."
            )


class _CausalStack(PretrainedModel, nn.Module):
    """Shared forward of GPT and Decoder: embeddings, causal layers with a cache, final norm."""

    def _run(self, input_ids, *, memory=None, memory_mask=None, cache=None, attention_mask=None, positions=None,
             inputs_embeds=None, output_hidden_states=False, cu_seqlens=None):
        config = self.config
        _check_cache(cache, config)
        B, T, device = _input_shape(input_ids, inputs_embeds)
        mask = config.causal_mask()
        if cu_seqlens is not None:
            if B != 1 or attention_mask is not None:
                raise ValueError(f"cu_seqlens: packed sequences are one row (1, total) without attention_mask, got "
                                 f"batch {B}{' and an attention_mask' if attention_mask is not None else ''}. Fix: "
                                 "concatenate the sequences along the token axis.")
            if cache is not None and not isinstance(cache, PagedKVCache):
                raise TypeError(f"cache: packed sequences (cu_seqlens) are written into a PagedKVCache, got "
                                f"{type(cache).__name__}. Fix: model.make_cache('paged', num_blocks=...).")
            if positions is None:  # each sequence's own positions, after what the cache holds for it
                start = None if cache is None else torch.tensor(cache.lengths(), device=device)
                positions = packed_positions(cu_seqlens, T, start)[None]  # (1, total)
        if attention_mask is not None:
            past = cache.seq_len if cache is not None else 0
            valid = padding_mask(attention_mask, B, past + T, "past + T")
            mask = mask & Padding(valid)
            if positions is None:
                positions = positions_from_attention_mask(attention_mask, T)
        if positions is None:  # the cache knows each row's next position (rows may differ: paged)
            positions = torch.arange(T, device=device) if cache is None else cache.positions(T, device)
        x = self.embed(input_ids, positions=positions, inputs_embeds=inputs_embeds)
        hidden = [x]
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, mask=mask, memory_mask=memory_mask, positions=positions,
                      cache=None if cache is None else cache[i], cu_seqlens=cu_seqlens)
            hidden.append(x)
        x = self.final_norm(x)
        hidden[-1] = x
        return x, hidden


class GPT(_CausalStack, GenerationMixin):
    """Decoder-only causal LM (GPT-2 with ``activation="gelu_tanh"``). ``forward(input_ids (B, T),
    *, cache=None, attention_mask=None) -> logits (B, T, vocab)``.

    ``cache``: a :class:`~attnkit.cache.KVCache` (``model.make_cache(...)``); the call's tokens sit
    at positions ``cache.seq_len ..``. ``attention_mask``: ``(B, past + T)`` 1/0 (left padding);
    positions are derived from it."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.embed = Embeddings(config)
        self.layers = nn.ModuleList(DecoderLayer(config, kind=config.layer_kind(i)) for i in range(config.num_layers))
        self.final_norm = make_norm(config) if config.final_norm else nn.Identity()
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        init_weights(self, config.initializer_range)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight

    def forward(self, input_ids: Tensor | None = None, *, cache: KVCache | None = None,
                attention_mask: Tensor | None = None, positions: Tensor | None = None,
                inputs_embeds: Tensor | None = None, output_hidden_states: bool = False, logits_to_keep: int = 0,
                cu_seqlens: Tensor | None = None):
        """``logits_to_keep=n > 0`` computes logits for the last ``n`` positions only (decoding
        needs one; the LM head over a whole prompt costs ``T * E * vocab``).

        ``cu_seqlens``: ``input_ids (1, total)`` are packed sequences at these offsets (packed training,
        or prefilling many prompts at once); each attends only its own tokens, at its own positions.
        With a paged cache (``make_cache("paged", ...)``, one selected sequence per packed sequence) the
        prompts are written into their sequences in one call per layer; decoding then goes on per row."""
        x, hidden = self._run(input_ids, cache=cache, attention_mask=attention_mask, positions=positions,
                              inputs_embeds=inputs_embeds, cu_seqlens=cu_seqlens)
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep: expected an int >= 0 (0 = every position), got {logits_to_keep!r}.")
        logits = self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)
        return (logits, hidden) if output_hidden_states else logits

    def make_cache(self, kind: str = "dynamic", *, max_len: int | None = None, window: int | None = None,
                   quantize: str | None = None, num_blocks: int | None = None, block_size: int = 16) -> KVCache:
        """A :class:`KVCache` for this model: ``"dynamic"``, ``"static"`` (``max_len``),
        ``"sliding_window"`` (``window`` defaults to ``config.sliding_window``), ``"paged"``
        (``num_blocks`` of ``block_size`` tokens, shared by many sequences) or ``"recurrent"``
        (a linear-attention model: ``config.backend`` is ``"linear"`` or ``"performer"``).
        ``quantize="int8"`` stores static, dynamic and paged caches in int8. In a hybrid model
        (``config.layer_pattern``) the gated-delta layers get a state cache whatever ``kind``
        says, and ``kind`` applies to the softmax layers (``"paged"`` is not offered there)."""
        if not self.config.has_gated_layers:
            return self._make_kv_cache(kind, max_len=max_len, window=window, quantize=quantize,
                                       num_blocks=num_blocks, block_size=block_size)
        if kind == "paged":
            raise ValueError("kind: a paged cache serves softmax layers only; this model has gated-delta layers "
                             "(config.layer_pattern). Fix: kind='dynamic' or 'static'.")
        kinds = [self.config.layer_kind(i) for i in range(self.config.num_layers)]
        base = None if kind == "recurrent" and "attention" not in kinds else self._make_kv_cache(
            kind, max_len=max_len, window=window, quantize=quantize, num_blocks=num_blocks, block_size=block_size)
        return KVCache([StateCache(layer.linear_attn.make_state) if layer.linear_attn is not None else base[i]
                        for i, layer in enumerate(self.layers)])

    def _make_kv_cache(self, kind, *, max_len, window, quantize, num_blocks, block_size) -> KVCache:
        if kind == "recurrent":
            cfg = self.config.attention_config()
            return KVCache.recurrent(self.config.num_layers, self.config.backend, cfg.dim_per_head,
                                     options=self.config.backend_options)
        if kind == "paged":
            if num_blocks is None:
                raise ValueError("num_blocks: a paged cache needs num_blocks (blocks of block_size tokens, shared).")
            return PagedKVCache(self.config.num_layers, num_blocks=num_blocks, block_size=block_size,
                                quantize=quantize)
        window = self.config.sliding_window if window is None else window
        return KVCache.create(kind, self.config.num_layers, max_len=max_len, window=window, quantize=quantize)


class Decoder(_CausalStack):
    """Causal decoder with cross-attention to an encoder's memory; returns hidden states."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.embed = Embeddings(config)
        _softmax_only(config, "Decoder")
        self.layers = nn.ModuleList(DecoderLayer(config, cross_attention=True) for _ in range(config.num_layers))
        self.final_norm = make_norm(config) if config.final_norm else nn.Identity()
        init_weights(self, config.initializer_range)

    def forward(self, input_ids: Tensor, memory: Tensor | None, *, memory_mask: Mask | Tensor | None = None,
                cache: KVCache | None = None, attention_mask: Tensor | None = None,
                positions: Tensor | None = None) -> Tensor:
        """``memory (B, S, E)`` may be None after the first call with a cache (its K/V are cached)."""
        return self._run(input_ids, memory=memory, memory_mask=memory_mask, cache=cache,
                         attention_mask=attention_mask, positions=positions)[0]


class EncoderDecoder(PretrainedModel, nn.Module, GenerationMixin):
    """Seq2seq Transformer: ``encoder`` (Encoder), ``decoder`` (Decoder), ``lm_head``.

    ``forward(input_ids (B, S), decoder_input_ids (B, T), *, attention_mask=None (B, S) 1/0,
    cache=None) -> logits (B, T, vocab)``. With ``tie_embeddings`` the encoder, decoder and LM head
    share one token embedding."""

    is_encoder_decoder = True

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        init_weights(self.lm_head, config.initializer_range)
        if config.tie_embeddings:
            self.decoder.embed.tokens = self.encoder.embed.tokens
            self.lm_head.weight = self.encoder.embed.tokens.weight

    def encode(self, input_ids: Tensor, *, attention_mask: Tensor | None = None) -> Tensor:
        return self.encoder(input_ids, attention_mask=attention_mask)

    @staticmethod
    def memory_mask(attention_mask: Tensor | None) -> Mask | None:
        """The cross-attention mask for a source ``attention_mask (B, S)`` (None: no padding)."""
        return None if attention_mask is None else Padding(attention_mask.bool())

    def decode(self, decoder_input_ids: Tensor, memory: Tensor | None, *, attention_mask: Tensor | None = None,
               cache: KVCache | None = None, decoder_attention_mask: Tensor | None = None) -> Tensor:
        """Logits ``(B, T, vocab)`` for target tokens given the encoder ``memory``."""
        h = self.decoder(decoder_input_ids, memory, memory_mask=self.memory_mask(attention_mask), cache=cache,
                         attention_mask=decoder_attention_mask)
        return self.lm_head(h)

    def forward(self, input_ids: Tensor, decoder_input_ids: Tensor, *, attention_mask: Tensor | None = None,
                decoder_attention_mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        memory = self.encode(input_ids, attention_mask=attention_mask)
        return self.decode(decoder_input_ids, memory, attention_mask=attention_mask, cache=cache,
                           decoder_attention_mask=decoder_attention_mask)

    def make_cache(self, kind: str = "dynamic", *, max_len: int | None = None, quantize: str | None = None) -> KVCache:
        return KVCache.create(kind, self.config.num_layers, max_len=max_len, quantize=quantize)


@dataclass
class ViTConfig(TransformerConfig):
    """A :class:`TransformerConfig` plus the image geometry. ``position`` is ``"sincos2d"``
    (fixed 2-D sin/cos, default), ``"learned"`` or ``"none"``; ``vocab_size``/``max_len`` are unused."""

    image_size: int = field(default=32, metadata={"help": "square image side in pixels"})
    patch_size: int = field(default=4, metadata={"help": "square patch side in pixels"})
    in_channels: int = field(default=3, metadata={"help": "image channels"})
    num_classes: int = field(default=10, metadata={"help": "classifier outputs"})
    position: str = field(default="sincos2d", metadata={"help": "sincos2d | learned | none"})

    def __post_init__(self):
        super().__post_init__()
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ViTConfig: image_size={self.image_size} is not divisible by patch_size={self.patch_size}."
            )

    def _positions(self) -> tuple[str, ...]:
        return ("sincos2d", "learned", "none")

    @property
    def grid_size(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_size**2


class ViT(PretrainedModel, nn.Module):
    """Vision Transformer (Dosovitskiy et al. 2020): patch embedding (a strided conv), a CLS token,
    2-D positions, encoder layers, classifier on the CLS output.

    ``forward(pixel_values (B, C, H, W)) -> logits (B, num_classes)``; :meth:`features` gives the
    hidden states ``(B, 1 + num_patches, E)``."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        if not isinstance(config, ViTConfig):
            raise TypeError(f"config: expected a ViTConfig, got {type(config).__name__}.")
        self.config = config
        E = config.embed_dim
        self.patch_embed = nn.Conv2d(config.in_channels, E, kernel_size=config.patch_size, stride=config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, E))
        if config.position == "learned":
            self.pos_embed = nn.Parameter(torch.randn(1, 1 + config.num_patches, E) * config.initializer_range)
        elif config.position == "sincos2d":
            table = torch.cat([torch.zeros(1, E), sinusoidal_2d(config.grid_size, config.grid_size, E)])
            self.register_buffer("pos_embed", table[None], persistent=False)  # (1, 1 + N, E)
        else:
            self.pos_embed = None
        self.dropout = nn.Dropout(config.dropout)
        _softmax_only(config, "ViT")
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        self.final_norm = make_norm(config) if config.final_norm else nn.Identity()
        self.head = nn.Linear(E, config.num_classes)
        init_weights(self, config.initializer_range)

    def features(self, pixel_values: Tensor) -> Tensor:
        cfg = self.config
        if not isinstance(pixel_values, Tensor) or pixel_values.dim() != 4 or pixel_values.shape[1:] != (
            cfg.in_channels, cfg.image_size, cfg.image_size
        ):
            raise ValueError(
                f"pixel_values: expected (B, {cfg.in_channels}, {cfg.image_size}, {cfg.image_size}), got "
                f"{tuple(getattr(pixel_values, 'shape', ()))}."
            )
        x = self.patch_embed(pixel_values).flatten(2).transpose(1, 2)  # (B, N, E), patches row-major
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)  # (B, 1 + N, E)
        if self.pos_embed is not None:
            x = x + self.pos_embed.to(x.dtype)
        x = self.dropout(x)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.head(self.features(pixel_values)[:, 0])
