"""Build the native CPU attention kernel into the package: ``python -m attnkit.csrc.build``.

``make install`` runs this step. It compiles ``attention.cpp`` with ``torch.utils.cpp_extension``
and the machine's C++ compiler (``-O3 -march=native``: the kernel is built for the CPU it runs on)
into ``attnkit/csrc/_build/``, and writes a stamp naming the torch version it was built against.
Without a compiler (or on any build error) it prints why and exits 0: attnkit still installs,
and the ``native`` backend declines with the reason "native extension not built: ...".
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

NAME = "attnkit_native"
HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / "_build"
STAMP = BUILD_DIR / "stamp.json"
SOURCES = [HERE / "attention.cpp"]
# -fno-trapping-math lets the exp and mask loops vectorize (IEEE inf/NaN semantics are kept).
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fopenmp-simd"]


def library_path() -> Path:
    """Where the built extension lives (it may not exist)."""
    return BUILD_DIR / f"{NAME}.so"


def build(verbose: bool = False) -> float:
    """Compile the extension; returns the build time in seconds (raises on failure)."""
    import torch
    from torch.utils.cpp_extension import load

    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    load(name=NAME, sources=[str(s) for s in SOURCES], build_directory=str(BUILD_DIR), extra_cflags=CFLAGS,
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=verbose)
    seconds = time.perf_counter() - start
    STAMP.write_text(json.dumps({"torch": torch.__version__, "build_seconds": round(seconds, 1)}))
    return seconds


def main() -> int:
    try:
        seconds = build(verbose="-v" in sys.argv)
    except Exception as exc:  # no compiler, missing headers, ...: install anyway, say why
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"attnkit: native kernel not built ({type(exc).__name__}: {first}); the 'native' backend will "
              "decline and the pure-PyTorch backends run instead. Fix: install a C++ compiler (g++) and rerun "
              "`python -m attnkit.csrc.build`.")
        return 0
    print(f"attnkit: native kernel built in {seconds:.1f} s ({library_path()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
