"""``TrainConfig``: every setting of a training run, validated once, stored whole in each checkpoint.

The learning-rate schedule (:func:`lr_at`) lives here too: it is a pure function of the config and
the step, which is what makes ``--resume`` continue it exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

__all__ = ["TrainConfig", "lr_at", "GPT_TRAIN_DEFAULTS", "MODEL_KINDS"]

MODEL_KINDS = ("gpt", "lstm")  # what a run trains: attnkit's GPT, or the LSTM baseline

# The small GPT the `train` command starts from. RoPE positions: no learned-position table, so
# sampling is not capped at the training length.
GPT_TRAIN_DEFAULTS = {"embed_dim": 128, "num_layers": 4, "num_heads": 4, "max_len": 128, "position": "rope"}


@dataclass
class TrainConfig:
    data: str = field(default="default", metadata={
        "help": "'default' (Shakespeare, else Python stdlib sources), 'stdlib', a text file, or "
                "'task:assoc_recall|copy|selective_copy[:DISTANCE]'"})
    out: str = field(default="runs/attnkit", metadata={"help": "run directory (checkpoints, metrics, trace)"})
    overwrite: bool = field(default=False, metadata={"help": "start a new run in a non-empty --out, deleting "
                                                             "its checkpoints, metrics and results"})
    model: str = field(default="gpt", metadata={"help": "'gpt' or 'lstm' (baseline)"})
    steps: int = field(default=300, metadata={"help": "optimizer steps to train to"})
    batch_size: int = field(default=16,
                            metadata={"help": "global batch in sequences (all processes, all micro-batches)"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    seq_len: int = field(default=128, metadata={"help": "tokens per sequence (text data)"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final learning rate as a fraction of the peak"})
    warmup_steps: int = field(default=50, metadata={"help": "linear warmup steps"})
    decay_steps: int = field(default=0, metadata={"help": "step where the cosine decay reaches the floor "
                                                          "(0 = --steps; later steps train at the floor)"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (matrices only)"})
    grad_clip: float = field(default=1.0, metadata={"help": "max global gradient norm (0 = off)"})
    precision: str = field(default="fp32", metadata={"help": "'fp32' or 'bf16' (autocast)"})
    device: str = field(default="auto", metadata={"help": "'auto', 'cpu', 'cuda', 'cuda:1', ..."})
    seed: int = field(default=0, metadata={"help": "seed for weights, data and sampling"})
    log_every: int = field(default=10, metadata={"help": "print a line (step, loss, lr, tokens/s) every N steps "
                                                         "(0 = off)"})
    eval_every: int = field(default=100, metadata={"help": "evaluate (and sample) every N steps (0 = only at the end)"})
    eval_batches: int = field(default=4, metadata={"help": "validation batches per evaluation"})
    sample_tokens: int = field(default=200, metadata={"help": "tokens sampled at each evaluation (0 = none)"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only at the end)"})
    resume: str = field(default="", metadata={"help": "run directory or checkpoint to continue from exactly "
                                                      "(its stored settings apply; flags given override them)"})
    profile: bool = field(default=False, metadata={"help": "profile the first steps: Chrome trace + top operators"})
    profile_steps: int = field(default=5, metadata={"help": "steps recorded by --profile"})
    quantize: str = field(default="none", metadata={"help": "'int8': after training, report dynamic int8 "
                                                            "quantization (CPU inference speedup, eval-loss change)"})
    distill_from: str = field(default="", metadata={"help": "teacher run directory: train this (smaller) model "
                                                            "on KL to the teacher's logits + the data loss"})
    distill_alpha: float = field(default=0.5, metadata={"help": "weight of the KL term in distillation (0..1)"})
    distill_temperature: float = field(default=2.0, metadata={"help": "softmax temperature of distillation (> 0)"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar (only on a terminal)"})
    context_parallel: int = field(default=1, metadata={"help": "split each sequence across this many torchrun "
                                                               "processes (attnkit.distributed; 1 = off)"})

    def __post_init__(self):
        for name, allowed in (("precision", ("fp32", "bf16")), ("model", MODEL_KINDS),
                              ("quantize", ("none", "int8"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}.")
        for f in fields(self):
            rule = _RULES.get(f.name)
            if rule is not None:
                _check(f.name, getattr(self, f.name), *rule)

    @property
    def schedule_steps(self) -> int:
        """The step where the cosine decay ends: ``decay_steps``, or ``steps`` when that is 0."""
        return self.decay_steps or self.steps


# field -> (type, low, high, low_inclusive, hint): numbers outside [low, high] (or NaN/inf) are refused
_RULES = {
    "steps": (int, 1, None, True, "a positive number of optimizer steps"),
    "batch_size": (int, 1, None, True, "a positive number of sequences"),
    "grad_accum": (int, 1, None, True, "a positive number of micro-batches"),
    "seq_len": (int, 1, None, True, "a positive number of tokens"),
    "eval_batches": (int, 1, None, True, "a positive number of batches"),
    "profile_steps": (int, 1, None, True, "a positive number of steps"),
    "context_parallel": (int, 1, None, True, "a positive number of processes per sequence (1 = off)"),
    "warmup_steps": (int, 0, None, True, "0 (no warmup) or a positive number of steps"),
    "decay_steps": (int, 0, None, True, "0 (= --steps) or a positive step"),
    "log_every": (int, 0, None, True, "0 (off) or a positive number of steps"),
    "eval_every": (int, 0, None, True, "0 (only at the end) or a positive number of steps"),
    "save_every": (int, 0, None, True, "0 (only at the end) or a positive number of steps"),
    "sample_tokens": (int, 0, None, True, "0 (no sample) or a positive number of tokens"),
    "lr": (float, 0.0, None, False, "a finite learning rate > 0, e.g. 1e-3"),
    "min_lr_ratio": (float, 0.0, 1.0, True, "a fraction in [0, 1], e.g. 0.1"),
    "weight_decay": (float, 0.0, None, True, "a finite value >= 0, e.g. 0.1"),
    "grad_clip": (float, 0.0, None, True, "a finite max norm >= 0 (0 = off), e.g. 1.0"),
    "distill_alpha": (float, 0.0, 1.0, True, "a weight in [0, 1], e.g. 0.5"),
    "distill_temperature": (float, 0.0, None, False, "a finite temperature > 0, e.g. 2.0"),
}


def _check(name: str, value, kind: type, low, high, low_inclusive: bool, hint: str) -> None:
    flag = "--" + name.replace("_", "-")
    if kind is int:
        ok_type = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok_type:
        raise TypeError(f"{name} ({flag}): expected {hint}, got {value!r} of type {type(value).__name__}.")
    bad = not math.isfinite(value) or (value < low if low_inclusive else value <= low) or (
        high is not None and value > high)
    if bad:
        raise ValueError(f"{name} ({flag}): expected {hint}, got {value!r}.")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``
    at ``cfg.schedule_steps``; steps beyond it stay at the floor (as nanoGPT's ``lr_decay_iters``)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(cfg.schedule_steps - cfg.warmup_steps, 1)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * min(progress, 1.0)))
