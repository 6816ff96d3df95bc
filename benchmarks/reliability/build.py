"""Reliability probes of the native build: a kernel source that fails to compile takes only its own
family down.

A copy of the installed package (its C++ sources, no built libraries) gets one kernel source replaced
by a file that does not compile, and ``python -m attnkit.csrc.build`` builds it there, once for all the
probes of that broken source. A "value" probe is right when the build step says which kernel failed
(and exits non-zero), the kernels whose sources still compile load and give right results, and
``attnkit info`` names the broken kernel with the compiler's error.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import probe_reliability as pr

import attnkit

_PACKAGE = Path(attnkit.__file__).resolve().parent
_BROKEN = "#error this kernel source is broken on purpose\n"

# Run in the copy: the prefill kernel against the float64 oracle, the per-call helpers, the decode kernel.
_CHECK = r"""
import json, sys
import torch
import attnkit
from attnkit.csrc import loader
sys.path.insert(0, sys.argv[1])
import probe_reliability as pr
B, H, T, D = (int(x) for x in sys.argv[2].split(","))
q, k, v = pr.qkv(B=B, H=H, T=T, D=D)
reasons = attnkit.explain(q, k, v, mask=attnkit.Causal(), backend="native").reasons.get("native", ["missing"])
ok = not reasons and pr.close(attnkit.attention(q, k, v, mask=attnkit.Causal(), backend="native"),
                              pr.reference(q, k, v, keep=torch.ones(T, T, dtype=torch.bool).tril()))
fast = loader.fastpath()
print(json.dumps({"prefill": bool(ok), "prefill_reasons": reasons,
                  "fastpath": fast is not None and fast.finite(torch.ones(3)) is True}))
"""


@functools.lru_cache(maxsize=None)
def _broken_build(source: str) -> tuple[Path, subprocess.CompletedProcess]:
    """The package copied with ``source`` broken, built there: (the copy's root, the build's process)."""
    root = Path(tempfile.mkdtemp(prefix="attnkit-probe-build-"))
    shutil.copytree(_PACKAGE, root / "attnkit", ignore=shutil.ignore_patterns("_build", "__pycache__"))
    (root / "attnkit" / "csrc" / source).write_text(_BROKEN)
    proc = subprocess.run([sys.executable, "-m", "attnkit.csrc.build"], capture_output=True, text=True,
                          timeout=pr.LIMIT_S, cwd=root, env=_env(root))
    return root, proc


def _env(root: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(root)}


def _check(root: Path, shape: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHECK, str(Path(pr.__file__).parent), shape], capture_output=True,
                          text=True, timeout=pr.LIMIT_S, cwd=root, env=_env(root))
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}


def build_names_the_broken_kernel(source):
    def run():
        _, proc = _broken_build(source)
        return proc.returncode != 0 and source in proc.stderr and "broken on purpose" in proc.stderr
    return run


def prefill_runs_despite(source, shape):
    def run():
        root, _ = _broken_build(source)
        return _check(root, shape).get("prefill", False)
    return run


def fastpath_loads_despite(source):
    def run():
        root, _ = _broken_build(source)
        return _check(root, "1,2,8,8").get("fastpath", False)
    return run


def info_names_the_broken_kernel(source, family):
    def run():
        root, _ = _broken_build(source)
        proc = subprocess.run([sys.executable, "-m", "attnkit", "info"], capture_output=True, text=True,
                              timeout=pr.LIMIT_S, cwd=root, env=_env(root))
        text = " ".join(proc.stdout.split())
        broken = [line for line in proc.stdout.splitlines() if line.startswith("native kernel:") and family in line]
        return proc.returncode == 0 and bool(broken) and "broken on purpose" in text
    return run


PROBES = [
    ("a broken decode.cpp is named by the build step", "value", build_names_the_broken_kernel("decode.cpp"),
     None),
    ("prefill kernel runs with decode.cpp broken", "value", prefill_runs_despite("decode.cpp", "2,3,37,16"),
     None),
    ("per-call helpers load with decode.cpp broken", "value", fastpath_loads_despite("decode.cpp"), None),
    ("info names the broken decode kernel and its error", "value",
     info_names_the_broken_kernel("decode.cpp", "decode"), None),
    # extra: another broken source, another shape
    ("prefill kernel runs with fastpath.cpp broken", "value", prefill_runs_despite("fastpath.cpp", "1,4,70,24"),
     None),
]
