"""Build the native CPU attention kernel into the package: ``attnkit build`` (``make install`` runs it).

``make install`` runs this step. It compiles three sources, ``attention.cpp`` (the fused
prefill kernel, forward and backward), ``decode.cpp`` (the split-K decode kernel) and ``fastpath.cpp``
(the per-call key and finiteness scan), with ``torch.utils.cpp_extension`` and the machine's C++
compiler (``-O3 -march=native``: the kernel is built for the CPU it runs on) into
``attnkit/csrc/_build/``, and writes a stamp naming the torch version and the CPU's instruction
set flags it was built for; a copy on a CPU lacking any of those flags declines instead of dying
with SIGILL. No OpenMP runtime is linked: the parallel loops run on torch's own (at::parallel_for),
and the tile products call oneDNN's micro-kernel through ``at::native::cpublas::brgemm``, which every
torch CPU build exports (no BLAS symbol of one torch build is required). On a build error it
prints the compiler's message and exits 1 (the ``native`` backend then declines with the reason
"native extension not built: ...").
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

NAME = "attnkit_native"
HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / "_build"
STAMP = BUILD_DIR / "stamp.json"
# attention.cpp includes tiles.h and score_mod.h, decode.cpp tiles.h (ninja tracks the headers)
SOURCES = [HERE / "attention.cpp", HERE / "decode.cpp", HERE / "fastpath.cpp"]
HEADERS = [HERE / "tiles.h", HERE / "score_mod.h"]


def sources_digest() -> str:
    """A digest of the kernel's sources (what a build compiles), kept in the stamp: measurements of
    the kernel (a calibration table, the probed constants) name the build they were taken with."""
    digest = hashlib.sha256()
    for path in sorted(SOURCES + HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
# -fno-trapping-math lets the exp and mask loops vectorize (IEEE inf/NaN semantics are kept).
# -fopenmp: at::parallel_for is a header template; on torch's OpenMP builds its `omp parallel`
# region is compiled into this library, and without the flag every parallel loop would run on one
# thread. No OpenMP runtime is linked: the region runs on the one torch already loaded.
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]


def library_path() -> Path:
    """Where the built extension lives (it may not exist)."""
    return BUILD_DIR / f"{NAME}.so"


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (Linux: ``/proc/cpuinfo``; elsewhere empty: not checked)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build(verbose: bool = False) -> float:
    """Compile the extension; returns the build time in seconds (raises on failure)."""
    import torch
    from torch.utils.cpp_extension import load

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    load(name=NAME, sources=[str(s) for s in SOURCES], build_directory=str(BUILD_DIR), extra_cflags=CFLAGS,
         is_python_module=False, verbose=verbose)
    seconds = time.perf_counter() - start
    STAMP.write_text(json.dumps({"torch": torch.__version__, "cpu_flags": sorted(cpu_flags()),
                                 "sources": sources_digest(), "build_seconds": round(seconds, 1)}))
    return seconds


def main(verbose: bool | None = None) -> int:
    """Build, print one line saying where (or why not), and return the exit status (0 built, 1 not)."""
    try:
        seconds = build(verbose="-v" in sys.argv if verbose is None else verbose)
    except Exception as exc:  # no compiler, missing headers, a compile error: say which, exit non-zero
        print(f"attnkit: native kernel not built ({type(exc).__name__}):\n{str(exc).strip()}\nThe 'native' backend "
              "will decline and the pure-PyTorch backends run instead. Fix the error above (no compiler: install "
              "g++) and rerun `attnkit build`.", file=sys.stderr)
        return 1
    print(f"attnkit: native kernel built in {seconds:.1f} s ({library_path()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
