"""Train a byte-level GPT (or the LSTM baseline) on text or a synthetic task; resume, DDP, profile, int8, distill.

Examples:
  python -m attnkit train                                   # a 0.8M-parameter GPT on Shakespeare, 300 steps
  python -m attnkit train --resume runs/attnkit --steps 600 # continue (stored settings; the schedule's
                                                            # floor lr after its end, or --decay-steps 600)
  torchrun --nproc_per_node=2 -m attnkit train              # DDP (gloo on CPU, nccl on GPU)
  python -m attnkit train --precision bf16 --profile --out runs/profiled --overwrite
  python -m attnkit train --data task:assoc_recall:128 --backend naive --out runs/recall
  python -m attnkit train --distill-from runs/attnkit --out runs/student --embed-dim 64 --num-layers 2
  python -m attnkit train --resume runs/attnkit --quantize int8   # a finished run: read-only report

A new run refuses a non-empty --out (pass --resume to continue it or --overwrite to replace it).
With --resume the run's stored settings apply; flags given explicitly override them (reported).
Ctrl-C (SIGINT) or SIGTERM stops the run between optimizer steps: the last finished step is saved,
one line says so, and the exit status is 130 or 143; --resume RUN then continues it exactly.
"""

from __future__ import annotations

import argparse
import json
import os

from ..train.config import GPT_TRAIN_DEFAULTS, TrainConfig
from ..train.loop import train
from ..train.lstm import LSTMConfig
from .config_args import add_dataclass_arguments, name_the_flag

_MODEL_SKIP = ("vocab_size",)


class _Default:
    """A flag's default, wrapped so that ``run`` can tell it from a value given on the command line."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)

    def __str__(self) -> str:
        return str(self.value)


def _transformer_config_cls():
    try:
        from ..nn.layers import TransformerConfig
    except ImportError:  # models not installed in this checkout
        return None
    return TransformerConfig


def _add(parser: argparse.ArgumentParser, key: str, cls, **kwargs) -> None:
    pairs = add_dataclass_arguments(parser, cls, **kwargs)
    parser.set_defaults(**{key: pairs}, **{dest: _Default(parser.get_default(dest)) for _, dest in pairs})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    _add(parser, "_train_pairs", TrainConfig, group_title="training")
    tc = _transformer_config_cls()
    if tc is not None:
        _add(parser, "_gpt_pairs", tc, group_title="GPT model (TransformerConfig)", prefix="model_",
             defaults=GPT_TRAIN_DEFAULTS, skip=_MODEL_SKIP)
    _add(parser, "_lstm_pairs", LSTMConfig, group_title="LSTM baseline (--model lstm)", prefix="lstm_",
         skip=_MODEL_SKIP, force_prefix=True)


def _values(args: argparse.Namespace, pairs) -> tuple[dict, set[str]]:
    """``{field: value}`` for the flags of ``pairs`` and the set of fields given on the command line."""
    values, given = {}, set()
    for name, dest in pairs:
        value = getattr(args, dest)
        if isinstance(value, _Default):
            value = value.value
        else:
            given.add(name)
        values[name] = value
    return values, given


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def run(args: argparse.Namespace) -> int:
    values, given = _values(args, args._train_pairs)
    pairs = list(args._train_pairs)
    try:
        cfg = TrainConfig(**values)
        model_pairs = args._lstm_pairs if cfg.model == "lstm" else getattr(args, "_gpt_pairs", None)
        if model_pairs is None:
            raise ValueError("model: the GPT model (attnkit.nn.models) is not available in this install. "
                             "Fix: --model lstm, or install attnkit with its models.")
        pairs += model_pairs
        if cfg.resume and not os.path.exists(cfg.resume):
            raise ValueError(f"--resume {cfg.resume!r}: no such run directory or checkpoint. Fix: pass the --out "
                             f"of an earlier run (or one of its step-* directories).")
        model_values, model_given = _values(args, model_pairs)
        if cfg.resume and model_given:
            flags = ", ".join(_flag(dest) for name, dest in model_pairs if name in model_given)
            raise ValueError(f"{flags}: a resumed run keeps the model stored in {cfg.resume}. Fix: drop these "
                             f"flags, or start a new run (--out) to train another model.")
        model_config = (LSTMConfig if cfg.model == "lstm" else _transformer_config_cls())(**model_values)
        results = train(cfg, model_config, given=given)
    except (ValueError, TypeError) as exc:  # a config's refusal names its field: name the flag too
        raise name_the_flag(exc, pairs) from None
    summary = {k: v for k, v in results.items() if k not in ("history", "evals")}
    if results.get("history"):
        tail = results["history"][-10:]
        summary["train_loss_last10"] = sum(r["loss"] for r in tail) / len(tail)
        rates = sorted(r["tokens_per_s"] for r in results["history"])
        summary["tokens_per_s_median"] = rates[len(rates) // 2]
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, indent=1))
    return 0
