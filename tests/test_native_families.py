"""Each native kernel family (prefill, decode, fastpath, gated, sparse) is its own library: a source
that fails to compile takes only its own family down. The others build, load and run, the build
step says which failed and exits 1, and ``attnkit info`` and the backends' reasons name the broken
family with the compiler's first error line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from attnkit.csrc import build, loader

_BUILT = all(problem is None for problem in loader.family_reasons().values())
pytestmark = [pytest.mark.skipif(not _BUILT, reason="the native kernels are not all built here"),
              pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                 reason="no C++ compiler"),
              pytest.mark.xdist_group("native")]

# Run in a fresh interpreter: a process loads each op namespace once. The broken family goes through
# the real compiler; the others are the libraries already built here, copied into a scratch build.
_SCRIPT = r"""
import json, shutil, sys
from pathlib import Path

import torch
import attnkit
from attnkit.backends import decode as decode_backend, decode_native, native
from attnkit.cli.info import native_kernel_line
from attnkit.csrc import build, loader

tmp, broken = Path(sys.argv[1]), sys.argv[2]
built_dir, built_stamp = build.BUILD_DIR, build.read_stamp()
src = tmp / "src"
shutil.copytree(build.HERE, src, ignore=shutil.ignore_patterns("_build", "__pycache__"))
(src / build.FAMILIES[broken].source).write_text("#error this kernel source is broken on purpose\n")
build.HERE, build.BUILD_DIR = src, tmp / "_build"
build.STAMP = build.BUILD_DIR / "stamp.json"
compile_for_real = build.build

def build_or_copy(family, verbose=False):
    if family == broken:
        return compile_for_real(family, verbose)
    target = build.library_path(family)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(built_dir / family / target.name, target)
    build._record(family, built_stamp["families"][family])
    return 0.0

build.build = build_or_copy
result = {"exit": build.main(), "reasons": loader.family_reasons(), "info": native_kernel_line().splitlines()}
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
result["prefill_reason"] = native.load_extension()[1]
if result["prefill_reason"] is None:
    out = attnkit.attention(q, k, v, mask=attnkit.Causal(), backend="native")
    result["prefill_ok"] = bool(torch.allclose(out, ref, atol=1e-10))
else:
    result["native_reasons"] = attnkit.explain(q, k, v, backend="native").reasons["native"]
result["decode_reason"] = decode_native._extension()[1]
calls, real = [], decode_backend.native_decode
decode_backend.native_decode = lambda *a, **kw: calls.append(1) or real(*a, **kw)
with torch.no_grad():
    out = attnkit.attention(q[:, :, -1:].float(), k.float(), v.float(), backend="decode")
result["decode_ok"] = bool(torch.allclose(out, ref[:, :, -1:].float(), atol=1e-5))
result["decode_kernel_ran"] = bool(calls)
top = attnkit.TopK((torch.arange(9).view(1, 1, 9, 1) - torch.arange(3)).clamp(min=-1))
result["sparse_reason"] = attnkit.backends.topk.kernel_reason(attnkit.AttentionInputs.create(q, k, v))
out = attnkit.attention(q, k, v, mask=top & attnkit.Causal(), backend="topk")
result["sparse_ok"] = bool(torch.allclose(out, attnkit.attention(q, k, v, mask=top & attnkit.Causal(),
                                                                 backend="naive"), atol=1e-10))
fast = loader.fastpath()
result["fastpath_ok"] = fast is not None and fast.finite(torch.ones(5)) is True and \
    fast.finite(torch.tensor([1.0, float("nan")])) is False
from attnkit.backends.kernelized.gated import kernel as gated_kernel
result["gated_reason"] = gated_kernel.extension_reason()
gq, gk, gv = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
gg, gb = -torch.rand(1, 2, 9, generator=g), torch.rand(1, 2, 9, generator=g)
want = attnkit.gated_linear_attention(gq, gk, gv, gg, gb, qk_l2norm=True, native=False)
got = attnkit.gated_linear_attention(gq, gk, gv, gg, gb, qk_l2norm=True)
result["gated_ok"] = bool(torch.allclose(got, want, atol=1e-5))
print(json.dumps(result))
"""


@pytest.mark.parametrize("broken", list(build.FAMILIES))
def test_a_family_that_fails_to_compile_leaves_the_others_working(broken, tmp_path):
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), broken], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    source = build.FAMILIES[broken].source
    # the build step goes on past the broken family, names it, and exits 1
    assert result["exit"] == 1
    assert f"native kernel {broken} ({source}) not built" in run.stderr
    assert f"native kernels not built: {broken}." in run.stderr
    # the loader and info name the broken family and the compiler's first error line; the others load
    for family, reason in result["reasons"].items():
        if family == broken:
            assert reason.startswith("native extension not built") and f"its {broken} kernel failed" in reason
            assert source in reason and "broken on purpose" in reason
        else:
            assert reason is None
    info = {line.split()[2]: line for line in result["info"]}
    assert "unavailable" in info[broken] and "broken on purpose" in info[broken]
    assert all("loaded from" in line for family, line in info.items() if family != broken)
    # the working families run (and the broken one's backend declines, its twin answering)
    if broken == "prefill":
        assert any("broken on purpose" in r for r in result["native_reasons"])
    else:
        assert result["prefill_reason"] is None and result["prefill_ok"]
    assert result["decode_ok"] and result["decode_kernel_ran"] == (broken != "decode")
    if broken == "decode":
        assert "broken on purpose" in result["decode_reason"]
    assert result["fastpath_ok"] == (broken != "fastpath")
    # gated linear attention runs either way: the kernel, or its PyTorch twin when the gated family is broken
    assert result["gated_ok"] and (result["gated_reason"] is None) == (broken != "gated")
    if broken == "gated":
        assert "broken on purpose" in result["gated_reason"]
    assert result["sparse_ok"] and (result["sparse_reason"] is None) == (broken != "sparse")
