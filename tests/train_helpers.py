"""Shared tiny configurations for the training tests (fast on 2 CPU cores)."""

from __future__ import annotations

import json
import os

from attnkit.train import TrainConfig


def tiny_train_config(out, **overrides) -> TrainConfig:
    base = dict(data="stdlib", out=str(out), steps=6, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2,
                eval_every=0, eval_batches=1, sample_tokens=0, progress=False, device="cpu")
    base.update(overrides)
    return TrainConfig(**base)


def tiny_gpt_config(**overrides):
    from attnkit.nn.layers import TransformerConfig

    base = dict(embed_dim=32, num_layers=2, num_heads=2, max_len=64)
    base.update(overrides)
    return TransformerConfig(**base)


def read_losses(out) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]
