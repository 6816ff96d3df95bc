"""The per-machine table of measured crossovers that ``auto`` dispatch reads.

``python -m attnkit bench --calibrate`` times every exact backend per (device, dtype, mask kind,
pass) over a range of lengths and stores, for each measured length, the backends ranked by median
time. :func:`attnkit.dispatch.priority` asks :func:`preferred` for that ranking; without a table the
built-in rules apply. The file lives at ``$ATTNKIT_CALIBRATION`` if set, else
``$XDG_CACHE_HOME/attnkit/calibration.json`` (``~/.cache/attnkit/calibration.json``).

File format (JSON)::

    {"version": 1, "machine": {...}, "command": "...",
     "entries": {"cpu|float32|SlidingWindow|forward":
                   [{"n": 1024, "order": ["sdpa", "tiled", "naive"], "times": {"sdpa": 0.0012, ...}}, ...]}}

A lookup takes the measured length nearest to the input's ``n = sqrt(Tq * Tk)`` on a log scale
(so a one-token decode step over 4096 keys counts as n = 64: its work is Tq * Tk).
"""

from __future__ import annotations

import bisect
import json
import math
import os
import warnings
from pathlib import Path

from .inputs import AttentionInputs
from .masks import Mask

__all__ = ["calibration_path", "load", "reload", "save", "preferred", "describe", "entry_key", "mask_kind"]

VERSION = 1

# key -> (boundaries, points): points sorted by n; boundaries[i] = geometric midpoint between
# points[i] and points[i + 1], so bisect_right(boundaries, n) is the nearest point on a log scale.
_Table = dict[str, tuple[list[float], list[dict]]]
_UNLOADED = object()
_CACHE: list = [_UNLOADED]  # the parsed table (or None), loaded on first use; reload() resets it


def calibration_path() -> Path:
    """Where the calibration is read and written (``ATTNKIT_CALIBRATION`` overrides)."""
    override = os.environ.get("ATTNKIT_CALIBRATION")
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "attnkit" / "calibration.json"


def mask_kind(mask: Mask | None) -> str:
    """The mask's kind as stored in the table: ``"none"`` or its structure key (``"Causal"``,
    ``"And(Causal,KeyPadding)"``): masks of one structure share measurements."""
    return "none" if mask is None else mask.structure_key()


def entry_key(device: str, dtype: str, kind: str, passes: str) -> str:
    """``"cpu|float32|Causal|forward"``; ``passes`` is ``"forward"`` or ``"train"`` (forward+backward)."""
    return f"{device}|{dtype}|{kind}|{passes}"


def load() -> dict | None:
    """The calibration file as a dict, or None when there is none.

    A file that cannot be used as it is (unreadable, not JSON, another version, or any entry that
    is not a non-empty list of ``{"n": positive number, "order": [names], "times": {name: seconds}}``)
    is ignored as a whole with one ``RuntimeWarning`` naming the file and the fix: ``attention()``
    then uses the built-in rules, it never fails because of this file."""
    path = calibration_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        return _ignored(path, f"unreadable ({exc})")
    try:
        data = json.loads(text)
    except ValueError as exc:
        return _ignored(path, f"not valid JSON ({exc})")
    problem = _problem(data)
    return _ignored(path, problem) if problem else data


def _ignored(path: Path, problem: str) -> None:
    warnings.warn(f"calibration: ignoring {path}: {problem}; built-in dispatch rules apply. Fix: run "
                  f"`python -m attnkit bench --calibrate` to write a new one, or delete the file.",
                  RuntimeWarning, stacklevel=3)
    return None


def _positive_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _problem(data) -> str | None:
    """What makes ``data`` unusable as a calibration table, or None when it is usable."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    if data.get("version") != VERSION:
        return f"version {data.get('version')!r}, this attnkit reads version {VERSION}"
    entries = data.get("entries")
    if not isinstance(entries, dict):
        return "'entries' is missing or not an object"
    for key, points in entries.items():
        if not isinstance(key, str) or len(key.split("|")) < 4:
            return f"entry key {key!r} is not 'device|dtype|mask kind|pass'"
        if not isinstance(points, list) or not points:
            return f"entry {key!r} has no points"
        for p in points:
            if not isinstance(p, dict) or not _positive_number(p.get("n")):
                return f"entry {key!r} has a point without a positive 'n': {p!r:.80}"
            order, times = p.get("order"), p.get("times")
            if not isinstance(order, list) or not order or not all(isinstance(b, str) for b in order):
                return f"entry {key!r} has a point whose 'order' is not a non-empty list of backend names"
            if not isinstance(times, dict) or not all(b in times and _positive_number(times[b]) for b in order):
                return f"entry {key!r} has a point whose 'times' lack a positive time for each backend of 'order'"
    return None


def _table() -> _Table | None:
    """The parsed table, loaded once (``attention()`` runs per layer per token: no file or
    environment reads on the hot path; call :func:`reload` after changing ``ATTNKIT_CALIBRATION``)."""
    if _CACHE[0] is _UNLOADED:
        data = load()
        table: _Table | None = None
        if data is not None:
            table = {}
            for key, points in data["entries"].items():
                points = sorted(points, key=lambda p: p["n"])
                bounds = [math.sqrt(a["n"] * b["n"]) for a, b in zip(points, points[1:])]
                table[key] = (bounds, points)
        _CACHE[0] = table
    return _CACHE[0]


def reload() -> None:
    """Forget the loaded table (after writing a new calibration, or in tests)."""
    _CACHE[0] = _UNLOADED


def save(data: dict) -> Path:
    """Write a calibration (see the module docstring for the format) and reload it.

    Written atomically (a temporary file beside it, then ``os.replace``): a crash mid-write leaves the
    previous file, never half of one; a symbolic link at the path is replaced, not written through.
    A table that :func:`load` would ignore is refused with a ``ValueError``."""
    data = {"version": VERSION, **data}
    problem = _problem(data)
    if problem:
        raise ValueError(f"calibration: not saving an unusable table: {problem}.")
    from .train.files import atomic_write_text  # only `bench --calibrate` writes: not on the import path

    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1))
    reload()
    return path


_DTYPE_NAMES: dict = {}


def _point(inp: AttentionInputs) -> tuple[str, dict] | None:
    table = _table()
    if not table:
        return None
    dtype = _DTYPE_NAMES.get(inp.dtype)
    if dtype is None:
        dtype = _DTYPE_NAMES.setdefault(inp.dtype, str(inp.dtype).removeprefix("torch."))
    key = entry_key(inp.device.type, dtype, mask_kind(inp.mask), "train" if inp.requires_grad else "forward")
    entry = table.get(key)
    if entry is None:
        return None
    bounds, points = entry
    return key, points[bisect.bisect_right(bounds, math.sqrt(inp.Tq * inp.Tk))]


def preferred(inp: AttentionInputs) -> tuple[str, ...] | None:
    """The measured ranking of exact backends for this input, fastest first; None without a table
    entry for its device, dtype, mask kind and pass. Pure Python on shapes and types: no tensor reads."""
    found = _point(inp)
    return None if found is None else tuple(found[1]["order"])


def describe(inp: AttentionInputs) -> str:
    """One line quoting the measured figures behind ``auto``'s choice for ``inp`` (for ``explain``)."""
    found = _point(inp)
    if found is None:
        where = calibration_path()
        if _table() is None:
            return f"no calibration on this machine ({where}): built-in defaults apply; run `python -m attnkit bench --calibrate`"
        return "calibration has no entry for this device/dtype/mask kind/pass: built-in defaults apply"
    key, point = found
    device, dtype, kind, passes = key.split("|")
    order, times = point["order"], point["times"]
    if len(order) < 2:
        return f"measured on this machine: only {order[0]} ran at n={point['n']} for {kind} {dtype} {passes}"
    best, second = order[0], order[1]
    return (
        f"measured on this machine: {best} {times[second] / times[best]:.2f}x faster than {second} at "
        f"n={point['n']} for {kind} {dtype} {passes} on {device} ({best} {times[best] * 1e3:.3g} ms, "
        f"{second} {times[second] * 1e3:.3g} ms)"
    )
