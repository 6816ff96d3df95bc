"""How far an approximate backend is from exact attention, on your inputs."""

from __future__ import annotations

import torch
from torch import Tensor

from .functional import attention
from .masks import Mask

__all__ = ["approximation_error"]


def approximation_error(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    backend: str,
    mask: Mask | Tensor | None = None,
    options=None,
    scale: float | None = None,
    reference: str = "naive",
    reference_mask: Mask | Tensor | None = None,
    per_row: bool = False,
) -> float | Tensor:
    """Relative error ``|out - exact| / |exact|`` (Frobenius norms over the whole output, computed
    in float64) of ``backend``'s output against exact attention on the same ``q, k, v``.

    Args:
        backend: the backend to judge (e.g. ``"performer"``), run with ``options``.
        mask, scale: as in :func:`attnkit.attention`, for both runs.
        reference: the exact backend to compare with (``"naive"`` or ``"sdpa"``).
        reference_mask: a different mask for the reference only (e.g. LSH's exact twin uses
            ``lsh.self_exclusion(keep)``); defaults to ``mask``.
        per_row: return the error of each query row ``(B, Hq, Tq)`` instead of one float.

    Example::

        err = attnkit.approximation_error(q, k, v, backend="performer",
                                          options=PerformerOptions(num_features=256))
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name (str) such as 'performer', got {type(backend).__name__}.")
    from .registry import get_backend

    if not get_backend(reference).exact:
        raise ValueError(f"reference: expected an exact backend such as 'naive' or 'sdpa', got {reference!r}.")
    with torch.no_grad():
        out = attention(q, k, v, mask=mask, scale=scale, backend=backend, options=options).double()
        ref_mask = mask if reference_mask is None else reference_mask
        ref = attention(q, k, v, mask=ref_mask, scale=scale, backend=reference).double()
    if per_row:
        return (out - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(torch.finfo(torch.float64).tiny)
    return float((out - ref).norm() / ref.norm().clamp_min(torch.finfo(torch.float64).tiny))
