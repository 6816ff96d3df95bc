"""Peak memory of one call, measured by the allocator or the kernel, and labelled with the method.

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the caching
  allocator's own accounting), minus what was allocated before the call.
* CPU on Linux with glibc: the process's peak resident set. Before the call we pin glibc's mmap
  threshold to 128 KiB (so every tensor of 128 KiB or more is its own mmap, returned to the kernel on
  free instead of staying in the heap), ``malloc_trim(0)``, and reset the kernel's high-water mark
  (``echo 5 > /proc/self/clear_refs``); after it, the peak is ``VmHWM - VmRSS(before)``. It counts
  every byte the call touched (including allocator slack and thread stacks) and misses memory reused
  from the heap's free lists (small tensors): accurate to about a MiB for the MiB-to-GiB peaks that
  matter here. After the call the thresholds go back to where glibc's own dynamic rule settles in a
  process that keeps allocating tensors (mmap 32 MiB, trim 64 MiB): left at 128 KiB, every later
  tensor of 128 KiB or more would be a fresh mmap with its page faults, and the calls timed after a
  measurement would pay a cost no user's process pays (more for backends that allocate more).
* Elsewhere: no measurement (``None``); the report shows the estimate only, labelled as such.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable

import torch

__all__ = ["PeakMemory"]

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters
_M_MMAP_THRESHOLD = -3
_MEASURE_MMAP = 128 * 1024  # every tensor of this size or more its own mmap while a call is measured
# glibc's dynamic thresholds at their ceiling (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, trim = 2 x mmap),
# where they settle in a process that allocates and frees tensors of up to 32 MiB
_STEADY_MMAP, _STEADY_TRIM = 32 * 1024 * 1024, 64 * 1024 * 1024


class PeakMemory:
    """``PeakMemory(device).measure(fn)`` -> peak extra bytes while ``fn()`` ran (or None)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.method = "none"
        self._libc = None
        if self.device.type == "cuda":
            self.method = "cuda allocator peak (torch.cuda.max_memory_allocated)"
        elif self.device.type == "cpu" and self._setup_cpu():
            self.method = "peak RSS delta (VmHWM reset per case; glibc mmap threshold 128 KiB)"

    def _setup_cpu(self) -> bool:
        try:
            libc = ctypes.CDLL("libc.so.6")
            if libc.mallopt(_M_MMAP_THRESHOLD, _MEASURE_MMAP) != 1:
                return False
            self._steady(libc)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._status()
        except (OSError, AttributeError, ValueError):
            return False
        self._libc = libc
        return True

    @staticmethod
    def _steady(libc) -> None:
        libc.mallopt(_M_MMAP_THRESHOLD, _STEADY_MMAP)
        libc.mallopt(_M_TRIM_THRESHOLD, _STEADY_TRIM)

    @staticmethod
    def _status() -> tuple[int, int]:
        text = open("/proc/self/status").read()

        def kib(key: str) -> int:
            found = re.search(key + r":\s+(\d+) kB", text)
            if found is None:
                raise ValueError(f"/proc/self/status has no {key}")
            return int(found.group(1)) * 1024

        return kib("VmRSS"), kib("VmHWM")

    def measure(self, fn: Callable[[], object]) -> int | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            result = fn()
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - before
            del result
            return peak
        if self._libc is None:
            fn()
            return None
        self._libc.mallopt(_M_MMAP_THRESHOLD, _MEASURE_MMAP)
        try:
            self._libc.malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            rss_before, _ = self._status()
            result = fn()
            _, high = self._status()
            del result
        finally:
            self._steady(self._libc)
        return max(0, high - rss_before)
