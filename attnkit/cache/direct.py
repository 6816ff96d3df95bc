"""Layer caches whose storage attention reads in place (int8, paged).

A contiguous full-precision cache returns views of its buffers from ``update``. A quantized or
paged cache would have to build a full-precision, contiguous copy of itself for that, every step;
a :class:`DirectLayerCache` instead returns a :class:`~attnkit.kv_handle.KVHandle` — its int8
values and scales, or its pools and block table, and the keys each row holds — which
:func:`attnkit.attention` accepts in place of K/V. Which kernel reads it is the dispatcher's choice
(``attnkit.explain(q, handle, handle)`` says which): the ``decode`` backend reads the storage in
place; any other backend (a named one, gradients, a long prefill, a score modifier or sinks the
decode kernel does not apply) runs on the handle's dense conversion, a contiguous copy.

A prefill over an empty cache returns the new keys themselves (full precision, with their
graph): they are all there is.

These are inference caches: stored keys are detached. Rows of a batch may hold different lengths
(paged caches: continuous batching); attention evaluates masks and score modifiers at each row's
own positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv_handle import KVHandle
from .layers import LayerCache, atomic

__all__ = ["DirectLayerCache"]


def nbytes(*tensors: Tensor | None) -> int:
    """Bytes held by the given buffers (None: not allocated)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class DirectLayerCache(LayerCache):
    """Base of the caches read in place through a :class:`KVHandle`. Subclasses implement the
    storage: ``_store(k, v) -> lengths before the append`` and ``handle()``."""

    kind: str = "direct"

    def row_lengths(self) -> list[int]:
        """Tokens held by each row of the current batch."""
        raise NotImplementedError

    def _store(self, k: Tensor, v: Tensor) -> list[int]:
        raise NotImplementedError

    def handle(self) -> KVHandle:
        """What attention reads: the storage of the current batch rows, in place."""
        raise NotImplementedError

    def positions(self, length: int, device=None) -> Tensor:
        """Absolute positions ``(B, length)`` of the next ``length`` tokens of each row."""
        start = torch.tensor(self.row_lengths(), dtype=torch.long, device=device)
        return start[:, None] + torch.arange(length, device=device)

    def next_positions(self, length: int, device=None) -> Tensor:
        return self.positions(length, device)

    @atomic
    def update(self, k: Tensor, v: Tensor):
        """Append ``k, v (B, Hkv, Tnew, ·)`` and return ``(handle, handle, 0)`` for
        ``attention(q, handle, handle, ...)``; over an empty cache, ``(k, v, 0)`` themselves."""
        before = self._store(k.detach(), v.detach())  # an inference cache: stored keys carry no graph
        if not any(before):  # a prefill over an empty cache: the new keys are all there is (full precision)
            return k, v, 0
        h = self.handle()
        return h, h, 0
