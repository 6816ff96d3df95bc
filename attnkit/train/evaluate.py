"""Validation loss, perplexity and answer accuracy on fixed batches (the same on 1 or N processes)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import TrainConfig
from .data import IGNORE_INDEX
from .distributed import DistContext, all_reduce_sum
from .parallel import DataParallel

__all__ = ["evaluate", "loss_sum", "autocast"]


def autocast(device: torch.device, precision: str):
    """bf16 autocast when ``precision == "bf16"``, else a no-op context."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def loss_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Summed next-token cross-entropy over the answer tokens (targets != IGNORE_INDEX), in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def evaluate(model: nn.Module, data, cfg: TrainConfig, ctx: DistContext | None = None, *,
             device: torch.device | None = None, parallel=None) -> dict:
    """Validation loss (mean per answer token), perplexity and answer accuracy on fixed batches.

    ``parallel``: the strategy that splits the batches over the processes of ``ctx`` (default:
    rows split over every process, :class:`~attnkit.train.parallel.DataParallel`); ``model`` is
    what it runs (its ``prepare``-d model)."""
    ctx = ctx or DistContext()
    parallel = parallel or DataParallel(ctx)
    device = device or ctx.device
    was_training = model.training
    model.eval()
    loss = correct = count = 0.0
    rows = max(cfg.batch_size // parallel.replicas, 1)
    mine = slice(parallel.replica * rows, (parallel.replica + 1) * rows)
    for i in range(cfg.eval_batches):
        x, y = data.sample("val", cfg.seed, i, rows * parallel.replicas, cfg.seq_len)
        x, y = parallel.shard(x[mine]).to(device), parallel.shard(y[mine]).to(device)
        with autocast(device, cfg.precision):
            logits = model(x)
        loss += float(loss_sum(logits, y))
        valid = y != IGNORE_INDEX
        correct += float(((logits.argmax(-1) == y) & valid).sum())
        count += float(valid.sum())
    model.train(was_training)
    loss, correct, count = (all_reduce_sum(v, ctx) for v in (loss, correct, count))
    mean = loss / max(count, 1)
    return {"loss": mean, "perplexity": math.exp(min(mean, 50)), "accuracy": correct / max(count, 1)}
