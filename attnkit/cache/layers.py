"""Contiguous layer caches for autoregressive decoding.

A :class:`~attnkit.cache.KVCache` holds one layer cache per layer. A layer cache's ``update(k, v)`` appends new
keys/values ``(B, Hkv, Tnew, D)`` and returns ``(k_all, v_all, kv_offset)``: every key the new
queries may need, in chronological order, the first at absolute position ``kv_offset``. Attention
layers read ``q_offset = cache.seq_len`` *before* ``update``, apply positions (RoPE) there, and call
``attention(q, k_all, v_all, mask=..., q_offset=q_offset, kv_offset=kv_offset)``. The masks are
defined over absolute positions, so one ``Causal()`` makes decoding equal a full forward::

    cache = KVCache.static(num_layers=12, max_len=1024)
    logits = model(prompt, cache=cache)           # prefill: positions 0..P-1
    logits = model(next_token, cache=cache)       # decode:  position P, q_offset = P

Lengths are explicit counters (``seq_len``), never inferred from data. K/V heads are stored
unrepeated (GQA).

Layer caches:

* :class:`DynamicLayerCache` — grows by concatenation; any batch/length.
* :class:`StaticLayerCache` — preallocated ``(B, Hkv, max_len, D)`` buffers written in place;
  no reallocation while decoding (fastest on CPU; see benchmarks/bench_decode.py).
* :class:`SlidingWindowLayerCache` — a ring buffer of the last ``window`` keys, each slot tagged
  with its absolute position (:meth:`~SlidingWindowLayerCache.positions`). ``update`` returns the
  retained keys in chronological order (one ``cat`` that also unrolls the ring), so they are
  contiguous positions ``seq_len - window .. seq_len + Tnew - 1`` and any positional mask with
  offsets is right. Exact for masks that never look further back than ``window``
  (``SlidingWindow(left<=window, 0)``); per-token cost is flat in the context length.
* :class:`StateCache` — the hook for recurrent (linear-attention) layers: it holds a state object
  with ``step(q, k, v) -> out``, ``seq_len`` and ``reset()`` (e.g. ``attnkit.RecurrentState``, or
  ``attnkit.GatedLinearState``, whose ``step`` also takes the gates ``g=``, ``beta=``) instead of
  keys and values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from .._validate import positive_int, finite_only

__all__ = [
    "BaseLayerCache",
    "LayerCache",
    "DynamicLayerCache",
    "StaticLayerCache",
    "SlidingWindowLayerCache",
    "StateCache",
]


def _check_kv(k: Tensor, v: Tensor) -> None:
    if not isinstance(k, Tensor) or not isinstance(v, Tensor) or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "k, v: expected tensors (B, Hkv, Tnew, D) and (B, Hkv, Tnew, Dv), got "
            f"{getattr(k, 'shape', type(k).__name__)} and {getattr(v, 'shape', type(v).__name__)}."
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k, v: expected matching (B, Hkv, Tnew), got k {tuple(k.shape)} and v {tuple(v.shape)}.")


def _check_same_layout(held_k: Tensor, held_v: Tensor, k: Tensor, v: Tensor) -> None:
    """New keys must match what the cache holds: batch, heads, D, Dv, dtype and device; the refusal
    names only what differs, and the fix for that."""
    parts = [  # (what, held, got, fix)
        ("batch size", held_k.shape[0], k.shape[0], "use one cache per batch; reset() it for a new batch"),
        ("key/value heads (Hkv)", held_k.shape[1], k.shape[1], "use one cache per model"),
        ("head_dim of k (D)", held_k.shape[3], k.shape[3], "use one cache per model"),
        ("head_dim of v (Dv)", held_v.shape[3], v.shape[3], "use one cache per model"),
        ("dtype", (held_k.dtype, held_v.dtype), (k.dtype, v.dtype),
         "the model was cast (model.to(dtype)) after this cache was filled: reset() the cache, or make a new "
         "one, after changing the model's dtype"),
        ("device", held_k.device, k.device,
         "the model moved after this cache was filled: reset() the cache, or make a new one, after moving it"),
    ]
    wrong = [(what, held, got, fix) for what, held, got, fix in parts if held != got]
    if wrong:
        said = "; ".join(f"{what} {_plain(held)} held, {_plain(got)} given" for what, held, got, _ in wrong)
        fixes = "; ".join(dict.fromkeys(fix for *_, fix in wrong))
        raise ValueError(f"k, v: they do not match what this cache holds: {said}. Fix: {fixes}.")


def _plain(value) -> str:
    """A (k, v) pair that agrees as one value: ``torch.float32``, not ``(torch.float32, torch.float32)``."""
    if isinstance(value, tuple) and len(set(value)) == 1:
        value = value[0]
    return str(value)


def _check_index(index: Tensor, batch_size: int | None) -> Tensor:
    if not isinstance(index, Tensor) or index.dim() != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
        raise TypeError(f"index: expected a 1-D integer tensor of batch rows, got {getattr(index, 'dtype', index)!r}.")
    if batch_size is not None and index.numel() and (int(index.min()) < 0 or int(index.max()) >= batch_size):
        raise ValueError(f"index: rows must lie in [0, {batch_size}), got {index.tolist()}.")
    return index


def all_finite(k: Tensor, v: Tensor) -> bool:
    """Whether the new tokens are finite: one scan of each over them only (never the whole cache),
    :func:`~attnkit._validate.finite_only`."""
    return finite_only(k) and finite_only(v)


def atomic(update):
    """A layer's ``update`` as one step of an all-or-nothing model update: when it raises, the
    layers of the same :class:`~attnkit.cache.KVCache` that already appended this step's tokens
    are rolled back to this layer's length, so every layer keeps the same tokens."""

    @functools.wraps(update)
    def wrapper(self, k, v):
        try:
            return update(self, k, v)
        except Exception:
            self.rollback_siblings()
            raise

    return wrapper


class BaseLayerCache:
    """What every layer's cache has, whether it keeps keys (:class:`LayerCache`) or a recurrent state
    (:class:`StateCache`). ``seq_len`` counts the tokens seen so far (= the absolute position of the
    next token). ``cross_kv`` memoizes a cross-attention layer's projected memory ``(k, v)`` (filled
    on the first decode step; reordered and reset with the rest). ``siblings`` are the layer caches of
    the same :class:`~attnkit.cache.KVCache` (set by it)."""

    seq_len: int = 0  # an attribute here; a cache whose rows hold different lengths computes it

    def __init__(self) -> None:
        self.cross_kv: tuple[Tensor, Tensor] | None = None
        self.finite = True
        self.siblings: list[BaseLayerCache] = [self]

    def next_positions(self, length: int, device=None) -> Tensor:
        """Absolute positions of the next ``length`` tokens: ``(length,)`` (``(B, length)`` for
        caches whose rows hold different lengths)."""
        return torch.arange(self.seq_len, self.seq_len + length, device=device)

    def rollback_siblings(self) -> None:
        """Crop every sibling that holds more tokens than this layer back to this layer's length."""
        for layer in self.siblings:
            if layer is not self and layer.seq_len > self.seq_len:
                try:
                    layer.crop(self.seq_len)
                except (TypeError, ValueError):  # a ring or recurrent state cannot go back
                    pass

    def reset(self) -> None:
        """Forget everything (start a new sequence)."""
        self.seq_len = 0
        self.cross_kv = None
        self.finite = True

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens (e.g. to reject speculative tokens)."""
        raise NotImplementedError

    def reorder(self, index: Tensor) -> None:
        """Select batch rows ``index`` (beam search): row ``i`` becomes old row ``index[i]``."""
        if self.cross_kv is not None:
            self.cross_kv = tuple(t.index_select(0, index.to(t.device)) for t in self.cross_kv)

    def _check_crop(self, length: int) -> None:
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self.seq_len:
            raise ValueError(f"length: expected an int in [0, seq_len={self.seq_len}], got {length!r}.")


class LayerCache(BaseLayerCache):
    """Base class: one layer's cache of keys and values (:meth:`update` appends and returns them).

    ``finite`` is True while every token written since the last reset was finite (each update
    checks only its new tokens); attention is told so (``kv_finite=``) and skips its NaN/Inf scan."""

    def note_written(self, k: Tensor, v: Tensor) -> None:
        """Record whether the tokens just written are finite."""
        if self.finite and not all_finite(k, v):
            self.finite = False

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """Append ``k (B, Hkv, Tnew, D)``, ``v (B, Hkv, Tnew, Dv)``; return ``(k_all, v_all, kv_offset)``."""
        raise NotImplementedError

    def update_packed(self, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Append packed sequences ``k, v (total, Hkv, D)`` split by ``cu_seqlens``, one per selected row;
        return all of each row's keys packed, and their offsets. Only a paged cache takes them."""
        raise TypeError(f"cache: packed sequences (cu_seqlens) are written into a paged cache (PagedKVCache), got "
                        f"{type(self).__name__}. Fix: model.make_cache('paged', ...).")

    def _select_rows(self, index: Tensor, names: tuple[str, ...] = ("k", "v")) -> None:
        """Replace the buffers ``names`` (when allocated) by their batch rows ``index``."""
        if getattr(self, "k", None) is not None:
            index = _check_index(index, self.k.shape[0]).to(self.k.device)
            for name in names:
                setattr(self, name, getattr(self, name).index_select(0, index))


class DynamicLayerCache(LayerCache):
    """Keys and values concatenated along the length axis as they arrive."""

    def __init__(self) -> None:
        super().__init__()
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    @atomic
    def update(self, k, v):
        _check_kv(k, v)
        if self.k is None:
            self.k, self.v = k, v
        else:
            _check_same_layout(self.k, self.v, k, v)
            self.k = torch.cat([self.k, k], dim=2)  # (B, Hkv, L + Tnew, D)
            self.v = torch.cat([self.v, v], dim=2)
        self.note_written(k, v)
        self.seq_len += k.shape[2]
        return self.k, self.v, 0

    def reset(self):
        super().reset()
        self.k = self.v = None

    def crop(self, length):
        self._check_crop(length)
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]
        self.seq_len = length

    def reorder(self, index):
        super().reorder(index)
        self._select_rows(index)


class StaticLayerCache(LayerCache):
    """Preallocated ``(B, Hkv, max_len, D)`` buffers, written in place.

    The buffers are allocated on the first ``update`` (from its batch, heads, dims, dtype and
    device) or by :meth:`allocate`. ``update`` returns views of the filled prefix, so decoding
    allocates no new K/V memory."""

    def __init__(self, max_len: int) -> None:
        super().__init__()
        positive_int(max_len, "max_len", owner="StaticLayerCache", fix="pass the tokens the cache can hold")
        self.max_len = max_len
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def allocate(self, batch_size: int, num_kv_heads: int, head_dim: int, value_dim: int | None = None, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        """Allocate the buffers now (otherwise the first ``update`` does)."""
        shape = (batch_size, num_kv_heads, self.max_len)
        self.k = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(*shape, head_dim if value_dim is None else value_dim, dtype=dtype, device=device)

    @atomic
    def update(self, k, v):
        _check_kv(k, v)
        if self.k is None:
            self.allocate(k.shape[0], k.shape[1], k.shape[3], v.shape[3], dtype=k.dtype, device=k.device)
        else:
            _check_same_layout(self.k, self.v, k, v)
        start, stop = self.seq_len, self.seq_len + k.shape[2]
        if stop > self.max_len:
            raise ValueError(
                f"StaticLayerCache: {stop} tokens exceed max_len={self.max_len} (holding {start}, adding "
                f"{k.shape[2]}). Fix: build the cache with max_len >= prompt length + max_new_tokens."
            )
        self.k[:, :, start:stop].copy_(k)  # in place: no reallocation while decoding
        self.v[:, :, start:stop].copy_(v)
        self.note_written(k, v)
        self.seq_len = stop
        return self.k[:, :, :stop], self.v[:, :, :stop], 0

    def crop(self, length):
        self._check_crop(length)
        self.seq_len = length  # stale slots beyond seq_len are never returned

    def reorder(self, index):
        super().reorder(index)
        if self.k is not None:
            index = _check_index(index, self.k.shape[0]).to(self.k.device)
            if index.numel() != self.k.shape[0]:
                raise ValueError(
                    f"index: a static cache keeps its batch size {self.k.shape[0]}, got {index.numel()} rows."
                )
            self.k.copy_(self.k.index_select(0, index))
            self.v.copy_(self.v.index_select(0, index))


class SlidingWindowLayerCache(LayerCache):
    """Ring buffer of the last ``window`` keys/values; slot ``p % window`` holds position ``p``.

    ``update`` returns the retained keys followed by the new ones in chronological order, i.e. the
    contiguous positions ``max(0, seq_len - window) .. seq_len + Tnew - 1``, with that first
    position as ``kv_offset``. A query at position ``p`` under ``SlidingWindow(left, 0)`` needs
    keys ``p - left .. p``; with ``left <= window`` all of them are returned, so decoding equals the
    full forward. Memory and per-token cost do not grow with the context."""

    def __init__(self, window: int) -> None:
        super().__init__()
        positive_int(window, "window", owner="SlidingWindowLayerCache", fix="pass the past keys to keep")
        self.window = window
        self.k: Tensor | None = None  # (B, Hkv, window, D), slot order
        self.v: Tensor | None = None
        self._positions: Tensor | None = None  # (window,) absolute position per slot, -1 = empty

    def positions(self) -> Tensor:
        """Absolute position held by each ring slot ``(window,)``; ``-1`` marks an empty slot."""
        if self._positions is None:
            return torch.full((self.window,), -1, dtype=torch.long)
        return self._positions.clone()

    def _retained(self) -> tuple[Tensor, Tensor] | None:
        """The retained keys/values in chronological order (views or one copy), or None."""
        L, W = self.seq_len, self.window
        if self.k is None or L == 0:
            return None
        if L <= W:  # not wrapped yet: slots 0..L-1 hold positions 0..L-1
            return self.k[:, :, :L], self.v[:, :, :L]
        s = L % W  # the oldest retained position sits in slot s
        return (torch.cat([self.k[:, :, s:], self.k[:, :, :s]], dim=2),
                torch.cat([self.v[:, :, s:], self.v[:, :, :s]], dim=2))

    def update(self, k, v):  # a ring cannot roll back: every layer refuses the same bad input first
        _check_kv(k, v)
        W, L, T = self.window, self.seq_len, k.shape[2]
        if self.k is None:
            B, H = k.shape[:2]
            self.k = k.new_zeros(B, H, W, k.shape[3])
            self.v = v.new_zeros(B, H, W, v.shape[3])
            self._positions = torch.full((W,), -1, dtype=torch.long, device=k.device)
        else:
            _check_same_layout(self.k, self.v, k, v)
        old = self._retained()
        kv_offset = max(0, L - W)
        if old is None:
            k_all, v_all = k, v
        else:
            # One cat unrolls the ring and appends the new keys (the unrolled ring is a copy when wrapped).
            k_all, v_all = torch.cat([old[0], k], dim=2), torch.cat([old[1], v], dim=2)
        n = min(T, W)  # only the last `window` new tokens stay
        new_positions = torch.arange(L + T - n, L + T, device=k.device)
        slots = new_positions % W
        self.k.index_copy_(2, slots, k[:, :, T - n :])
        self.v.index_copy_(2, slots, v[:, :, T - n :])
        self._positions.index_copy_(0, slots, new_positions)
        self.note_written(k, v)
        self.seq_len = L + T
        return k_all, v_all, kv_offset

    def reset(self):
        super().reset()
        self.k = self.v = self._positions = None

    def crop(self, length):
        self._check_crop(length)
        if length != self.seq_len:
            raise ValueError(
                f"SlidingWindowLayerCache cannot crop from {self.seq_len} to {length} tokens: the keys before "
                f"position {self.seq_len - self.window} were overwritten. Fix: use a dynamic or static cache."
            )

    def reorder(self, index):
        super().reorder(index)
        self._select_rows(index)


class StateCache(BaseLayerCache):
    """Hook for recurrent (linear-attention) layers: holds a state object instead of keys/values.

    ``make_state()`` builds the state; it must provide ``step(q, k, v) -> out`` (causal attention
    of the new tokens over everything seen, then absorb them), ``seq_len`` and ``reset()`` —
    ``attnkit.RecurrentState`` does. ``MultiHeadAttention`` given a ``StateCache`` calls
    :meth:`step` instead of ``attention()``. Per-token cost is O(1) in the context length.
    ``reorder`` selects batch rows of every tensor attribute of the state (batch is dim 0)."""

    def __init__(self, make_state: Callable[[], object]) -> None:
        super().__init__()
        if not callable(make_state):
            raise TypeError(f"make_state: expected a callable returning a state, got {type(make_state).__name__}.")
        self.make_state = make_state
        self.state = make_state()
        for name in ("step", "reset"):
            if not callable(getattr(self.state, name, None)):
                raise TypeError(
                    f"make_state(): the state must have a {name}() method, got {type(self.state).__name__}."
                )

    @classmethod
    def recurrent(cls, backend: str, head_dim: int, *, options=None, scale: float | None = None) -> StateCache:
        """A cache over ``attnkit.RecurrentState.create(backend, head_dim, ...)``."""
        from ..backends.kernelized import RecurrentState

        if backend == "auto":  # a softmax model: RecurrentState would only say 'auto' is no backend name
            raise ValueError(
                "backend: a recurrent cache needs a linear-attention model (backend 'linear' or 'performer'); this "
                "model uses 'auto', softmax attention, which must keep its keys. Fix: use a static, dynamic or "
                "paged cache (generate(..., cache='static'))."
            )
        return cls(lambda: RecurrentState.create(backend, head_dim, options=options, scale=scale))

    def step(self, q: Tensor, k: Tensor, v: Tensor, **gates: Tensor) -> Tensor:
        """``state.step(q, k, v, **gates)``; ``gates`` (e.g. ``g=``, ``beta=``) are for gated states."""
        out = self.state.step(q, k, v, **gates)
        self.seq_len += q.shape[2]
        return out

    def reset(self):
        super().reset()
        self.state.reset()

    def crop(self, length):
        self._check_crop(length)
        if length != self.seq_len:
            raise ValueError(
                "StateCache cannot crop: a recurrent state cannot forget tokens. Fix: reset() and re-feed."
            )

    def reorder(self, index):
        super().reorder(index)
        for name, value in vars(self.state).items():
            if isinstance(value, Tensor) and value.dim() > 0:
                setattr(self.state, name, value.index_select(0, index.to(value.device)))
