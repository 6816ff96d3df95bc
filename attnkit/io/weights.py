"""The safetensors weight format: reading files and headers, checking weights against a model.

Everything here treats a file as untrusted: safetensors only (never ``torch.load``/pickle), a
symbolic link is refused, a stored config is checked against the file's *header* on the meta device
before the model is allocated (:func:`model_from_header`), and weights holding NaN or infinity are
refused (attnkit never saves them). Every refusal is a :class:`CheckpointError` (a ``ValueError``)
naming the file and the fix. The model directory format (``nn.pretrained``) and training checkpoints
(``io.checkpoints``, ``train.checkpoint``) are built on these.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

__all__ = ["CheckpointError", "require_safetensors", "read_safetensors", "read_header", "check_finite_weights",
           "model_from_header", "load_model_weights"]

_FIX = "keep the config and the weights of one save together; a file edited by hand cannot be trusted"


class CheckpointError(ValueError):
    """A checkpoint, run or model directory that cannot be used as it is (the message names the file and the fix)."""


def require_safetensors() -> ModuleType:
    """``safetensors.torch``, or ``ImportError`` naming the extra that installs it."""
    try:
        import safetensors.torch as st
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("saving and loading weights needs the optional package 'safetensors', which is not "
                          "installed. Fix: pip install 'attnkit[train]' (training), or pip install 'attnkit[hf]' "
                          "(Hugging Face interop); both carry it") from exc
    return st


def _fail(path, problem: str, fix: str) -> CheckpointError:
    return CheckpointError(f"checkpoint: {path}: {problem}. Fix: {fix}.")


def read_safetensors(path: str | os.PathLike, *, device: str = "cpu", fix: str = _FIX) -> dict[str, Tensor]:
    """The tensors of a safetensors file, with a ``CheckpointError`` naming the file when it is not one."""
    st = require_safetensors()
    path = os.fspath(path)
    if os.path.islink(path):
        raise _fail(path, "is a symbolic link", fix)
    try:
        return st.load_file(path, device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError, ValueError)
        raise _fail(path, f"not a readable safetensors file ({type(exc).__name__}: {exc})", fix) from None


def read_header(path: str | os.PathLike, *, fix: str = _FIX) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{name: (shape, dtype)}`` from a safetensors header, without reading the tensors."""
    require_safetensors()
    from safetensors import safe_open

    path = Path(path)
    if os.path.islink(path) or not path.is_file():
        raise _fail(path, "missing, or not a regular file", fix)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as exc:  # safetensors' own SafetensorError, OSError, ...
        raise _fail(path, f"not a readable safetensors file ({type(exc).__name__}: {exc})", fix) from None


def check_finite_weights(tensors: Mapping[str, Tensor], path: str) -> None:
    """Refuse stored weights holding a NaN or an infinity: attnkit never saves such weights, so the
    file was damaged or edited, and a model loaded from it would answer NaN."""
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(f"checkpoint: {path}: {len(bad)} weight tensor(s) hold NaN or infinity "
                              f"({', '.join(bad[:3])}); attnkit never saves such weights, so the file was damaged "
                              f"or edited. Fix: load another checkpoint (the run keeps the previous one).")


def _aliases(model: nn.Module) -> dict[str, set[str]]:
    """Each state-dict name -> every name of the same tensor (tied weights share one)."""
    groups: dict[int, set[str]] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, p in named:
        groups.setdefault(id(p), set()).add(name)
    return {n: group for group in groups.values() for n in group}


def model_from_header(build: Callable[[], nn.Module],
                      stored: Mapping[str, tuple[tuple[int, ...], str]] | Mapping[str, Tensor], where: str, *,
                      config: Mapping | None = None) -> nn.Module:
    """``build()`` after checking on the meta device (no memory) that the model it makes has exactly
    the stored tensors, with the same shapes and dtype families.

    ``stored`` maps names to tensors or to ``(shape, dtype name)`` as read from a safetensors header.
    Every layer stores at least one tensor, so a ``config`` whose ``num_layers`` exceeds the number
    of stored tensors is refused before even the meta-device model is built (building a million
    layers takes minutes). Raises ``CheckpointError`` naming ``where``."""
    info = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) if isinstance(v, Tensor) else (tuple(v[0]), v[1])
            for k, v in stored.items()}
    layers = (config or {}).get("num_layers")
    if isinstance(layers, int) and layers > len(info):
        raise CheckpointError(f"{where}: the stored config claims num_layers={layers} but the weights hold only "
                              f"{len(info)} tensors; nothing was allocated. Fix: keep the config and the weights "
                              f"of one save together (a hand-edited config cannot be loaded).")
    with torch.device("meta"):
        try:
            skeleton = build()
        except (TypeError, ValueError, LookupError) as exc:  # the config's own validation, unknown names
            raise CheckpointError(f"{where}: the stored config is not valid ({type(exc).__name__}: {exc}). "
                                  f"Fix: keep the config and the weights of one save together.") from None
        except (RuntimeError, OverflowError, MemoryError) as exc:  # sizes no tensor can have (2**31 x 2**31)
            raise CheckpointError(f"{where}: the stored config asks for tensors too large to exist "
                                  f"({type(exc).__name__}: {str(exc)[:200]}); nothing was allocated. Fix: keep the "
                                  f"config and the weights of one save together (a hand-edited config cannot be "
                                  f"loaded).") from None
    expected = {k: (tuple(t.shape), t.is_floating_point()) for k, t in skeleton.state_dict().items()}
    aliases = _aliases(skeleton)
    unexpected = [k for k in info if k not in expected]
    missing = [k for k in expected if not (aliases.get(k, {k}) & info.keys())]
    wrong = [f"{k}: stored {list(info[k][0])} {info[k][1]}, config needs {list(expected[k][0])}"
             for k in info if k in expected and (info[k][0] != expected[k][0]
                                                 or _is_float_name(info[k][1]) != expected[k][1])]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"{where}: the stored config does not describe the stored weights (missing {missing[:4]}, unexpected "
            f"{unexpected[:4]}, mismatched {wrong[:3]}); nothing was allocated. Fix: keep the config and the "
            f"weights of one save together (a hand-edited config cannot be loaded).")
    _check_derived_sizes(skeleton, info, where)
    del skeleton
    return build()


DERIVED_LIMIT_BYTES = 256 * 2**20  # tensors a config derives (position tables, caches) beyond the stored weights


def _check_derived_sizes(skeleton: nn.Module, info: Mapping[str, tuple[tuple[int, ...], str]], where: str) -> None:
    """Refuse a config whose tensors that are *not* stored (a sin/cos position table, a cache, both
    computed from the config) would take more than ``max(4 x the stored weights, DERIVED_LIMIT_BYTES)``."""
    stored_bytes = sum(math.prod(shape) * 4 for shape, _ in info.values())
    kept = set(skeleton.state_dict())
    derived = [(name, t) for name, t in skeleton.named_buffers() if name not in kept]
    total = sum(t.numel() * t.element_size() for _, t in derived)
    limit = max(4 * stored_bytes, DERIVED_LIMIT_BYTES)
    if total > limit:
        name, t = max(derived, key=lambda nt: nt[1].numel())
        raise CheckpointError(f"{where}: the stored config derives {total / 2**20:.0f} MiB of tensors that are not "
                              f"stored (largest: {name} {list(t.shape)}), more than the {limit / 2**20:.0f} MiB "
                              f"allowed beside {stored_bytes / 2**20:.1f} MiB of weights; nothing was allocated. "
                              f"Fix: keep the config and the weights of one save together (a hand-edited config "
                              f"cannot be loaded).")


def _is_float_name(dtype: str) -> bool:
    return dtype.lower() in ("float64", "float32", "float16", "bfloat16", "f64", "f32", "f16", "bf16")


def load_model_weights(model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Load weights saved by :func:`save_checkpoint` (tied tensors were stored once)."""
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # a tied weight is stored under one of its names; the others are loaded through it
    by_name = _aliases(model)
    missing = [m for m in missing if not (by_name.get(m, set()) & tensors.keys())]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint: weights do not match the model (missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}); was it saved from a different config?")


