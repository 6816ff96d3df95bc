"""Argument checks shared by masks, options and configs: one message format everywhere.

Each check returns the value it accepted, so a constructor reads ``self.n = positive_int(n, "n")``.
The message names the argument (inside its ``owner``, a class or function name, when given), the
value given, what was expected and (with ``fix=``) how to repair the call::

    >>> positive_int(0, "block_q", owner="TiledOptions", fix="pass e.g. block_q=256")
    Traceback (most recent call last):
    ...
    ValueError: TiledOptions(block_q=0): expected a positive int. Fix: pass e.g. block_q=256.

``bool`` is rejected although it is an ``int`` subclass (``True`` is never meant as a count).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .csrc import loader

__all__ = ["positive_int", "non_negative_int", "finite_float", "check_bool", "padding_mask", "check_int",
           "check_int_at_least", "score_scale"]


def _fail(value, name: str, expected: str, fix: str | None, allow_none: bool, owner: str | None):
    if allow_none:
        expected += " or None"
    given = f"{name}={value!r}"
    message = f"{owner}({given}): expected {expected}." if owner else f"{given}: expected {expected}."
    if fix:
        message += f" Fix: {fix.rstrip('.')}."
    raise ValueError(message)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value, name: str, *, owner: str | None = None, fix: str | None = None, allow_none: bool = False):
    """``value`` if it is an int ``>= 1`` (or None when ``allow_none``), else ``ValueError``."""
    if value is None and allow_none:
        return None
    if not _is_int(value) or value < 1:
        _fail(value, name, "a positive int", fix, allow_none, owner)
    return value


def non_negative_int(value, name: str, *, owner: str | None = None, fix: str | None = None,
                     allow_none: bool = False):
    """``value`` if it is an int ``>= 0`` (or None when ``allow_none``), else ``ValueError``."""
    if value is None and allow_none:
        return None
    if not _is_int(value) or value < 0:
        _fail(value, name, "a non-negative int", fix, allow_none, owner)
    return value


def finite_float(
    value, name: str, *, low: float | None = None, high: float | None = None, owner: str | None = None,
    fix: str | None = None, low_inclusive: bool = True, high_inclusive: bool = True,
) -> float:
    """``float(value)`` if it is a finite real number within ``[low, high]`` (bounds optional;
    ``*_inclusive=False`` makes a bound strict), else ``ValueError``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value >= low if low_inclusive else value > low
    if ok and high is not None:
        ok = value <= high if high_inclusive else value < high
    if not ok:
        lo = "" if low is None else f"{'>=' if low_inclusive else '>'} {low}"
        hi = "" if high is None else f"{'<=' if high_inclusive else '<'} {high}"
        bounds = " and ".join(x for x in (lo, hi) if x)
        _fail(value, name, "a finite number" + (f" {bounds}" if bounds else ""), fix, False, owner)
    return float(value)


def score_scale(scale, D: int) -> float:
    """The query scale of :func:`attnkit.attention` and :func:`attnkit.gated_linear_attention`:
    ``D ** -0.5`` for None, else ``float(scale)`` for a finite real number (0 and negative scales
    mean what they say); ``TypeError`` for another kind of value, ``ValueError`` for NaN/±Inf."""
    if scale is None:
        return D**-0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale: expected a float or None (= D ** -0.5), got {type(scale).__name__} {scale!r}.")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}. Fix: pass None for D ** -0.5 "
                         f"(= {D ** -0.5:.4g} here) or a finite float.")
    return scale


def check_bool(value, name: str, *, owner: str | None = None, allow_none: bool = False):
    """``value`` if it is a bool (or None when ``allow_none``: the documented automatic choice),
    else ``TypeError`` (``'no'``, ``1`` and ``None`` are not bools)."""
    if isinstance(value, bool) or (value is None and allow_none):
        return value
    expected = "True or False" + (" or None (automatic)" if allow_none else "")
    given = f"{name}={value!r}"
    raise TypeError(f"{owner}({given}): expected {expected}, got {type(value).__name__}." if owner
                    else f"{given}: expected {expected}, got {type(value).__name__}.")


def check_int_at_least(name: str, value, minimum: int = 1, *, allow_none: bool = False):
    """``value`` if it is an int ``>= minimum`` (or None when ``allow_none``), else ``ValueError``
    in the form ``"{name}: expected an int >= {minimum}, got {value!r}."`` (``name`` may carry its
    owner, as ``"TransformerConfig.num_heads"`` or ``"SequenceLayout.even(world)"``)."""
    if value is None and allow_none:
        return None
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{name}: expected {'None or ' if allow_none else ''}an int >= {minimum}, got {value!r}.")
    return value


def check_int(name: str, value, *, minimum: int | None = None) -> int:
    """``value`` if it is an int (``>= minimum`` when given): ``TypeError`` for another type (a float
    offset is a type mistake), ``ValueError`` below ``minimum``."""
    if not _is_int(value):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} ({value!r}).")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}.")
    return value


def padding_mask(attention_mask, batch: int, length: int, what: str = "T", *, need_token: bool = False) -> Tensor:
    """A Hugging Face style ``attention_mask`` (an integer or bool tensor ``(B, length)``, 1 = token,
    0 = padding) as a bool tensor: ``TypeError`` for another kind of value, ``ValueError`` for
    another shape and, with ``need_token``, for a row without any token (``what`` names the length
    in the message, e.g. ``"past + T"``)."""
    got = (f"{getattr(attention_mask, 'dtype', type(attention_mask).__name__)} "
           f"{tuple(getattr(attention_mask, 'shape', ()))}")
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2:
        raise TypeError(f"attention_mask: expected an integer or bool tensor (B, {what}) with 1 = token, 0 = padding, "
                        f"got {got}.")
    if attention_mask.shape != (batch, length):
        raise ValueError(
            f"attention_mask: expected shape (B, {what}) = ({batch}, {length}), got {tuple(attention_mask.shape)}."
        )
    if attention_mask.dtype.is_floating_point:  # an additive float mask (0 / -inf) would turn into its opposite
        raise TypeError(f"attention_mask: expected an integer or bool tensor (B, {what}) with 1 = token, 0 = padding, "
                        f"got {got}. Fix: a 0/1 float mask becomes `attention_mask.long()`.")
    valid = attention_mask.bool()
    if need_token:
        empty = (~valid.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"attention_mask: rows {empty} have no token (all zeros); a row needs at least one prompt token. "
                "Fix: drop those rows, or give them a start token."
            )
    return valid


def finite_only(x: Tensor) -> bool:
    """Whether ``x`` holds finite values only. With the built extension, a dense CPU tensor is
    read once in C, a bit test per element (:func:`attnkit.csrc.loader.fastpath`). Otherwise one
    read-only sum (a NaN or Inf entry makes any sum NaN or Inf, whatever the order of the
    additions), taken in its dtype (bfloat16 has float32's range, and its own sum is much faster than
    a float32-typed one on the CPU); a float16 sum past 65504 is taken again in float32. A sum that
    overflows anyway reads as non-finite: the NaN/Inf policy's slow path then finds every entry
    finite (correct, only slower)."""
    found = loader.finite(x)
    if found is not None:
        return found
    return math.isfinite(x.sum().item()) or (x.dtype == torch.float16
                                             and math.isfinite(x.sum(dtype=torch.float32).item()))


def broadcast_shapes(*shapes) -> torch.Size:
    """``torch.broadcast_shapes`` (same result, same ``RuntimeError``), without its first call's
    cost: torch's imports sympy, about half a second, on the first masked call of a process."""
    ndim = 0
    for shape in shapes:  # (plain loops: torch.compile traces this without a graph break)
        ndim = len(shape) if len(shape) > ndim else ndim
    out = [1] * ndim
    for shape in shapes:
        for i, n in enumerate(shape, ndim - len(shape)):
            if n != 1:
                if out[i] != 1 and out[i] != n:
                    raise RuntimeError(f"shape mismatch: objects cannot be broadcast to a single shape: "
                                       f"{', '.join(str(tuple(s)) for s in shapes)}")
                out[i] = n
    return torch.Size(out)
