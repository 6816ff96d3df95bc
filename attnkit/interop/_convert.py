"""Shared pieces of the checkpoint converters: activation names and a strict state-dict copy."""

from __future__ import annotations

import torch
from torch import Tensor

# HF hidden_act / activation_function -> attnkit TransformerConfig.activation
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu", "swish": "silu"}


def activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"hidden_act: {name!r} has no attnkit equivalent; expected one of {sorted(ACTIVATIONS)}. "
            "Fix: use a checkpoint with a supported activation."
        )
    return ACTIVATIONS[name]


def copy_state(model: torch.nn.Module, converted: dict[str, Tensor], *, what: str, fix: str,
               optional: tuple[str, ...] = ()) -> torch.nn.Module:
    """Copy ``converted`` (attnkit names) into ``model``: every parameter except ``optional`` must be
    given, nothing extra, same shapes; else ``ValueError`` listing what differs and ``fix``."""
    own = model.state_dict()
    missing = [k for k in own if k not in converted and k not in optional]
    unexpected = [k for k in converted if k not in own]
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in converted.items()
             if k in own and own[k].shape != v.shape]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{what} does not fit the attnkit {type(model).__name__}: missing {missing[:8]}, unexpected "
            f"{unexpected[:8]}, shapes (checkpoint vs model) {wrong[:8]}. Fix: {fix}"
        )
    with torch.no_grad():
        for key, value in converted.items():
            own[key].copy_(value)
    return model
