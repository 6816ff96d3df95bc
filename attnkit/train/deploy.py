"""Deployment helpers: dynamic int8 quantization of the linear layers for CPU inference."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.utils import benchmark

from .evaluate import evaluate
from .modeling import model_bytes

__all__ = ["quantize_model_int8", "quantize_report", "quantize_int8"]


def quantize_model_int8(model: nn.Module) -> nn.Module:
    """A CPU copy of ``model`` whose ``nn.Linear`` layers run int8 weights with dynamically quantized
    activations (``torch.ao.quantization.quantize_dynamic``); embeddings and norms stay float."""
    from torch.ao.quantization import quantize_dynamic

    float_model = copy.deepcopy(model).float().cpu().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        return quantize_dynamic(float_model, {nn.Linear}, dtype=torch.qint8)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Deprecated name of :func:`quantize_model_int8` (``attnkit.cache.quantize_int8`` quantizes K/V
    tensors, not a model)."""
    warnings.warn("attnkit.train.deploy.quantize_int8 is renamed quantize_model_int8 (attnkit.cache.quantize_int8 "
                  "is the K/V tensor quantizer); the old name will be removed.", DeprecationWarning, stacklevel=2)
    return quantize_model_int8(model)


def quantize_report(model: nn.Module, data, cfg, log=print, repeats: int = 3) -> dict:
    """Eval loss and forward time of the float model vs its int8 version on CPU (same batch, interleaved)."""
    from dataclasses import replace

    fp = copy.deepcopy(model).float().cpu().eval()
    q = quantize_model_int8(fp)
    cpu_cfg = replace(cfg, precision="fp32", device="cpu")
    loss_fp = evaluate(fp, data, cpu_cfg, device=torch.device("cpu"))["loss"]
    loss_q = evaluate(q, data, cpu_cfg, device=torch.device("cpu"))["loss"]
    x, _ = data.sample("val", cfg.seed, 0, max(cfg.batch_size // 2, 1), cfg.seq_len)
    times = {"fp32": [], "int8": []}
    with torch.inference_mode():
        for _ in range(repeats):  # interleave: the CPU is shared and noisy
            for name, m in (("fp32", fp), ("int8", q)):
                t = benchmark.Timer("m(x)", globals={"m": m, "x": x},
                                    num_threads=torch.get_num_threads()).blocked_autorange(min_run_time=0.3)
                times[name].append(t.median)
    t_fp, t_q = min(times["fp32"]), min(times["int8"])
    report = {"fp32_loss": loss_fp, "int8_loss": loss_q, "loss_delta": loss_q - loss_fp,
              "fp32_ms": t_fp * 1e3, "int8_ms": t_q * 1e3, "speedup": t_fp / t_q,
              "fp32_bytes": model_bytes(fp), "int8_bytes": model_bytes(q)}
    log(f"int8 dynamic quantization (CPU, batch {tuple(x.shape)}): forward {report['fp32_ms']:.1f} ms -> "
        f"{report['int8_ms']:.1f} ms ({report['speedup']:.2f}x); eval loss {loss_fp:.4f} -> {loss_q:.4f} "
        f"({report['loss_delta']:+.4f}); weights {report['fp32_bytes'] / 2**20:.2f} -> "
        f"{report['int8_bytes'] / 2**20:.2f} MiB")
    return report
