"""Save and load attnkit models as ``model.safetensors`` + ``config.json`` (exact round trip).

``config.json``::

    {"format": "attnkit", "version": 1, "model_type": "gpt", "model": "GPT", "config_class": "TransformerConfig",
     "config": {...every dataclass field...}, "backend_options": null | {"class": ..., "fields": {...}}}

Tied weights (``lm_head`` and ``embed.tokens``) are stored once, as safetensors requires. Both files
are written atomically (temporary file, then ``os.replace``), so a symbolic link already in the
directory is replaced, never written through.

Loading treats the directory as untrusted: ``config.json`` is size-limited and must be a regular
file; the config is checked against the safetensors *header* (names, shapes, dtypes) on the meta
device before a single weight is allocated, so a 12 KB directory claiming ``vocab_size=5_000_000``
is refused without allocating anything. :func:`load_pretrained` also reads the run directories of
``python -m attnkit train`` (or one of their ``step-*`` checkpoints).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from ._deps import require

__all__ = ["save_pretrained", "load_pretrained", "FORMAT_VERSION", "CONFIG_LIMIT_BYTES"]

FORMAT_VERSION = 1
CONFIG_LIMIT_BYTES = 2**20  # a config.json is a few KB; more is not a config
_FIX = "pass a directory written by save_pretrained() or the --out directory of `python -m attnkit train`"


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
    from ..train.files import atomic_write, atomic_write_text

    config = getattr(model, "config", None)
    if config is None or not dataclasses.is_dataclass(config) or type(model).__name__ not in _model_classes():
        raise TypeError(
            f"model: expected an attnkit model from attnkit.nn.models with a dataclass .config, got "
            f"{type(model).__name__}. Fix: save GPT, Encoder, ... instances."
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fields, options = _config_to_json(config)
    meta = {"format": "attnkit", "version": FORMAT_VERSION, "model_type": type(model).__name__.lower(),
            "model": type(model).__name__, "config_class": type(config).__name__, "config": fields,
            "backend_options": options}
    # weights first: a crash between the two leaves no config.json that promises them
    atomic_write(directory / "model.safetensors", lambda tmp: st.save_model(model, tmp, metadata={"format": "pt"}))
    atomic_write_text(directory / "config.json", json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return directory


def _fail(path, problem: str) -> ValueError:
    from ..train.checkpoint import CheckpointError

    return CheckpointError(f"load_pretrained: {path}: {problem}. Fix: {_FIX}.")


def _read_config(config_file: Path) -> dict:
    from ..train.files import read_json

    meta = read_json(config_file, limit_bytes=CONFIG_LIMIT_BYTES, fix=_FIX + ".")
    if not isinstance(meta, dict) or meta.get("format") != "attnkit" or meta.get("version") != FORMAT_VERSION:
        got = meta if not isinstance(meta, dict) else {k: meta.get(k) for k in ("format", "version")}
        raise ValueError(
            f"load_pretrained: {config_file} is not an attnkit v{FORMAT_VERSION} config ({got!r:.120}). "
            f"Fix: for Hugging Face checkpoints use load_bert / gpt2_from_hf."
        )
    models, configs = _model_classes(), _config_classes()
    if meta.get("model") not in models or meta.get("config_class") not in configs:
        raise _fail(config_file, f"unknown model {meta.get('model')!r:.60} or config class "
                                 f"{meta.get('config_class')!r:.60} (known: {', '.join(sorted(models))})")
    model_type = meta.get("model_type", meta["model"].lower())
    if model_type != meta["model"].lower():
        raise _fail(config_file, f"model_type {model_type!r:.60} disagrees with model {meta['model']!r}")
    if not isinstance(meta.get("config"), dict):
        raise _fail(config_file, "'config' is missing or not an object")
    options = meta.get("backend_options")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("fields"), dict)):
        raise _fail(config_file, "'backend_options' must be null or {'class': ..., 'fields': {...}}")
    return meta


def _header(weights: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype)}`` from a safetensors header, without reading the tensors."""
    from safetensors import safe_open

    if os.path.islink(weights) or not weights.is_file():
        raise _fail(weights, "missing, or not a regular file")
    try:
        with safe_open(str(weights), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as exc:  # safetensors' own SafetensorError, OSError, ...
        raise _fail(weights, f"not a readable safetensors file ({type(exc).__name__}: {exc})") from None


def _build(meta: dict):
    def build():
        fields = dict(meta["config"])
        if meta.get("backend_options"):
            from ..registry import get_backend

            options_cls = get_backend(fields.get("backend")).Options
            if options_cls is None:
                raise ValueError(f"backend {fields.get('backend')!r} takes no options")
            fields["backend_options"] = options_cls(**meta["backend_options"]["fields"])
        config = _config_classes()[meta["config_class"]](**fields)
        return _model_classes()[meta["model"]](config)

    return build


def load_pretrained(directory: str | os.PathLike, *, map_location: str = "cpu") -> torch.nn.Module:
    """Rebuild the model saved by :func:`save_pretrained` (eval mode, same dtype as saved), or the
    model of a training run directory / checkpoint. Refusals are ``ValueError`` naming the file."""
    st = require("safetensors.torch", "load_pretrained")
    from ..train.checkpoint import model_from_header

    directory = Path(directory)
    config_file = directory / "config.json"
    if not os.path.lexists(config_file):
        if (directory / "latest").is_file() or (directory / "meta.json").is_file():
            from ..train.modeling import load_model

            return load_model(str(directory), map_location)[0]
        raise FileNotFoundError(f"load_pretrained: {config_file} not found. Fix: {_FIX}.")
    meta = _read_config(config_file)
    weights = directory / "model.safetensors"
    header = _header(weights)
    dtypes = {dtype for _, dtype in header.values()}
    if len(dtypes) > 1:
        raise _fail(weights, f"tensors of several dtypes {sorted(dtypes)}; save_pretrained stores one")
    model = model_from_header(_build(meta), header, str(config_file), config=meta["config"])
    state = st.load_file(str(weights), device=map_location)
    if state:
        model = model.to(next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    stored = {own[k].data_ptr() for k in state if k in own}
    untied = [k for k in missing if own[k].data_ptr() not in stored]  # tied weights are stored once
    if untied or unexpected:
        raise _fail(weights, f"does not fit {meta['model']}: missing {untied[:8]}, unexpected {unexpected[:8]}")
    return model.eval()
