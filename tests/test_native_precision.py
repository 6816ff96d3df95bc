"""The native kernel in float32, bfloat16 and float16, both bfloat16/float16 paths forced (tiles in
the kernel in the input's type, or upcast to float32), whatever this machine measures: outputs and
gradients within flash-attn's rule of the float64 oracle (the independent low-precision reference as
yardstick), awkward shapes, every mask kind, GQA, fully masked rows; and the backward's determinism
(repeated passes bitwise equal, under either schedule)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding
from attnkit.backends import native

from .test_conformance import MASKS, Shape, _baselines, _inputs, _run, check_flash_rule

BUILT = native.load_extension()[0] is not None
pytestmark = [pytest.mark.skipif(not BUILT, reason=f"{native.load_extension()[1]}"), pytest.mark.xdist_group("native")]

# (dtype, half_tiles): float32 runs as itself; the reduced types on both paths.
PATHS = {
    "float32": (torch.float32, None),
    "bfloat16-kernel": (torch.bfloat16, True),
    "bfloat16-upcast": (torch.bfloat16, False),
    "float16-kernel": (torch.float16, True),
    "float16-upcast": (torch.float16, False),
}
GQA = Shape(1, 9, 3, 97, 127, 59, 59)  # 9 heads, GQA 3, Tq < Tk, odd head dim
CASES = [(GQA, mask) for mask in MASKS if mask != "CustomBH"] + [
    (Shape(1, 4, 1, 127, 97, 21, 21), mask) for mask in ("none", "Causal", "SlidingWindow2", "BigBird")
] + [
    (Shape(2, 2, 2, 17, 37, 224, 224), "Causal&KeyPadding"),  # Tq < Tk, D 224, batch lengths
    (Shape(1, 2, 2, 37, 17, 9, 9), "none"),  # Tq > Tk, D 9
    (Shape(1, 1, 1, 1, 1, 8, 8), "none"),
    (Shape(1, 2, 1, 1, 97, 64, 32), "Causal"),  # one-token decode, Dv != D
]
# Tiles smaller than the lengths: FULL, PARTIAL and EMPTY tiles and ragged edges in every case.
BLOCKS = (32, 48)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape,mask_name", CASES, ids=[f"{m}-{s}" for s, m in CASES])
def test_matches_reference(shape, mask_name, path):
    dtype, half = PATHS[path]
    mask = MASKS[mask_name](shape)
    qkv, do = _inputs(shape, dtype)
    out, grads = _run("native", qkv, do, mask=mask, options=native.NativeOptions(*BLOCKS, half_tiles=half))
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    check_flash_rule(out, grads, *_baselines(shape, mask_name, dtype), dtype)


@pytest.mark.parametrize("path", [p for p in PATHS if p != "float32"])
def test_fully_masked_rows_zero_and_lse_float32(path):
    """Rows that see no key are 0 with zero, finite gradients; the LSE is float32 on both paths."""
    dtype, half = PATHS[path]
    shape = Shape(2, 4, 2, 9, 12, 16, 16)
    mask = Causal() & KeyPadding([6, 0])
    qkv, do = _inputs(shape, dtype)
    options = native.NativeOptions(8, 8, half_tiles=half)
    out, (dq, dk, dv) = _run("native", qkv, do, mask=mask, options=options)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().amin() > 0
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[1], torch.zeros_like(dq[1])) and torch.equal(dk[1], torch.zeros_like(dk[1]))
    _, lse = attnkit.attention(*qkv, mask=mask, backend="native", options=options, return_lse=True)
    assert lse.dtype == torch.float32 and torch.isneginf(lse[1]).all()


def test_nan_in_unseen_keys_changes_no_bit_bfloat16():
    """A NaN key no query of a row may see leaves that row bitwise unchanged (tiles in the kernel)."""
    shape = Shape(2, 4, 2, 33, 40, 16, 16)
    mask = Causal() & KeyPadding([40, 25])
    qkv, do = _inputs(shape, torch.bfloat16, requires_grad=False)
    options = native.NativeOptions(16, 16, half_tiles=True)
    clean = attnkit.attention(*qkv, mask=mask, backend="native", options=options)
    q, k, v = (x.clone() for x in qkv)
    k[1, :, 30:], v[1, :, 30:] = float("nan"), float("nan")
    out = attnkit.attention(q, k, v, mask=mask, backend="native", options=options)
    assert torch.equal(out, clean)


def test_explain_says_which_path():
    q = torch.zeros(1, 2, 64, 16, dtype=torch.bfloat16)
    plan = attnkit.explain(q, q, q, backend="native").plan
    assert ("bfloat16 tiles in the kernel" in plan) == native.half_tiles(torch.bfloat16)
    assert ("upcast to float32" in plan) != native.half_tiles(torch.bfloat16)


def _backward(qkv, do, mask, options):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in qkv)
    attnkit.attention(q, k, v, mask=mask, backend="native", options=options).backward(do)
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype,half", [(torch.float32, None), (torch.bfloat16, True)], ids=["float32", "bf16"])
def test_backward_deterministic(dtype, half):
    """100 backward passes bitwise equal, under both schedules: one pass per (batch, kv head) (one
    thread) and key tiles / query tiles in parallel (more threads than B * Hkv = 2). Both sum every
    accumulator in the same fixed order, so they agree bitwise too."""
    shape = Shape(1, 4, 2, 67, 67, 16, 16)
    qkv, do = _inputs(shape, dtype)
    mask, options = Causal(), native.NativeOptions(16, 16, half_tiles=half)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = _backward(qkv, do, mask, options)
        torch.set_num_threads(4)
        for _ in range(100):
            again = _backward(qkv, do, mask, options)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
    finally:
        torch.set_num_threads(threads)


AVX2_SCRIPT = """
import sys, torch, attnkit
from attnkit.backends import native
qkv, do, out_path = torch.load(sys.argv[1])
results = []
for dtype in (torch.float32, torch.bfloat16):
    q, k, v = (x.detach().to(dtype).clone().requires_grad_(True) for x in qkv)
    out = attnkit.attention(q, k, v, mask=attnkit.Causal(), backend="native",
                            options=native.NativeOptions(16, 32, half_tiles=True))
    out.backward(do.to(dtype))
    results.append((out.detach(), (q.grad, k.grad, v.grad)))
torch.save(results, out_path)
"""
AVX2_SHAPE = Shape(1, 4, 2, 37, 53, 24, 24)


def test_avx2_tiles_match_the_reference(tmp_path):
    """The kernel as an AVX2-only CPU runs it (oneDNN capped at AVX2: fp32 tiles in AVX2 and no
    VNNI bf16 tiles, cpublas's fallback GEMM for them), in a fresh process: fp32 and bf16 within
    the rule of the float64 oracle."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    qkv, do = _inputs(AVX2_SHAPE, torch.float32, requires_grad=False)
    torch.save((qkv, do, str(tmp_path / "out.pt")), tmp_path / "in.pt")
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", AVX2_SCRIPT, str(tmp_path / "in.pt")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for dtype, (out, grads) in zip((torch.float32, torch.bfloat16), torch.load(tmp_path / "out.pt")):
        check_flash_rule(out, grads, *_baselines(AVX2_SHAPE, "Causal", dtype), dtype)


def _modified_attention(q, k, v, slopes, sinks, bias, cap, dtype):
    """Causal attention with ALiBi then a soft-cap after an additive bias, sinks in the normaliser,
    every operation in ``dtype`` (the float64 oracle, or the low-precision yardstick)."""
    q, k, v, slopes, sinks, bias = (x.to(dtype) for x in (q, k, v, slopes, sinks, bias))
    B, Hq, Tq, D = q.shape
    G, Tk = Hq // k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    distance = (torch.arange(Tk)[None, :] - torch.arange(Tk - Tq, Tk)[:, None]).to(dtype)  # pos(k) - pos(q)
    s = q @ k.transpose(-1, -2) * D**-0.5 + bias
    s = s - slopes.view(1, -1, 1, 1) * distance.abs()
    s = cap * torch.tanh(s / cap)
    s = s.masked_fill(distance > 0, float("-inf"))
    s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(B, Hq, Tq, 1)], dim=-1)
    return torch.softmax(s, dim=-1)[..., :-1] @ v


def _modifier_leaves(shape, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    slopes = torch.rand(shape.Hq, generator=g)
    sinks = torch.randn(shape.Hq, generator=g)
    bias = torch.randn(1, shape.Hq, 1, shape.Tk, generator=g)
    return [x.to(dtype).requires_grad_(True) for x in (slopes, sinks, bias)]


def _modified_native(qkv, mods, do, options):
    from attnkit.score_mods import ALiBi, SoftCap

    q, k, v = (x.detach().clone().requires_grad_(True) for x in qkv)
    slopes, sinks, bias = (x.detach().clone().requires_grad_(True) for x in mods)
    out = attnkit.attention(q, k, v, mask=Causal(), score_mod=[ALiBi(slopes), SoftCap(2.0)], sinks=sinks, bias=bias,
                            backend="native", options=options)
    leaves = (q, k, v, slopes, sinks, bias)
    return out.detach(), torch.autograd.grad(out, leaves, do)


@pytest.mark.parametrize("path", PATHS)
def test_score_mods_sinks_and_bias_match_reference(path):
    """ALiBi and a soft-cap after a bias, sinks, GQA, Tq < Tk, ragged tiles: output and every gradient
    (q, k, v, slopes, sinks, bias) within flash-attn's rule of the float64 oracle, with the modifiers
    computed on the float32 scores of bfloat16/float16 tiles."""
    from tests.reference import flash_rule_ok, max_error

    dtype, half = PATHS[path]
    shape = Shape(1, 4, 2, 37, 53, 24, 24)
    qkv, do = _inputs(shape, dtype)
    mods = _modifier_leaves(shape, dtype)
    out, grads = _modified_native(qkv, mods, do, native.NativeOptions(16, 32, half_tiles=half))

    def reference(ref_dtype):
        leaves = [x.detach().to(ref_dtype).requires_grad_(True) for x in (*qkv, *mods)]
        ref = _modified_attention(*leaves, 2.0, ref_dtype)
        return ref.detach(), torch.autograd.grad(ref, leaves, do.to(ref_dtype))

    (ref, ref_grads), (lowp, lowp_grads) = reference(torch.float64), reference(dtype)
    assert flash_rule_ok(max_error(out, ref), max_error(lowp, ref), factor=2, dtype=dtype)
    for name, g, lg, rg in zip(["q", "k", "v", "slopes", "sinks", "bias"], grads, lowp_grads, ref_grads):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        err, lp_err = max_error(g, rg), max_error(lg, rg)
        assert flash_rule_ok(err, lp_err, factor=3, dtype=dtype, magnitude=float(rg.abs().max())), (
            f"d{name} error {err:.3g} vs low-precision reference {lp_err:.3g}")


@pytest.mark.parametrize("dtype,half", [(torch.float32, None), (torch.bfloat16, True)], ids=["float32", "bf16"])
def test_backward_with_learnable_modifiers_deterministic(dtype, half):
    """Learnable ALiBi slopes, sinks and bias (and a soft-cap): 20 backward passes bitwise equal on the
    key-tile schedule (more threads than B * Hkv), and equal to the one-pass schedule (one thread).
    The slopes' gradient comes from per-distance sums over every tile of a head: buffers per query
    tile, reduced in a fixed order, never raced on by the tasks of different key tiles."""
    shape = Shape(1, 4, 2, 67, 97, 16, 16)
    qkv, do = _inputs(shape, dtype)
    mods = _modifier_leaves(shape, dtype)
    options = native.NativeOptions(16, 16, half_tiles=half)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _, first = _modified_native(qkv, mods, do, options)
        torch.set_num_threads(4)
        for _ in range(20):
            _, again = _modified_native(qkv, mods, do, options)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
    finally:
        torch.set_num_threads(threads)
