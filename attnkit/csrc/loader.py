"""Loading the built extension (``attnkit build``): the one place that checks its
stamp and loads it, for the ``native`` backends' ops and for the per-call helpers in C
(:func:`fastpath`)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json

from . import build


def load_library() -> str | None:
    """Load the built extension's ops into ``torch.ops``; ``None`` when it loaded, else why not
    (not built, built for another torch, built for a CPU with instruction sets this one lacks, or
    failing to load). Not cached: its callers cache what they build on it."""
    import torch

    problem = _stamp()[0]
    if problem is not None:
        return problem
    try:
        torch.ops.load_library(str(build.library_path()))
    except (ImportError, OSError, RuntimeError) as exc:
        return f"native extension not built: it fails to load ({exc})"
    return None


def build_id() -> str | None:
    """Which usable build this is, for measurements taken with it (the measured dispatch table): a digest
    of its stamp (torch version, CPU flags and the digest of the sources it was
    compiled from, :func:`build.sources_digest`; the library's modification time for a stamp from
    before stamps named their sources). None when no build is usable here. Reads the stamp only."""
    problem, stamp = _stamp()
    if problem is not None:
        return None
    ident = {key: value for key, value in stamp.items() if key != "build_seconds"}
    if "sources" not in ident:
        try:
            ident["mtime_ns"] = build.library_path().stat().st_mtime_ns
        except OSError:
            return None
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _stamp() -> tuple[str | None, dict]:
    """``(why the build cannot be loaded here or None, its stamp)``."""
    import torch

    path = build.library_path()
    if not path.exists():
        return (f"native extension not built: run `attnkit build` (or `make install`); "
                f"no {path.name}"), {}
    try:
        stamp = json.loads(build.STAMP.read_text())
    except (OSError, ValueError):
        stamp = {}
    if not isinstance(stamp, dict):
        stamp = {}
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
    """The extension's per-call helpers (``attnkit/csrc/fastpath.cpp``), or None without the
    extension (Python's own path then runs, with the same results):

    * ``key(q, k, v, *scalars) -> bytes | None``: the exact key of the tensors' shapes, dtypes,
      devices and ``requires_grad``, whether autograd records, torch's thread count and up to 8
      scalar arguments with their types (None, bool, int, float; anything else answers None), for
      the dispatcher's per-call cache;
    * ``finite(x) -> bool | None``: whether a dense CPU floating tensor holds finite values only
      (the NaN/Inf policy's scan), a bit test per element.

    Both answer None for what they do not read (tensor subclasses, functorch and functionalization
    wrappers, non-CPU tensors for ``finite``); the caller then takes its Python path."""
    if load_library() is not None:
        return None
    try:
        create = ctypes.PyDLL(str(build.library_path())).attnkit_fastpath_module
    except (OSError, AttributeError):  # a build from before the helpers existed
        return None
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
