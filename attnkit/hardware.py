"""What this machine's CPU can do, from its features (never from a timing, never assumed from one machine).

Half-precision matrix products on a CPU range from several times faster than float32 (AVX512-BF16,
AMX) to about a hundred times slower (AVX2, emulated). Backends that run their tiles through
``torch.matmul`` ask :func:`half_matmul_is_fast` whether to keep float16/bfloat16 tiles or to
upcast them to float32 (softmax statistics are float32 either way). The answer follows the CPU's
instruction set, so two processes on one machine always run the same arithmetic.

``ATTNKIT_HALF_MATMUL=fast`` or ``=slow`` overrides it (a deployment that knows its machine).
"""

from __future__ import annotations

import os
import platform
import time

import torch

__all__ = ["half_matmul_is_fast", "half_matmul_reason", "cpu_features", "matmul_rate", "machine_id", "refresh"]

_SIZE = 256  # a 256^3 product: about 3 ms at the slowest rate seen, microseconds at the fastest


def matmul_rate(dtype: torch.dtype, size: int = _SIZE, repeats: int = 3) -> float:
    """Best-of-``repeats`` GFLOP/s of one ``size``-cubed CPU matrix product in ``dtype``."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.matmul(a, b)  # warm up (packing buffers, first-call dispatch)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


#: The CPU features that give half-precision matrix products at least float32's rate, per dtype.
HALF_MATMUL_FEATURES = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def cpu_features() -> dict:
    """The CPU's features as torch detects them (``torch.cpu.get_capabilities()``; {} where not known)."""
    try:
        return dict(torch.cpu.get_capabilities())
    except (AttributeError, RuntimeError):  # an older torch, or a platform cpuinfo does not read
        return {}


def _decide_half(dtype: torch.dtype) -> tuple[bool | None, str]:
    forced = os.environ.get("ATTNKIT_HALF_MATMUL", "").strip().lower()
    if forced in ("fast", "slow"):
        return forced == "fast", f"ATTNKIT_HALF_MATMUL={forced}"
    if forced:
        return None, f"ATTNKIT_HALF_MATMUL={forced!r}: expected 'fast', 'slow' or unset (the CPU's features)."
    wanted = HALF_MATMUL_FEATURES.get(dtype, ())
    features = cpu_features()
    found = [f for f in wanted if features.get(f)]
    if found:
        return True, f"this CPU has {found[0]}"
    return False, f"this CPU has none of {', '.join(wanted) or 'the half-precision instructions'}"


# Decided once at import (a dict a torch.compile trace reads as a constant); reread by refresh().
_HALF: dict = {}


def refresh() -> None:
    """Decide the half-precision paths again (after changing ``ATTNKIT_HALF_MATMUL``)."""
    _HALF.clear()
    _HALF.update({dtype: _decide_half(dtype) for dtype in HALF_MATMUL_FEATURES})


refresh()


def half_matmul_is_fast(dtype: torch.dtype) -> bool:
    """True when this CPU multiplies ``dtype`` (float16/bfloat16) matrices in hardware, at least at
    float32's rate: from its features (:data:`HALF_MATMUL_FEATURES`), never from a timing, so every
    process on one machine takes the same arithmetic. ``ATTNKIT_HALF_MATMUL=fast|slow`` overrides."""
    fast, why = _HALF.get(dtype, (False, ""))
    if fast is None:
        raise ValueError(why)
    return fast


def half_matmul_reason(dtype: torch.dtype) -> str:
    """Why :func:`half_matmul_is_fast` answers as it does for ``dtype`` (a feature, or the override)."""
    return _HALF.get(dtype, (False, "not a half-precision dtype"))[1]


def machine_id() -> dict:
    """What makes measurements on this machine comparable: CPU model and features, thread count, the
    torch version, attnkit's version and the native kernel's build (:func:`attnkit.csrc.loader.build_id`;
    None when none is usable): a table or a probe from another machine, torch or attnkit build does
    not apply here, since its backends may have been faster or slower there."""
    from ._version import __version__
    from .csrc import loader

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {
        "cpu": model,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "attnkit": __version__,
        "native": loader.build_id(),
    }
