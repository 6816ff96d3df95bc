"""The lightning indexer's key store for decoding (DeepSeek Sparse Attention).

DeepSeek-V3.2's indexer scores every past key at each step with one key per token (128 numbers,
shared by its heads) that the attention's own cache does not hold. :class:`IndexerKeyCache` keeps
them in any layer cache of :mod:`attnkit.cache` given zero-width values (a ``DynamicLayerCache()``,
``StaticLayerCache(max_len)``, an int8 ``QuantizedLayerCache(max_len)`` or a paged layer), beside
the layer's KV cache, and returns them dense for :func:`attnkit.nn.lightning_indexer`::

    store = IndexerKeyCache(StaticLayerCache(4096))
    keys, kv_offset = store.update(new_keys)                       # (B, 1, Tk, D)
    idx = lightning_indexer(q_index, keys, weights, topk=2048, kv_offset=kv_offset)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv_handle import KVHandle
from .layers import LayerCache

__all__ = ["IndexerKeyCache"]


class IndexerKeyCache:
    """One layer's indexer keys ``(B, 1, T, D)`` over ``storage`` (a fresh layer cache). ``seq_len``,
    ``reset``, ``crop`` and ``reorder`` follow the storage, so the store steps with the model's cache."""

    def __init__(self, storage: LayerCache) -> None:
        if not isinstance(storage, LayerCache):
            raise TypeError(f"storage: expected a layer cache (DynamicLayerCache(), StaticLayerCache(n), "
                            f"QuantizedLayerCache(n), a PagedKVCache layer), got {type(storage).__name__}.")
        self.storage = storage

    def update(self, k: Tensor) -> tuple[Tensor, int | Tensor]:
        """Append the new tokens' indexer keys ``k (B, 1, Tnew, D)``; return every key held,
        ``(B, 1, Tk, D)`` (dequantized or gathered from pages when the storage is int8 or paged), and
        the absolute position of the first (``kv_offset``)."""
        if not isinstance(k, Tensor) or k.dim() != 4 or k.shape[1] != 1:
            raise ValueError(f"k: expected the new tokens' indexer keys (B, 1, Tnew, D), got "
                             f"{tuple(getattr(k, 'shape', ())) or type(k).__name__}. Fix: k.view(B, 1, Tnew, D).")
        keys, _, offset = self.storage.update(k, k[..., :0])  # zero-width values: the keys alone are stored
        if isinstance(keys, KVHandle):
            keys = keys.dense()[0]
        return keys, offset

    @property
    def seq_len(self) -> int:
        return self.storage.seq_len

    def reset(self) -> None:
        self.storage.reset()

    def crop(self, length: int) -> None:
        self.storage.crop(length)

    def reorder(self, index: Tensor) -> None:
        self.storage.reorder(index)

    def memory_bytes(self) -> int:
        """Bytes held by the storage's buffers."""
        if hasattr(self.storage, "memory_bytes"):
            return self.storage.memory_bytes()
        held = (getattr(self.storage, name, None) for name in ("k", "v"))
        return sum(t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor))

    def __repr__(self) -> str:
        return f"IndexerKeyCache({type(self.storage).__name__}, seq_len={self.seq_len})"
