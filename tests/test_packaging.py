"""What an install carries and what a command prints on a CPU-only machine."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_the_native_kernel_source(tmp_path):
    """`pip install .` must be able to build the kernel: its C++ source is package data."""
    pytest.importorskip("setuptools")
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                             "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    if result.returncode != 0:
        pytest.skip(f"pip cannot build a wheel here: {result.stderr.strip()[-200:]}")
    (wheel,) = tmp_path.glob("attnkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = sorted(p.name for p in (ROOT / "attnkit" / "csrc").glob("*.cpp"))
    assert sources and all(f"attnkit/csrc/{name}" in names for name in sources), names
    assert "attnkit/csrc/build.py" in names


def test_importing_attnkit_does_not_load_the_compiler_stack():
    """torch._dynamo costs about a second of every command's start: attnkit loads it only when
    something compiles. torch.utils.cpp_extension logs "No CUDA runtime is found, using CUDA_HOME"
    on a CPU-only torch where a CUDA toolkit is installed: only the kernel build and the timing of
    `bench` load it, never a command's start or `info`."""
    code = ("import sys, io, contextlib, attnkit\n"
            "from attnkit.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['info', '--shape', '1,2,16,8'])\n"
            "print([m for m in ('torch._dynamo', 'torch.utils.cpp_extension') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "[]", (out.stdout, out.stderr)


MARKED = """
import sys, torch
from attnkit._compat import assume_constant_result
assert "torch._dynamo" not in sys.modules  # marked before the compiler is loaded

def reads_a_file() -> bool:  # something dynamo cannot trace: only a constant result compiles
    return len(open(__file__).read()) > 0

marked = assume_constant_result(reads_a_file)
f = torch.compile(lambda x: x * (2 if marked() else 3), backend="eager", fullgraph=True)
print(f(torch.ones(2)).tolist())
"""


def test_marked_functions_stay_constants_under_compile(tmp_path):
    script = tmp_path / "marked.py"
    script.write_text(MARKED)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "[2.0, 2.0]", out.stderr[-2000:]
    unmarked = MARKED.replace("marked = assume_constant_result(reads_a_file)", "marked = reads_a_file")
    script.write_text(unmarked)  # the check can fail: without the mark the graph cannot be built
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode != 0 and "open" in out.stderr


def test_a_cli_call_prints_no_warning():
    out = subprocess.run([sys.executable, "-W", "default", "-m", "attnkit", "info", "--shape", "1,2,16,8"],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr and "CUDA_HOME" not in out.stderr, out.stderr


def test_the_package_and_its_metadata_name_one_version():
    """attnkit.__version__ (which measurements name their build by) is the version pyproject.toml
    installs: a release bump that missed one of them would keep a stale calibration table in use."""
    import tomllib

    import attnkit

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert attnkit.__version__ == project["version"]
