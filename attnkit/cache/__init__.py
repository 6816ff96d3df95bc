"""KV caches for autoregressive decoding: contiguous layer caches (:mod:`.layers`), int8
quantized caches (:mod:`.quantized`) and the paged cache for many sequences (:mod:`.paged`)."""

from .direct import DirectLayerCache
from .kv import KVCache
from .layers import (
    BaseLayerCache,
    DynamicLayerCache,
    LayerCache,
    SlidingWindowLayerCache,
    StateCache,
    StaticLayerCache,
)
from .paged import PagedKVCache, PagedLayerCache
from .quantized import QuantizedLayerCache, dequantize_int8, quantize_int8

__all__ = [
    "BaseLayerCache",
    "LayerCache",
    "DynamicLayerCache",
    "StaticLayerCache",
    "SlidingWindowLayerCache",
    "StateCache",
    "KVCache",
    "DirectLayerCache",
    "QuantizedLayerCache",
    "PagedKVCache",
    "PagedLayerCache",
    "quantize_int8",
    "dequantize_int8",
]
