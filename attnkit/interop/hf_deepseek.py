"""transformers' DeepSeek-V3 decoding over the latents, on attnkit's latent cache and decode kernel.

With ``attn_implementation="attnkit"`` alone, DeepSeek-V3 runs on attnkit's kernels in its
non-absorbed form: transformers' cache keeps the latents (``kv_nope`` as keys, the rotary key as
values), but its attention layer expands them to every head (``kv_b_proj``) at every step before
the attention function sees them. :func:`use_latent_decoding` makes the layers that find a
:func:`latent_cache` decode over the latents themselves instead (the absorbed form,
:func:`attnkit.mla_decode`: one row of ``kv_lora_rank + qk_rope_head_dim`` numbers per token read
once for every head); prompts (more than 16 new tokens) and training keep the per-head form::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")
    cache = attnkit.interop.latent_cache(model.config)            # or "static", "int8", "paged", ...
    with attnkit.interop.use_latent_decoding():
        out = model.generate(input_ids, past_key_values=cache, max_new_tokens=32)

The cache also serves transformers' own attention layer (outside the block): ``update`` then
returns the latents and rotary keys as it expects.

DeepSeek-V3.2 decodes the same way: its layers run their lightning indexer (whose keys the latent
cache keeps too, ``update_indexer``) and attend the indexer's top-k keys over the latents, the
mask ``TopK(indices) & <the model's mask>``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
from torch import Tensor

from ..backends.decode_native import KERNEL_MAX_QUERIES
from ..cache import DynamicLayerCache, IndexerKeyCache
from ..cache.latent import alias_values
from ..kv_handle import KVHandle
from ..masks import TopK
from ..mla import mla_decode
from ._deps import require
from .hf_attention import HFMask
from .hf_cache import hf_cache

__all__ = ["latent_cache", "use_latent_decoding"]
_MODELING = "transformers.models.deepseek_v3.modeling_deepseek_v3"
_MODELING_V32 = "transformers.models.deepseek_v32.modeling_deepseek_v32"


_CLASSES: dict = {}


def _latent_class(base):
    """``base`` (an :func:`~attnkit.interop.hf_cache` layer class) extended to hold latent rows."""
    if base in _CLASSES:
        return _CLASSES[base]

    class LatentLayer(base):
        """One DeepSeek layer's latent rows ``(B, 1, T, kv_lora_rank + rope)`` in an attnkit layer cache
        (values zero-wide: they are the rows' first columns)."""

        def update_rows(self, rows: Tensor, rank: int):
            """Append the rows; return every row held (a tensor, or an int8/paged handle)."""
            k, _ = base.update(self, rows, rows[..., :0])
            return alias_values(k, rank)[0]

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
            """transformers' attention layer: ``kv_nope (B, 1, T, rank)``, ``k_rot (B, 1, T, rope)``."""
            rank = key_states.shape[-1]
            rows = self.update_rows(torch.cat([key_states, value_states], dim=-1), rank)
            if isinstance(rows, KVHandle):
                rows = rows.dense()[0]
            return rows[..., :rank], rows[..., rank:]

        def update_indexer(self, keys: Tensor) -> Tensor:
            """DeepSeek-V3.2's indexer keys ``(B, S, D)``: appended to this layer's
            :class:`~attnkit.cache.IndexerKeyCache`; returns every key held, ``(B, T, D)``."""
            store = self.__dict__.get("indexer_store")
            if store is None:
                store = self.indexer_store = IndexerKeyCache(DynamicLayerCache())
            return store.update(keys[:, None])[0][:, 0]

        def reset(self) -> None:
            base.reset(self)
            if self.__dict__.get("indexer_store") is not None:
                self.indexer_store.reset()

        def reorder_cache(self, beam_idx) -> None:
            base.reorder_cache(self, beam_idx)
            if self.__dict__.get("indexer_store") is not None:
                self.indexer_store.reorder(beam_idx)

    _CLASSES[base] = LatentLayer
    return LatentLayer


def latent_cache(config, kind: str = "dynamic", **sizes):
    """A ``transformers.Cache`` holding one latent row per token and layer for a DeepSeek-V3
    ``config``: every kind of :func:`~attnkit.interop.hf_cache` (``"dynamic"``, ``"static"``,
    ``"int8"``, ``"paged"``, ``"paged-int8"``) with its sizes (``max_cache_len=``, ``num_blocks=``,
    ...), each layer storing the rows alone (int8: one int8 row and a float32 scale per token)."""
    if not hasattr(config, "kv_lora_rank"):
        raise ValueError(f"config: expected a DeepSeek-V3 config (with kv_lora_rank), got {type(config).__name__}.")
    cache = hf_cache(config, kind, **sizes)
    for layer in cache.layers:
        layer.__class__ = _latent_class(type(layer))  # the same layer, with the latent row methods
    return cache


def _latent_layer(module, past_key_values):
    layers = getattr(past_key_values, "layers", None)
    if not layers or module.layer_idx >= len(layers):
        return None
    layer = layers[module.layer_idx]
    return layer if hasattr(layer, "update_rows") else None


def _forward(original, module: str):
    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        layer = _latent_layer(self, past_key_values)
        B, T = hidden_states.shape[:-1]
        indexer = getattr(self, "indexer", None)  # DeepSeek-V3.2
        absorbed = (layer is not None and T <= KERNEL_MAX_QUERIES and not (torch.is_grad_enabled() and self.training)
                    and (attention_mask is None or isinstance(attention_mask, HFMask))
                    and (indexer is None or attention_mask is not None))
        if not absorbed:  # transformers' own layer (per-head form); a latent cache serves it too
            return original(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        modeling = require(module, "use_latent_decoding")
        R, rope = self.kv_lora_rank, self.qk_rope_head_dim
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
            q = self.q_b_proj(q_resid)
        q = q.view(B, T, -1, self.qk_head_dim).transpose(1, 2)  # (B, H, T, nope + rope)
        q_nope, q_rot = q.split([self.qk_nope_head_dim, rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([R, rope], dim=-1)
        latent = self.kv_a_layernorm(latent).view(B, 1, T, R)
        k_rot = k_rot.view(B, 1, T, rope)
        cos, sin = position_embeddings
        interleave = indexer is not None or self.config.rope_interleave  # V3.2 always interleaves
        rotate = modeling.apply_rotary_pos_emb_interleave if interleave else modeling.apply_rotary_pos_emb
        q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
        rows = layer.update_rows(torch.cat([latent, k_rot], dim=-1), R)  # (B, 1, Tk, R + rope) or a handle
        H = q.shape[1]
        w = self.kv_b_proj.weight.view(H, self.qk_nope_head_dim + self.v_head_dim, R)
        q_latent = torch.einsum("bhtd,hdr->bhtr", q_nope, w[:, :self.qk_nope_head_dim])  # (B, H, T, R)
        mask, q_offset, kv_offset = None, None, 0
        if isinstance(attention_mask, HFMask):
            mask, q_offset, kv_offset = attention_mask.mask, attention_mask.q_offset, attention_mask.kv_offset
        if indexer is not None:  # each new token's top-k keys (the indexer's keys kept by the latent cache)
            indices = indexer(hidden_states, q_resid, position_embeddings, attention_mask[:, 0], None,
                              past_key_values=past_key_values)  # (B, T, k), key positions
            lists = TopK(torch.where(indices >= 0, indices.long() + kv_offset, -1)[:, None])
            mask = lists if mask is None else mask & lists
        out = mla_decode(torch.cat([q_latent, q_rot], dim=-1), rows, kv_lora_rank=R, scale=self.scaling, mask=mask,
                         q_offset=q_offset, kv_offset=kv_offset, kv_finite=layer.store.finite)  # (B, H, T, R)
        out = torch.einsum("bhtr,hvr->bthv", out, w[:, self.qk_nope_head_dim:])  # (B, T, H, v_head_dim)
        return self.o_proj(out.reshape(B, T, -1)), None

    forward.attnkit_latent = True
    return forward


@contextlib.contextmanager
def use_latent_decoding() -> Iterator[None]:
    """Within the block, transformers' DeepSeek-V3 (and, where installed, V3.2) attention layers
    decode over a :func:`latent_cache` in the absorbed form (see the module docstring); restored on
    exit, also after an exception."""
    classes = [(require(_MODELING, "use_latent_decoding").DeepseekV3Attention, _MODELING)]
    try:
        classes.append((importlib.import_module(_MODELING_V32).DeepseekV32Attention, _MODELING_V32))
    except ImportError:  # a transformers without DeepSeek-V3.2
        pass
    patched = []
    try:
        for cls, module in classes:
            if not getattr(cls.forward, "attnkit_latent", False):  # nested: already on
                patched.append((cls, cls.forward))
                cls.forward = _forward(cls.forward, module)
        yield
    finally:
        for cls, original in patched:
            cls.forward = original
