"""One model format, Hugging Face style: ``Model.from_pretrained(dir_or_run)`` / ``model.save_pretrained(dir)``.

A directory holds ``model.safetensors`` and ``config.json``::

    {"format": "attnkit", "version": 1, "model_type": "gpt", "model": "GPT", "config_class": "TransformerConfig",
     "config": {...every dataclass field...}, "backend_options": null | {"class": ..., "fields": {...}}}

Tied weights (``lm_head`` and ``embed.tokens``) are stored once, as safetensors requires. Both files
are written atomically (temporary file, then ``os.replace``), so a symbolic link already in the
directory is replaced, never written through.

Loading treats the directory as untrusted: ``config.json`` is size-limited and must be a regular
file; the config is checked against the safetensors *header* (names, shapes, dtypes) on the meta
device before a single weight is allocated, so a 12 KB directory claiming ``vocab_size=5_000_000``
is refused without allocating anything. Tensors the config derives rather than stores (ViT's
sin/cos position table grows with ``image_size``) are sized on the meta device too and refused
beyond a bound; weights holding NaN or infinity are refused. ``from_pretrained`` also reads the run directories of
``python -m attnkit train`` (their ``latest`` checkpoint) and their ``step-*`` checkpoints.

Model classes register themselves by subclassing :class:`PretrainedModel`, so this module needs no
import of the models that use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from ..io.checkpoints import load_checkpoint
from ..io.files import atomic_write, atomic_write_text, read_json
from ..io.weights import (CheckpointError, check_finite_weights, load_model_weights, model_from_header, read_header,
                          require_safetensors)
from .layers import TransformerConfig

__all__ = ["PretrainedModel", "save_pretrained", "load_pretrained", "config_from_dict", "FORMAT_VERSION",
           "CONFIG_LIMIT_BYTES"]

FORMAT_VERSION = 1
CONFIG_LIMIT_BYTES = 2**20  # a config.json is a few KB; more is not a config
_FIX = "pass a directory written by save_pretrained() or the --out directory of `attnkit train`"
_MODELS: dict[str, type] = {}


class PretrainedModel:
    """Mixin of the attnkit models (``GPT``, ``Encoder``, ``Decoder``, ``EncoderDecoder``, ``ViT``).

    >>> model.save_pretrained("my-model")                  # doctest: +SKIP
    >>> GPT.from_pretrained("my-model")                     # doctest: +SKIP
    >>> GPT.from_pretrained("runs/attnkit")                 # a `python -m attnkit train` run  # doctest: +SKIP
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.__name__.startswith("_"):
            _MODELS[cls.__name__] = cls

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, map_location: str = "cpu"):
        """The model saved in ``path``: a :meth:`save_pretrained` directory, a training run directory
        (its ``latest`` checkpoint) or one ``step-*`` checkpoint. Eval mode, the stored dtype.

        Raises ``TypeError`` when ``path`` holds another kind of model (an ``Encoder`` asked for as
        ``GPT``), ``ValueError`` naming the file when it cannot be trusted as it is."""
        model = load_pretrained(path, map_location=map_location)
        if not isinstance(model, cls):
            raise TypeError(f"{cls.__name__}.from_pretrained: {path} holds a {type(model).__name__}, not a "
                            f"{cls.__name__}. Fix: {type(model).__name__}.from_pretrained({str(path)!r}).")
        return model

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` (with ``model_type``) and ``model.safetensors`` into ``directory``."""
        return save_pretrained(self, directory)


def _config_classes() -> dict[str, type]:
    """``TransformerConfig`` and its subclasses (``ViTConfig``), by name."""
    found, todo = {}, [TransformerConfig]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return found


def config_from_dict(cls: type, values: dict):
    """``cls(**values)`` without the keys ``cls`` does not have (configs written by other versions)
    and without ``backend_options`` (stored apart)."""
    names = {f.name for f in dataclasses.fields(cls)} - {"backend_options"}
    return cls(**{k: v for k, v in values.items() if k in names})


def save_pretrained(model: torch.nn.Module, directory: str | os.PathLike) -> Path:
    """Write ``model.safetensors`` and ``config.json`` for an attnkit model (``GPT``, ``Encoder``, ...)."""
    st = require_safetensors()
    config = getattr(model, "config", None)
    if config is None or not dataclasses.is_dataclass(config) or type(model).__name__ not in _MODELS:
        raise TypeError(
            f"model: expected an attnkit model from attnkit.nn.models with a dataclass .config, got "
            f"{type(model).__name__}. Fix: save GPT, Encoder, ... instances."
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    options = fields.pop("backend_options", None)
    if options is not None:
        options = {"class": type(options).__name__, "fields": dataclasses.asdict(options)}
    meta = {"format": "attnkit", "version": FORMAT_VERSION, "model_type": type(model).__name__.lower(),
            "model": type(model).__name__, "config_class": type(config).__name__, "config": fields,
            "backend_options": options}
    # weights first: a crash between the two leaves no config.json that promises them
    atomic_write(directory / "model.safetensors", lambda tmp: st.save_model(model, tmp, metadata={"format": "pt"}))
    atomic_write_text(directory / "config.json", json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return directory


def _fail(path, problem: str) -> ValueError:
    return CheckpointError(f"load_pretrained: {path}: {problem}. Fix: {_FIX}.")


def _read_config(config_file: Path) -> dict:
    meta = read_json(config_file, limit_bytes=CONFIG_LIMIT_BYTES, fix=_FIX + ".")
    if not isinstance(meta, dict) or meta.get("format") != "attnkit" or meta.get("version") != FORMAT_VERSION:
        got = meta if not isinstance(meta, dict) else {k: meta.get(k) for k in ("format", "version")}
        raise ValueError(
            f"load_pretrained: {config_file} is not an attnkit v{FORMAT_VERSION} config ({got!r:.120}). "
            f"Fix: for Hugging Face checkpoints use load_bert / gpt2_from_hf."
        )
    if meta.get("model") not in _MODELS or meta.get("config_class") not in _config_classes():
        raise _fail(config_file, f"unknown model {meta.get('model')!r:.60} or config class "
                                 f"{meta.get('config_class')!r:.60} (known: {', '.join(sorted(_MODELS))})")
    model_type = meta.get("model_type", meta["model"].lower())
    if model_type != meta["model"].lower():
        raise _fail(config_file, f"model_type {model_type!r:.60} disagrees with model {meta['model']!r}")
    if not isinstance(meta.get("config"), dict):
        raise _fail(config_file, "'config' is missing or not an object")
    options = meta.get("backend_options")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("fields"), dict)):
        raise _fail(config_file, "'backend_options' must be null or {'class': ..., 'fields': {...}}")
    return meta


def _builder(meta: dict):
    def build():
        fields = dict(meta["config"])
        if meta.get("backend_options"):
            from ..registry import get_backend

            options_cls = get_backend(fields.get("backend")).Options
            if options_cls is None:
                raise ValueError(f"backend {fields.get('backend')!r} takes no options")
            fields["backend_options"] = options_cls(**meta["backend_options"]["fields"])
        return _MODELS[meta["model"]](_config_classes()[meta["config_class"]](**fields))

    return build


def _load_run(path: Path, map_location: str) -> torch.nn.Module:
    """The GPT of a training run directory or checkpoint (an LSTM baseline is not an attnkit model)."""
    meta, weights, _ = load_checkpoint(str(path))
    if meta["model_kind"] != "gpt":
        raise TypeError(f"load_pretrained: {path} is a run of the {meta['model_kind']!r} baseline, not an attnkit "
                        f"model. Fix: attnkit.train.load_model({str(path)!r}).")
    model = model_from_header(lambda: _MODELS["GPT"](config_from_dict(TransformerConfig, meta["model_config"])),
                              weights, str(path), config=meta["model_config"])
    load_model_weights(model, weights)
    return model.to(map_location).eval()


def load_pretrained(directory: str | os.PathLike, *, map_location: str = "cpu") -> torch.nn.Module:
    """Rebuild the model saved by :func:`save_pretrained` (eval mode, same dtype as saved), or the
    GPT of a training run directory / checkpoint. Refusals are ``ValueError`` naming the file."""
    st = require_safetensors()
    directory = Path(directory)
    config_file = directory / "config.json"
    if not os.path.lexists(config_file):
        if os.path.lexists(directory / "latest") or os.path.lexists(directory / "meta.json"):
            return _load_run(directory, map_location)
        raise FileNotFoundError(f"load_pretrained: {config_file} not found. Fix: {_FIX}.")
    meta = _read_config(config_file)
    weights = directory / "model.safetensors"
    header = read_header(weights, fix=_FIX)
    dtypes = {dtype for _, dtype in header.values()}
    if len(dtypes) > 1:
        raise _fail(weights, f"tensors of several dtypes {sorted(dtypes)}; save_pretrained stores one")
    model = model_from_header(_builder(meta), header, str(config_file), config=meta["config"])
    state = st.load_file(str(weights), device=map_location)
    check_finite_weights(state, str(weights))
    if state:
        model = model.to(next(iter(state.values())).dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    stored = {own[k].data_ptr() for k in state if k in own}
    untied = [k for k in missing if own[k].data_ptr() not in stored]  # tied weights are stored once
    if untied or unexpected:
        raise _fail(weights, f"does not fit {meta['model']}: missing {untied[:8]}, unexpected {unexpected[:8]}")
    return model.eval()
