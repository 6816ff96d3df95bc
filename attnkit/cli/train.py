"""Train a byte-level GPT (or the LSTM baseline) on text or a synthetic task; resume, DDP, profile, int8, distill.

Examples:
  python -m attnkit train                                   # Shakespeare, ~2 min on 2 CPU cores
  python -m attnkit train --resume runs/attnkit --steps 600 # continue exactly where it stopped
  torchrun --nproc_per_node=2 -m attnkit train              # DDP (gloo on CPU, nccl on GPU)
  python -m attnkit train --precision bf16 --profile        # bf16 autocast, Chrome trace + top operators
  python -m attnkit train --data task:assoc_recall:128 --backend naive
  python -m attnkit train --distill-from runs/attnkit --out runs/student --embed-dim 64 --num-layers 2
  python -m attnkit train --resume runs/attnkit --quantize int8 --out runs/attnkit
"""

from __future__ import annotations

import argparse
import json

from ..train.loop import GPT_TRAIN_DEFAULTS, TrainConfig, train
from ..train.lstm import LSTMConfig
from .config_args import add_dataclass_arguments, dataclass_from_args

_MODEL_SKIP = ("vocab_size",)


def _transformer_config_cls():
    try:
        from ..nn.layers import TransformerConfig
    except ImportError:  # models not installed in this checkout
        return None
    return TransformerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.set_defaults(_train_pairs=add_dataclass_arguments(parser, TrainConfig, group_title="training"))
    tc = _transformer_config_cls()
    if tc is not None:
        pairs = add_dataclass_arguments(parser, tc, group_title="GPT model (TransformerConfig)", prefix="model_",
                                        defaults=GPT_TRAIN_DEFAULTS, skip=_MODEL_SKIP)
        parser.set_defaults(_gpt_pairs=pairs)
    pairs = add_dataclass_arguments(parser, LSTMConfig, group_title="LSTM baseline (--model lstm)", prefix="lstm_",
                                    skip=_MODEL_SKIP, force_prefix=True)
    parser.set_defaults(_lstm_pairs=pairs)


def run(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(TrainConfig, args, args._train_pairs)
    if cfg.model == "lstm":
        model_config = dataclass_from_args(LSTMConfig, args, args._lstm_pairs)
    else:
        tc = _transformer_config_cls()
        if tc is None:
            raise SystemExit("train: the GPT model (attnkit.nn.models) is not available in this install.")
        model_config = dataclass_from_args(tc, args, args._gpt_pairs)
    results = train(cfg, model_config)
    summary = {k: v for k, v in results.items() if k not in ("history", "evals")}
    if results.get("history"):
        tail = results["history"][-10:]
        summary["train_loss_last10"] = sum(r["loss"] for r in tail) / len(tail)
        summary["tokens_per_s_median"] = sorted(r["tokens_per_s"] for r in results["history"])[len(results["history"]) // 2]
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, indent=1))
    return 0
