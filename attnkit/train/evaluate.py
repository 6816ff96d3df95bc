"""Validation loss, perplexity and answer accuracy on fixed batches (the same on 1 or N processes)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import TrainConfig
from .data import IGNORE_INDEX
from .distributed import DistContext, all_reduce_sum

__all__ = ["evaluate", "loss_sum", "autocast"]


def autocast(device: torch.device, precision: str):
    """bf16 autocast when ``precision == "bf16"``, else a no-op context."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def loss_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Summed next-token cross-entropy over the answer tokens (targets != IGNORE_INDEX), in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


@torch.no_grad()
def evaluate(model: nn.Module, data, cfg: TrainConfig, ctx: DistContext | None = None, *,
             device: torch.device | None = None) -> dict:
    """Validation loss (mean per answer token), perplexity and answer accuracy on fixed batches."""
    ctx = ctx or DistContext()
    device = device or ctx.device
    was_training = model.training
    model.eval()
    loss = correct = count = 0.0
    rows = max(cfg.batch_size // ctx.world, 1)
    for i in range(cfg.eval_batches):
        x, y = data.sample("val", cfg.seed, i, rows * ctx.world, cfg.seq_len)
        x, y = x[ctx.rank * rows:(ctx.rank + 1) * rows].to(device), y[ctx.rank * rows:(ctx.rank + 1) * rows].to(device)
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
