"""KV caches for autoregressive decoding: contiguous layer caches (:mod:`.layers`), int8
quantized caches (:mod:`.quantized`), the paged cache for many sequences (:mod:`.paged`) and
the latent cache of multi-head latent attention (:mod:`.latent`) and the lightning indexer's key
store (:mod:`.indexer`)."""

from .direct import DirectLayerCache
from .indexer import IndexerKeyCache
from .kv import KVCache
from .latent import LatentLayerCache, latent_update
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
    "LatentLayerCache",
    "IndexerKeyCache",
    "latent_update",
    "quantize_int8",
    "dequantize_int8",
]
