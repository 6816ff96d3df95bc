"""Save and load attnkit models as ``model.safetensors`` + ``config.json`` (exact round trip).

The format and its checks live with the models (:mod:`attnkit.nn.pretrained`: ``GPT.from_pretrained``,
``model.save_pretrained``); these are the same functions under the interop package's names.
"""

from __future__ import annotations

from ..nn.pretrained import CONFIG_LIMIT_BYTES, FORMAT_VERSION, load_pretrained, save_pretrained

__all__ = ["save_pretrained", "load_pretrained", "FORMAT_VERSION", "CONFIG_LIMIT_BYTES"]
