"""Shared builders of test inputs: q/k/v of any shape, dtype, GQA grouping and memory layout, and the
tiny models the model, cache and generation tests run.

Every builder is seeded: the same arguments give the same tensors (drawn in float32 on the CPU, then
cast and moved), so a failure replays."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["qkv", "tiny_gpt"]


def _draw(shape, g: torch.Generator, *, dtype, device, non_contiguous: bool, offset: int) -> Tensor:
    """``randn(shape)``; ``non_contiguous``: a (B, T, H, D) buffer seen as (B, H, T, D) (as a model's
    projection gives it); ``offset``: the tensor starts ``offset`` elements into its storage."""
    B, H, T, D = shape
    drawn = torch.randn(B, T, H, D, generator=g).transpose(1, 2) if non_contiguous else torch.randn(*shape, generator=g)
    x = drawn.to(device=device, dtype=dtype)
    if offset:
        storage = torch.zeros(offset + x.numel(), dtype=dtype, device=device)
        x = storage[offset:].view(B, T, H, D).transpose(1, 2) if non_contiguous else storage[offset:].view(shape)
        x.copy_(drawn)
    return x


def qkv(B: int = 2, Hq: int = 4, Hkv: int | None = None, Tq: int = 16, Tk: int | None = None, D: int = 8, *,
        Dv: int | None = None, dtype: torch.dtype = torch.float32, seed: int = 0, requires_grad: bool = False,
        device: torch.device | str | None = None, non_contiguous: bool = False, offset: int = 0):
    """``q (B, Hq, Tq, D)``, ``k (B, Hkv, Tk, D)``, ``v (B, Hkv, Tk, Dv)`` from one generator seeded with
    ``seed`` (``Hkv``, ``Tk``, ``Dv`` default to ``Hq``, ``Tq``, ``D``; ``Hkv < Hq``: GQA)."""
    g = torch.Generator().manual_seed(seed)
    Hkv, Tk, Dv = Hkv or Hq, Tk or Tq, Dv or D
    layout = dict(dtype=dtype, device=device, non_contiguous=non_contiguous, offset=offset)
    out = tuple(_draw(s, g, **layout) for s in ((B, Hq, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, Dv)))
    return tuple(x.requires_grad_() for x in out) if requires_grad else out


def tiny_gpt(*, seed: int = 0, vocab_size: int = 50, embed_dim: int = 32, num_layers: int = 2, num_heads: int = 4,
             max_len: int = 64, **config):
    """A small ``GPT`` in eval mode, its weights drawn after ``torch.manual_seed(seed)``; ``config``: any
    other ``TransformerConfig`` field (``num_kv_heads``, ``position``, ``backend``, ...)."""
    from attnkit.nn import GPT, TransformerConfig

    torch.manual_seed(seed)
    return GPT(TransformerConfig(vocab_size=vocab_size, embed_dim=embed_dim, num_layers=num_layers,
                                 num_heads=num_heads, max_len=max_len, **config)).eval()
