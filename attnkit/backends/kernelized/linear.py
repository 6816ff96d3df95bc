"""Linear attention (Katharopoulos et al. 2020, https://arxiv.org/abs/2006.16236), φ = elu + 1.

Not softmax attention: a different function, used only when named (``backend="linear"``)::

    out_i = Σ_j φ(q_i)ᵀφ(k_j) v_j / Σ_j φ(q_i)ᵀφ(k_j)        over the keys j that query i may see

Naive twin: ``kernelized.ops.quadratic_attention(φ(Q), φ(K), V, keep)`` — the masked quadratic form.
Non-causal costs O(T · D · Dv) (``φ(K)ᵀV`` first); causal uses chunked prefix sums (never an
``(n, D, Dv)`` tensor) and decodes in O(1) per token with :class:`~attnkit.backends.kernelized.state.RecurrentState`.
``scale`` is not used: φ is applied to the raw q and k, and the row normalization removes any
constant factor. Masks: ``Causal``, ``KeyPadding``, per-key bool masks and their ``And``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._validate import positive_int
from ...registry import register_backend
from . import features as fm
from .base import KernelizedBackend


@dataclass(frozen=True)
class LinearOptions:
    """``chunk``: tokens per block of the causal prefix sums (speed only, same result);
    ``segment``: tokens whose features are computed at once (bounds memory to
    ``segment / chunk · D · Dv`` per head)."""

    chunk: int = 64
    segment: int = 4096

    def __post_init__(self):
        positive_int(self.chunk, "chunk", owner="LinearOptions", fix="pass e.g. chunk=64")
        positive_int(self.segment, "segment", owner="LinearOptions", fix="pass e.g. segment=4096")


@register_backend
class LinearBackend(KernelizedBackend):
    name = "linear"
    summary = "APPROXIMATE linear attention, phi = elu+1 (Katharopoulos 2020): O(T) time and memory, O(1) decode"
    Options = LinearOptions

    @classmethod
    def feature_maps(cls, options: LinearOptions | None, head_dim: int, scale: float, device=None):
        options = options or LinearOptions()
        return fm.elu_features, fm.elu_key_features, options.chunk, options.segment
