"""Distillation: a student trained on the temperature-softened logits of a teacher checkpoint."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .config import TrainConfig
from .data import IGNORE_INDEX
from .evaluate import evaluate
from .modeling import model_bytes, num_params

__all__ = ["distill_loss", "distill_report"]


def distill_loss(logits: Tensor, teacher_logits: Tensor, targets: Tensor, data_loss: Tensor, count: int,
                 cfg: TrainConfig) -> Tensor:
    """``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * data loss``, over answer tokens."""
    T = cfg.distill_temperature
    valid = (targets != IGNORE_INDEX).flatten()
    s = F.log_softmax(logits.float().flatten(0, 1)[valid] / T, dim=-1)
    t = F.log_softmax(teacher_logits.float().flatten(0, 1)[valid] / T, dim=-1)
    kl = F.kl_div(s, t, log_target=True, reduction="sum") / count
    return cfg.distill_alpha * T * T * kl + (1 - cfg.distill_alpha) * data_loss


def distill_report(teacher, student, data, cfg, ctx, results, log) -> dict:
    """Teacher vs student: eval loss, parameters and bytes (logged as one line)."""
    t_eval = evaluate(teacher, data, cfg, ctx)
    s_eval = results.get("eval") or evaluate(student, data, cfg, ctx)
    report = {"teacher_loss": t_eval["loss"], "student_loss": s_eval["loss"],
              "teacher_params": num_params(teacher), "student_params": num_params(student),
              "teacher_bytes": model_bytes(teacher), "student_bytes": model_bytes(student)}
    log(f"distillation: teacher eval loss {report['teacher_loss']:.4f} ({report['teacher_params'] / 1e6:.2f}M params, "
        f"{report['teacher_bytes'] / 2**20:.2f} MiB) | student {report['student_loss']:.4f} "
        f"({report['student_params'] / 1e6:.2f}M params, {report['student_bytes'] / 2**20:.2f} MiB, "
        f"{report['teacher_params'] / report['student_params']:.1f}x smaller)")
    return report
