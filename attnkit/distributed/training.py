"""The model side of training one long sequence split across ranks (``--context-parallel N``).

The training loop (:func:`attnkit.train.train`) takes context parallelism as a strategy
(:class:`attnkit.train.parallel.ContextParallel`); this module holds what it wraps the model with:
:class:`ContextParallelGroups` (``world = replicas x N`` ranks, ``N`` consecutive ranks per
sequence), :func:`make_context_parallel` (self-attention layers that call
:func:`~attnkit.distributed.context_parallel_attention` over their group, and gated-delta layers
that call :func:`~attnkit.distributed.context_parallel_gated_linear_attention`) and
:class:`ContextParallelModel` (the model run on a rank's slice with the slice's absolute
positions, so learned and sinusoidal embeddings and RoPE see the right ones).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from ..nn.gated_delta import GatedDeltaNet
from .attention import context_parallel_attention
from .gated import context_parallel_gated_linear_attention
from .layout import SequenceLayout

__all__ = ["ContextParallelSelfAttention", "ContextParallelGatedDeltaNet", "ContextParallelGroups",
           "ContextParallelModel", "make_context_parallel"]


class ContextParallelSelfAttention(MultiHeadAttention):
    """A :class:`~attnkit.nn.MultiHeadAttention` self-attention layer whose inputs are one rank's
    slice of the sequence; attention runs over the whole sequence across ``group``.

    Built from an existing layer by :meth:`from_layer` (same parameters, same state-dict keys)."""

    group: object
    layout: SequenceLayout
    strategy: str

    @classmethod
    def from_layer(cls, layer: MultiHeadAttention, group, layout: SequenceLayout, strategy: str = "ring"):
        if type(layer) is not MultiHeadAttention or layer.config.cross_attention:
            raise TypeError(f"layer: expected a self-attention MultiHeadAttention, got {type(layer).__name__}"
                            f"{' (cross-attention)' if getattr(layer.config, 'cross_attention', False) else ''}.")
        if layer.config.position == "alibi":
            raise ValueError("layer: ALiBi is an additive bias, which context parallelism does not take; "
                             "use position='rope', 'learned' or 'sinusoidal'.")
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)  # shares the parameters, buffers and submodules
        new.group, new.layout, new.strategy = group, layout, strategy
        return new

    def attend(self, q, k, v, *, mask=None, bias=None, q_offset=None, kv_offset=0, need_weights=False,
               kv_finite=None):  # no cache here: K/V are the layer's own projections
        cfg = self.config
        if bias is not None or need_weights:
            raise ValueError("context-parallel attention takes no bias= and cannot return weights (need_weights).")
        if cfg.dropout and self.training:
            raise ValueError(f"attention dropout {cfg.dropout}: context parallelism computes exact attention; "
                             "set the attention dropout to 0.")
        out = context_parallel_attention(q, k, v, mask=mask, group=self.group, layout=self.layout,
                                         strategy=self.strategy, backend=cfg.backend)
        B, _, Tq, _ = out.shape
        out = out.transpose(1, 2).reshape(B, Tq, -1)  # (B, T_local, Hq*hd)
        return self.out_proj(out), None


class ContextParallelGatedDeltaNet(GatedDeltaNet):
    """A :class:`~attnkit.nn.GatedDeltaNet` whose inputs are one rank's slice of the sequence; the
    rule runs over the whole sequence across ``group``, exchanging state summaries
    (:func:`~attnkit.distributed.context_parallel_gated_linear_attention`).

    Built from an existing layer by :meth:`from_layer` (same parameters, same state-dict keys)."""

    group: object
    layout: SequenceLayout

    @classmethod
    def from_layer(cls, layer: GatedDeltaNet, group, layout: SequenceLayout):
        if type(layer) is not GatedDeltaNet:
            raise TypeError(f"layer: expected a GatedDeltaNet, got {type(layer).__name__}.")
        new = cls.__new__(cls)
        new.__dict__.update(layer.__dict__)  # shares the parameters, buffers and submodules
        new.group, new.layout = group, layout
        return new

    def forward(self, x, *, cache=None, **kwargs):
        if cache is not None:
            raise ValueError("cache: a context-parallel gated-delta layer runs one sequence split across ranks and "
                             "keeps no decoding state. Fix: decode with the model itself (unwrapped), cache and all.")
        return super().forward(x, **kwargs)

    def mix(self, q, k, v, g, beta):
        return context_parallel_gated_linear_attention(q, k, v, g, beta, group=self.group, layout=self.layout,
                                                       qk_l2norm=True, check_gates=False)


def make_context_parallel(model: nn.Module, group, layout: SequenceLayout, strategy: str = "ring") -> nn.Module:
    """Swap every self-attention layer of ``model`` for a :class:`ContextParallelSelfAttention` and
    every gated-delta layer for a :class:`ContextParallelGatedDeltaNet` (in place; returns
    ``model``). Call the model with a rank's slice ``layout.shard(ids, rank, dim=1)`` and
    ``positions=layout.positions(rank)``."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is MultiHeadAttention and not child.config.cross_attention:
                setattr(module, name, ContextParallelSelfAttention.from_layer(child, group, layout, strategy))
                swapped += 1
            elif type(child) is GatedDeltaNet:
                setattr(module, name, ContextParallelGatedDeltaNet.from_layer(child, group, layout))
                swapped += 1
    if not swapped:
        raise ValueError(f"model: {type(model).__name__} has no MultiHeadAttention self-attention or GatedDeltaNet "
                         "layer to split.")
    return model


class ContextParallelGroups:
    """``world = dp * cp`` ranks: ``cp`` consecutive ranks share a sequence (``cp_group``), ranks
    with the same position in their replica form ``dp_group``. Every rank must build it (collective)."""

    def __init__(self, cp: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if cp < 1 or world % cp:
            raise ValueError(f"context_parallel: {cp} does not divide the {world} processes; launch "
                             f"torchrun --nproc_per_node with a multiple of {cp}.")
        self.cp, self.dp = cp, world // cp
        self.cp_rank, self.dp_rank = rank % cp, rank // cp
        self.cp_group = None
        for d in range(self.dp):  # new_group is collective: every rank creates every group
            g = dist.new_group(list(range(d * cp, (d + 1) * cp)))
            if d == self.dp_rank:
                self.cp_group = g


class ContextParallelModel(nn.Module):
    """``model`` (its self-attention layers swapped by :func:`make_context_parallel`, in place)
    called on this rank's slice ``layout.shard(ids, rank, dim=1)`` of token ids ``(B, T)``, with
    ``positions`` = ``layout.positions(rank)``; returns the slice's logits ``(B, T_local, V)``."""

    def __init__(self, model: nn.Module, group, layout: SequenceLayout, positions: Tensor, strategy: str = "ring"):
        super().__init__()
        self.model = make_context_parallel(model, group, layout, strategy)
        self.positions = positions

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(ids, positions=self.positions)
