"""Feature maps of kernelized attention: ``φ`` for ``linear`` (elu + 1) and ``performer`` (FAVOR+).

Key features may carry a *log-scale*: the stored sums are ``Σ φ(k) · exp(-log_scale)`` so that
Performer's ``exp(·)`` features never overflow. A constant factor over the keys a query sees
cancels between numerator and denominator, so rescaling is exact (up to rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

#: ``queries(q (B, H, T, D)) -> (B, H, T, M)`` (any positive per-row factor is allowed: it cancels).
FeatureFn = Callable[[Tensor], Tensor]
#: ``keys(k (B, H, T, D), keep (B|1, H|1, T) | None, floor (B, H) | None)
#: -> (features (B, H, T, M), log_scale (B, H) | None)``: the true features are
#: ``features · exp(log_scale)`` with ``log_scale >= floor``; masked keys get features 0 and do
#: not take part in choosing ``log_scale``.
KeyFeatureFn = Callable[[Tensor, Tensor | None, Tensor | None], tuple[Tensor, Tensor | None]]


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
    # (B, H, T, M)
    return torch.matmul(x, projection.transpose(-2, -1).to(x.dtype)) - 0.5 * (x * x).sum(-1, keepdim=True)


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
