"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically, loaded without pickle.

Layout of a run directory::

    out/
      latest                 one line: the name of the newest complete checkpoint (atomically replaced)
      step-000400/
        model.safetensors    the weights (shared / tied tensors stored once), loadable on their own
        state.safetensors    optimizer moments and RNG states
        meta.json            model and training configs, step, optimizer hyper-parameters, metrics

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
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from .config import MODEL_KINDS
from .files import atomic_write_text, fsync_dir, read_json, remove_stale_temporaries, temp_prefix

__all__ = ["save_checkpoint", "load_checkpoint", "resolve_checkpoint", "load_model_weights", "model_from_header",
           "checkpoint_names", "checkpoint_order", "newest_checkpoint",
           "non_finite_parameters", "check_finite_weights", "read_safetensors", "CheckpointError"]

CHECKPOINT_NAME = re.compile(r"^step-(\d{6,})(?:-r(\d+))?$")
META_LIMIT_BYTES = 64 * 2**20  # meta.json holds the per-step history: ~100 bytes a step
FILES = ("meta.json", "model.safetensors", "state.safetensors")
_FIX = "pass the --out directory of a training run made by attnkit (or one of its step-* directories)"


class CheckpointError(ValueError):
    """A checkpoint or run directory that cannot be used as it is (the message names the file and the fix)."""


def _require_safetensors():
    try:
        import safetensors.torch as st
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("checkpoints need safetensors: pip install 'attnkit[train]'") from exc
    return st


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


def save_checkpoint(out_dir: str, step: int, model: nn.Module, meta: dict,
                    optimizer: torch.optim.Optimizer | None = None, keep: int = 2) -> str:
    """Write ``out_dir/step-XXXXXX`` atomically, point ``out_dir/latest`` at it, keep the newest ``keep``.

    Refuses (``CheckpointError``, nothing written or rotated) when a weight is NaN or infinite."""
    st = _require_safetensors()
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


def check_meta(meta, path: str) -> dict:
    """``meta`` if it has the fields and types :func:`save_checkpoint` writes, else ``CheckpointError``."""
    if not isinstance(meta, dict):
        raise _fail(path, f"expected a JSON object, got {type(meta).__name__}")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise _fail(path, f"'step' must be an integer >= 0, got {step!r}")
    if meta.get("model_kind") not in MODEL_KINDS:
        raise _fail(path, f"'model_kind' must be one of {MODEL_KINDS}, got {meta.get('model_kind')!r}")
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


def read_safetensors(path: str, *, device: str = "cpu") -> dict[str, Tensor]:
    """The tensors of a safetensors file, with a ``CheckpointError`` naming the file when it is not one."""
    st = _require_safetensors()
    if os.path.islink(path):
        raise _fail(path, "is a symbolic link")
    try:
        return st.load_file(path, device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError, ValueError)
        raise _fail(path, f"not a readable safetensors file ({type(exc).__name__}: {exc})") from None


def load_checkpoint(path: str) -> tuple[dict, dict[str, Tensor], dict[str, Tensor]]:
    """``(meta, model_tensors, state_tensors)`` of a checkpoint, read with safetensors and json only."""
    ckpt = resolve_checkpoint(path)
    meta_path = os.path.join(ckpt, "meta.json")
    meta = check_meta(read_json(meta_path, limit_bytes=META_LIMIT_BYTES, fix=_FIX + "."), meta_path)
    weights_path = os.path.join(ckpt, "model.safetensors")
    weights = read_safetensors(weights_path)
    check_finite_weights(weights, weights_path)
    return meta, weights, read_safetensors(os.path.join(ckpt, "state.safetensors"))


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
                                  f"Fix: {_FIX}.") from None
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
