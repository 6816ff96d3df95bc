"""Tile grids shared by the fused backends (``flex``, ``native``), and the empty-batch result.

:func:`tile_grid` (from :mod:`attnkit.masks.export`) gives the :class:`~attnkit.masks.BlockStatus`
of every (query tile × key tile) of a call as one ``uint8`` tensor (0 EMPTY, 1 PARTIAL, 2 FULL),
each mask class computing its own grid with tensor operations.

:func:`empty_batch` is the result of a call with an empty batch, for the backends whose
reshapes cannot run on zero elements.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..masks.export import EMPTY, FULL, PARTIAL, tile_grid

__all__ = ["EMPTY", "PARTIAL", "FULL", "tile_grid", "empty_batch"]


def empty_batch(inp) -> Tensor | tuple[Tensor, Tensor]:
    """The result of a call with ``B = 0`` (nothing to compute): ``out (0, Hq, Tq, Dv)``, and the LSE
    with ``return_lse``, in the autograd graph of q, k and v (their gradients are empty too). For
    backends whose reshapes cannot infer a dimension from zero elements."""
    connect = (inp.q.sum() + inp.k.sum() + inp.v.sum()) * 0  # a sum over nothing: 0
    out = inp.q.new_zeros(0, inp.Hq, inp.Tq, inp.Dv) + connect.to(inp.dtype)
    if not inp.return_lse:
        return out
    return out, torch.zeros(0, inp.Hq, inp.Tq, dtype=torch.promote_types(inp.dtype, torch.float32), device=inp.device)
