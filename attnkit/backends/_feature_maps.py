"""Kernelized attention shared by ``linear`` and ``performer``: feature maps and prefix sums.

Both backends compute ``out_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i`` with ``S_i = Σ_j φ(k_j) v_jᵀ`` and
``z_i = Σ_j φ(k_j)`` over the keys ``j`` that query ``i`` may see — the naive twin is the quadratic
form ``A = φ(Q) φ(K)ᵀ`` masked, row-normalized, times ``V`` (:func:`quadratic_attention`).

Key features may carry a *log-scale*: the stored sums are ``Σ φ(k) · exp(-log_scale)`` so that
Performer's ``exp(·)`` features never overflow. A constant factor over the keys a query sees
cancels between numerator and denominator, so rescaling is exact (up to rounding).

Both directions run through a :class:`~attnkit.recurrent.RecurrentState`, ``segment`` tokens at a
time (bounding temporaries to ``segment · M`` per head). Non-causal: absorb every key, then read
the state with every query, O(T · M · Dv). Causal never materializes an ``(n, M, Dv)`` tensor:
inside a segment, chunks of ``chunk`` tokens use the quadratic form against themselves and an
exclusive prefix sum of per-chunk states ``(segment / chunk, M, Dv)`` for the earlier chunks.
Values carry a column of ones (``[v, 1]``) so one matmul yields numerator and normalizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..inputs import AttentionInputs
from ..masks import Mask, MaskSupport
from ..registry import Backend

#: ``queries(q (B, H, T, D)) -> (B, H, T, M)`` (any positive per-row factor is allowed: it cancels).
FeatureFn = Callable[[Tensor], Tensor]
#: ``keys(k (B, H, T, D), keep (B|1, H|1, T) | None, floor (B, H) | None)
#: -> (features (B, H, T, M), log_scale (B, H) | None)``: the true features are
#: ``features · exp(log_scale)`` with ``log_scale >= floor``; masked keys get features 0 and do
#: not take part in choosing ``log_scale``.
KeyFeatureFn = Callable[[Tensor, Tensor | None, Tensor | None], tuple[Tensor, Tensor | None]]


# -- feature maps ---------------------------------------------------------------------------------
def elu_features(x: Tensor) -> Tensor:
    """φ(x) = elu(x) + 1 (Katharopoulos et al. 2020): positive, so every normalizer is > 0."""
    return F.elu(x).add_(1.0)  # in place is safe: elu saves its input for backward, not its output


def elu_key_features(x: Tensor, keep: Tensor | None, floor: Tensor | None = None) -> tuple[Tensor, None]:
    phi = elu_features(x)
    return (phi if keep is None else phi.masked_fill(~keep[..., None], 0.0)), None


def favor_logits(x: Tensor, projection: Tensor, scale: float) -> Tensor:
    """``wᵀx' - |x'|²/2`` with ``x' = x · scale^½`` for each random feature ``w`` (rows of
    ``projection``), so that ``E[exp(logit(q)) exp(logit(k))] = exp(scale · qᵀk)``."""
    x = x * math.sqrt(scale)
    return torch.matmul(x, projection.transpose(-2, -1).to(x.dtype)) - 0.5 * (x * x).sum(-1, keepdim=True)  # (B, H, T, M)


def favor_query_features(x: Tensor, projection: Tensor, scale: float) -> Tensor:
    """Positive random features of queries up to a per-row factor (which cancels in the
    normalization): ``exp(Wx' - max)``; ``-|x'|²/2`` and ``1/√M`` are per-row constants too."""
    raw = torch.matmul(x, (projection * math.sqrt(scale)).transpose(-2, -1).to(x.dtype))  # (B, H, T, M)
    # In place is safe: matmul saves its inputs, exp its output (nothing modifies it afterwards).
    return raw.sub_(raw.detach().amax(-1, keepdim=True)).exp_()


def favor_key_features(
    x: Tensor, keep: Tensor | None, projection: Tensor, scale: float, floor: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Positive random features of keys divided by ``exp(log_scale)`` (and by the constant ``√M``),
    ``log_scale (B, H)`` the max over the kept keys and features and ``floor`` (one constant per
    head: it cancels)."""
    raw = torch.matmul(x, (projection * math.sqrt(scale)).transpose(-2, -1).to(x.dtype))  # (B, H, T, M)
    raw = raw.sub_(0.5 * scale * (x * x).sum(-1, keepdim=True))  # logits wᵀx' - |x'|²/2
    if keep is not None:
        raw = raw.masked_fill(~keep[..., None], float("-inf"))
    log_scale = raw.detach().amax(dim=(-2, -1))  # (B, H); -inf when every key is masked
    if floor is not None:
        log_scale = torch.maximum(log_scale, floor)
    log_scale = log_scale.masked_fill(torch.isinf(log_scale), 0.0)
    return raw.sub_(log_scale[..., None, None]).exp_(), log_scale


def safe_divide(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` for kernel sums ``den >= 0``. Rows with ``den = 0`` (nothing visible) give 0;
    ``den`` is floored at ``sqrt(tiny)`` (1e-19 in float32) so a row whose features underflowed
    (extreme norms in Performer) stays finite, in the output and in its gradient."""
    return num / den.clamp_min(torch.finfo(den.dtype).tiny ** 0.5)


# -- the quadratic twin ---------------------------------------------------------------------------
def quadratic_attention(phi_q: Tensor, phi_k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
    """The naive twin: ``A = φ(Q) φ(K)ᵀ`` (masked by ``keep``), rows normalized, times ``V``.
    O(Tq · Tk) memory; rows with nothing kept give 0."""
    a = torch.matmul(phi_q, phi_k.transpose(-2, -1))  # (B, H, Tq, Tk)
    if keep is not None:
        a = a.masked_fill(~keep, 0.0)
    return safe_divide(torch.matmul(a, v), a.sum(-1, keepdim=True))


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


# -- forward --------------------------------------------------------------------------------------
def with_ones(v: Tensor) -> Tensor:
    """``[v, 1]`` (…, Dv + 1): one matmul with it gives numerator and normalizer together."""
    return torch.cat([v, v.new_ones(v.shape[:-1] + (1,))], dim=-1)


def normalize(num_den: Tensor) -> Tensor:
    """``(…, Dv + 1)`` numerator | normalizer -> ``(…, Dv)`` output."""
    return safe_divide(num_den[..., :-1], num_den[..., -1:])


def causal_segment(phi_q: Tensor, phi_k: Tensor, v1: Tensor, state: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Causal attention of aligned queries/keys ``(B, H, T, ·)`` (query ``i`` sees keys ``<= i``)
    on top of earlier keys summarized by ``state = Σ φ(k) [v, 1]ᵀ (B, H, M, Dv + 1)``.

    ``v1`` is ``[v, 1]``. Returns the unnormalized ``(B, H, T, Dv + 1)`` and this segment's
    ``Σ φ(k) [v, 1]ᵀ`` (to add to the state)."""
    B, H, T, M = phi_q.shape
    E = v1.shape[-1]
    chunk = min(chunk, T)  # a decode step (T = 1) is one 1x1 chunk, not a padded block
    pad = (-T) % chunk
    if pad:  # zero features: padded keys add nothing, padded queries are dropped below
        phi_q, phi_k, v1 = (F.pad(x, (0, 0, 0, pad)) for x in (phi_q, phi_k, v1))
    N = (T + pad) // chunk
    qc = phi_q.reshape(B, H, N, chunk, M)
    kc = phi_k.reshape(B, H, N, chunk, M)
    vc = v1.reshape(B, H, N, chunk, E)
    # Earlier chunks: exclusive prefix sum of per-chunk states, plus the carried state.
    chunk_kv = torch.matmul(kc.transpose(-2, -1), vc)  # (B, H, N, M, Dv + 1)
    inclusive = torch.cumsum(chunk_kv, dim=2)
    out = torch.matmul(qc, inclusive - chunk_kv + state[:, :, None])  # (B, H, N, chunk, Dv + 1)
    # Inside a chunk: the masked quadratic form.
    a = torch.matmul(qc, kc.transpose(-2, -1))  # (B, H, N, chunk, chunk)
    a = a.masked_fill(torch.ones(chunk, chunk, dtype=torch.bool, device=a.device).triu(1), 0.0)
    out = out + torch.matmul(a, vc)
    return out.reshape(B, H, N * chunk, E)[:, :, :T], inclusive[:, :, -1]


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
    from ..recurrent import RecurrentState

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
    def feature_maps(cls, options, head_dim: int, scale: float, device=None) -> tuple[FeatureFn, KeyFeatureFn, int, int]:
        """``(queries, keys, chunk, segment)``, also for :class:`~attnkit.recurrent.RecurrentState`."""
        raise NotImplementedError

    @classmethod
    def forward(cls, inp: AttentionInputs, options):
        queries, keys, chunk, segment = cls.feature_maps(options, inp.D, inp.scale, inp.device)
        return kernel_attention(inp, queries, keys, chunk=chunk, segment=segment)
