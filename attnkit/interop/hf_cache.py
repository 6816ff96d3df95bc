"""attnkit's KV caches as a ``transformers`` cache: written in place, read by attnkit's decode kernel.

::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnkit")
    cache = attnkit.interop.hf_cache(model.config, "int8")          # or "static" (max_cache_len=...)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

Each layer keeps one attnkit layer cache (:mod:`attnkit.cache`): ``"static"`` preallocates
``(B, Hkv, max_cache_len, D)`` buffers and writes each step's keys in place (no concatenation of the
whole cache per step, as transformers' ``DynamicCache`` does); ``"int8"`` stores int8 values with a
float32 scale per token and head (about 27% of float32's bytes at head dim 64, 26% at 128: see
:mod:`attnkit.cache.quantized` for the error), growing as needed or preallocated with
``max_cache_len``. ``update`` returns what attention reads: views of the filled prefix, or a
:class:`~attnkit.kv_handle.KVHandle` that the decode kernel reads in place. Every token is checked
finite as it is written, and attention is told so (no scan of the cache per step).

The model must run with ``attn_implementation="attnkit"`` (another implementation cannot read an
int8 handle). Full-attention layers only: a model with sliding-window layers keeps all keys here
(the mask still hides the old ones, so results are exact, at full-cache cost).
"""

from __future__ import annotations

import weakref

from torch import Tensor

from ..cache import QuantizedLayerCache, StaticLayerCache
from ..cache.layers import DynamicLayerCache
from ..kv_handle import KVHandle
from ._deps import require

__all__ = ["hf_cache", "vouched", "KINDS"]

KINDS = ("static", "int8", "dynamic")

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

        def __init__(self, make):
            super().__init__()
            self.store = make()
            self._last = None  # the id registered in _VOUCHED

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
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
            self.store.reset()
            _VOUCHED.pop(self._last, None)
            self._last = None

        def reorder_cache(self, beam_idx) -> None:
            self.store.reorder(beam_idx)

        def batch_select_indices(self, indices) -> None:
            self.store.reorder(indices)

    return cache_utils, AttnkitLayer


def hf_cache(config, kind: str = "static", *, max_cache_len: int | None = None):
    """A ``transformers.Cache`` for ``config``'s decoder layers, one attnkit layer cache each.

    ``kind``: ``"static"`` (preallocated, written in place; needs ``max_cache_len``: prompt plus new
    tokens), ``"int8"`` (int8 values and float32 scales; preallocated with ``max_cache_len``, else
    grown as needed) or ``"dynamic"`` (attnkit's growing full-precision cache)."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}. Fix: hf_cache(config, 'static', "
                         "max_cache_len=...).")
    if kind == "static" and max_cache_len is None:
        raise ValueError("max_cache_len: a static cache needs its size (prompt plus new tokens), got None. "
                         "Fix: hf_cache(config, 'static', max_cache_len=prompt_len + max_new_tokens), or kind='int8'.")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"config: expected num_hidden_layers >= 1 (a decoder's config), got {layers!r}.")
    make = {"static": lambda: StaticLayerCache(max_cache_len), "int8": lambda: QuantizedLayerCache(max_cache_len),
            "dynamic": DynamicLayerCache}[kind]
    cache_utils, layer = _layer_class()
    return cache_utils.Cache(layers=[layer(make) for _ in range(layers)])
