"""Build the native CPU kernels into the package: ``attnkit build`` (``make install`` runs it).

``make install`` runs this step. Each kernel family is its own library, compiled on its own with
``torch.utils.cpp_extension`` and the machine's C++ compiler (``-O3 -march=native``: the kernels are
built for the CPU they run on) into ``attnkit/csrc/_build/<family>/``:

* ``prefill``: ``attention.cpp``, the fused prefill kernel, forward and backward (ops
  ``torch.ops.attnkit_native``);
* ``decode``: ``decode.cpp``, the split-K decode kernel (ops ``torch.ops.attnkit_decode``);
* ``fastpath``: ``fastpath.cpp``, the per-call key and finiteness scan (a small CPython module);
* ``gated``: ``gated.cpp``, gated linear attention: the chunked gated delta rule and SSD, forward
  and backward, and the recurrent decode step (ops ``torch.ops.attnkit_gated``);
* ``sparse``: ``sparse.cpp``, top-k sparse attention over per-query key lists, forward and backward
  (ops ``torch.ops.attnkit_sparse``).

A family whose source fails to compile takes only itself down: the others still build, load and
run. The stamp names the torch version and the CPU's instruction-set flags the build was made for
(a copy on a CPU lacking any of those flags declines instead of dying with SIGILL), and per family
the digest of its sources or the compiler's first error line. No OpenMP runtime is linked: the
parallel loops run on torch's own (at::parallel_for), and the tile products call oneDNN's
micro-kernel through ``at::native::cpublas::brgemm``, which every torch CPU build exports (no BLAS
symbol of one torch build is required). When a family fails, the step prints which one and the
compiler's message and exits 1 (the backends using it then decline with the reason "native
extension not built: ..."); ``make install`` goes on.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / "_build"
STAMP = BUILD_DIR / "stamp.json"


@dataclass(frozen=True)
class Family:
    """One kernel family: its library (and op namespace, for the torch ops), source and the headers it includes."""

    name: str
    library: str
    source: str
    headers: tuple[str, ...] = ()


# ninja tracks the headers; the digests below name them too
FAMILIES = {
    "prefill": Family("prefill", "attnkit_native", "attention.cpp", ("tiles.h", "spec.h", "score_mod.h")),
    "decode": Family("decode", "attnkit_decode", "decode.cpp", ("tiles.h", "spec.h")),
    "fastpath": Family("fastpath", "attnkit_fastpath", "fastpath.cpp"),
    "gated": Family("gated", "attnkit_gated", "gated.cpp"),
    "sparse": Family("sparse", "attnkit_sparse", "sparse.cpp"),
}
NAME = FAMILIES["prefill"].library  # the prefill kernel's op namespace: torch.ops.attnkit_native


def sources_digest(family: str = "prefill") -> str:
    """A digest of a family's sources (what its build compiles), kept in the stamp: measurements of
    the kernel (a calibration table, the probed constants) name the build they were taken with."""
    fam = FAMILIES[family]
    digest = hashlib.sha256()
    for name in sorted((fam.source, *fam.headers)):
        digest.update(name.encode() + b"\0" + (HERE / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


# -march=native: the kernels are built for the CPU they run on (the stamp records its flags; the
# ISA-specific code in the sources sits behind #if guards, with a portable path for any target).
# -fno-trapping-math lets the exp and mask loops vectorize (IEEE inf/NaN semantics are kept).
# -fopenmp: at::parallel_for is a header template; on torch's OpenMP builds its `omp parallel`
# region is compiled into this library, and without the flag every parallel loop would run on one
# thread. No OpenMP runtime is linked: the region runs on the one torch already loaded.
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp"]


def library_path(family: str = "prefill") -> Path:
    """Where a family's built library lives (it may not exist)."""
    return BUILD_DIR / family / f"{FAMILIES[family].library}.so"


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (Linux: ``/proc/cpuinfo``; elsewhere empty: not checked)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def first_error(message: str) -> str:
    """The compiler's first error line in a build failure's message (else its first line)."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() and not line.startswith(("FAILED:", "[")) and "Error building extension" not in line:
            return line
    return lines[0] if lines else "unknown error"


def read_stamp() -> dict:
    """The stamp's contents ({} when there is none or it is unreadable)."""
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def _record(family: str, entry: dict) -> None:
    """Write ``entry`` as ``family``'s part of the stamp (the torch version and CPU flags of this build)."""
    import torch

    stamp = read_stamp()
    if stamp.get("torch") != torch.__version__ or not isinstance(stamp.get("families"), dict):
        stamp = {"families": {}}  # a stamp of another torch (or of the single-library layout) names nothing built now
    stamp.update(torch=torch.__version__, cpu_flags=sorted(cpu_flags()))
    stamp["families"][family] = entry
    STAMP.parent.mkdir(parents=True, exist_ok=True)
    STAMP.write_text(json.dumps(stamp))


def build(family: str, verbose: bool = False) -> float:
    """Compile one family; returns the build time in seconds (raises on failure, after recording
    the compiler's first error line in the stamp so the loader and ``attnkit info`` can say why)."""
    from torch.utils.cpp_extension import load

    fam = FAMILIES[family]
    out = library_path(family).parent
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        load(name=fam.library, sources=[str(HERE / fam.source)], build_directory=str(out), extra_cflags=CFLAGS,
             is_python_module=False, verbose=verbose)
    except Exception as exc:
        _record(family, {"error": first_error(str(exc))})
        raise
    seconds = time.perf_counter() - start
    _record(family, {"sources": sources_digest(family), "build_seconds": round(seconds, 1)})
    return seconds


def main(verbose: bool | None = None) -> int:
    """Build every family, print one line each saying where (or why not), and return the exit status
    (0 all built, 1 some family not built: the others are built and usable all the same)."""
    verbose = "-v" in sys.argv if verbose is None else verbose
    failed = []
    for family in FAMILIES:
        try:
            seconds = build(family, verbose=verbose)
        except Exception as exc:  # no compiler, missing headers, a compile error: say which, go on with the others
            failed.append(family)
            print(f"attnkit: native kernel {family} ({FAMILIES[family].source}) not built ({type(exc).__name__}):\n"
                  f"{str(exc).strip()}", file=sys.stderr)
            continue
        print(f"attnkit: native kernel {family} built in {seconds:.1f} s ({library_path(family)})")
    if failed:
        print(f"attnkit: native kernels not built: {', '.join(failed)}. The backends using them will decline and "
              "the pure-PyTorch backends run instead (the other kernels are built and used). Fix the error above "
              "(no compiler: install g++) and rerun `attnkit build`.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
