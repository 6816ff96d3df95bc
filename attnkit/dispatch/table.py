"""The measured table: this machine's rankings from ``python -m attnkit bench``, which ``auto`` reads.

The bench times every exact backend per (device, dtype, mask kind, pass, heads, head dim) over a
range of lengths, times the leader against the runner-up interleaved, and writes a point only where
that confirms the leader; a point it cannot confirm is left out (the static rule decides there).
The file lives at ``$ATTNKIT_CALIBRATION`` if set, else ``$XDG_CACHE_HOME/attnkit/calibration.json``
(``~/.cache/attnkit/calibration.json``). It is read once, when attnkit is imported (:func:`reload` reads
it again).

A table is used only in the setting it was measured in: this CPU, torch version, attnkit build and
thread count. One measured at another thread count is ignored quietly (``attnkit info`` says so);
one from another machine or build, or one that fails the schema check (any key, type or range:
:func:`problem`), is ignored with one warning. No call ever fails because of this file.

File format (JSON)::

    {"version": 3, "machine_id": {"cpu": ..., "capability": ..., "threads": ..., "torch": ...,
                                  "attnkit": ..., "native": ...},
     "command": "...",
     "entries": {"cpu|float32|SlidingWindow|forward|H8|D64":
                   [{"n": 1024, "order": ["native", "sdpa"], "times": {"native": 0.0012, "sdpa": 0.0019},
                     "interleaved": {"ratio": 1.31, "rounds": 5}}, ...]}}

``times`` are the sweep's; ``interleaved`` is the runner-up's time over the leader's, the median of
the ratios over ``rounds`` alternating rounds. A lookup takes the measured length nearest to the
input's ``n = sqrt(Tq * Tk)`` on a log scale. Decoding steps (few queries) are never looked up: the
table times ``Tq == Tk``.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import warnings
from pathlib import Path

from .. import hardware
from ..inputs import AttentionInputs
from ..masks import Mask

__all__ = ["calibration_path", "load", "reload", "save", "preferred", "describe", "entry_key", "mask_kind",
           "problem", "status"]

VERSION = 3
PASSES = ("forward", "train")
_MAX_BYTES = 64 * 2**20  # a table is a few hundred kB; anything far larger is not one

_CACHE: list = [None]  # the parsed table (or None), read at import and by reload()
_STATUS: list = ["not read yet"]


def calibration_path() -> Path:
    """Where the table is read and written (``ATTNKIT_CALIBRATION`` overrides)."""
    override = os.environ.get("ATTNKIT_CALIBRATION")
    if override:
        return Path(override).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "attnkit" / "calibration.json"


def mask_kind(mask: Mask | None) -> str:
    """The mask's kind as stored in the table: ``"none"`` or its structure key (``"Causal"``,
    ``"And(Causal,KeyPadding)"``): masks of one structure share measurements."""
    return "none" if mask is None else mask.structure_key()


def entry_key(device: str, dtype: str, kind: str, passes: str, *, heads: int, head_dim: int) -> str:
    """``"cpu|float32|Causal|forward|H8|D64"``; ``passes`` is ``"forward"`` or ``"train"``."""
    return f"{device}|{dtype}|{kind}|{passes}|H{heads}|D{head_dim}"


def _positive_number(x) -> bool:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x)) and x > 0
    except OverflowError:  # an int past float's range
        return False


def _positive_int(text: str) -> bool:
    return text.isdigit() and 0 < int(text) < 2**31


def _key_problem(key) -> str | None:
    parts = key.split("|") if isinstance(key, str) else []
    if len(parts) != 6 or not all(parts[:3]) or parts[3] not in PASSES or parts[4][:1] != "H" or parts[5][:1] != "D" \
            or not _positive_int(parts[4][1:]) or not _positive_int(parts[5][1:]):
        return f"entry key {key!r:.80} is not 'device|dtype|mask kind|forward or train|H<heads>|D<head dim>'"
    return None


_POINT_KEYS = frozenset({"n", "order", "times", "interleaved"})


def _point_problem(key: str, p) -> str | None:
    if not isinstance(p, dict) or not _positive_number(p.get("n")) or p["n"] > 2**40:
        return f"entry {key!r} has a point without an 'n' in 1..2**40: {p!r:.80}"
    if not p.keys() <= _POINT_KEYS:  # e.g. "tie": a ranking the bench could not confirm is never written
        return f"entry {key!r} has a point with keys {sorted(p.keys() - _POINT_KEYS)!r:.60} (expected only " \
               f"{sorted(_POINT_KEYS)})"
    order, times, interleaved = p.get("order"), p.get("times"), p.get("interleaved")
    if not isinstance(order, list) or not order or not all(isinstance(b, str) and b for b in order) \
            or len(set(order)) != len(order):
        return f"entry {key!r} has a point whose 'order' is not a non-empty list of distinct backend names"
    if not isinstance(times, dict) or not all(b in times and _positive_number(times[b]) for b in order):
        return f"entry {key!r} has a point whose 'times' lack a positive time for each backend of 'order'"
    if interleaved is not None and not (isinstance(interleaved, dict) and _positive_number(interleaved.get("ratio"))
                                        and _positive_number(interleaved.get("rounds"))):
        return f"entry {key!r} has a point whose 'interleaved' is not {{'ratio': > 0, 'rounds': > 0}}"
    return None


def problem(data) -> str | None:
    """What makes ``data`` unusable as a table (its keys, types and ranges), or None when usable."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    if data.get("version") != VERSION:
        return f"version {data.get('version')!r:.40}, this attnkit reads version {VERSION}"
    machine = data.get("machine_id")
    if not isinstance(machine, dict) or not all(isinstance(k, str) for k in machine):
        return "'machine_id' is missing or not an object"
    entries = data.get("entries")
    if not isinstance(entries, dict):
        return "'entries' is missing or not an object"
    for key, points in entries.items():
        found = _key_problem(key)
        if found:
            return found
        if not isinstance(points, list) or not points:
            return f"entry {key!r} has no points"
        for p in points:
            found = _point_problem(key, p)
            if found:
                return found
    return None


def _parse(text: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def load() -> dict | None:
    """The table as a dict, or None when there is none or it does not apply here (see the module
    docstring: why is kept for :func:`status`; a warning only for a file that is unusable or from
    another machine)."""
    path = calibration_path()
    try:
        if path.stat().st_size > _MAX_BYTES:
            return _ignored(path, f"larger than {_MAX_BYTES >> 20} MiB")
        text = path.read_text()
    except FileNotFoundError:
        _STATUS[0] = f"no table at {path}"
        return None
    except (OSError, UnicodeDecodeError) as exc:
        return _ignored(path, f"unreadable ({exc})")
    try:
        data = _parse(text)
    except ValueError as exc:
        return _ignored(path, f"not valid JSON ({str(exc)[:80]})")
    found = problem(data)
    if found:
        return _ignored(path, found)
    here, theirs = hardware.machine_id(), data["machine_id"]
    if theirs != here:
        if all(theirs.get(k) == v for k, v in here.items() if k != "threads"):
            _STATUS[0] = (f"table at {path} measured at {theirs.get('threads')!r:.20} threads, this process runs "
                          f"{here['threads']}: not used (the static rule decides)")
            return None
        diff = ", ".join(f"{k} {theirs.get(k)!r:.40} here {v!r}" for k, v in here.items() if theirs.get(k) != v)
        return _ignored(path, f"measured on another machine, torch version or attnkit build ({diff})")
    _STATUS[0] = f"table at {path}: {sum(len(p) for p in data['entries'].values())} points"
    return data


def _ignored(path: Path, why: str) -> None:
    _STATUS[0] = f"table at {path} ignored: {why}"
    warnings.warn(f"calibration: ignoring {path}: {why}; the static dispatch rule applies. Fix: run "
                  f"`python -m attnkit bench` to write a new one, or delete the file.", RuntimeWarning, stacklevel=4)
    return None


def status() -> str:
    """One line on the table this process uses (for ``attnkit info``)."""
    return _STATUS[0]


# key -> (boundaries, points): points sorted by n; boundaries[i] = geometric midpoint between points[i]
# and points[i + 1], so bisect_right(boundaries, n) is the nearest point on a log scale.
_Table = dict[str, tuple[list[float], list[dict]]]


def _parsed(data: dict | None) -> _Table | None:
    if data is None:
        return None
    parsed: _Table = {}
    for key, points in data["entries"].items():
        points = sorted(points, key=lambda p: p["n"])
        parsed[key] = ([math.sqrt(a["n"] * b["n"]) for a, b in zip(points, points[1:])], points)
    return parsed


def _table() -> _Table | None:
    """The table read when attnkit was imported (or at the last :func:`reload`): no file or
    environment reads on the hot path, and a constant to a ``torch.compile`` trace."""
    return _CACHE[0]


#: Called after every reload (the per-call cache registers its ``clear``: decisions taken from the old table).
ON_RELOAD: list = []


def reload() -> None:
    """Read the table again (after writing one, or changing ``ATTNKIT_CALIBRATION``) and forget the
    decisions taken from the old one."""
    _CACHE[0] = _parsed(load())
    for forget in ON_RELOAD:
        forget()


def save(data: dict, *, merge: bool = False) -> Path:
    """Write a table (the module docstring's format) atomically and reload it. ``merge=True`` keeps the
    entries of this machine's usable table already there that ``data`` does not measure. A table that
    :func:`load` would ignore is refused with a ``ValueError``."""
    data = {"version": VERSION, "machine_id": hardware.machine_id(), **data}
    if merge:
        old = _existing(data["machine_id"])
        if old is not None:
            data["entries"] = {**old["entries"], **data.get("entries", {})}
    found = problem(data)
    if found:
        raise ValueError(f"calibration: not saving an unusable table: {found}.")
    from ..io.files import atomic_write_text  # only writers need it: not on the import path

    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1))
    reload()
    return path


def _existing(machine: dict) -> dict | None:
    try:
        data = _parse(calibration_path().read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if problem(data) is None and data.get("machine_id") == machine else None


_DTYPE_NAMES: dict = {}


def _point(inp: AttentionInputs) -> tuple[str, dict] | None:
    table = _table()
    if not table:
        return None
    dtype = _DTYPE_NAMES.get(inp.dtype)
    if dtype is None:
        dtype = _DTYPE_NAMES.setdefault(inp.dtype, str(inp.dtype).removeprefix("torch."))
    key = entry_key(inp.device.type, dtype, mask_kind(inp.mask), "train" if inp.requires_grad else "forward",
                    heads=inp.Hq, head_dim=inp.D)
    entry = table.get(key)
    if entry is None:
        return None
    bounds, points = entry
    return key, points[bisect.bisect_right(bounds, math.sqrt(inp.Tq * inp.Tk))]


def preferred(inp: AttentionInputs) -> list[str] | None:
    """The measured ranking for ``inp``, fastest first; None without a row for it. Pure Python on
    shapes and types: no tensor reads."""
    found = _point(inp)
    return None if found is None else found[1]["order"]


def describe(inp: AttentionInputs) -> str | None:
    """One line quoting the measured figures behind the table's ranking for ``inp``; None without a row."""
    found = _point(inp)
    if found is None:
        return None
    key, point = found
    device, dtype, kind, passes, heads, dim = key.split("|")
    times, interleaved = point["times"], point.get("interleaved")
    order = [b for b in point["order"] if b != "naive"]  # the rule tries naive last, whatever was measured
    if not order:
        return None
    if order[:2] != point["order"][:2]:
        interleaved = None  # its ratio compares another pair
    where = f"at n={point['n']:g} for {kind} {dtype} {passes} {heads} {dim} on {device}"
    if len(order) < 2:
        return f"measured on this machine: only {order[0]} ran {where}"
    best, second = order[0], order[1]
    if interleaved is not None:
        return (f"measured on this machine: {best} {interleaved['ratio']:.2f}x faster than {second} {where} "
                f"(interleaved, median of {interleaved['rounds']:g} rounds)")
    return f"measured on this machine: {best} {times[second] / times[best]:.2f}x faster than {second} {where}"


_CACHE[0] = _parsed(load())
