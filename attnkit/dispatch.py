"""Choosing a backend: the priority policy, ``select``, ``explain`` and ``use_backend``.

Rules:

* ``backend="auto"`` takes the first backend of :func:`priority` that is exact, available and has no
  reasons against the input. Approximate backends (``exact = False``) run only when named.
* A named backend is checked, never silently replaced: if it cannot run, ``NoBackendError`` says why.
* ``with use_backend("tiled"):`` makes ``"auto"`` mean ``"tiled"`` inside the block (a ContextVar,
  so threads and async tasks keep their own choice).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

from . import calibration
from .inputs import AttentionInputs
from .registry import Backend, get_backend, list_backends, registered_names

__all__ = ["NoBackendError", "select", "resolve", "explain", "use_backend", "priority", "Explanation"]

_SCOPED: ContextVar[tuple[str, ...] | None] = ContextVar("attnkit_backend", default=None)

# Above this many materialized mask elements per call (B*H*Tq*Tk), a backend that builds the
# whole (Tq, Tk) mask costs more memory than a tiled one: 2**26 bool elements = 64 MiB.
# A measured calibration table (attnkit.calibration) takes precedence over these defaults.
MATERIALIZE_LIMIT = 2**26
# Structured backends (tried in this order) and the score count per head (Tq * Tk) from which
# they beat SDPA's materialized-mask path when no calibration exists. Measured forward, fp32 and
# bf16, B=1, H=4, D=64 (window 256, BigBird blocks of 64) by `attnkit bench` on a 2-core CPU:
# sliding_window wins from n = 2048, block_sparse from n = 4096 (docs/bench/report.md).
STRUCTURED_MIN_SCORES = {"sliding_window": 2048**2, "block_sparse": 4096**2}
# The fused C++ kernel (backends/native.py, when built) skips masked tiles without materializing
# anything: measured faster than SDPA with a materialized mask from n = 512, forward and training
# (Causal&KeyPadding, SlidingWindow(256); B=1, H=8, D=64, 2-core CPU). Tried after the structured
# backends (not yet measured against them) and before SDPA and tiled.
NATIVE_MIN_SCORES = 512**2


class NoBackendError(ValueError):
    """No backend can run the input; the message lists every backend with its reasons."""


def priority(inp: AttentionInputs) -> tuple[str, ...]:
    """The order in which ``auto`` tries backends for this input (the whole policy).

    1. SDPA first: PyTorch's fused kernels are the fastest exact path for dense and causal masks.
    2. When SDPA would have to materialize the mask (its ``dense_mask_elements`` hint is not 0):
       a structured sparse mask (a finite band, a BlockSparse layout) over at least
       STRUCTURED_MIN_SCORES[backend] scores per head goes to the backend that skips its
       masked-out work (each declines, with a reason, masks it cannot use); from
       NATIVE_MIN_SCORES the fused C++ kernel ``native`` (when it is built) comes next; and over
       MATERIALIZE_LIMIT mask elements ``tiled`` comes before SDPA: it evaluates the mask per tile
       (skipping EMPTY tiles) in O(Tq + Tk) memory.
    3. ``naive`` last: it runs everything (LSE, bias, dropout), but in O(Tq * Tk) memory.
    Backends registered later and not named here are tried before ``naive``.

    A measured table (``python -m attnkit bench --calibrate``, see :mod:`attnkit.calibration`)
    replaces rules 1-2: when it has an entry for this device/dtype/mask kind/pass, its ranking of
    backends at the nearest measured length comes first (a cached dict + bisect lookup, no tensor reads).
    """
    registered = registered_names()
    measured = calibration.preferred(inp)
    if measured is not None:
        return _order(measured, registered)
    sdpa = list_backends().get("sdpa")
    dense = sdpa.dense_mask_elements(inp) if sdpa is not None else 0
    if not dense:
        return _order(("sdpa", "tiled"), registered)
    preferred = ("tiled", "sdpa") if dense > MATERIALIZE_LIMIT else ("sdpa", "tiled")
    scores = inp.Tq * inp.Tk
    if scores >= NATIVE_MIN_SCORES:
        preferred = ("native",) + preferred
    preferred = tuple(name for name, n in STRUCTURED_MIN_SCORES.items() if scores >= n) + preferred
    return _order(preferred, registered)


@functools.lru_cache(maxsize=64)
def _order(preferred: tuple[str, ...], registered: tuple[str, ...]) -> tuple[str, ...]:
    """``preferred`` first, then the other registered backends, ``naive`` last (cached: the
    registry rarely changes, and attention() is called per layer per token)."""
    order = [name for name in preferred if name in registered]
    order += [name for name in registered if name not in order and name != "naive"]
    return tuple(order + ["naive"] * ("naive" in registered and "naive" not in order))


def _candidates(backend: str) -> tuple[list[str], bool]:
    """Names to try and whether they were named explicitly (by argument or ``use_backend``)."""
    if backend != "auto":
        get_backend(backend)
        return [backend], True
    scoped = _SCOPED.get()
    if scoped is not None:
        return list(scoped), True
    return [], False


def resolve(inp: AttentionInputs, backend: str = "auto") -> tuple[type[Backend], AttentionInputs]:
    """The backend that will run ``inp`` and the inputs it runs on: ``inp`` itself, or, when K/V
    are a cache handle that no candidate reads in place (or the one that reads it cannot run this
    call), ``inp.dense()``, the handle's declared conversion to contiguous K/V."""
    if inp.kv_format != "dense":
        reader = _reader(inp, backend)
        if reader is not None:
            return reader, inp
        inp = inp.dense()
    return select(inp, backend), inp


def _reader(inp: AttentionInputs, backend: str) -> type[Backend] | None:
    """The first candidate that reads ``inp``'s KV handle in place and can run it, or None."""
    known = list_backends()
    names, named = _candidates(backend)
    for name in names if named else priority(inp):
        impl = known[name]
        if (named or impl.exact) and inp.kv_format in impl.kv_formats and impl.can_run(inp):
            return impl
    return None


def select(inp: AttentionInputs, backend: str = "auto") -> type[Backend]:
    """The backend that will run ``inp``; ``NoBackendError`` with every reason if none can.
    K/V given as a cache handle are converted when no candidate reads them (:func:`resolve`)."""
    if inp.kv_format != "dense":
        return resolve(inp, backend)[0]
    known = list_backends()
    if backend == "auto" and _SCOPED.get() is None:  # the common case, kept lean: per layer per token
        for name in priority(inp):
            impl = known[name]
            if impl.exact and impl.can_run(inp):
                return impl
        raise NoBackendError(_no_backend_message(inp, list(known)))
    names, _ = _candidates(backend)
    for name in names:
        if known[name].can_run(inp):
            return known[name]
    raise NoBackendError(_no_backend_message(inp, names))


def _describe(inp: AttentionInputs) -> str:
    mask = "no mask" if inp.mask is None else repr(inp.mask)
    return (
        f"q {tuple(inp.q.shape)}, k {tuple(inp.k.shape)}, v {tuple(inp.v.shape)}, {inp.dtype}, "
        f"{inp.device.type}, {mask}, q_offset={inp.q_offset}, kv_offset={inp.kv_offset}"
    )


def _no_backend_message(inp: AttentionInputs, names: Sequence[str]) -> str:
    known = list_backends()
    lines = [f"no attention backend can run this input ({_describe(inp)}):"]
    for name in names:
        reasons = known[name].not_supported_reasons(inp)
        if not known[name].exact and not reasons:
            reasons = ["approximate: runs only when named, e.g. backend='%s'" % name]
        lines.append(f"  {name}: {'; '.join(reasons) or 'can run'}")
    lines.append("Fix: relax the unsupported option, or name a backend that lists no reasons above.")
    return "\n".join(lines)


@dataclass(frozen=True)
class Explanation:
    """What ``auto`` (or a named backend) would do for an input, and why."""

    chosen: str | None
    reasons: dict[str, list[str]]  # backend name -> reasons it cannot run ([] = it could)
    order: list[str]  # the order tried
    description: str
    plan: str = ""  # how the chosen backend runs it, in words
    measured: str = ""  # the measured figures behind auto's order, or why built-in defaults apply
    named: tuple[str, ...] = ()  # the backends named (backend= or use_backend); () for auto
    kv: str = ""  # how a KV cache handle is read: in place, or converted to dense K/V and why

    def __str__(self) -> str:
        lines = [f"input: {self.description}"]
        named = ", ".join(self.named)
        if self.chosen:
            lines.append(f"chosen: {self.chosen}")
        elif self.named:
            lines.append(f"chosen: none: the backend(s) named ({named}) cannot run this input")
        else:
            lines.append("chosen: none (no backend can run this input)")
        for name in self.order:
            why = self.reasons[name]
            if name == self.chosen:
                first = "the first named" if self.named else "first in priority order"
                lines.append(f"  {name}: runs ({first} with no reasons against it): {self.plan}")
            elif why:
                lines.append(f"  {name}: not used: {'; '.join(why)}")
            elif self.named and name not in self.named:
                lines.append(f"  {name}: could run, but was not named ({named} was)")
            else:
                lines.append(f"  {name}: could run, but comes after {self.chosen} in priority order")
        if self.kv:
            lines.append(f"kv cache: {self.kv}")
        if self.measured:
            lines.append(f"policy: {self.measured}")
        return "\n".join(lines)


def explain(q, k, v, *, backend: str = "auto", **kwargs) -> Explanation:
    """Say which backend ``attention(q, k, v, **kwargs)`` would run and why the others would not.

    Takes the same keyword arguments as :func:`attnkit.attention`; runs nothing."""
    inp = AttentionInputs.create(q, k, v, **kwargs)
    kv = ""
    if inp.kv_format != "dense":
        handle, reader = inp.k, _reader(inp, backend)
        if reader is not None:
            kv = f"{handle!r} read in place by {reader.name}"
            return _explain(inp, backend, kv)
        why = {name: impl.not_supported_reasons(inp) for name, impl in list_backends().items()
               if inp.kv_format in impl.kv_formats}
        kv = (f"{handle!r} converted to contiguous {inp.dtype} K/V (a copy), because "
              + "; ".join(f"{name}, which reads it in place: {'; '.join(r) or 'not a candidate'}"
                          for name, r in why.items()))
        inp = inp.dense()
    return _explain(inp, backend, kv)


def _explain(inp: AttentionInputs, backend: str, kv: str) -> Explanation:
    known = list_backends()
    names, named = _candidates(backend)
    order = list(names if named else priority(inp))
    reasons = {}
    for name in known:
        why = list(known[name].not_supported_reasons(inp))
        if not named and not known[name].exact:
            why.append("approximate: runs only when named")
        reasons[name] = why
    order = order + [name for name in known if name not in order]
    chosen = next((name for name in (names if named else priority(inp)) if not reasons[name]), None)
    plan = known[chosen].describe(inp) if chosen else ""
    measured = "" if named else calibration.describe(inp)
    return Explanation(chosen, reasons, order, _describe(inp), plan, measured, tuple(names) if named else (), kv)


@contextlib.contextmanager
def use_backend(*names: str | Sequence[str]) -> Iterator[None]:
    """Within the block, ``backend="auto"`` means the first of ``names`` that can run.

    ``with use_backend("tiled"):`` or ``with use_backend("sliding_window", "tiled"):``."""
    flat: list[str] = []
    for name in names:
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
