"""The per-machine measurements that ``auto`` dispatch reads: the probed machine constants and the
table of measured rankings.

**Machine constants** (:func:`machine_constants`): GEMM rate per dtype, memory bandwidth, the cost
of one PyTorch op and each backend's per-call overhead, probed on first use (well under a second)
and cached in ``machine.json`` beside the table, per machine, torch version, thread count and native
build; probed again when the build changes, when a quick re-check on loading finds them measured
under load, and at the start of ``python -m attnkit bench``. The cost model in
:mod:`attnkit.dispatch` reads them; nothing there is a figure from one machine.

**The table** (written by ``python -m attnkit bench``): every exact backend timed per
(device, dtype, mask kind, pass, heads, head dim) over a range of lengths; for each measured length,
the backends ranked by median time. Where others are within the sweep's noise of the fastest, the
job times those again interleaved (alternating rounds) and stores the fastest first when it is more
than 1% ahead of each (the point records its ratio to the runner-up as ``"interleaved"``); where it
is not, or there was no time left to measure, the point is a ``"tie"`` and the cost model decides.
:func:`attnkit.dispatch.priority` asks :func:`preferred` for that ranking. The file lives at
``$ATTNKIT_CALIBRATION`` if set, else ``$XDG_CACHE_HOME/attnkit/calibration.json``
(``~/.cache/attnkit/calibration.json``). A table measured on another machine, torch version or attnkit build is
ignored with one warning; a corrupt one is refused, and no call ever fails because of it.

File format (JSON)::

    {"version": 2, "machine_id": {"cpu": ..., "capability": ..., "threads": ..., "torch": ...,
                                  "attnkit": ..., "native": ...},
     "command": "...",
     "entries": {"cpu|float32|SlidingWindow|forward|H8|D64":
                   [{"n": 1024, "order": ["native", "sdpa"], "times": {"native": 0.0012, ...}},
                    {"n": 4096, "order": ["sdpa", "native"], "times": {...},
                     "interleaved": {"ratio": 1.04, "rounds": 5}},
                    {"n": 8192, "order": [...], "times": {...}, "tie": true}, ...]}}

``times`` are the sweep's; ``interleaved`` (optional) is the second backend's time over the first's,
the median of the ratios over ``rounds`` alternating rounds; ``tie`` (optional) leaves the point to
the cost model.

A lookup takes the measured length nearest to the input's ``n = sqrt(Tq * Tk)`` on a log scale
(so a one-token decode step over 4096 keys counts as n = 64: its work is Tq * Tk).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from . import hardware
from .inputs import AttentionInputs
from .masks import Mask

__all__ = ["calibration_path", "load", "reload", "save", "preferred", "describe", "entry_key", "mask_kind",
           "machine_constants", "constants_path", "generation", "reprobe", "build_stamp"]

VERSION = 2

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


def entry_key(device: str, dtype: str, kind: str, passes: str, *, heads: int, head_dim: int) -> str:
    """``"cpu|float32|Causal|forward|H8|D64"``; ``passes`` is ``"forward"`` or ``"train"``
    (forward+backward). Heads and head dim are part of the key: a ranking measured at 4 heads says
    nothing certain about 8."""
    return f"{device}|{dtype}|{kind}|{passes}|H{heads}|D{head_dim}"


def load() -> dict | None:
    """The calibration file as a dict, or None when there is none.

    A file that cannot be used as it is (unreadable, not JSON, another version, or any entry that
    is not a non-empty list of ``{"n": positive number, "order": [names], "times": {name: seconds}}``)
    is ignored as a whole with one ``RuntimeWarning`` naming the file and the fix: ``attention()``
    then uses the built-in rules, it never fails because of this file. So is a table measured on
    another machine, torch version or attnkit build (one line saying which)."""
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
    if problem:
        return _ignored(path, problem)
    here = hardware.machine_id()
    if data.get("machine_id") != here:
        theirs = data.get("machine_id") or {}
        diff = ", ".join(f"{k} {theirs.get(k)!r} here {v!r}" for k, v in here.items() if theirs.get(k) != v)
        if all(theirs.get(k) == v for k, v in here.items() if k != "threads"):
            return _ignored(path, f"measured with {theirs.get('threads')} threads, this process runs "
                                  f"{here.get('threads')} (torch.set_num_threads); a table holds one thread count")
        return _ignored(path, f"measured on another machine, torch version or attnkit build ({diff})")
    return data


def _ignored(path: Path, problem: str) -> None:
    warnings.warn(f"calibration: ignoring {path}: {problem}; built-in dispatch rules apply. Fix: run "
                  f"`python -m attnkit bench` to write a new one, or delete the file.",
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
        if not isinstance(key, str) or len(key.split("|")) != 6:
            return f"entry key {key!r} is not 'device|dtype|mask kind|pass|H<heads>|D<head dim>'"
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
            interleaved = p.get("interleaved")
            if interleaved is not None and not (isinstance(interleaved, dict) and _positive_number(
                    interleaved.get("ratio")) and _positive_number(interleaved.get("rounds"))):
                return f"entry {key!r} has a point whose 'interleaved' is not {{'ratio': > 0, 'rounds': > 0}}"
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


def reload(*, constants: bool = False) -> None:
    """Forget the loaded table (after writing a new calibration, or in tests), and with
    ``constants=True`` the machine constants too (read again, or probed, on next use)."""
    _CACHE[0] = _UNLOADED
    if constants:
        _CONSTANTS[0] = None
    _GENERATION[0] += 1


def generation() -> int:
    """A counter that changes whenever the table or constants are reloaded (a key for caches of
    decisions taken from them)."""
    return _GENERATION[0]


def save(data: dict, *, merge: bool = False) -> Path:
    """Write a calibration (see the module docstring for the format) and reload it.

    ``merge=True`` keeps the entries of the table already there (when it is usable and from this
    machine, torch version and attnkit build) whose keys ``data`` does not measure, so a sweep at other heads or
    head dims adds to the table; a corrupt or foreign table is replaced.

    Written atomically (a temporary file beside it, then ``os.replace``): a crash mid-write leaves the
    previous file, never half of one; a symbolic link at the path is replaced, not written through.
    A table that :func:`load` would ignore is refused with a ``ValueError``."""
    data = {"version": VERSION, "machine_id": hardware.machine_id(), **data}
    if merge:
        old = _existing(data["machine_id"])
        if old is not None:
            data["entries"] = {**old["entries"], **data.get("entries", {})}
    problem = _problem(data)
    if problem:
        raise ValueError(f"calibration: not saving an unusable table: {problem}.")
    path = calibration_path()
    _write(path, json.dumps(data, indent=1))
    reload()
    return path


def _existing(machine: dict) -> dict | None:
    """The table at :func:`calibration_path` if it is usable and from ``machine``, else None (no
    warning: it is about to be replaced)."""
    try:
        data = json.loads(calibration_path().read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if _problem(data) is None and data.get("machine_id") == machine else None


def _write(path: Path, text: str) -> None:
    from .io.files import atomic_write_text  # only writers need it: not on the import path

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)


_DTYPE_NAMES: dict = {}


def _point(inp: AttentionInputs) -> tuple[str, dict] | None:
    table = _table()
    if not table or inp.Tq <= DECODE_QUERIES:  # the table times Tq == Tk: decoding is the cost model's
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


def preferred(inp: AttentionInputs) -> tuple[str, ...] | None:
    """The measured ranking of exact backends for this input, fastest first; None without a table
    entry for its device, dtype, mask kind, pass, heads and head dim, or where the measured leaders
    were within noise of each other, also when timed interleaved (``"tie"`` in the point: the cost
    model decides between them).
    Pure Python on shapes and types: no tensor reads."""
    found = _point(inp)
    if found is None or found[1].get("tie"):
        return None
    return tuple(found[1]["order"])


def describe(inp: AttentionInputs) -> str:
    """One line quoting the measured figures behind ``auto``'s choice for ``inp`` (for ``explain``)."""
    found = _point(inp)
    if found is None:
        where = calibration_path()
        if _table() is None:
            return (f"no calibration on this machine ({where}): the cost model from probed machine constants "
                    "decides; run `python -m attnkit bench` to measure")
        if inp.Tq <= DECODE_QUERIES:
            return (f"decoding ({inp.Tq} queries): the calibration table times Tq == Tk only, the cost model "
                    "decides (K/V bytes at each backend's measured rate)")
        return "calibration has no entry for this device/dtype/mask kind/pass/heads/head dim: the cost model decides"
    key, point = found
    device, dtype, kind, passes, heads, dim = key.split("|")
    order, times, interleaved = point["order"], point["times"], point.get("interleaved")
    if point.get("tie"):
        again = "" if interleaved is None else (
            f", also timed interleaved ({interleaved['ratio']:.3f}x over {interleaved['rounds']:g} rounds)")
        return (f"measured on this machine: {' and '.join(order[:2])} within noise of each other at n={point['n']} "
                f"for {kind} {dtype} {passes}{again}: the cost model decides")
    if len(order) < 2:
        return f"measured on this machine: only {order[0]} ran at n={point['n']} for {kind} {dtype} {passes}"
    best, second = order[0], order[1]
    where = f"at n={point['n']} for {kind} {dtype} {passes} {heads} {dim} on {device}"
    if interleaved is not None:  # within the sweep's noise: the interleaved ratio decided
        return (f"measured on this machine, interleaved: {best} {interleaved['ratio']:.2f}x faster than {second} "
                f"{where} (median of {interleaved['rounds']:g} alternating rounds; the sweep's single timings were "
                "within noise)")
    return (
        f"measured on this machine: {best} {times[second] / times[best]:.2f}x faster than {second} {where} "
        f"({best} {times[best] * 1e3:.3g} ms, {second} {times[second] * 1e3:.3g} ms)"
    )


# -- probed machine constants ---------------------------------------------------------------------

# 3: one entry per thread count, each with its native build stamp; 4: the decode reference reads 4096 keys;
# 5: each backend's half-precision times on the causal reference; 7: the square reference problems have 8 heads;
# 8: each backend's forward+backward on the tiny input; 9: the native kernel's faster training path;
# 10: each backend on a second, smaller decode problem; 11: native's square tiles across a band edge;
# 12: the decode reference reads 32 MiB each of K and V; 13: the layout reference in blocks of 64, the
# reference problems timed in rounds; 14: a 16-key decode problem (each backend's fixed decode cost);
# 15: each backend's forward and backward on the causal reference
CONSTANTS_VERSION = 15
_CONSTANTS: list = [None]
_CONSTANTS_THREADS: list = [None]  # the thread count _CONSTANTS were loaded for (None: set from outside)
_GENERATION = [0]
_PROBE_LOCK = threading.Lock()
#: A stored constant this many times slower than the quick re-check on loading it says it was
#: probed while the machine was busy: the constants are probed again.
RECHECK_FACTOR = 3.0


def constants_path() -> Path:
    """Where the probed constants are cached: ``machine.json`` beside the calibration table."""
    return calibration_path().with_name("machine.json")


def machine_constants() -> dict:
    """This machine's constants for the cost model (see :func:`attnkit.hardware.probe_rates`) plus
    ``backend_seconds``: each exact backend's time for a tiny call (its per-call overhead), for the
    current ``torch.get_num_threads()`` (a new count loads, or probes, its own).

    Probed on first use and cached in :func:`constants_path` (written atomically), one entry per
    thread count, for this machine, torch version and native build (:func:`build_stamp`). A cached
    entry is used while its build stamp is current and a quick re-check (a few milliseconds,
    :func:`attnkit.hardware.quick_rates`) finds none of its rates :data:`RECHECK_FACTOR` times
    slower than now (constants probed under load): otherwise the constants are probed again and
    the entry replaced. A corrupt file, or one from another machine, torch version or attnkit build, is ignored
    with a one-line ``RuntimeWarning`` and replaced; an unwritable directory only costs the probe
    in each process. ``python -m attnkit bench`` probes afresh at its start (:func:`reprobe`)."""
    threads = torch.get_num_threads()
    if _CONSTANTS[0] is None or _CONSTANTS_THREADS[0] not in (None, threads):
        with _PROBE_LOCK:  # threads starting together probe once
            if _CONSTANTS[0] is None or _CONSTANTS_THREADS[0] not in (None, threads):
                if _CONSTANTS[0] is not None:  # torch.set_num_threads since: decisions taken from them are forgotten
                    _GENERATION[0] += 1
                _CONSTANTS[0] = _load_or_probe()
                _CONSTANTS_THREADS[0] = threads
    return _CONSTANTS[0]


def constants_loaded() -> bool:
    """True once :func:`machine_constants` has its answer in this process (no probe will run)."""
    return _CONSTANTS[0] is not None


def reprobe() -> dict:
    """Probe the machine constants now, whatever is cached, store them (:func:`constants_path`) and
    use them from the next decision on (the calibration job runs this first)."""
    with _PROBE_LOCK:
        constants = _load_or_probe(fresh=True)
        _CONSTANTS[0], _CONSTANTS_THREADS[0] = constants, torch.get_num_threads()
        _GENERATION[0] += 1  # decisions taken from the old constants are forgotten
    return constants


def build_stamp() -> str:
    """Which native build the constants describe (:func:`attnkit.csrc.loader.build_id`); ``"none"``
    when no build is usable. A kernel built from other sources runs at another speed."""
    from .csrc import loader

    return loader.build_id() or "none"


def _load_or_probe(fresh: bool = False) -> dict:
    here = hardware.machine_id()
    machine = {key: value for key, value in here.items() if key != "threads"}
    threads, build = str(here["threads"]), build_stamp()
    path = constants_path()
    entries = _stored_entries(path, machine)
    entry = entries.get(threads)
    if not fresh and entry is not None and entry.get("build") == build:
        problem = _constants_problem(entry.get("constants"))
        if problem is not None:
            _constants_ignored(path, f"the entry for {threads} thread(s) is unusable: {problem}")
        elif _probed_under_load(entry["constants"]) is None:
            return entry["constants"]
    constants = probe_constants()
    entries[threads] = {"build": build, "constants": constants}
    try:
        _write(path, json.dumps({"version": CONSTANTS_VERSION, "machine": machine, "entries": entries}))
    except OSError:
        pass
    return constants


def _stored_entries(path: Path, machine: dict) -> dict:
    """The usable entries of the constants file (thread count -> entry), ``{}`` when there is no
    file; a file that cannot be used, or one from another machine, torch version or attnkit build, is ignored
    with one warning (it is replaced by the next probe's)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        _constants_ignored(path, f"unreadable or not JSON ({str(exc).splitlines()[0] if str(exc) else exc!r})")
        return {}
    version = data.get("version") if isinstance(data, dict) else None
    if version != CONSTANTS_VERSION:
        if not (type(version) is int and 0 < version < CONSTANTS_VERSION):  # an older attnkit's: replaced quietly
            _constants_ignored(path, f"version {version!r}, this attnkit reads version {CONSTANTS_VERSION}")
        return {}
    theirs, entries = data.get("machine"), data.get("entries")
    if not isinstance(theirs, dict) or not isinstance(entries, dict) or not all(
            isinstance(e, dict) for e in entries.values()):
        _constants_ignored(path, "'machine' or 'entries' is missing or not an object")
        return {}
    if theirs != machine:
        diff = ", ".join(f"{k} {theirs.get(k)!r} here {v!r}" for k, v in machine.items() if theirs.get(k) != v)
        _constants_ignored(path, f"probed on another machine, torch version or attnkit build ({diff or theirs!r})")
        return {}
    return dict(entries)


def _constants_ignored(path: Path, problem: str) -> None:
    warnings.warn(f"calibration: ignoring the machine constants in {path}: {problem}; this machine is probed "
                  "again and the file replaced.", RuntimeWarning, stacklevel=2)


def _probed_under_load(constants: dict) -> str | None:
    """Which stored constant the quick re-check finds :data:`RECHECK_FACTOR` times slower than
    now, or None (a busy machine now makes the re-check slower, never the stored values wrong)."""
    now = hardware.quick_rates()
    if constants["op_seconds"] > RECHECK_FACTOR * now["op_seconds"]:
        return "op_seconds"
    if constants["tile_gflops"] * RECHECK_FACTOR < now["tile_gflops"]:
        return "tile_gflops"
    return None


def _constants_problem(c) -> str | None:
    try:
        numbers = [*c["gemm_gflops"].values(), c["tile_gflops"], c["bandwidth_gbs"], c["op_seconds"],
                   *c["backend_seconds"].values(), *c["train_backend_seconds"].values(),
                   *(t for r in c["reference_seconds"].values() for t in r.values()),
                   *(t for r in c["half_reference_seconds"].values() for t in r.values()),
                   *c.get("decode_small_seconds", {}).values(), *c.get("decode_tiny_seconds", {}).values(),
                   *c.get("train_reference_seconds", {}).values()]
    except (TypeError, KeyError, AttributeError):
        return "missing fields"
    return None if all(_positive_number(x) for x in numbers) else "a constant is not a positive number"


#: Queries per call up to which an input counts as decoding (its time is reading K/V, not GEMMs).
DECODE_QUERIES = 16


def reference_problems() -> dict:
    """The probe's reference problem per mask class, ``class -> ((B, H, Tq, Tk, D), mask)``; each
    backend's time on it, less its per-call overhead, gives its achieved rate on this machine.
    ``"causal"`` also stands for no mask; ``"band"`` for every mask that needs evaluating (windows,
    padding, documents); ``"layout"`` for a BlockSparse layout; ``"decode"`` for a few queries over
    a cache (at most :data:`DECODE_QUERIES`)."""
    from .masks import BlockSparse, Causal, SlidingWindow

    T = 256
    # 8 heads: a tiled kernel's work items (heads x query tiles) balance over the threads, as in the
    # calls it is ranked for; with 2 heads its rate came out below what it reaches at any real size.
    square = (1, 8, T, T, 64)
    return {"causal": (square, Causal()), "band": (square, Causal() & SlidingWindow(T // 4, 0)),
            # blocks of 64, BigBird's usual size (a kernel that tiles by the layout's blocks runs at
            # the rate of its tiles, and 32-wide ones ran well below it at 64); the diagonal and one
            # global block: 10 of the 16 blocks, about the density the 32-wide layout had
            "layout": (square, BlockSparse.bigbird(T // 64, 64, window=0, global_blocks=1, random_blocks=0)),
            # 32 MiB each of K and V: a cache past the last-level caches (one that fits in them is
            # read faster per byte, and long caches would be priced as if they fit)
            "decode": ((1, 8, 1, 16384, 64), Causal())}


def decode_tiny_problem() -> tuple:
    """The smallest decode problem, ``((B, H, Tq, Tk, D), mask)``: 16 keys (32 KiB each of K and V).
    Its time is a decode step's fixed part (``decode_tiny_seconds``): a step over a short cache costs
    the line from it to the small problem's time."""
    from .masks import Causal

    return (1, 8, 1, 16, 64), Causal()


def decode_small_problem() -> tuple:
    """A second, smaller decode problem, ``((B, H, Tq, Tk, D), mask)``: 1 MiB each of K and V
    (``decode_small_seconds``). With the ``"decode"`` reference it gives each backend's cost per
    byte of K/V past it, and with the 16-key problem (:func:`decode_tiny_problem`) the line below it
    (a small cache is read from the CPU's caches, faster per byte)."""
    from .masks import Causal

    return (1, 8, 1, 512, 64), Causal()


#: Timed calls per reference problem (a fraction of a millisecond each; the long decode problem, a few
#: milliseconds, takes 3): the best of several, as one call on a shared machine is often slowed by a
#: third or more.
_REFERENCE_REPEATS = 5
#: The forward reference problems are timed in this many rounds, each a burst of _BURST calls of
#: which all but the first are timed: the steady state of a loop of calls, as a model's layers and a
#: benchmark run them (a call right after other backends' calls found its memory out of the caches,
#: and some kernels lose a tenth or more of their speed there, others nothing: single calls in rounds
#: ranked them by that).
_REFERENCE_ROUNDS = 3
_BURST = 3


def probe_constants() -> dict:
    """Measure the constants now (well under a second): the machine's rates, then each exact,
    available backend on a tiny input (``backend_seconds``: its per-call overhead; forward and
    backward, ``train_backend_seconds``: its per-call overhead when training), on the reference
    problem of each mask class it can run (``reference_seconds[backend][class]``), on the smaller
    decode problems (``decode_small_seconds[backend]``, :func:`decode_small_problem`;
    ``decode_tiny_seconds[backend]``, :func:`decode_tiny_problem`), on the causal reference in
    bfloat16 and float16 (``half_reference_seconds[backend][dtype]``), and its forward and backward
    on the causal reference (``train_reference_seconds[backend]``). The reference problems are
    timed in rounds (the backends compared are timed side by side), each round a burst of every
    fused kernel's forward calls, timed after the first (the steady state of a loop of calls), and
    one call of every other; tiny calls and decode steps back to back, as a loop runs them. A backend that fails
    anywhere but the long decode problem is left out of every table; one that fails there is not
    priced for decoding."""
    from .masks import BlockSparse, Causal, SlidingWindow
    from .registry import list_backends

    constants = hardware.probe_rates()
    tiny = torch.randn(1, 1, 32, 16)
    tiny_masks = [None, Causal() & SlidingWindow(8, 0), BlockSparse.bigbird(2, 16, window=1, global_blocks=1,
                                                                             random_blocks=0)]
    problems = {cls: (_random(shape), mask) for cls, (shape, mask) in reference_problems().items()}
    small_shape, small_mask = decode_small_problem()
    small = AttentionInputs.create(*_random(small_shape), mask=small_mask)
    tiny_shape, tiny_mask = decode_tiny_problem()
    tiny_decode = AttentionInputs.create(*_random(tiny_shape), mask=tiny_mask)
    overhead, train_overhead, reference, half, decode_small, decode_tiny, train = {}, {}, {}, {}, {}, {}, {}
    # The reference problems' calls of every backend: (backend, where its best time goes, key, call,
    # rounds, calls a round).
    calls: list[tuple[str, dict, str, Callable[[], object], int, int]] = []
    with torch.no_grad():
        for name, impl in list_backends().items():
            if not impl.exact or getattr(impl, "compiles", False):
                continue
            mine = []
            # (rounds, calls a round): a fused kernel in bursts (its steady state), PyTorch ops one call a round
            timing = (_REFERENCE_ROUNDS, _BURST) if impl.work.fused else (_REFERENCE_REPEATS, 1)
            try:
                inp = next((i for m in tiny_masks
                            if impl.can_run(i := AttentionInputs.create(tiny, tiny, tiny, mask=m))), None)
                if inp is None:
                    continue
                # a tiny call's cost, timed back to back (as a loop of calls runs it): one timed right
                # after a large call pays for the caches that call filled
                overhead[name] = hardware.best_seconds(functools.partial(impl.forward, inp, None), 5)
                seconds = _train_overhead(impl, inp) if name != "naive" else None  # never ranked by cost
                if seconds is not None:
                    train_overhead[name] = seconds
                runs_causal = False
                for cls, ((q, k, v), mask) in problems.items() if name != "naive" else ():  # never ranked by cost
                    inp = AttentionInputs.create(q, k, v, mask=mask)
                    if cls != "decode" and impl.can_run(inp):
                        mine.append((name, reference.setdefault(name, {}), cls,
                                     functools.partial(impl.forward, inp, None), *timing))
                        runs_causal |= cls == "causal"
                # the 1 MiB and 16-key decode steps (priced together), back to back as a decode loop runs them
                if name != "naive" and impl.can_run(small) and impl.can_run(tiny_decode):
                    decode_small[name] = hardware.best_seconds(functools.partial(impl.forward, small, None),
                                                               _REFERENCE_REPEATS)
                    decode_tiny[name] = hardware.best_seconds(functools.partial(impl.forward, tiny_decode, None),
                                                              _REFERENCE_REPEATS)
                # Its own speed in half precision (a kernel's bf16 path need not follow the GEMM rates):
                # the causal reference again in each half dtype.
                (q, k, v), mask = problems["causal"]
                for dtype in (torch.bfloat16, torch.float16) if name in reference and impl.work.half != "never" else ():
                    inp = AttentionInputs.create(q.to(dtype), k.to(dtype), v.to(dtype), mask=mask)
                    if impl.can_run(inp):
                        mine.append((name, half.setdefault(name, {}), str(dtype).removeprefix("torch."),
                                     functools.partial(impl.forward, inp, None), *timing))
                # Forward and backward on the causal reference: what a backward costs this backend
                # beside its forward (kernels differ in it), once a round
                if seconds is not None and runs_causal:
                    mine.append((name, train, name, _train_call(impl, problems["causal"]), _REFERENCE_ROUNDS, 1))
                for call in mine:
                    call[3]()  # warm up (and fail here, if it fails)
            except Exception:  # a backend that fails here is not ranked by cost; its reasons decide
                _forget(name, overhead, train_overhead, reference, half, decode_small, decode_tiny, train)
                continue
            calls += mine
        # The reference problems timed in rounds, each round every call once (a burst for a fused
        # kernel): the backends compared with each other are timed side by side, so a slower stretch
        # of a shared machine falls on them alike.
        failed: set[str] = set()
        for r in range(max(repeats for *_, repeats, _ in calls) if calls else 0):
            for name, into, key, call, repeats, burst in calls:
                if r >= repeats or name in failed:
                    continue
                try:
                    for b in range(burst):
                        start = time.perf_counter()
                        call()
                        if b or burst == 1:
                            into[key] = min(into.get(key, math.inf), time.perf_counter() - start)
                except Exception:
                    failed.add(name)
                    continue
        for name in failed:
            _forget(name, overhead, train_overhead, reference, half, decode_small, decode_tiny, train)
        # The long decode problem (a few milliseconds a call; a prefill kernel, tens), fastest on
        # the small one first: a backend over 3x the fastest so far is timed once.
        (q, k, v), mask = problems["decode"]
        long = AttentionInputs.create(q, k, v, mask=mask)
        fastest = None
        for name in sorted(decode_small, key=decode_small.get):
            impl = list_backends()[name]
            try:
                if impl.can_run(long):
                    seconds = hardware.best_seconds(lambda: impl.forward(long, None), 3,
                                                    enough=None if fastest is None else 3 * fastest)
                    reference.setdefault(name, {})["decode"] = seconds
                    fastest = seconds if fastest is None else min(fastest, seconds)
            except Exception:
                pass
        decode_small = {n: t for n, t in decode_small.items() if "decode" in reference.get(n, {})}
        decode_tiny = {n: t for n, t in decode_tiny.items() if n in decode_small}
    constants["backend_seconds"] = overhead
    constants["train_backend_seconds"] = train_overhead
    constants["reference_seconds"] = reference
    constants["half_reference_seconds"] = half
    constants["decode_small_seconds"] = decode_small
    constants["decode_tiny_seconds"] = decode_tiny
    constants["train_reference_seconds"] = train
    return constants


def _forget(name: str, *tables: dict) -> None:
    """Drop ``name`` from the probe's tables (a backend that failed there is not ranked by cost)."""
    for table in tables:
        table.pop(name, None)


def _train_overhead(impl, inp: AttentionInputs) -> float | None:
    """Forward and backward of ``impl`` on the tiny input ``inp``: its per-call cost when training
    (a backward has its own: autograd's bookkeeping, scratch, a second kernel), or None when it
    cannot train."""
    if not impl.supports_backward:
        return None
    q, k, v = (t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))
    grad_inp = AttentionInputs.create(q, k, v, mask=inp.mask)
    try:
        with torch.enable_grad():
            # the gradient of a sum: no grad_outputs tensor (torch's check of one imports sympy, about
            # half a second, on a process's first backward)
            return hardware.best_seconds(
                lambda: torch.autograd.grad(impl.forward(grad_inp, None).sum(), (q, k, v)), 3)
    except Exception:  # no backward after all: priced as three forwards
        return None


def _train_call(impl, problem: tuple) -> Callable[[], object]:
    """One forward and backward of ``impl`` on a reference ``problem`` (``((q, k, v), mask)``)."""
    (q, k, v), mask = problem
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    inp = AttentionInputs.create(q, k, v, mask=mask)

    def call():
        with torch.enable_grad():
            return torch.autograd.grad(impl.forward(inp, None).sum(), (q, k, v))

    return call


def _random(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v; a long K/V repeats a random block of 1024 keys (drawing 32 MiB of normal
    values takes longer than timing the call; the kernels' time does not depend on the values)."""
    B, H, Tq, Tk, D = shape

    def keys() -> torch.Tensor:
        block = torch.randn(B, H, min(Tk, 1024), D)
        return block if Tk <= 1024 else block.repeat(1, 1, -(-Tk // 1024), 1)[:, :, :Tk].contiguous()

    return torch.randn(B, H, Tq, D), keys(), keys()
