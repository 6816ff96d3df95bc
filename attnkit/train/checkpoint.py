"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically, loaded without pickle.

Layout of a run directory::

    out/
      latest                 one line: the name of the newest complete checkpoint (atomically replaced)
      step-000400/
        model.safetensors    the weights (shared / tied tensors stored once), loadable on their own
        state.safetensors    optimizer moments and RNG states
        meta.json            model and training configs, step, optimizer hyper-parameters, metrics

A checkpoint directory is first written under a temporary name, flushed, and renamed into place
with ``os.replace``; only then is ``latest`` replaced (temp file + ``os.replace``). A crash at any
moment leaves ``latest`` naming a complete checkpoint. Loading uses ``safetensors`` and ``json``
only, never ``torch.load``/pickle, so a checkpoint from elsewhere cannot run code.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from torch import Tensor, nn

__all__ = ["save_checkpoint", "load_checkpoint", "resolve_checkpoint", "load_model_weights"]


def _require_safetensors():
    try:
        import safetensors.torch as st
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("checkpoints need safetensors: pip install 'attnkit[train]'") from exc
    return st


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - not every platform opens directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same directory and ``os.replace``."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(directory)


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


def save_checkpoint(out_dir: str, step: int, model: nn.Module, meta: dict,
                    optimizer: torch.optim.Optimizer | None = None, keep: int = 2) -> str:
    """Write ``out_dir/step-XXXXXX`` atomically, point ``out_dir/latest`` at it, keep the newest ``keep``."""
    st = _require_safetensors()
    os.makedirs(out_dir, exist_ok=True)
    name = f"step-{step:06d}"
    revision = 0
    while os.path.exists(os.path.join(out_dir, name)):  # re-saving a step never touches the saved one
        revision += 1
        name = f"step-{step:06d}-r{revision}"
    final = os.path.join(out_dir, name)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out_dir)
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
    _fsync_dir(out_dir)
    atomic_write_text(os.path.join(out_dir, "latest"), name + "\n")
    old = sorted(d for d in os.listdir(out_dir) if d.startswith("step-") and d != name)
    for d in old[: max(len(old) - (keep - 1), 0)]:
        shutil.rmtree(os.path.join(out_dir, d), ignore_errors=True)
    return final


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory from a run directory (via ``latest``) or a checkpoint directory itself."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    raise ValueError(f"checkpoint: {path!r} is neither a run directory with a 'latest' file nor a checkpoint "
                     f"directory with meta.json; pass the --out directory of a training run.")


def load_checkpoint(path: str) -> tuple[dict, dict[str, Tensor], dict[str, Tensor]]:
    """``(meta, model_tensors, state_tensors)`` of a checkpoint, read with safetensors and json only."""
    st = _require_safetensors()
    ckpt = resolve_checkpoint(path)
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    return meta, st.load_file(os.path.join(ckpt, "model.safetensors")), st.load_file(
        os.path.join(ckpt, "state.safetensors"))


def load_model_weights(model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Load weights saved by :func:`save_checkpoint` (tied tensors were stored once)."""
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # a tied weight is stored under one of its names; the others are loaded through it
    aliases: dict[int, set[str]] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        aliases.setdefault(id(p), set()).add(name)
    by_name = {n: group for group in aliases.values() for n in group}
    missing = [m for m in missing if not (by_name.get(m, set()) & tensors.keys())]
    if missing or unexpected:
        raise ValueError(f"checkpoint: weights do not match the model (missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}); was it saved from a different config?")


def restore_training_state(optimizer: torch.optim.Optimizer, meta: dict, state: dict[str, Tensor]) -> None:
    if "optimizer" in meta:
        _restore_optimizer(optimizer, state, meta["optimizer"])
    restore_rng(state)
