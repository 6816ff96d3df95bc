"""Small argument checks shared by configs, options and the public functions.

Each raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value) naming the argument, the
value given, what was expected and the fix; ``bool`` is never accepted as a number.
"""

from __future__ import annotations

import math

__all__ = ["check_bool", "check_optional_bool", "positive_int", "finite_float"]


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool, else ``TypeError`` (``'no'``, ``1`` and ``None`` are not bools)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {type(value).__name__} {value!r}.")
    return value


def check_optional_bool(name: str, value) -> bool | None:
    """``value`` if it is a bool or None (None = the documented automatic choice)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}: expected True, False or None (automatic), got {type(value).__name__} {value!r}.")
    return value


def positive_int(name: str, value, *, optional: bool = False, minimum: int = 1) -> int | None:
    """``value`` if it is an int >= ``minimum`` (or None when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int >= {minimum}{' or None' if optional else ''}, "
                        f"got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}.")
    return value


def finite_float(name: str, value, *, positive: bool = False, hint: str = "") -> float:
    """``float(value)`` if it is a finite real number (``> 0`` when ``positive``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a {'positive ' if positive else ''}finite float, "
                        f"got {type(value).__name__} {value!r}.")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name}: expected a {'positive ' if positive else ''}finite number, got {value}."
                         + (f" Fix: {hint}" if hint else ""))
    return value
