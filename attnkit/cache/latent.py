"""A latent KV cache for multi-head latent attention (MLA, DeepSeek-V2/V3).

An MLA layer caches, per token, one latent vector of ``kv_lora_rank`` numbers (DeepSeek: 512)
followed by a rotary key of ``rope_dim`` numbers (64): ``kv_lora_rank + rope_dim`` numbers shared
by every head, instead of per-head keys and values. Decoding "absorbs" the up-projections into the
queries and the output, so attention runs directly over the cached rows: an MQA (one K/V head)
whose keys are the whole rows and whose **values are the first** ``kv_lora_rank`` **columns of the
keys** (:func:`attnkit.mla_decode`)::

    one cached token:   [ latent c (kv_lora_rank) | rotary key (rope_dim) ]   <- the key
                        [ latent c (kv_lora_rank) ]                           <- the value: a view

The storage is any layer cache of :mod:`attnkit.cache` — contiguous (dynamic, static), int8
(:class:`~attnkit.cache.QuantizedLayerCache`) or paged (:class:`~attnkit.cache.PagedKVCache`, with
or without int8) — given zero-width values, so it holds the keys alone. :func:`latent_update`
appends the new rows and returns what attention reads: the keys and a value view of their first
``kv_lora_rank`` columns (for int8 and paged storage a :class:`~attnkit.kv_handle.KVHandle` whose
values alias its keys, and whose value scales are the keys' scales: one scale per 576-number row).
The decode kernel then reads each cached row once for the scores and the values of every head.

:class:`LatentLayerCache` wraps one such storage layer behind the usual ``update(k, v)`` protocol;
:class:`attnkit.nn.MultiHeadLatentAttention` takes either it or a plain layer of any
:class:`~attnkit.cache.KVCache` (``cache[i]``) and writes its latents through
:func:`latent_update`.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor

from ..kv_handle import KVHandle
from .layers import LayerCache

__all__ = ["LatentLayerCache", "latent_update", "alias_values"]


def _check_latents(k: Tensor, kv_lora_rank: int) -> None:
    if not isinstance(k, Tensor) or k.dim() != 4 or k.shape[-1] <= kv_lora_rank:
        raise ValueError(
            f"k: expected latent rows (B, 1, Tnew, kv_lora_rank + rope_dim) with more than kv_lora_rank="
            f"{kv_lora_rank} columns, got {tuple(getattr(k, 'shape', ())) or type(k).__name__}. Fix: pass "
            "torch.cat([latent, rotary_key], -1) of the new tokens."
        )


def alias_values(k: Tensor | KVHandle, kv_lora_rank: int) -> tuple[Tensor | KVHandle, Tensor | KVHandle]:
    """``(k, v)`` with ``v`` the first ``kv_lora_rank`` columns of ``k``, a view (a handle whose
    values and value scales are its keys' own)."""
    if isinstance(k, KVHandle):
        h = dataclasses.replace(k, v=k.k[..., :kv_lora_rank], v_scale=k.k_scale)
        return h, h
    return k, k[..., :kv_lora_rank]


def latent_update(cache: LayerCache, k: Tensor, kv_lora_rank: int):
    """Append latent rows ``k (B, Hkv, Tnew, kv_lora_rank + rope_dim)`` to a layer cache that
    holds keys only, and return ``(k_all, v_all, kv_offset)`` for :func:`attnkit.attention` (or
    :func:`attnkit.mla_decode`): ``v_all`` is ``k_all``'s first ``kv_lora_rank`` columns, a view."""
    _check_latents(k, kv_lora_rank)
    k_all, _, offset = cache.update(k, k[..., :0])  # (B, Hkv, Tnew, 0): the values are not stored
    k_all, v_all = alias_values(k_all, kv_lora_rank)
    return k_all, v_all, offset


class LatentLayerCache(LayerCache):
    """One layer's latent cache over ``storage`` (a fresh layer cache: ``DynamicLayerCache()``,
    ``StaticLayerCache(max_len)``, ``QuantizedLayerCache(max_len)``, or a layer of a
    :class:`~attnkit.cache.PagedKVCache`), holding ``kv_lora_rank + rope_dim`` numbers per token.

    ``update(k, v=None)`` appends ``k (B, 1, Tnew, kv_lora_rank + rope_dim)`` and returns
    ``(k_all, v_all, kv_offset)`` with ``v_all`` the first ``kv_lora_rank`` columns of ``k_all``;
    ``v``, when given, must be that view of ``k`` (values are never stored twice)::

        cache = LatentLayerCache(StaticLayerCache(4096), kv_lora_rank=512)
        k_all, v_all, offset = cache.update(rows)       # rows: (B, 1, T, 576)
        out = attnkit.mla_decode(q, k_all, kv_lora_rank=512, scale=192 ** -0.5)
    """

    def __init__(self, storage: LayerCache, kv_lora_rank: int) -> None:
        super().__init__()
        if not isinstance(storage, LayerCache) or isinstance(storage, LatentLayerCache):
            raise TypeError(f"storage: expected a layer cache holding keys (DynamicLayerCache(), StaticLayerCache(n), "
                            f"QuantizedLayerCache(n), a PagedKVCache layer), got {type(storage).__name__}.")
        if not isinstance(kv_lora_rank, int) or isinstance(kv_lora_rank, bool) or kv_lora_rank < 1:
            raise ValueError(f"kv_lora_rank: expected a positive int (the latent width, 512 in DeepSeek-V3), "
                             f"got {kv_lora_rank!r}.")
        self.storage = storage
        self.kv_lora_rank = kv_lora_rank

    @property
    def kind(self) -> str:
        return f"latent {getattr(self.storage, 'kind', type(self.storage).__name__)}"

    @property
    def seq_len(self) -> int:
        return self.storage.seq_len

    @seq_len.setter
    def seq_len(self, value: int) -> None:  # BaseLayerCache.reset assigns it; the storage counts
        pass

    @property
    def finite(self) -> bool:
        return self.storage.finite

    @finite.setter
    def finite(self, value: bool) -> None:
        pass

    def update(self, k: Tensor, v: Tensor | None = None):
        try:  # all or nothing across the layers of one KVCache, as every layer cache
            return self._update(k, v)
        except Exception:
            self.rollback_siblings()
            raise

    def _update(self, k: Tensor, v: Tensor | None):
        _check_latents(k, self.kv_lora_rank)
        if v is not None and (not isinstance(v, Tensor) or v.shape != k[..., :self.kv_lora_rank].shape
                              or v.data_ptr() != k.data_ptr() or v.stride() != k.stride()):
            raise ValueError(f"v: the values of a latent cache are the first kv_lora_rank={self.kv_lora_rank} "
                             f"columns of k; got v of shape {tuple(getattr(v, 'shape', ()))} that is not that view. "
                             f"Fix: pass v=None (or k[..., :{self.kv_lora_rank}]).")
        return latent_update(self.storage, k, self.kv_lora_rank)

    def next_positions(self, length: int, device=None) -> Tensor:
        return self.storage.next_positions(length, device)

    def row_lengths(self) -> list[int]:
        return self.storage.row_lengths() if hasattr(self.storage, "row_lengths") else [self.seq_len]

    def memory_bytes(self) -> int:
        """Bytes held by the storage's buffers."""
        if hasattr(self.storage, "memory_bytes"):
            return self.storage.memory_bytes()
        return sum(t.numel() * t.element_size() for t in (self.storage.k, self.storage.v) if t is not None)

    def reset(self) -> None:
        super().reset()
        self.storage.reset()

    def crop(self, length: int) -> None:
        self.storage.crop(length)

    def reorder(self, index: Tensor) -> None:
        self.storage.reorder(index)

    def __repr__(self) -> str:
        return f"LatentLayerCache(kv_lora_rank={self.kv_lora_rank}, {self.kind}, seq_len={self.seq_len})"

