"""The body shared by the kernelized backends (``linear``, ``performer``): masks and the forward.

Both directions run through a :class:`~attnkit.backends.kernelized.state.RecurrentState`,
``segment`` tokens at a time (bounding temporaries to ``segment · M`` per head). Non-causal: absorb
every key, then read the state with every query, O(T · M · Dv). Causal: the chunked prefix sums of
:mod:`.ops`, on top of a state holding the keys before the first query (offsets, decoding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...inputs import AttentionInputs
from ...masks import Mask, MaskSupport
from ...registry import Backend
from .features import FeatureFn, KeyFeatureFn
from .state import RecurrentState

# -- masks ----------------------------------------------------------------------------------------
def split_mask(mask: Mask | None) -> tuple[bool, list[Mask]]:
    """``(causal, key_masks)`` of a mask that ``MaskSupport("none", "per_key")`` accepts: whether a
    causal conjunct is present, and the query-independent conjuncts (one keep per key)."""
    parts = () if mask is None else mask.conjuncts()
    return any(p.is_causal() for p in parts), [p for p in parts if not p.is_causal()]


def key_keep(inp: AttentionInputs, key_masks: list[Mask]) -> Tensor | None:
    """Per-key keep ``(B|1, H|1, Tk)`` from the per-key masks, or None."""
    keep = None
    for m in key_masks:
        part = m.materialize(1, inp.Tk, q_offset=inp.kv_offset, kv_offset=inp.kv_offset, device=inp.device,
                             batch_size=inp.B, num_heads=inp.Hq)[:, :, 0]
        keep = part if keep is None else keep & part
    return keep


def kernel_attention(
    inp: AttentionInputs,
    queries: FeatureFn,
    keys: KeyFeatureFn,
    *,
    chunk: int,
    segment: int,
) -> Tensor:
    """Run kernelized attention for validated inputs: the body of ``linear`` and ``performer``.

    Features and sums are in float32 (float64 for float64 inputs); the output is cast back."""
    acc = torch.promote_types(inp.dtype, torch.float32)
    causal, key_masks = split_mask(inp.mask)
    k, v = inp.expand_kv()  # (B, Hq, Tk, D), (B, Hq, Tk, Dv)
    keep = key_keep(inp, key_masks)
    q, k, v = inp.q.to(acc), k.to(acc), v.to(acc)
    if keep is not None:  # masked keys: zero features and zero values (NaN there cannot leak)
        v = v.masked_fill(~keep[..., None], 0.0)
        k = k.masked_fill(~keep[..., None], 0.0)
    state = RecurrentState(queries, keys, chunk=chunk, segment=segment)
    if not causal:  # O(T · M · Dv): sum every key into the state, then read it with each query
        state.absorb(k, v, keep)
        return state.read(q).to(inp.dtype)

    # Causal with offsets: query i sits at position q_offset + i and sees keys at positions <= it.
    # Keys before the first query form the initial state; the rest are aligned with the queries.
    p = inp.q_offset - inp.kv_offset  # key index aligned with query 0
    if p > 0:
        state.absorb(k[:, :, :p], v[:, :, :p], None if keep is None else keep[..., :p])
    lo, hi = max(p, 0), max(min(p + inp.Tq, inp.Tk), max(p, 0))
    k_al, v_al = k[:, :, lo:hi], v[:, :, lo:hi]
    keep_al = None if keep is None else keep[..., lo:hi]
    left = min(max(-p, 0), inp.Tq)  # queries before every key: left-pad keys with masked ones
    right = inp.Tq - left - k_al.shape[2]
    if left or right:
        k_al, v_al = F.pad(k_al, (0, 0, left, right)), F.pad(v_al, (0, 0, left, right))
        kk = torch.ones(*k_al.shape[:2], hi - lo, dtype=torch.bool, device=k.device) if keep_al is None else keep_al
        keep_al = F.pad(kk.expand(*k_al.shape[:2], -1), (left, right), value=False)
    return state.step_features(q, k_al, v_al, keep_al).to(inp.dtype)


class KernelizedBackend(Backend):
    """Base of ``linear`` and ``performer``: approximate, causal/per-key masks, and a forward
    through :func:`kernel_attention` with the subclass's :meth:`feature_maps`."""

    exact = False
    #: The prefix sums cannot skip arbitrary (query, key) pairs: only causality and per-key masks.
    mask_support = MaskSupport("none", "per_key")

    @classmethod
    def feature_maps(cls, options, head_dim: int, scale: float,
                     device=None) -> tuple[FeatureFn, KeyFeatureFn, int, int]:
        """``(queries, keys, chunk, segment)``, also for
        :class:`~attnkit.backends.kernelized.state.RecurrentState`."""
        raise NotImplementedError

    @classmethod
    def forward(cls, inp: AttentionInputs, options):
        queries, keys, chunk, segment = cls.feature_maps(options, inp.D, inp.scale, inp.device)
        return kernel_attention(inp, queries, keys, chunk=chunk, segment=segment)
