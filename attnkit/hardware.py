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
import platform
import time

import torch

from ._compat import assume_constant_result

__all__ = ["half_matmul_is_fast", "matmul_rate", "machine_id", "probe_rates", "quick_rates", "best_seconds"]

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


def best_seconds(fn, repeats: int, enough: float | None = None) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` after one warm-up call; with ``enough``,
    fewer once the fastest so far is slower than that (more calls would not change a ranking)."""
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        if enough is not None and best > enough:
            break
    return best


def probe_rates() -> dict:
    """This machine's constants for a cost model, measured in well under a second:

    * ``gemm_gflops[dtype]``: GFLOP/s of a large matrix product (float32, bfloat16, float16);
    * ``tile_gflops``: GFLOP/s of one 64-cubed float32 product issued as its own op (a PyTorch
      loop's tile: small-GEMM efficiency and the op's overhead together);
    * ``bandwidth_gbs``: GB/s of a 32 MiB copy (read + write);
    * ``op_seconds``: the overhead of one tiny PyTorch op (what a Python loop pays per op)."""
    with torch.inference_mode():
        gemm = {"float32": matmul_rate(torch.float32, 256)}
        for dtype in (torch.bfloat16, torch.float16):
            gemm[str(dtype).removeprefix("torch.")] = matmul_rate(dtype, 128, repeats=2)
        src, dst = torch.ones(2**23), torch.empty(2**23)  # 32 MiB each, preallocated: no page faults timed
        bandwidth = 2 * src.numel() * 4 / best_seconds(lambda: dst.copy_(src), 3) / 1e9
    return {"gemm_gflops": gemm, "bandwidth_gbs": bandwidth, **quick_rates(tiles=20, op_repeats=3)}


def quick_rates(tiles: int = 5, op_repeats: int = 2) -> dict:
    """``tile_gflops`` and ``op_seconds`` of :func:`probe_rates` alone, from fewer repeats: a few
    milliseconds, to re-check stored constants against (the best of the repeats, as the probe)."""
    with torch.inference_mode():
        a, b = torch.randn(64, 64), torch.randn(64, 64)
        tile = 2 * 64**3 / best_seconds(lambda: torch.matmul(a, b), tiles) / 1e9
        x = torch.zeros(1)
        ops = 200
        op = best_seconds(lambda: [torch.add(x, x) for _ in range(ops)], op_repeats) / ops
    return {"tile_gflops": tile, "op_seconds": op}
