"""Choosing the backend for a call: ``select``, ``resolve``, ``use_backend`` and the per-call cache
of ``attention()``'s hot path.

* ``backend="auto"`` takes the first backend of :func:`~attnkit.dispatch.rule.priority` that is exact
  and has no reasons against the input (or, with :class:`~attnkit.dispatch.tuning.autotune` on, the
  measured winner of its shape class). Approximate backends (``exact = False``) run only when named.
* A named backend is checked, never silently replaced: if it cannot run, ``NoBackendError`` says why.
* ``with use_backend("tiled"):`` makes ``"auto"`` mean ``"tiled"`` inside the block (a ContextVar,
  so threads and async tasks keep their own choice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch
from torch import Tensor
from torch.compiler import is_compiling as _is_compiling

from .._compat import scope_reader
from ..csrc import loader
from ..inputs import AttentionInputs
from ..masks import Mask
from ..masks.export import value_keyed
from ..score_mods import CustomScoreMod, ScoreMod
from ..registry import Backend, get_backend, list_backends, names_now
from . import table, tuning
from .rule import priority

__all__ = ["NoBackendError", "select", "resolve", "resolve_call", "use_backend", "candidates", "clear",
           "no_backend_message", "reader", "describe_input"]

_SCOPED: ContextVar[tuple[str, ...] | None] = ContextVar("attnkit_backend", default=None)
_scoped = scope_reader(_SCOPED)


class NoBackendError(ValueError):
    """No backend can run the input; the message lists every backend with its reasons."""


def candidates(backend: str) -> tuple[list[str], bool]:
    """Names to try and whether they were named explicitly (by argument or ``use_backend``)."""
    if backend != "auto":
        get_backend(backend)
        return [backend], True
    scoped = _scoped()
    if scoped is not None:
        return list(scoped), True
    return [], False


def select(inp: AttentionInputs, backend: str = "auto") -> type[Backend]:
    """The backend that will run ``inp``; ``NoBackendError`` with every reason if none can.
    K/V given as a cache handle are converted when no candidate reads them (:func:`resolve`)."""
    if inp.kv_format != "dense":
        return resolve(inp, backend)[0]
    known = list_backends()
    names, named = candidates(backend)
    if named:
        for name in names:
            if known[name].can_run(inp):
                return known[name]
        raise NoBackendError(no_backend_message(inp, names))
    winner = tuning.tuned(inp, known)
    if winner is not None:
        return known[winner]
    for name in priority(inp):
        impl = known[name]
        if impl.exact and impl.can_run(inp):
            return impl
    raise NoBackendError(no_backend_message(inp, list(known)))


def reader(inp: AttentionInputs, backend: str) -> type[Backend] | None:
    """The first candidate that reads ``inp``'s KV handle in place and can run it, or None."""
    known = list_backends()
    names, named = candidates(backend)
    for name in names if named else priority(inp):
        impl = known[name]
        if (named or impl.exact) and inp.kv_format in impl.kv_formats and impl.can_run(inp):
            return impl
    return None


def resolve(inp: AttentionInputs, backend: str = "auto") -> tuple[type[Backend], AttentionInputs]:
    """The backend that will run ``inp`` and the inputs it runs on: ``inp`` itself, or, when K/V
    are a cache handle that no candidate reads in place (or the one that reads it cannot run this
    call), ``inp.dense()``, the handle's declared conversion to contiguous K/V."""
    if inp.kv_format != "dense":
        found = reader(inp, backend)
        if found is not None:
            return found, inp
        inp = inp.dense()
    return select(inp, backend), inp


# -- the per-call cache of attention()'s hot path -------------------------------------------------

_CALLS: dict = {}  # call key -> (backend, AttentionInputs.cache_fields(), registered names, on the CPU, generation)
_CALLS_SIZE = 512
# Calls whose mask holds tensors (padding lengths, document ids, a layout): keyed by the mask's identity,
# so an entry keeps its mask alive; a few suffice (a model's layers share one mask per forward).
_BY_IDENTITY: dict = {}
_BY_IDENTITY_SIZE = 16
# Calls with sinks or a score modifier holding tensors (ALiBi slopes, a relative-bias table), keyed by
# the objects' identity: a model passes one per layer; one built anew per call only churns this cache.
_BY_MODIFIER: dict = {}
_BY_MODIFIER_SIZE = 64
_CONTEXT_VARS: list = [((), ())]  # (registered names, their backends' reason_contexts)


_GENERATION = [0]  # bumped by clear(): an entry decided before it (in another thread) is never used after


def clear() -> None:
    """Forget every cached decision (a new table was loaded)."""
    _GENERATION[0] += 1
    _CALLS.clear()
    _BY_IDENTITY.clear()
    _BY_MODIFIER.clear()


table.ON_RELOAD.append(clear)


def resolve_call(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite,
                 backend: str, score_mod=None, sinks=None) -> tuple[type[Backend], AttentionInputs, bool | None]:
    """``attention()``'s common call (dense tensors, no bias or SDPA-style mask): the backend,
    validated inputs and whether the host may branch on them (:func:`attnkit.backends.nonfinite.host_may_branch`;
    None: not known here), cached per call: shapes, dtypes, devices, mask, offsets, scale, dropout,
    LSE, ``kv_finite``, whether gradients are needed, the score modifier and sinks (the objects, with
    their tensors' shapes, dtypes, devices and ``requires_grad``:
    :meth:`~attnkit.score_mods.ScoreMod.call_key`), the backend asked for and the scope
    (``use_backend``, autotuning, each backend's ``reason_contexts``). A hit skips validation and
    selection, both pure functions of that key (strides are not in it: neither reads them); an
    entry is used only while the registry it was decided under holds. With the built extension
    the tensors and scalars are keyed in one C call (:func:`attnkit.csrc.loader.key`), which also
    proves the tensors plain (no subclass or ``torch.func`` wrapper): the host may then branch on
    CPU tensors, and the inputs carry the entry's memo (:meth:`AttentionInputs.memo`)."""
    args = (q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite, backend, score_mod, sinks)
    if _is_compiling():
        return (*_resolve_slow(*args), None)
    # Shapes, dtypes, devices, whether gradients are needed and the scalars with their types (1 == True ==
    # 1.0 as Python keys, but a call validation would refuse must never hit).
    scalars = loader.key(q, k, v, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite)
    plain = scalars is not None
    if not plain:
        if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
            return (*_resolve_slow(*args), None)
        scalars = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                   torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
                   scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite,
                   type(scale), type(dropout_p), type(q_offset), type(kv_offset), type(return_lse), type(kv_finite))
    names = names_now()
    contexts = _CONTEXT_VARS[0]
    if contexts[0] is not names:
        known = list_backends()
        names = names_now()
        contexts = _CONTEXT_VARS[0] = (names, tuple(var for name in names for var in known[name].reason_contexts))
    contexts = contexts[1]
    cache, size = ((_CALLS, _CALLS_SIZE) if mask is None or (isinstance(mask, Mask) and value_keyed(mask))
                   else (_BY_IDENTITY, _BY_IDENTITY_SIZE))
    if score_mod is not None and not isinstance(score_mod, ScoreMod):  # a list, tuple or callable: its parts'
        return (*_resolve_slow(*args), None)                             # tensors are not in a key
    try:
        if score_mod is None and sinks is None:
            mods = None
        else:  # the objects are kept alive by their entry: an id is never reused meanwhile
            mods = (score_mod if score_mod is None else score_mod.call_key(),
                    sinks if sinks is None else (sinks, sinks.shape, sinks.dtype, sinks.device, sinks.requires_grad),
                    torch.is_grad_enabled())
            if cache is _CALLS and (sinks is not None or not _value_hashed(score_mod)):
                cache, size = _BY_MODIFIER, _BY_MODIFIER_SIZE
        key = (scalars, mask, backend, _SCOPED.get(), tuning.enabled(),
               contexts and tuple([var.get() for var in contexts]), mods)
        hit = cache.get(key)
    except (TypeError, RuntimeError, AttributeError):  # unhashable, tensor-valued (a scale tensor), not a tensor
        return (*_resolve_slow(*args), None)
    if hit is not None and hit[2] is names and hit[4] == _GENERATION[0]:
        return hit[0], AttentionInputs.trusted(hit[1], q, k, v), plain and hit[3]
    generation = _GENERATION[0]
    impl, inp = _resolve_slow(*args)
    if not isinstance(mask, (Mask, type(None))):
        return impl, inp, None  # a raw tensor: wrapped anew each call, its entry could never hit
    if len(cache) >= size:
        cache.clear()
    fields = inp.cache_fields()
    if plain:  # no subclass or wrapper: what a backend derives from the key holds for every hit
        fields["_memo"] = {}
    cache[key] = (impl, fields, names, inp.q.is_cpu, generation)
    return impl, inp, None


def _value_hashed(score_mod) -> bool:
    """Whether ``score_mod`` (or None) compares and hashes by value and holds no tensor (``SoftCap(30.0)``
    equals a new ``SoftCap(30.0)``); a modifier holding tensors, or a callable, is known by its identity."""
    return score_mod is None or (isinstance(score_mod, ScoreMod) and not isinstance(score_mod, CustomScoreMod)
                                 and type(score_mod).__hash__ is not object.__hash__ and not score_mod.parameters())


def _resolve_slow(q, k, v, mask, scale, dropout_p, q_offset, kv_offset, return_lse, kv_finite, backend,
                  score_mod=None, sinks=None):
    inp = AttentionInputs.create(q, k, v, mask=mask, scale=scale, dropout_p=dropout_p, q_offset=q_offset,
                                 kv_offset=kv_offset, return_lse=return_lse, kv_finite=kv_finite,
                                 score_mod=score_mod, sinks=sinks)
    return resolve(inp, backend)


def describe_input(inp: AttentionInputs) -> str:
    mask = "no mask" if inp.mask is None else repr(inp.mask)
    return (f"q {tuple(inp.q.shape)}, k {tuple(inp.k.shape)}, v {tuple(inp.v.shape)}, {inp.dtype}, "
            f"{inp.device.type}, {mask}, q_offset={inp.q_offset}, kv_offset={inp.kv_offset}")


def no_backend_message(inp: AttentionInputs, names: Sequence[str]) -> str:
    known = list_backends()
    lines = [f"no attention backend can run this input ({describe_input(inp)}):"]
    for name in names:
        reasons = known[name].not_supported_reasons(inp)
        if not known[name].exact and not reasons:
            reasons = ["approximate: runs only when named, e.g. backend='%s'" % name]
        lines.append(f"  {name}: {'; '.join(reasons) or 'can run'}")
    lines.append("Fix: relax the unsupported option, or name a backend that lists no reasons above.")
    return "\n".join(lines)


@contextlib.contextmanager
def use_backend(*names: str | Sequence[str]) -> Iterator[None]:
    """Within the block, ``backend="auto"`` means the first of ``names`` that can run.

    ``with use_backend("tiled"):`` or ``with use_backend("sliding_window", "tiled"):``."""
    flat: list[str] = []
    for name in names:
        if not isinstance(name, (str, Sequence)):
            raise TypeError(f"use_backend: expected backend names (str) or lists of them, got {name!r:.80}. "
                            "Fix: use_backend('tiled') or use_backend(['sliding_window', 'tiled']).")
        flat.extend([name] if isinstance(name, str) else list(name))
    if not flat:
        raise ValueError("use_backend: expected at least one backend name, e.g. use_backend('tiled').")
    for name in flat:
        get_backend(name)
    token = _SCOPED.set(tuple(flat))
    try:
        yield
    finally:
        _SCOPED.reset(token)
