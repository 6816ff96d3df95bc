"""``Model.from_pretrained(dir_or_run)`` and ``model.save_pretrained(dir)``, as Hugging Face users expect."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PretrainedModel"]


class PretrainedModel:
    """Mixin of the attnkit models: one model format (``config.json`` + ``model.safetensors``).

    >>> model.save_pretrained("my-model")                  # doctest: +SKIP
    >>> GPT.from_pretrained("my-model")                     # doctest: +SKIP
    >>> GPT.from_pretrained("runs/attnkit")                 # a `python -m attnkit train` run  # doctest: +SKIP
    """

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, map_location: str = "cpu"):
        """The model saved in ``path``: a :meth:`save_pretrained` directory, a training run directory
        (its ``latest`` checkpoint) or one ``step-*`` checkpoint. Eval mode, the stored dtype.

        Raises ``TypeError`` when ``path`` holds another kind of model (an ``Encoder`` asked for as
        ``GPT``), ``ValueError`` naming the file when it cannot be trusted as it is."""
        from ..interop.export import load_pretrained

        model = load_pretrained(path, map_location=map_location)
        if not isinstance(model, cls):
            raise TypeError(f"{cls.__name__}.from_pretrained: {path} holds a {type(model).__name__}, not a "
                            f"{cls.__name__}. Fix: {type(model).__name__}.from_pretrained({str(path)!r}).")
        return model

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write ``config.json`` (with ``model_type``) and ``model.safetensors`` into ``directory``."""
        from ..interop.export import save_pretrained

        return save_pretrained(self, directory)
