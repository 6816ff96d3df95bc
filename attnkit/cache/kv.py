"""The model-level cache: one layer cache per layer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from .layers import BaseLayerCache, DynamicLayerCache, SlidingWindowLayerCache, StateCache, StaticLayerCache
from .quantized import QuantizedLayerCache, check_quantize

__all__ = ["KVCache"]


class KVCache:
    """One layer cache per layer. ``seq_len`` is the number of tokens seen (all layers agree)."""

    def __init__(self, layers: Sequence[BaseLayerCache]):
        layers = list(layers)
        if not layers or not all(isinstance(layer, BaseLayerCache) for layer in layers):
            raise TypeError("layers: expected a non-empty sequence of layer caches (DynamicLayerCache(), "
                            "StateCache(...), ...).")
        self.layers = layers
        for layer in layers:  # a step that fails in one layer rolls the others back (all or nothing)
            layer.siblings = layers

    @classmethod
    def dynamic(cls, num_layers: int) -> KVCache:
        return cls([DynamicLayerCache() for _ in range(num_layers)])

    @classmethod
    def static(cls, num_layers: int, max_len: int) -> KVCache:
        return cls([StaticLayerCache(max_len) for _ in range(num_layers)])

    @classmethod
    def sliding_window(cls, num_layers: int, window: int) -> KVCache:
        return cls([SlidingWindowLayerCache(window) for _ in range(num_layers)])

    @classmethod
    def recurrent(cls, num_layers: int, backend: str, head_dim: int, *, options=None) -> KVCache:
        """One :class:`StateCache` per layer for a linear-attention model (``backend`` ``"linear"``
        or ``"performer"``, with the model's ``backend_options``)."""
        return cls([StateCache.recurrent(backend, head_dim, options=options) for _ in range(num_layers)])

    @classmethod
    def gated(cls, num_layers: int, *, scale: float | None = None, qk_l2norm: bool = False) -> KVCache:
        """One :class:`StateCache` over ``attnkit.GatedLinearState`` per layer, for gated
        linear-attention layers (gated delta rule, KDA, SSD); ``step(q, k, v, g=..., beta=...)``."""
        from ..backends.kernelized.gated import GatedLinearState

        return cls([StateCache(lambda: GatedLinearState(scale=scale, qk_l2norm=qk_l2norm)) for _ in range(num_layers)])

    @classmethod
    def quantized(cls, num_layers: int, max_len: int | None = None) -> KVCache:
        """int8 layer caches (:class:`QuantizedLayerCache`): static with ``max_len``, else dynamic."""
        return cls([QuantizedLayerCache(max_len) for _ in range(num_layers)])

    @classmethod
    def create(cls, kind: str, num_layers: int, *, max_len: int | None = None, window: int | None = None,
               quantize: str | None = None) -> KVCache:
        """``kind`` is ``"dynamic"``, ``"static"`` (needs ``max_len``) or ``"sliding_window"`` (needs
        ``window``); ``quantize="int8"`` stores static/dynamic caches in int8. Recurrent caches
        come from :meth:`recurrent`, paged ones from :class:`~attnkit.cache.PagedKVCache`."""
        if check_quantize(quantize) is not None and kind not in ("static", "dynamic"):
            raise ValueError(f"quantize: {quantize!r} applies to 'static', 'dynamic' and paged caches, not {kind!r}.")
        if kind == "dynamic":
            return cls.quantized(num_layers) if quantize else cls.dynamic(num_layers)
        if kind == "static":
            if max_len is None:
                raise ValueError("max_len: a static cache needs max_len (prompt length + new tokens).")
            return cls.quantized(num_layers, max_len) if quantize else cls.static(num_layers, max_len)
        if kind == "sliding_window":
            if window is None:
                raise ValueError("window: a sliding-window cache needs window (the attention window).")
            return cls.sliding_window(num_layers, window)
        raise ValueError(f"kind: expected 'dynamic', 'static', 'sliding_window' or 'recurrent', got {kind!r}.")

    @property
    def seq_len(self) -> int:
        return self.layers[0].seq_len

    def positions(self, length: int, device=None) -> Tensor:
        """Absolute positions of the next ``length`` tokens: ``(length,)``, or ``(B, length)`` when
        rows hold different lengths (paged caches)."""
        return torch.arange(self.seq_len, self.seq_len + length, device=device)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> BaseLayerCache:
        return self.layers[i]

    def __iter__(self) -> Iterator[BaseLayerCache]:
        return iter(self.layers)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (beam search): row ``i`` becomes old row ``index[i]``."""
        for layer in self.layers:
            layer.reorder(index)

    def __repr__(self) -> str:
        kinds = sorted({type(layer).__name__ for layer in self.layers})
        return f"KVCache({len(self.layers)} layers of {', '.join(kinds)}, seq_len={self.seq_len})"
