"""Performer FAVOR+ (Choromanski et al. 2020, https://arxiv.org/abs/2009.14794).

Not softmax attention: an unbiased random-feature estimate of it, used only when named
(``backend="performer"``). With positive random features ``φ(x) = exp(Wx' - |x'|²/2) / √M``,
``x' = x · scale^½`` and rows of ``W (M, D)`` drawn orthogonal (in blocks of ``D``) with Gaussian
norms, ``E[φ(q)ᵀφ(k)] = exp(scale · qᵀk)``, so::

    out_i = Σ_j φ(q_i)ᵀφ(k_j) v_j / Σ_j φ(q_i)ᵀφ(k_j)      ≈  softmax attention

Naive twin: ``kernelized.ops.quadratic_attention(φ(Q), φ(K), V, keep)``; the kernel estimate
itself is tested to be unbiased. Numerically stabilized: query features are divided by their row
max and key features by a per-head running max (constants that cancel; in causal mode the max of
a segment may include later keys, which only rounding can notice — gradients into the future are
exactly 0), so large-norm inputs stay finite. Causal attention and O(1) decoding share linear
attention's prefix sums and :class:`~attnkit.backends.kernelized.state.RecurrentState`.

The projection ``W`` is data: the backend is stateless, a module holds ``W`` (a buffer, see
:class:`PerformerProjection`, which can redraw it) and passes it as
``PerformerOptions(projection=W)``. Without one, a projection is drawn from ``seed`` on every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..._validate import positive_int
from ...registry import register_backend
from . import features as fm
from .base import KernelizedBackend

__all__ = ["PerformerOptions", "PerformerProjection", "draw_projection"]


def draw_projection(
    num_features: int,
    head_dim: int,
    *,
    orthogonal: bool = True,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Random features ``W (num_features, head_dim)`` for FAVOR+.

    ``orthogonal=True``: stacked blocks of ``head_dim`` exactly orthogonal rows (QR of a Gaussian
    matrix), each row rescaled to the norm of a Gaussian vector, so every row is still marginally
    N(0, I) (the estimate stays unbiased) but rows within a block are orthogonal (lower variance).
    ``orthogonal=False``: i.i.d. N(0, I) rows."""
    positive_int(num_features, "num_features", owner="draw_projection", fix="pass e.g. 256")
    positive_int(head_dim, "head_dim", owner="draw_projection")
    gauss = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64)
    if not orthogonal:
        return gauss.to(device=device, dtype=dtype)
    n_blocks = -(-num_features // head_dim)
    g = torch.randn(n_blocks, head_dim, head_dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]  # Haar-distributed (sign fix)
    rows = q.transpose(-2, -1).reshape(n_blocks * head_dim, head_dim)[:num_features]  # orthonormal within a block
    w = rows * gauss.norm(dim=1, keepdim=True)  # Gaussian row norms (chi, head_dim dof)
    return w.to(device=device, dtype=dtype)


@dataclass(frozen=True, eq=False)
class PerformerOptions:
    """``projection``: ``W (M, D)`` from :func:`draw_projection` (usually a module's buffer);
    ``None`` draws ``num_features`` rows from ``seed`` on each call. ``chunk``/``segment``: blocking
    of the causal prefix sums (speed and memory only)."""

    projection: Tensor | None = None
    num_features: int = 256
    orthogonal: bool = True
    seed: int = 0
    chunk: int = 64
    segment: int = 4096

    def __post_init__(self):
        positive_int(self.chunk, "chunk", owner="PerformerOptions", fix="pass e.g. chunk=64")
        positive_int(self.segment, "segment", owner="PerformerOptions", fix="pass e.g. segment=4096")
        if self.projection is not None and (not isinstance(self.projection, Tensor) or self.projection.dim() != 2):
            raise ValueError(
                f"PerformerOptions(projection=...): expected a (num_features, head_dim) tensor, got "
                f"{getattr(self.projection, 'shape', type(self.projection).__name__)}. Fix: use draw_projection()."
            )
        positive_int(self.num_features, "num_features", owner="PerformerOptions", fix="pass e.g. num_features=256")

    def resolve(self, head_dim: int, device=None) -> Tensor:
        """The projection to use for ``head_dim``, checked."""
        if self.projection is None:
            gen = torch.Generator().manual_seed(self.seed)
            return draw_projection(self.num_features, head_dim, orthogonal=self.orthogonal, generator=gen,
                                   device=device)
        if self.projection.shape[1] != head_dim:
            raise ValueError(
                f"PerformerOptions(projection=...): shape {tuple(self.projection.shape)} has head_dim "
                f"{self.projection.shape[1]}, but q has D={head_dim}. Fix: draw_projection(num_features, {head_dim})."
            )
        return self.projection if device is None else self.projection.to(device)


class PerformerProjection(nn.Module):
    """Holds a FAVOR+ projection as a buffer (saved with the model, moved with ``.to()``).

    ``redraw_interval``: in training mode, draw a fresh projection every that many calls of
    :meth:`options` (``None``: never; :meth:`redraw` draws one on demand)."""

    def __init__(self, num_features: int, head_dim: int, *, orthogonal: bool = True, redraw_interval: int | None = None,
                 generator: torch.Generator | None = None):
        super().__init__()
        positive_int(redraw_interval, "redraw_interval", owner="PerformerProjection", allow_none=True)
        self.num_features, self.head_dim, self.orthogonal = num_features, head_dim, orthogonal
        self.redraw_interval = redraw_interval
        self.calls = 0
        self.register_buffer("projection", draw_projection(num_features, head_dim, orthogonal=orthogonal,
                                                           generator=generator))

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        new = draw_projection(self.num_features, self.head_dim, orthogonal=self.orthogonal, generator=generator)
        self.projection.copy_(new.to(self.projection))

    def options(self, **kwargs) -> PerformerOptions:
        """``PerformerOptions`` with this projection (redrawing first when due in training)."""
        if self.training and self.redraw_interval is not None:
            if self.calls and self.calls % self.redraw_interval == 0:
                self.redraw()
            self.calls += 1
        return PerformerOptions(projection=self.projection, **kwargs)


@register_backend
class PerformerBackend(KernelizedBackend):
    name = "performer"
    summary = "APPROXIMATE Performer FAVOR+ positive orthogonal random features: O(T*M) time, O(1) decode"
    Options = PerformerOptions

    @classmethod
    def feature_maps(cls, options: PerformerOptions | None, head_dim: int, scale: float, device=None):
        options = options or PerformerOptions()
        w = options.resolve(head_dim, device)

        def queries(x: Tensor) -> Tensor:
            return fm.favor_query_features(x, w, scale)

        def keys(x: Tensor, keep: Tensor | None, floor: Tensor | None = None):
            return fm.favor_key_features(x, keep, w, scale, floor)

        return queries, keys, options.chunk, options.segment


def kernel_estimate(q: Tensor, k: Tensor, projection: Tensor, scale: float = 1.0) -> Tensor:
    """The FAVOR+ estimate of ``exp(scale · qᵀk)`` for every pair: ``(…, Tq, Tk)`` (unstabilized;
    for tests and error studies). ``projection (…, M, D)`` may hold a batch of draws."""
    m = projection.shape[-2]
    fq = torch.exp(fm.favor_logits(q, projection, scale)) / math.sqrt(m)
    fk = torch.exp(fm.favor_logits(k, projection, scale)) / math.sqrt(m)
    return fq @ fk.transpose(-2, -1)
