"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically, loaded without pickle.

The layout of a run directory (``latest``, ``step-XXXXXX/{model,state}.safetensors``, ``meta.json``)
and reading it as untrusted data live in :mod:`attnkit.io.checkpoints`; this module writes it.

A checkpoint directory is first written under a temporary name, flushed, and renamed into place
with ``os.replace``; only then is ``latest`` replaced (temp file + ``os.replace``), and only then
are the old checkpoints rotated out (each renamed to a temporary name before it is deleted). So a
``step-*`` directory is always complete, and a crash at any moment leaves a resumable run: a run
directory resolves to the newest of ``latest`` and its complete ``step-*`` directories (a kill
between the rename and the ``latest`` update leaves ``latest`` one save behind, or absent after the
first save). The next save removes the crashed one's temporary directory. Weights with a NaN or
infinity are never saved, so a diverging run cannot rotate the good checkpoints out.

Loading treats the directory as untrusted: ``safetensors`` and ``json`` only, never
``torch.load``/pickle; ``latest`` must name a checkpoint directory inside the run directory (no
``..``, absolute paths or symbolic links); ``meta.json`` is size-limited and checked field by field;
a stored config is checked against the weights' shapes before the model is allocated
(:func:`model_from_header`), including the tensors the config derives that are not stored; weights
holding NaN or infinity are refused (attnkit never saves them); resuming needs the stored RNG state
(without it the continuation would not be exact). Every refusal is a ``ValueError`` naming the file and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from torch import Tensor, nn

from ..io import checkpoints as _layout
from ..io.checkpoints import (CHECKPOINT_NAME, FILES, META_LIMIT_BYTES, check_meta, checkpoint_names,  # noqa: F401
                              checkpoint_order, newest_checkpoint, resolve_checkpoint)
from ..io.files import atomic_write_text, fsync_dir, remove_stale_temporaries, temp_prefix
from ..io.weights import (CheckpointError, check_finite_weights, load_model_weights, model_from_header,
                          read_safetensors, require_safetensors)
from .config import MODEL_KINDS

__all__ = ["save_checkpoint", "load_checkpoint", "resolve_checkpoint", "load_model_weights", "model_from_header",
           "checkpoint_names", "checkpoint_order", "newest_checkpoint",
           "non_finite_parameters", "check_finite_weights", "read_safetensors", "CheckpointError"]

_FIX = "pass the --out directory of a training run made by attnkit (or one of its step-* directories)"


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict]:
    """Split ``optimizer.state_dict()`` into tensors (for safetensors) and JSON-able rest."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for pid, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                tensors[f"optim.{pid}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars[f"{pid}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = value
    for name, value in meta["scalars"].items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def rng_tensors() -> dict[str, Tensor]:
    out = {"rng.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def restore_rng(tensors: dict[str, Tensor]) -> None:
    if "rng.cpu" in tensors:
        torch.set_rng_state(tensors["rng.cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def _weights(model: nn.Module) -> dict[str, Tensor]:
    """The state dict with each tied tensor once (under its first name) and every tensor in storage
    of its own: safetensors refuses shared storage, which ties and cuDNN's flattened LSTM weights use."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu", copy=True).contiguous()
    return out


def non_finite_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters and floating buffers holding a NaN or an infinity."""
    bad = []
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append(name)
    return bad


def save_checkpoint(out_dir: str, step: int, model: nn.Module, meta: dict,
                    optimizer: torch.optim.Optimizer | None = None, keep: int = 2) -> str:
    """Write ``out_dir/step-XXXXXX`` atomically, point ``out_dir/latest`` at it, keep the newest ``keep``.

    Refuses (``CheckpointError``, nothing written or rotated) when a weight is NaN or infinite."""
    st = require_safetensors()
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step: expected an int >= 0, got {step!r}.")
    bad = non_finite_parameters(model)
    if bad:
        raise CheckpointError(f"checkpoint: refusing to save step {step} to {out_dir}: {len(bad)} weight tensor(s) "
                              f"hold NaN or infinity ({', '.join(bad[:3])}); the previous checkpoints are kept. "
                              f"Fix: resume from them with a lower --lr or a --grad-clip.")
    os.makedirs(out_dir, exist_ok=True)
    remove_stale_temporaries(out_dir)
    name = f"step-{step:06d}"
    revision = 0
    while os.path.lexists(os.path.join(out_dir, name)):  # re-saving a step never touches the saved one
        revision += 1
        name = f"step-{step:06d}-r{revision}"
    final = os.path.join(out_dir, name)
    tmp = tempfile.mkdtemp(prefix=temp_prefix(name), dir=out_dir)
    try:
        st.save_file(_weights(model), os.path.join(tmp, "model.safetensors"))
        state = rng_tensors()
        meta = dict(meta, step=step)
        if optimizer is not None:
            opt_tensors, meta["optimizer"] = _optimizer_tensors(optimizer)
            state.update(opt_tensors)
        st.save_file(state, os.path.join(tmp, "state.safetensors"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        for fname in os.listdir(tmp):
            with open(os.path.join(tmp, fname), "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out_dir)
    atomic_write_text(os.path.join(out_dir, "latest"), name + "\n")
    old = [d for d in checkpoint_names(out_dir) if d != name]
    for d in old[: max(len(old) - (keep - 1), 0)]:
        doomed = tempfile.mkdtemp(prefix=temp_prefix(d), dir=out_dir)
        os.replace(os.path.join(out_dir, d), doomed)  # never a half-deleted step-* directory
        shutil.rmtree(doomed, ignore_errors=True)
    return final


def load_checkpoint(path: str) -> tuple[dict, dict[str, Tensor], dict[str, Tensor]]:
    """``(meta, model_tensors, state_tensors)`` of a checkpoint of a run this package trained (see
    :func:`attnkit.io.checkpoints.load_checkpoint`: safetensors and json only, every field checked)."""
    return _layout.load_checkpoint(path, model_kinds=MODEL_KINDS)


def restore_training_state(optimizer: torch.optim.Optimizer, meta: dict, state: dict[str, Tensor],
                           where: str = "checkpoint") -> None:
    """Optimizer moments and RNG states from a checkpoint (``CheckpointError`` when they do not fit)."""
    if "rng.cpu" not in state:
        raise CheckpointError(f"{where}: its state.safetensors holds no RNG state ('rng.cpu'), so a resumed run "
                              f"could not continue exactly (dropout, sampling). Fix: resume from another checkpoint "
                              f"of the run, or load its weights (attnkit.train.load_model) for a new run.")
    try:
        if "optimizer" in meta:
            _restore_optimizer(optimizer, state, meta["optimizer"])
        restore_rng(state)
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as exc:
        raise CheckpointError(f"{where}: the optimizer or RNG state does not fit this model ({type(exc).__name__}: "
                              f"{exc}). Fix: {_FIX}.") from None
