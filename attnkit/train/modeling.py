"""The models a run trains: building one from a stored config, loading a checkpoint, sizes, sampling."""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import Tensor, nn

from ..generation import process_logits
from .checkpoint import load_checkpoint, load_model_weights, model_from_header
from .config import GPT_TRAIN_DEFAULTS, MODEL_KINDS
from .data import decode, encode
from .lstm import LSTMConfig, LSTMLanguageModel

__all__ = ["build_model", "config_dict", "default_model_config", "load_model", "num_params",
           "model_bytes", "sample_text"]

def _config_class(kind: str):
    if kind == "lstm":
        return LSTMConfig
    from ..nn.layers import TransformerConfig

    return TransformerConfig


def build_model(kind: str, config: dict) -> nn.Module:
    """A model from its kind and config dict (as stored in a checkpoint's meta.json).

    Unknown keys are ignored (configs written by other attnkit versions); wrong values raise the
    config's own ``ValueError``."""
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind: expected one of {MODEL_KINDS}, got {kind!r}.")
    from ..nn.pretrained import config_from_dict

    model_config = config_from_dict(_config_class(kind), config)
    if kind == "lstm":
        return LSTMLanguageModel(model_config)
    from ..nn.models import GPT

    return GPT(model_config)


def default_model_config(kind: str):
    """The config a new run of ``kind`` starts from (``GPT_TRAIN_DEFAULTS`` for the GPT)."""
    return LSTMConfig() if kind == "lstm" else _config_class(kind)(**GPT_TRAIN_DEFAULTS)


def config_dict(config) -> dict:
    return {k: v for k, v in asdict(config).items() if k != "backend_options"}


def load_model(path: str, device: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """The model of a checkpoint (run directory or step directory) and its meta.

    The stored config is checked against the weights' shapes before any weight is allocated."""
    meta, weights, _ = load_checkpoint(path)
    model = model_from_header(lambda: build_model(meta["model_kind"], meta["model_config"]), weights, path,
                              config=meta["model_config"])
    load_model_weights(model, weights)
    return model.to(device).eval(), meta


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts tied weights once


def model_bytes(model: nn.Module) -> int:
    """Bytes of the weights as stored (state dict, tied tensors once, packed int8 counted as such)."""
    seen, total = set(), 0
    for value in model.state_dict().values():
        tensors = value if isinstance(value, tuple) else (value,)
        for t in tensors:
            if isinstance(t, Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def sample_text(model: nn.Module, prompt: str, max_new_tokens: int, *, temperature: float = 0.8,
                top_k: int | None = 40, device="cpu", seed: int = 0) -> str:
    """A sample from a byte-level model, without touching the global RNG stream (resume stays exact)."""
    ids = encode(prompt)[None].to(device)
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = _generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k)
    model.train(was_training)
    return decode(out[0, ids.shape[1]:].tolist())


def _generate(model, ids: Tensor, max_new_tokens: int, *, temperature: float, top_k: int | None) -> Tensor:
    config = getattr(model, "config", None)
    if getattr(config, "position", None) == "learned":  # a learned-position table ends at max_len
        max_new_tokens = min(max_new_tokens, config.max_len - ids.shape[1])
    if not isinstance(model, LSTMLanguageModel):
        from ..generation import generate

        return generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k)
    for _ in range(max_new_tokens):  # the LSTM baseline: no KV cache, rerun the prefix
        scores = process_logits(model(ids)[:, -1], temperature=temperature, top_k=top_k)
        ids = torch.cat([ids, torch.multinomial(scores.softmax(-1), 1)], dim=1)
    return ids
