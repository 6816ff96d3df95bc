"""Loading the built kernel libraries (``attnkit build``): the one place that checks their
stamp and loads them, one family at a time (``prefill``, ``decode``, ``fastpath``, ``gated``,
``sparse``: see :mod:`attnkit.csrc.build`), for the ``native``, ``decode`` and ``topk`` backends'
ops, gated linear attention's ops and the per-call helpers in C (:func:`fastpath`). A family that
is not built leaves the others usable."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json

from . import build


def load_library(family: str = "prefill") -> str | None:
    """Load a kernel family's library (its ops into ``torch.ops``); ``None`` when it loaded, else why
    not (not built, its source failed to compile, built for another torch, built for a CPU with
    instruction sets this one lacks, or failing to load). Not cached: its callers cache what they
    build on it."""
    import torch

    problem = _stamp(family)[0]
    if problem is not None:
        return problem
    try:
        if family == "fastpath":  # a CPython module's constructor, not torch ops (see fastpath())
            ctypes.PyDLL(str(build.library_path(family))).attnkit_fastpath_module  # noqa: B018 (the symbol exists)
        else:
            torch.ops.load_library(str(build.library_path(family)))
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        return f"native extension not built: its {family} kernel fails to load ({exc})"
    return None


def family_reasons() -> dict[str, str | None]:
    """Per kernel family, why it cannot be loaded here (None: it can), from the stamp and the files
    alone (loads nothing)."""
    return {family: _stamp(family)[0] for family in build.FAMILIES}


def build_id() -> str | None:
    """Which usable build this is, for measurements taken with it (the measured dispatch table): a digest
    of its stamp (torch version, CPU flags and, per usable family, the digest of the sources it was
    compiled from, :func:`build.sources_digest`). None when no family is usable here. Reads the stamp only."""
    usable = [family for family, problem in family_reasons().items() if problem is None]
    if not usable:
        return None
    stamp = build.read_stamp()
    ident = {"torch": stamp.get("torch"), "cpu_flags": stamp.get("cpu_flags"),
             "families": {f: stamp["families"][f].get("sources") for f in usable}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _stamp(family: str) -> tuple[str | None, dict]:
    """``(why the family's build cannot be loaded here or None, the stamp)``."""
    import torch

    stamp = build.read_stamp()
    families = stamp.get("families")
    entry = families.get(family) if isinstance(families, dict) else None
    if isinstance(entry, dict) and entry.get("error"):
        return (f"native extension not built: its {family} kernel failed to compile ({entry['error']}); fix that "
                f"and rerun `attnkit build` (the other kernels are unaffected)"), stamp
    path = build.library_path(family)
    if not path.exists() or not isinstance(entry, dict):
        return (f"native extension not built: run `attnkit build` (or `make install`); "
                f"no {family} kernel ({path.name})"), stamp
    if stamp.get("torch") != torch.__version__:
        return (f"native extension not built for this torch: built against {stamp.get('torch')}, running "
                f"{torch.__version__}; rebuild with `attnkit build`"), stamp
    missing = set(stamp.get("cpu_flags", ())) - build.cpu_flags()
    if missing and build.cpu_flags():
        return (f"native extension built for another CPU: this one lacks {', '.join(sorted(missing)[:6])}; "
                "rebuild here with `attnkit build`"), stamp
    return None, stamp


@functools.lru_cache(maxsize=1)
def fastpath():
    """The fastpath family's per-call helpers (``attnkit/csrc/fastpath.cpp``), or None without the
    extension (Python's own path then runs, with the same results):

    * ``key(q, k, v, *scalars) -> bytes | None``: the exact key of the tensors' shapes, dtypes,
      devices and ``requires_grad``, whether autograd records, torch's thread count and up to 8
      scalar arguments with their types (None, bool, int, float; anything else answers None), for
      the dispatcher's per-call cache;
    * ``finite(x) -> bool | None``: whether a dense CPU floating tensor holds finite values only
      (the NaN/Inf policy's scan), a bit test per element.

    Both answer None for what they do not read (tensor subclasses, functorch and functionalization
    wrappers, non-CPU tensors for ``finite``); the caller then takes its Python path."""
    if load_library("fastpath") is not None:
        return None
    create = ctypes.PyDLL(str(build.library_path("fastpath"))).attnkit_fastpath_module
    create.restype, create.argtypes = ctypes.py_object, []
    return create()


# The helpers as module functions, bound on first use (``import attnkit`` loads no library):
# callers read them as ``loader.key`` / ``loader.finite``, so the binding below replaces them.

def key(q, k, v, *scalars):
    """:func:`fastpath`'s ``key`` (None without the extension)."""
    _bind()
    return key(q, k, v, *scalars)


def finite(x):
    """:func:`fastpath`'s ``finite`` (None without the extension)."""
    _bind()
    return finite(x)


def _none(*args):
    return None


def _bind() -> None:
    global key, finite
    fast = fastpath()
    key, finite = (fast.key, fast.finite) if fast is not None else (_none, _none)
