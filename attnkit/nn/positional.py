"""Positional encodings, all computed at *absolute* positions so they work with caches and offsets.

* :func:`sinusoidal` / :class:`SinusoidalPositionalEmbedding` — the Transformer's sin/cos table,
  computed on the fly for any position (no ``max_len`` buffer to outgrow).
* :class:`LearnedPositionalEmbedding` — an ``nn.Embedding`` over positions that says clearly when
  a position exceeds ``max_len``.
* :class:`RotaryEmbedding` — RoPE (Su et al. 2021, https://arxiv.org/abs/2104.09864) rotating query
  and key heads by their absolute positions; the "rotate half" layout of GPT-NeoX / Llama.
* :func:`alibi_slopes` / :func:`alibi_bias` — ALiBi (Press et al. 2021,
  https://arxiv.org/abs/2108.12409) as an additive score bias ``-slope_h * |pos(q) - pos(k)|``.
* :func:`sinusoidal_2d` — 2-D sin/cos for a grid of image patches (MAE / ViT variants).

``positions`` arguments are integer tensors ``(T,)`` or ``(B, T)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._validate import finite_float

__all__ = [
    "sinusoidal",
    "SinusoidalPositionalEmbedding",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "sinusoidal_2d",
]


def _check_positions(positions, name: str = "positions") -> Tensor:
    if not isinstance(positions, Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise TypeError(
            f"{name}: expected an integer tensor (T,) or (B, T) of absolute positions, got "
            f"{getattr(positions, 'dtype', type(positions).__name__)}. Fix: torch.arange(T) (+ offset)."
        )
    if positions.dim() not in (1, 2):
        raise ValueError(f"{name}: expected shape (T,) or (B, T), got {tuple(positions.shape)}.")
    return positions


def sinusoidal(positions: Tensor, dim: int, *, base: float = 10000.0, dtype: torch.dtype = torch.float32) -> Tensor:
    """``(..., dim)`` sin/cos encodings of ``positions`` (``(T,)`` or ``(B, T)``).

    Channel ``2i`` is ``sin(p / base**(2i/dim))`` and ``2i+1`` the matching cos (Vaswani et al.)."""
    positions = _check_positions(positions)
    if dim < 2 or dim % 2:
        raise ValueError(f"dim: sinusoidal encodings need an even dim >= 2, got {dim}.")
    inv_freq = base ** (-torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64) / dim)  # (dim/2,)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # (..., dim/2)
    out = torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)  # (..., dim) interleaved sin, cos
    return out.to(dtype)


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed sin/cos embeddings; ``forward(positions) -> (..., dim)``. No parameters, no buffer."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        if dim < 2 or dim % 2:
            raise ValueError(f"dim: sinusoidal encodings need an even dim >= 2, got {dim}.")
        self.dim, self.base = dim, base

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        return sinusoidal(positions, self.dim, base=self.base, dtype=dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


class LearnedPositionalEmbedding(nn.Embedding):
    """Learned absolute positions (GPT-2, BERT): an ``nn.Embedding(max_len, dim)`` whose forward
    raises a clear error for positions outside ``[0, max_len)``."""

    def forward(self, positions: Tensor) -> Tensor:
        positions = _check_positions(positions)
        # A host read of the positions: eager only (traced, the embedding's own index check remains).
        if positions.numel() and not torch.compiler.is_compiling() and (
                int(positions.min()) < 0 or int(positions.max()) >= self.num_embeddings):
            raise ValueError(
                f"positions: learned position embeddings cover 0..{self.num_embeddings - 1} (max_len="
                f"{self.num_embeddings}), got positions {int(positions.min())}..{int(positions.max())}. Fix: raise "
                "max_len in the config, shorten the input, or use position='rope'/'sinusoidal'/'alibi'."
            )
        return super().forward(positions)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding applied to ``(B, H, T, D)`` heads at absolute ``positions``.

    Pairs channel ``i`` with ``i + rotary_dim/2`` (the "rotate half" layout of GPT-NeoX/Llama) and
    rotates the pair by ``pos * base**(-2i/rotary_dim)``. Channels beyond ``rotary_dim`` (partial
    rotary) pass through. Dot products of rotated q and k depend only on ``pos(q) - pos(k)``."""

    def __init__(self, head_dim: int, *, base: float = 10000.0, rotary_dim: int | None = None):
        super().__init__()
        finite_float(base, "base", low=0.0, low_inclusive=False, owner="RotaryEmbedding",
                     fix="RoPE's usual base is 10000.0")
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(
                f"rotary_dim: expected an even number in [2, head_dim={head_dim}], got {rotary_dim}. "
                "Fix: use an even head_dim or set rotary_dim."
            )
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos, sin`` of shape ``(T, rotary_dim)`` or ``(B, 1, T, rotary_dim)`` (computed in fp32)."""
        positions = _check_positions(positions)
        half = self.rotary_dim // 2
        exponents = torch.arange(half, device=positions.device, dtype=torch.float32) * 2 / self.rotary_dim
        inv_freq = self.base ** (-exponents)
        angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., T, half)
        angles = torch.cat([angles, angles], dim=-1)  # (..., T, rotary_dim)
        if positions.dim() == 2:
            angles = angles[:, None]  # (B, 1, T, rotary_dim): broadcast over heads
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate ``x`` ``(B, H, T, D)`` by ``positions`` ``(T,)`` or ``(B, T)``."""
        if x.dim() != 4 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x: expected (B, H, T, D={self.head_dim}), got {tuple(x.shape)}.")
        if positions.shape[-1] != x.shape[2]:
            raise ValueError(
                f"positions: expected {x.shape[2]} positions (one per token), got shape {tuple(positions.shape)}."
            )
        cos, sin = self.cos_sin(positions, x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
        return torch.cat([rotated, rest], dim=-1) if rest.shape[-1] else rotated

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}"


def sinusoidal_2d(grid_height: int, grid_width: int, dim: int, *, base: float = 10000.0) -> Tensor:
    """``(grid_height * grid_width, dim)`` 2-D sin/cos encodings of patches in row-major order:
    the first half of the channels encodes the row, the second half the column (MAE's layout)."""
    if dim % 4:
        raise ValueError(f"dim: 2-D sinusoidal encodings need dim divisible by 4, got {dim}.")
    rows = torch.arange(grid_height).repeat_interleave(grid_width)  # (h*w,)
    cols = torch.arange(grid_width).repeat(grid_height)  # (h*w,)
    return torch.cat([sinusoidal(rows, dim // 2, base=base), sinusoidal(cols, dim // 2, base=base)], dim=-1)
