"""Optional dependencies of the interop package, imported on first use with an error naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA_HINT = "pip install 'attnkit[hf]'"


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` saying which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise ImportError(
            f"{feature} needs the optional package {top!r}, which is not installed. Fix: {EXTRA_HINT}"
        ) from exc
