"""Save and load attnkit models as ``model.safetensors`` + ``config.json`` (exact round trip).

``config.json``::

    {"format": "attnkit", "version": 1, "model": "GPT", "config_class": "TransformerConfig",
     "config": {...every dataclass field...}, "backend_options": null | {"backend": ..., "fields": {...}}}

Tied weights (``lm_head`` and ``embed.tokens``) are stored once, as safetensors requires.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from ._deps import require

__all__ = ["save_pretrained", "load_pretrained", "FORMAT_VERSION"]

FORMAT_VERSION = 1


def _model_classes() -> dict[str, type]:
    from ..nn import models

    return {name: obj for name, obj in vars(models).items() if isinstance(obj, type) and issubclass(obj, torch.nn.Module)}


def _config_classes() -> dict[str, type]:
    from ..nn import layers, models

    found = {}
    for module in (layers, models):
        found.update({n: o for n, o in vars(module).items() if isinstance(o, type) and dataclasses.is_dataclass(o)})
    return found


def _config_to_json(config) -> tuple[dict, dict | None]:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    options = fields.pop("backend_options", None)
    if options is not None:
        options = {"class": type(options).__name__, "fields": dataclasses.asdict(options)}
    return fields, options


def save_pretrained(model: torch.nn.Module, directory: str | os.PathLike) -> Path:
    """Write ``model.safetensors`` and ``config.json`` for an attnkit model (``GPT``, ``Encoder``, ...)."""
    st = require("safetensors.torch", "save_pretrained")
    config = getattr(model, "config", None)
    if config is None or not dataclasses.is_dataclass(config) or type(model).__name__ not in _model_classes():
        raise TypeError(
            f"model: expected an attnkit model from attnkit.nn.models with a dataclass .config, got "
            f"{type(model).__name__}. Fix: save GPT, Encoder, ... instances."
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fields, options = _config_to_json(config)
    meta = {"format": "attnkit", "version": FORMAT_VERSION, "model": type(model).__name__,
            "config_class": type(config).__name__, "config": fields, "backend_options": options}
    (directory / "config.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    st.save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def load_pretrained(directory: str | os.PathLike, *, map_location: str = "cpu") -> torch.nn.Module:
    """Rebuild the model saved by :func:`save_pretrained` (eval mode, same dtype as saved)."""
    st = require("safetensors.torch", "load_pretrained")
    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"load_pretrained: {config_file} not found. Fix: pass a save_pretrained() directory.")
    meta = json.loads(config_file.read_text())
    if meta.get("format") != "attnkit" or meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"load_pretrained: {config_file} is not an attnkit v{FORMAT_VERSION} config (format={meta.get('format')!r}, "
            f"version={meta.get('version')!r}). Fix: for Hugging Face checkpoints use load_bert / gpt2_from_hf."
        )
    models, configs = _model_classes(), _config_classes()
    if meta["model"] not in models or meta["config_class"] not in configs:
        raise ValueError(f"load_pretrained: unknown model {meta['model']!r} or config {meta['config_class']!r}.")
    fields = dict(meta["config"])
    if meta.get("backend_options"):
        from ..registry import get_backend

        options_cls = get_backend(fields["backend"]).Options
        fields["backend_options"] = options_cls(**meta["backend_options"]["fields"])
    config = configs[meta["config_class"]](**fields)
    model = models[meta["model"]](config)
    state = st.load_file(str(directory / "model.safetensors"), device=map_location)
    if state:
        model = model.to(next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    stored = {own[k].data_ptr() for k in state if k in own}
    untied = [k for k in missing if own[k].data_ptr() not in stored]  # tied weights are stored once
    if untied or unexpected:
        raise ValueError(
            f"load_pretrained: {directory / 'model.safetensors'} does not fit {meta['model']}: missing {untied[:8]}, "
            f"unexpected {unexpected[:8]}. Fix: save and load with the same attnkit version."
        )
    return model.eval()
