"""Opt-in autotuning, as ``torch.backends.cudnn.benchmark``: the first ``auto`` call of each shape
class times the leading candidates of the rule and later calls of the class take the fastest.

Off by default (it times calls, so two processes could choose differently): the rule and the
measured table are the reproducible path.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from ..inputs import AttentionInputs
from ..registry import Backend
from .rule import priority

__all__ = ["autotune", "tuned", "tuned_description", "enabled", "AUTOTUNE_CANDIDATES", "AUTOTUNE_BUDGET_S"]

_ENABLED = [os.environ.get("ATTNKIT_AUTOTUNE", "").strip().lower() in ("1", "true", "yes", "on")]
_TUNED: dict = {}  # (shape class, candidates) -> (winner, {name: seconds})
_LOCK = threading.Lock()
#: How many of the leading candidates the first call of a shape class times, and its time bound.
AUTOTUNE_CANDIDATES = 3
AUTOTUNE_BUDGET_S = 1.0


def enabled() -> bool:
    return _ENABLED[0]


class autotune:
    """Turn autotuning on (``attnkit.autotune()``) or off (``attnkit.autotune(False)``) for the
    process; as a context manager (``with attnkit.autotune():``) it restores the previous setting
    on exit. ``ATTNKIT_AUTOTUNE=1`` turns it on at import.

    While on, the first ``auto`` call of each shape class (shapes, dtype, mask, offsets, pass, and
    the backends that can run it) times the :data:`AUTOTUNE_CANDIDATES` leading candidates of the
    rule (forward, without gradients, at most about :data:`AUTOTUNE_BUDGET_S` seconds) and remembers
    the fastest; later calls of the class take it. Thread-safe; never inside ``torch.compile``
    tracing; inputs with dropout are not tuned. ``explain()`` quotes the measured times."""

    def __init__(self, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"autotune: expected True or False, got {enabled!r}. Fix: attnkit.autotune(True).")
        self._previous = _ENABLED[0]
        _ENABLED[0] = enabled

    def __enter__(self) -> autotune:
        return self

    def __exit__(self, *exc) -> None:
        _ENABLED[0] = self._previous


def _shape_class(inp: AttentionInputs) -> tuple:
    return (inp.q.shape, inp.k.shape, inp.v.shape, inp.q.dtype, inp.q.device, inp.mask, inp.q_offset, inp.kv_offset,
            inp.requires_grad)


def _key(inp: AttentionInputs, known: dict) -> tuple[tuple, list[str]]:
    candidates = [n for n in priority(inp) if known[n].exact and known[n].can_run(inp)][:AUTOTUNE_CANDIDATES]
    return (_shape_class(inp), tuple(candidates)), candidates


def tuned(inp: AttentionInputs, known: dict[str, type[Backend]]) -> str | None:
    """The measured winner for ``inp``'s shape class (timing the candidates on its first call), or
    None where nothing is tuned (autotuning off, tracing, dropout, an unhashable mask, one candidate)."""
    if not _ENABLED[0] or inp.dropout_p > 0 or torch.compiler.is_compiling():
        return None
    try:
        key, candidates = _key(inp, known)
        hash(key)
    except TypeError:
        return None
    if len(candidates) < 2:
        return None
    found = _TUNED.get(key)
    if found is None:
        with _LOCK:
            found = _TUNED.get(key)
            if found is None:
                found = _TUNED[key] = _time(inp, candidates, known)
    return found[0]


def _time(inp: AttentionInputs, candidates: list[str], known: dict) -> tuple[str, dict[str, float]]:
    deadline = time.perf_counter() + AUTOTUNE_BUDGET_S
    times: dict[str, float] = {}
    with torch.no_grad():
        for name in candidates:
            runs = []
            for _ in range(3):  # a warm-up call, then the best of two (fewer when over budget)
                start = time.perf_counter()
                known[name].forward(inp, None)
                runs.append(time.perf_counter() - start)
                if time.perf_counter() > deadline:
                    break
            times[name] = min(runs[1:] or runs)
            if time.perf_counter() > deadline:
                break
    return min(times, key=times.get), times


def tuned_description(inp: AttentionInputs, known: dict) -> tuple[str | None, str]:
    """(the tuned winner, one line quoting its times) for ``inp``'s shape class; (None, "") if untuned."""
    try:
        found = _TUNED.get(_key(inp, known)[0])
    except TypeError:
        return None, ""
    if found is None:
        return None, ""
    figures = ", ".join(f"{n} {t * 1e3:.3g} ms" for n, t in sorted(found[1].items(), key=lambda x: x[1]))
    return found[0], f"autotuned on this machine (first call of this shape class, forward): {figures}"
