"""Recurrent state for causal kernelized attention (``linear``, ``performer``): O(1) per token.

Causal linear attention is an RNN (Katharopoulos et al. 2020, §3.4): after ``t`` tokens the whole
past is two running sums per head::

    S_t = Σ_{j<=t} φ(k_j) v_jᵀ      (B, H, M, Dv)
    z_t = Σ_{j<=t} φ(k_j)           (B, H, M)
    out_t = φ(q_t)ᵀ S_t / φ(q_t)ᵀ z_t

so a decode step costs O(M · Dv) whatever the context length. Performer's ``exp`` features are
kept in range by a running ``log_scale`` (B, H): the stored sums are ``S · exp(-log_scale)``; when
new keys need a larger scale the old sums are multiplied down (as online softmax does with its
running max). The constant cancels between ``S`` and ``z``.

Usage::

    state = RecurrentState.create("performer", head_dim=64, options=PerformerOptions(projection=P))
    out = state.step(q_prompt, k_prompt, v_prompt)   # prefill: causal within the prompt
    out = state.step(q_new, k_new, v_new)            # decode: (B, Hq, 1, Dv) per token, O(1)
    state.seq_len                                    # tokens absorbed so far

``state.step`` over a sequence in pieces equals one causal forward of the backend over the whole
sequence (tested). A KV cache layer wraps this object; it is self-contained on purpose. GQA: K/V
heads are repeated to the query heads, so the sums are stored per query head. Reformer LSH has no
such state (its buckets depend on future keys): it cannot decode incrementally.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..._validate import positive_int
from .ops import causal_segment, normalize, with_ones

__all__ = ["RecurrentState"]


class RecurrentState:
    """Running sums ``S = Σ φ(k) vᵀ`` and ``z = Σ φ(k)`` of causal kernelized attention.

    Build with :meth:`create` (from a backend name and options); ``queries``/``keys`` are the
    feature maps of :mod:`attnkit.backends.kernelized.features`. ``chunk``/``segment`` only set how a
    multi-token step is blocked (see there); they do not change the result."""

    def __init__(
        self,
        queries: Callable[[Tensor], Tensor],
        keys: Callable[[Tensor, Tensor | None, Tensor | None], tuple[Tensor, Tensor | None]],
        *,
        chunk: int = 64,
        segment: int = 4096,
    ):
        self.queries = queries
        self.keys = keys
        self.chunk = chunk
        self.segment = max(segment, chunk)
        self.state: Tensor | None = None  # (B, H, M, Dv + 1): [S | z] · exp(-log_scale)
        self.log_scale: Tensor | None = None  # (B, H), None for features that need no scale
        self.seq_len = 0

    @property
    def kv(self) -> Tensor | None:
        """``S = Σ φ(k) vᵀ`` (B, H, M, Dv), times ``exp(-log_scale)``."""
        return None if self.state is None else self.state[..., :-1]

    @property
    def z(self) -> Tensor | None:
        """``z = Σ φ(k)`` (B, H, M), times ``exp(-log_scale)``."""
        return None if self.state is None else self.state[..., -1]

    @classmethod
    def create(cls, backend: str, head_dim: int, *, options=None, scale: float | None = None) -> RecurrentState:
        """An empty state for the named backend (``"linear"`` or ``"performer"``) and its options.

        ``scale`` is the attention scale (``None``: ``head_dim ** -0.5``), as in ``attention()``."""
        from ...registry import get_backend  # a name lookup: the registry never imports backends

        impl = get_backend(backend)
        feature_maps = impl.feature_maps
        if feature_maps is None:
            raise ValueError(f"backend: {backend!r} has no recurrent state; expected 'linear' or 'performer'. "
                             + impl.no_recurrent_reason)
        positive_int(head_dim, "head_dim")
        scale = head_dim**-0.5 if scale is None else float(scale)
        queries, keys, chunk, segment = feature_maps(options, head_dim, scale)
        return cls(queries, keys, chunk=chunk, segment=segment)

    # -- the recurrence --------------------------------------------------------------------------
    def _keys(self, k: Tensor, v: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        """Key features and ``[v, 1]`` for a segment, with the state brought to a common scale."""
        phi_k, log_scale = self.keys(k, keep, self.log_scale)  # log_scale >= the state's
        B, H, _, M = phi_k.shape
        if self.state is None:
            self.state = phi_k.new_zeros(B, H, M, v.shape[-1] + 1)
        elif log_scale is not None:  # online rescaling, as online softmax does with its running max
            self.state = self.state * torch.exp(self.log_scale - log_scale)[..., None, None]
        self.log_scale = log_scale
        v1 = with_ones(v)
        if keep is not None:  # masked keys add nothing (also to the normalizer)
            v1 = v1.masked_fill(~keep[..., None], 0.0)
        return phi_k, v1

    def absorb(self, k: Tensor, v: Tensor, keep: Tensor | None = None) -> None:
        """Add keys ``(B, H, T, D)`` and values ``(B, H, T, Dv)`` (float32/64) without queries;
        ``keep (B|1, H|1, T)`` drops masked keys."""
        for s in range(0, k.shape[2], self.segment):
            part = slice(s, s + self.segment)
            phi_k, v1 = self._keys(k[:, :, part], v[:, :, part], None if keep is None else keep[..., part])
            self.state = self.state + torch.matmul(phi_k.transpose(-2, -1), v1)
        self.seq_len += k.shape[2]

    def read(self, q: Tensor) -> Tensor:
        """Attention of queries ``(B, H, T, D)`` over every absorbed key (non-causal read)."""
        if self.state is None:
            raise ValueError("state: empty; absorb keys (or step) before reading it.")
        outs = [normalize(torch.matmul(self.queries(q[:, :, s : s + self.segment]), self.state))
                for s in range(0, q.shape[2], self.segment)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def step_features(self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
        """Causal attention of ``T`` new tokens (query ``i`` sees the state and new keys ``<= i``),
        then absorb the keys. Inputs ``(B, H, T, ·)`` in the accumulation dtype, heads matched."""
        outs = []
        for s in range(0, q.shape[2], self.segment):
            part = slice(s, s + self.segment)
            phi_k, v1 = self._keys(k[:, :, part], v[:, :, part], None if keep is None else keep[..., part])
            out, total = causal_segment(self.queries(q[:, :, part]), phi_k, v1, self.state, self.chunk)
            self.state = self.state + total
            outs.append(normalize(out))
        self.seq_len += q.shape[2]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def step(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attend ``T`` new tokens causally over everything seen, and absorb their keys.

        ``q (B, Hq, T, D)``, ``k (B, Hkv, T, D)``, ``v (B, Hkv, T, Dv)``; returns ``(B, Hq, T, Dv)``
        in q's dtype. Equals the backend's ``Causal()`` forward over the whole sequence."""
        if not all(isinstance(x, Tensor) and x.dim() == 4 for x in (q, k, v)):
            raise ValueError("q, k, v: expected 4-D tensors (B, H, T, D); got " + ", ".join(
                str(tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__ for x in (q, k, v)))
        if q.shape[2] != k.shape[2] or k.shape[:3] != v.shape[:3] or q.shape[1] % k.shape[1]:
            raise ValueError(
                f"q, k, v: expected q (B, Hq, T, D), k (B, Hkv, T, D), v (B, Hkv, T, Dv) with one T and "
                f"Hq % Hkv == 0, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
            )
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.state is not None and (self.state.shape[:2] != q.shape[:2] or self.state.shape[-1] != v.shape[-1] + 1):
            raise ValueError(
                f"q, v: this state holds (B, H, Dv) = {tuple(self.state.shape[:2]) + (self.state.shape[-1] - 1,)}, "
                f"got q {tuple(q.shape)} and v {tuple(v.shape)}. Fix: use one state per layer and batch."
            )
        acc = torch.promote_types(q.dtype, torch.float32)
        return self.step_features(q.to(acc), k.to(acc), v.to(acc)).to(q.dtype)

    def reset(self) -> None:
        """Forget everything (a new sequence)."""
        self.state = self.log_scale = None
        self.seq_len = 0
