"""int8 KV caches: per-token, per-head symmetric quantization, read by the decode kernel.

Each key (and value) vector ``x`` of one token and one head is stored as ``round(x / s)`` in int8
with its own float32 scale ``s = max|x| / 127``, so the error of every element is at most
``s / 2 = max|x| / 254`` (0.4% of that vector's largest entry) and the cache holds
``D + 4`` bytes per token and head instead of ``4 D`` (float32) or ``2 D`` (bf16).

``update`` returns a :class:`~attnkit.kv_handle.KVHandle` (format ``"int8"``); the decode kernel
reads the int8 values segment by segment and folds the scales into the scores and the
probabilities (:mod:`attnkit.backends.decode`); no full-precision copy of the cache is made.
Other backends read the handle's dequantized copy. The first call over an empty cache (the
prefill) attends its own keys in full precision; every later token reads the int8 cache (the
error is measured on real weights in the tests:
``tests/test_quantized_cache.py``).

:class:`QuantizedLayerCache` is the static (``max_len``: preallocated, written in place) or
dynamic (capacity doubling) contiguous variant; the paged cache quantizes its pages the same way
(:class:`~attnkit.cache.paged.PagedKVCache` with ``quantize="int8"``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv_handle import KVHandle, dequantize_int8
from .direct import DirectLayerCache, nbytes
from .layers import _check_kv, all_finite

__all__ = ["quantize_int8", "dequantize_int8", "QuantizedLayerCache", "QUANTIZE_KINDS"]

QUANTIZE_KINDS = ("int8",)


def check_quantize(quantize) -> str | None:
    if quantize is not None and quantize not in QUANTIZE_KINDS:
        raise ValueError(f"quantize: expected None (full precision) or one of {QUANTIZE_KINDS}, got {quantize!r}.")
    return quantize


def quantize_int8(x: Tensor, finite: bool = True) -> tuple[Tensor, Tensor]:
    """``x (..., D)`` float -> ``(values (..., D) int8, scales (...) float32)`` with
    ``x ≈ values * scales[..., None]`` (symmetric, one scale per vector; an all-zero vector gets scale 1).
    A vector holding NaN or Inf (``finite=False`` says there may be one) is stored as zeros with
    scale NaN: it reads back as NaN (int8 has no Inf). Zero-width vectors (``D = 0``: a latent
    cache's values, which alias its keys) get scale 1."""
    if x.shape[-1] == 0:
        return torch.empty(x.shape, dtype=torch.int8, device=x.device), torch.ones(x.shape[:-1], device=x.device)
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if not finite:
        bad = ~torch.isfinite(xf).all(-1)
        scale = scale.masked_fill(bad, 1.0)
        xf = xf.masked_fill(bad.unsqueeze(-1), 0.0)
    values = torch.round(xf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    if not finite:
        scale = scale.masked_fill(bad, float("nan"))
    return values, scale


class QuantizedLayerCache(DirectLayerCache):
    """Contiguous int8 cache of one layer: ``(B, Hkv, capacity, D)`` int8 plus ``(B, Hkv, capacity)``
    float32 scales, for K and for V. With ``max_len`` the buffers are preallocated once (static);
    without, the capacity doubles as needed (dynamic). ``update`` returns a
    :class:`~attnkit.kv_handle.KVHandle` of format ``"int8"``."""

    def __init__(self, max_len: int | None = None) -> None:
        super().__init__()
        if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1):
            raise ValueError(f"max_len: expected a positive int or None (grow as needed), got {max_len!r}.")
        self.max_len = max_len
        self.kind = "static int8" if max_len else "dynamic int8"
        self.k = self.v = self.k_scale = self.v_scale = None
        self.dtype: torch.dtype | None = None  # dtype of the keys given to update/attend

    def row_lengths(self) -> list[int]:
        B = 0 if self.k is None else self.k.shape[0]
        return [self.seq_len] * B

    def positions(self, length, device=None):
        return torch.arange(self.seq_len, self.seq_len + length, device=device)

    def _allocate(self, k: Tensor, v: Tensor, capacity: int) -> None:
        B, H = k.shape[:2]
        new = lambda D, dt: torch.zeros(B, H, capacity, *D, dtype=dt, device=k.device)  # noqa: E731
        buffers = (new((k.shape[3],), torch.int8), new((v.shape[3],), torch.int8), new((), torch.float32),
                   new((), torch.float32))
        if self.k is not None:  # grow: keep what is stored
            for old, buf in zip((self.k, self.v, self.k_scale, self.v_scale), buffers):
                buf[:, :, : self.seq_len].copy_(old[:, :, : self.seq_len])
        self.k, self.v, self.k_scale, self.v_scale = buffers

    def _store(self, k, v):
        _check_kv(k, v)
        if self.k is None:
            self.dtype = k.dtype
            self._allocate(k, v, self.max_len or max(16, k.shape[2]))
        else:
            held = (self.k.shape[0], self.k.shape[1], self.k.shape[3], self.v.shape[3])
            got = (k.shape[0], k.shape[1], k.shape[3], v.shape[3])
            if got != held or k.dtype != self.dtype or v.dtype != self.dtype:
                raise ValueError(
                    f"k, v: this cache holds (B, Hkv, D, Dv) = {held} from {self.dtype} keys, got {got} in "
                    f"{k.dtype}/{v.dtype}. Fix: one cache per model and batch; reset() it for a new batch."
                )
        start, stop = self.seq_len, self.seq_len + k.shape[2]
        if stop > self.k.shape[2]:
            if self.max_len is not None:
                raise ValueError(
                    f"QuantizedLayerCache: {stop} tokens exceed max_len={self.max_len} (holding {start}, adding "
                    f"{k.shape[2]}). Fix: build the cache with max_len >= prompt length + max_new_tokens."
                )
            self._allocate(k, v, max(stop, 2 * self.k.shape[2]))
        finite = all_finite(k, v)
        self.finite = self.finite and finite
        kq, ks = quantize_int8(k, finite)
        vq, vs = quantize_int8(v, finite)
        self.k[:, :, start:stop], self.k_scale[:, :, start:stop] = kq, ks
        self.v[:, :, start:stop], self.v_scale[:, :, start:stop] = vq, vs
        self.seq_len = stop
        return [start] * k.shape[0]

    def handle(self) -> KVHandle:
        n = self.seq_len
        return KVHandle("int8", self.k[:, :, :n], self.v[:, :, :n], (n,) * self.k.shape[0], self.dtype, self.finite,
                        self.k_scale[:, :, :n], self.v_scale[:, :, :n])

    def memory_bytes(self) -> int:
        """Bytes held by the buffers (int8 values and float32 scales)."""
        return nbytes(self.k, self.v, self.k_scale, self.v_scale)

    def reset(self):
        super().reset()
        self.k = self.v = self.k_scale = self.v_scale = None
        self.dtype = None

    def crop(self, length):
        self._check_crop(length)
        self.seq_len = length  # stale slots beyond seq_len are never read

    def reorder(self, index):
        super().reorder(index)
        self._select_rows(index, ("k", "v", "k_scale", "v_scale"))
