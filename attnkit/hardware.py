"""What this machine's CPU does fast, measured once per process (never assumed from one machine).

Half-precision matrix products on a CPU range from several times faster than float32 (AVX512-BF16,
AMX) to about a hundred times slower (AVX2, emulated). Backends that run their tiles through
``torch.matmul`` ask :func:`half_matmul_is_fast` whether to keep float16/bfloat16 tiles or to
upcast them to float32 (softmax statistics are float32 either way).

``ATTNKIT_HALF_MATMUL=fast`` or ``=slow`` skips the probe (a deployment that knows its machine).
"""

from __future__ import annotations

import functools
import os
import time

import torch

from ._compat import assume_constant_result

__all__ = ["half_matmul_is_fast", "matmul_rate"]

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


@assume_constant_result  # a traced graph takes the measured answer as a constant
@functools.lru_cache(maxsize=None)
def half_matmul_is_fast(dtype: torch.dtype) -> bool:
    """True when CPU matrix products in ``dtype`` (float16/bfloat16) run at least as fast as in
    float32 here (measured once per process and dtype, or set by ``ATTNKIT_HALF_MATMUL``)."""
    forced = os.environ.get("ATTNKIT_HALF_MATMUL", "").strip().lower()
    if forced in ("fast", "slow"):
        return forced == "fast"
    if forced:
        raise ValueError(f"ATTNKIT_HALF_MATMUL={forced!r}: expected 'fast', 'slow' or unset (measure).")
    with torch.inference_mode():
        return matmul_rate(dtype) >= matmul_rate(torch.float32)
