"""Training one long sequence split across ranks: ``torchrun ... -m attnkit train --context-parallel N``.

The ``WORLD_SIZE`` processes form ``WORLD_SIZE / N`` data-parallel replicas of ``N`` ranks each
(ranks ``d*N .. d*N + N - 1`` share one sequence). Every rank holds its zigzag slice of each
sequence of its replica's rows, runs the model on it with the slice's absolute positions (learned
and sinusoidal embeddings, RoPE), and its self-attention layers call
:func:`~attnkit.distributed.context_parallel_attention` over the replica's group. The loss is the
sum over a rank's tokens divided by the answer tokens of the *global* batch, so summing gradients
over all ranks gives exactly the gradient of one process on the whole batch: the same losses as
``python -m attnkit train`` within float tolerance, at ``1 / N`` of the activation memory.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from ..train import loop, modeling
from ..train.config import lr_at
from ..train.data import IGNORE_INDEX
from ..train.evaluate import autocast, loss_sum
from ..train.checkpoint import save_checkpoint
from ..train.distributed import all_reduce_sum, setup_distributed, teardown
from .attention import context_parallel_attention
from .layout import SequenceLayout

__all__ = ["ContextParallelSelfAttention", "ContextParallelGroups", "make_context_parallel", "train_context_parallel"]


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


def make_context_parallel(model: nn.Module, group, layout: SequenceLayout, strategy: str = "ring") -> nn.Module:
    """Swap every self-attention layer of ``model`` for a :class:`ContextParallelSelfAttention`
    (in place; returns ``model``). Call the model with a rank's slice ``layout.shard(ids, rank,
    dim=1)`` and ``positions=layout.positions(rank)``."""
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is MultiHeadAttention and not child.config.cross_attention:
                setattr(module, name, ContextParallelSelfAttention.from_layer(child, group, layout, strategy))
                swapped += 1
    if not swapped:
        raise ValueError(f"model: {type(model).__name__} has no MultiHeadAttention self-attention layer to split.")
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


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def train_context_parallel(cfg, model_config=None) -> dict:
    """Train ``cfg`` (a :class:`~attnkit.train.TrainConfig` with ``context_parallel > 1``) under
    ``torchrun``; returns the history like :func:`attnkit.train.train`. Rank 0 writes
    ``metrics.jsonl``, ``results.json`` and the final checkpoint into ``cfg.out``."""
    cp = cfg.context_parallel
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"context_parallel: expected a positive int (1 = off), got {cp!r}.")
    if cfg.model != "gpt":
        raise ValueError(f"context_parallel: splits a transformer's sequence; --model {cfg.model} has no attention.")
    unsupported = {"--resume": cfg.resume, "--distill-from": cfg.distill_from, "--quantize": cfg.quantize != "none",
                   "--profile": cfg.profile}
    if any(unsupported.values()):
        raise ValueError(f"context_parallel: {', '.join(k for k, v in unsupported.items() if v)} not supported with "
                         "--context-parallel; run without those flags.")
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError(f"context_parallel={cfg.context_parallel}: launch with torchrun --nproc_per_node="
                         f"{cfg.context_parallel} (or a multiple of it for data parallelism as well).")
    ctx = setup_distributed(cfg.device)
    try:
        return _train(cfg, model_config, ctx)
    finally:
        teardown(ctx)


def _train(cfg, model_config, ctx) -> dict:
    groups = ContextParallelGroups(cfg.context_parallel)
    device = ctx.device
    if cfg.batch_size % (groups.dp * cfg.grad_accum):
        raise ValueError(f"batch_size: the global batch {cfg.batch_size} must divide into {groups.dp} data-parallel "
                         f"replicas x {cfg.grad_accum} micro-batches.")
    data = loop.load_data(cfg.data)
    if hasattr(data, "seq_len"):
        cfg.seq_len = data.seq_len
    layout = SequenceLayout.zigzag(cfg.seq_len, groups.cp)
    positions = layout.positions(groups.cp_rank, device)
    torch.manual_seed(cfg.seed)  # the same initial weights as a single-process run
    if model_config is None:
        model_config = modeling.default_model_config("gpt")
    model_config.vocab_size = data.vocab_size
    model_config.max_len = max(model_config.max_len, cfg.seq_len)
    model_cfg = modeling.config_dict(model_config)
    model = modeling.build_model("gpt", model_cfg)
    make_context_parallel(model, groups.cp_group, layout)
    model.to(device).train()
    optimizer = loop._optimizer(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    if ctx.is_main:
        os.makedirs(cfg.out, exist_ok=True)
        print(f"context parallel: {groups.dp} replica(s) x {groups.cp} ranks, {layout.local_len(0)} of "
              f"{cfg.seq_len} positions per rank (zigzag) | {modeling.num_params(model) / 1e6:.2f}M parameters | "
              "no periodic evaluation or samples in this mode", flush=True)
    rows_per_micro = cfg.batch_size // (groups.dp * cfg.grad_accum)
    history = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = data.sample("train", cfg.seed, step, cfg.batch_size, cfg.seq_len)
        count = max(int((y != IGNORE_INDEX).sum()), 1)  # answer tokens in the global batch
        step_loss = 0.0
        for micro in range(cfg.grad_accum):
            start = (groups.dp_rank * cfg.grad_accum + micro) * rows_per_micro
            xb = layout.shard(x[start:start + rows_per_micro], groups.cp_rank, dim=1).to(device)
            yb = layout.shard(y[start:start + rows_per_micro], groups.cp_rank, dim=1).to(device)
            with autocast(device, cfg.precision):
                logits = model(xb, positions=positions)
                loss = loss_sum(logits, yb) / count
            loss.backward()
            step_loss += float(loss.detach())
        _all_reduce_grads(params)  # sum over every rank = the whole global batch's gradient
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_loss = all_reduce_sum(step_loss, ctx)
        record = {"step": step + 1, "loss": step_loss, "lr": lr,
                  "tokens_per_s": cfg.batch_size * cfg.seq_len / (time.perf_counter() - t0)}
        history.append(record)
        if ctx.is_main:
            with open(os.path.join(cfg.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
            if cfg.progress:
                print(f"step {step + 1}/{cfg.steps}: loss {step_loss:.4f}", flush=True)
    peak = [all_reduce_sum(_peak_rss_mb() if r == dist.get_rank() else 0.0, ctx) for r in range(ctx.world)]
    results = {"model_kind": "gpt", "params": modeling.num_params(model), "steps": cfg.steps, "world": ctx.world,
               "context_parallel": groups.cp, "data_parallel": groups.dp, "history": history,
               "peak_rss_mb_per_rank": peak}
    if ctx.is_main:
        meta = {"model_kind": "gpt", "model_config": model_cfg, "train_config": asdict(cfg), "history": history,
                "evals": []}
        save_checkpoint(cfg.out, cfg.steps, model, meta, optimizer)
        with open(os.path.join(cfg.out, "results.json"), "w") as f:
            json.dump({k: v for k, v in results.items() if k != "history"}, f, indent=1)
    dist.barrier()
    return results


def _all_reduce_grads(params: list[Tensor]) -> None:
    """Sum gradients over every rank in one flat message (parameters unused on a rank count as 0)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
        offset += g.numel()
