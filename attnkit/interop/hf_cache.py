"""attnkit's KV caches as a ``transformers`` cache: written in place, read by attnkit's decode kernel.

::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")
    cache = attnkit.interop.hf_cache(model.config, "int8")          # or "static" (max_cache_len=...)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

    cache = attnkit.interop.hf_cache(model.config, "paged", num_blocks=256)   # beams share their prefix
    out = model.generate(**inputs, past_key_values=cache, num_beams=4, max_new_tokens=64)

Each layer keeps one attnkit layer cache (:mod:`attnkit.cache`): ``"static"`` preallocates
``(B, Hkv, max_cache_len, D)`` buffers and writes each step's keys in place (no concatenation of the
whole cache per step, as transformers' ``DynamicCache`` does); ``"int8"`` stores int8 values with a
float32 scale per token and head (about 27% of float32's bytes at head dim 64, 26% at 128: see
:mod:`attnkit.cache.quantized` for the error), growing as needed or preallocated with
``max_cache_len``. ``"paged"`` and ``"paged-int8"`` keep a :class:`~attnkit.cache.PagedKVCache`:
blocks of ``block_size`` tokens from a pool of ``num_blocks`` per layer, taken as each row grows,
shared copy-on-write between the beams of a beam search (``reorder_cache`` forks instead of
copying whole rows). ``update`` returns what attention reads: views of the filled prefix, or a
:class:`~attnkit.kv_handle.KVHandle` that the decode kernel reads in place. Every token is checked
finite as it is written, and attention is told so (no scan of the cache per step).

The model must run with ``attn_implementation="attnkit"`` (another implementation cannot read an
int8 handle). Full-attention layers only: a model with sliding-window layers keeps all keys here
(the mask still hides the old ones, so results are exact, at full-cache cost).
"""

from __future__ import annotations

import weakref

from torch import Tensor

from .._validate import check_int_at_least
from ..cache import PagedKVCache, QuantizedLayerCache, StaticLayerCache
from ..cache.layers import DynamicLayerCache
from ..kv_handle import KVHandle
from ._deps import require

__all__ = ["hf_cache", "vouched", "KINDS"]

KINDS = ("static", "int8", "dynamic", "paged", "paged-int8")

# id(key) -> (weakref(key), weakref(value)) for the views the layers below returned last, while their
# tokens are all finite: attention then skips its NaN/Inf scan of K and V (one entry per layer).
_VOUCHED: dict[int, tuple] = {}


def vouched(key, value) -> bool:
    """Whether ``key``/``value`` are the views an attnkit cache layer just returned, all finite."""
    entry = _VOUCHED.get(id(key))
    return entry is not None and entry[0]() is key and entry[1]() is value


def _layer_class():
    cache_utils = require("transformers.cache_utils", "attnkit.interop.hf_cache")

    class AttnkitLayer(cache_utils.DynamicLayer):
        """One model layer's attnkit cache behind transformers' cache-layer interface."""

        is_sliding = False
        is_croppable = False

        def __init__(self, store, paged: PagedKVCache | None = None, first: bool = True):
            super().__init__()
            self.store = store
            self.paged = paged  # the whole paged cache (its sequences are shared by every layer)
            self.first = first  # the layer that runs the paged cache's whole-cache operations
            self._last = None  # the id registered in _VOUCHED

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.paged is not None and not self.paged.active:  # the first forward: one sequence per row
                self.paged.select([self.paged.add_sequence() for _ in range(key_states.shape[0])])
            k, v, _ = self.store.update(key_states, value_states)
            _VOUCHED.pop(self._last, None)
            self._last = None
            if not isinstance(k, KVHandle) and self.store.finite:
                self._last = id(k)
                _VOUCHED[self._last] = (weakref.ref(k), weakref.ref(v))
            return k, v

        def get_seq_length(self) -> int:
            return self.store.seq_len

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.store.seq_len + query_length, 0

        def get_max_length(self) -> int:
            return getattr(self.store, "max_len", None) or -1

        def reset(self) -> None:
            if self.paged is None:
                self.store.reset()
            elif self.first:
                self.paged.reset()
            _VOUCHED.pop(self._last, None)
            self._last = None

        def reorder_cache(self, beam_idx) -> None:
            if self.paged is None:
                self.store.reorder(beam_idx)
            elif self.first:  # the block tables are the cache's, not a layer's: fork/free once
                self.paged.reorder(beam_idx)

        def batch_select_indices(self, indices) -> None:
            self.reorder_cache(indices)

    return cache_utils, AttnkitLayer


def hf_cache(config, kind: str = "static", *, max_cache_len: int | None = None, num_blocks: int | None = None,
             block_size: int = 16, max_batch_size: int = 1):
    """A ``transformers.Cache`` for ``config``'s decoder layers, one attnkit layer cache each.

    ``kind``: ``"static"`` (preallocated, written in place; needs ``max_cache_len``: prompt plus new
    tokens), ``"int8"`` (int8 values and float32 scales; preallocated with ``max_cache_len``, else
    grown as needed), ``"dynamic"`` (attnkit's growing full-precision cache), ``"paged"`` or
    ``"paged-int8"`` (a block pool of ``num_blocks`` blocks of ``block_size`` tokens per layer; by
    default enough for ``max_batch_size`` rows of ``max_cache_len`` tokens). A paged cache serves one
    ``generate()`` call at a time: ``reset()`` it (or make a new one) before the next."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}. Fix: hf_cache(config, 'static', "
                         "max_cache_len=...).")
    if kind == "static" and max_cache_len is None:
        raise ValueError("max_cache_len: a static cache needs its size (prompt plus new tokens), got None. "
                         "Fix: hf_cache(config, 'static', max_cache_len=prompt_len + max_new_tokens), or kind='int8'.")
    if kind.startswith("paged"):
        check_int_at_least("block_size", block_size)
        check_int_at_least("max_batch_size", max_batch_size)
        if num_blocks is None:
            if max_cache_len is None:
                raise ValueError("num_blocks: a paged cache needs its pool size, got neither num_blocks nor "
                                 "max_cache_len. Fix: hf_cache(config, 'paged', num_blocks=...) or max_cache_len=... "
                                 "(with max_batch_size=rows x beams).")
            num_blocks = -(-max_cache_len // block_size) * max_batch_size
        check_int_at_least("num_blocks", num_blocks)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"config: expected num_hidden_layers >= 1 (a decoder's config), got {layers!r}.")
    cache_utils, layer = _layer_class()
    if kind.startswith("paged"):
        paged = PagedKVCache(layers, num_blocks=num_blocks, block_size=block_size,
                             quantize="int8" if kind == "paged-int8" else None)
        return cache_utils.Cache(layers=[layer(store, paged, i == 0) for i, store in enumerate(paged.layers)])
    make = {"static": lambda: StaticLayerCache(max_cache_len), "int8": lambda: QuantizedLayerCache(max_cache_len),
            "dynamic": DynamicLayerCache}[kind]
    return cache_utils.Cache(layers=[layer(make()) for _ in range(layers)])
