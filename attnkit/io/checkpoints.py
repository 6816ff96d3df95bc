"""The on-disk layout of a training run directory, and reading it as untrusted data.

Layout of a run directory (written by :func:`attnkit.train.checkpoint.save_checkpoint`)::

    out/
      latest                 one line: the name of the newest complete checkpoint (atomically replaced)
      step-000400/
        model.safetensors    the weights (shared / tied tensors stored once), loadable on their own
        state.safetensors    optimizer moments and RNG states
        meta.json            model and training configs, step, optimizer hyper-parameters, metrics

Reading treats the directory as untrusted: ``safetensors`` and ``json`` only, never
``torch.load``/pickle; ``latest`` must name a checkpoint directory inside the run directory (no
``..``, absolute paths or symbolic links); ``meta.json`` is size-limited and checked field by field;
weights holding NaN or infinity are refused. A run directory resolves to the newest of ``latest``
and its complete ``step-*`` directories (a save renames its directory into place before it updates
``latest``). Every refusal is a :class:`CheckpointError` naming the file and the fix.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from torch import Tensor

from .files import read_json
from .weights import CheckpointError, check_finite_weights, read_safetensors

__all__ = ["CHECKPOINT_NAME", "FILES", "META_LIMIT_BYTES", "checkpoint_order", "checkpoint_names",
           "newest_checkpoint", "resolve_checkpoint", "check_meta", "load_checkpoint"]

CHECKPOINT_NAME = re.compile(r"^step-(\d{6,})(?:-r(\d+))?$")
META_LIMIT_BYTES = 64 * 2**20  # meta.json holds the per-step history: ~100 bytes a step
FILES = ("meta.json", "model.safetensors", "state.safetensors")
_FIX = "pass the --out directory of a training run made by attnkit (or one of its step-* directories)"


def checkpoint_order(name: str) -> tuple[int, int]:
    match = CHECKPOINT_NAME.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else (-1, -1)


def checkpoint_names(out_dir: str) -> list[str]:
    """The checkpoint directories (real directories, not links) in ``out_dir``, oldest first."""
    try:
        names = os.listdir(out_dir)
    except FileNotFoundError:
        return []
    found = [n for n in names if CHECKPOINT_NAME.match(n) and os.path.isdir(os.path.join(out_dir, n))
             and not os.path.islink(os.path.join(out_dir, n))]
    return sorted(found, key=checkpoint_order)


def _check_checkpoint_dir(ckpt: str) -> str:
    for fname in FILES:
        path = os.path.join(ckpt, fname)
        if os.path.islink(path) or not os.path.isfile(path):
            what = "a symbolic link" if os.path.islink(path) else "missing"
            raise CheckpointError(f"checkpoint: {path} is {what}; a checkpoint directory holds {', '.join(FILES)} "
                                  f"as regular files. Fix: {_FIX}.")
    return ckpt


def _is_complete(ckpt: str) -> bool:
    return all(os.path.isfile(os.path.join(ckpt, f)) and not os.path.islink(os.path.join(ckpt, f)) for f in FILES)


def _read_latest(path: str) -> str | None:
    """The checkpoint name ``path/latest`` holds (None when there is no ``latest``), checked:
    one line naming a ``step-*`` directory of ``path`` itself."""
    latest = os.path.join(path, "latest")
    if not os.path.lexists(latest):
        return None
    if os.path.islink(latest) or not os.path.isfile(latest) or os.path.getsize(latest) > 256:
        raise CheckpointError(f"checkpoint: {latest} is not the small regular file attnkit writes (a link, a "
                              f"directory or too large). Fix: {_FIX}.")
    with open(latest, "rb") as f:
        name = f.read().decode("utf-8", errors="replace").strip()
    ckpt = os.path.join(path, name)
    if not CHECKPOINT_NAME.match(name) or os.path.islink(ckpt) or not os.path.isdir(ckpt):
        raise CheckpointError(f"checkpoint: {latest} names {name!r}, which is not a step-* directory inside "
                              f"{path} (links, '..' and absolute paths are refused). Fix: write the name of one "
                              f"of its checkpoints ({', '.join(checkpoint_names(path)) or 'none found'}) into it, "
                              f"or pass the checkpoint directory itself.")
    return name


def newest_checkpoint(path: str) -> str | None:
    """The newest checkpoint of run directory ``path``: the newest of the one ``latest`` names and
    the complete ``step-*`` directories (a save renames its directory into place before it updates
    ``latest``, so a kill in between leaves ``latest`` one save behind). None when it has none."""
    path = os.fspath(path)
    named = _read_latest(path)
    complete = [n for n in checkpoint_names(path) if _is_complete(os.path.join(path, n))]
    candidates = complete + ([named] if named is not None else [])
    return max(candidates, key=checkpoint_order) if candidates else None


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory from a run directory (its newest checkpoint, see
    :func:`newest_checkpoint`) or a checkpoint directory itself.

    ``latest`` must be one line naming a ``step-*`` directory of the run directory itself: no path
    separators, no ``..``, no symbolic links."""
    path = os.fspath(path)
    if os.path.lexists(os.path.join(path, "meta.json")):
        return _check_checkpoint_dir(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint: {path!r} does not exist or is not a directory. Fix: {_FIX}.")
    name = newest_checkpoint(path)
    if name is None:
        raise CheckpointError(f"checkpoint: {path!r} holds no checkpoint (no 'latest' file, no complete step-* "
                              f"directory, no meta.json): a run stopped before its first save leaves none. Fix: "
                              f"{_FIX}; to start that run again, pass --out {path} --overwrite.")
    return _check_checkpoint_dir(os.path.join(path, name))


def _fail(path: str, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint: {path}: {problem}. Fix: {_FIX}; a checkpoint edited by hand cannot be "
                           f"trusted, resume from another one.")


def check_meta(meta, path: str, *, model_kinds: Sequence[str] | None = None) -> dict:
    """``meta`` if it has the fields and types :func:`save_checkpoint` writes, else ``CheckpointError``."""
    if not isinstance(meta, dict):
        raise _fail(path, f"expected a JSON object, got {type(meta).__name__}")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _fail(path, f"'step' must be an integer >= 0, got {step!r}")
    kind = meta.get("model_kind")
    if not isinstance(kind, str) or (model_kinds is not None and kind not in model_kinds):
        expected = "a string" if model_kinds is None else f"one of {tuple(model_kinds)}"
        raise _fail(path, f"'model_kind' must be {expected}, got {kind!r}")
    for key, kind in (("model_config", dict), ("train_config", dict), ("history", list), ("evals", list),
                      ("optimizer", dict)):
        if key in meta and not isinstance(meta[key], kind):
            raise _fail(path, f"{key!r} must be a JSON {'object' if kind is dict else 'array'}, "
                              f"got {type(meta[key]).__name__}")
    if "model_config" not in meta:
        raise _fail(path, "'model_config' is missing")
    history = meta.get("history")
    if history is not None:
        if len(history) != step:
            raise _fail(path, f"'history' has {len(history)} entries for step {step}")
        for i, rec in enumerate(history):
            if not (isinstance(rec, dict) and rec.get("step") == i + 1 and isinstance(rec.get("loss"), (int, float))):
                raise _fail(path, f"'history' entry {i} is not {{'step': {i + 1}, 'loss': <number>, ...}}")
    opt = meta.get("optimizer")
    if opt is not None and not (isinstance(opt.get("param_groups"), list) and isinstance(opt.get("scalars"), dict)):
        raise _fail(path, "'optimizer' must hold 'param_groups' (array) and 'scalars' (object)")
    return meta


def load_checkpoint(path: str, *, model_kinds: Sequence[str] | None = None
                    ) -> tuple[dict, dict[str, Tensor], dict[str, Tensor]]:
    """``(meta, model_tensors, state_tensors)`` of a checkpoint, read with safetensors and json only."""
    ckpt = resolve_checkpoint(path)
    meta_path = os.path.join(ckpt, "meta.json")
    meta = check_meta(read_json(meta_path, limit_bytes=META_LIMIT_BYTES, fix=_FIX + "."), meta_path,
                      model_kinds=model_kinds)
    weights_path = os.path.join(ckpt, "model.safetensors")
    weights = read_safetensors(weights_path, fix=_FIX)
    check_finite_weights(weights, weights_path)
    return meta, weights, read_safetensors(os.path.join(ckpt, "state.safetensors"), fix=_FIX)


