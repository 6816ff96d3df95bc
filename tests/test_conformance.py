"""Conformance of every registered exact backend, generated from the registry.

A backend is tested here the moment it is registered: against the float64 oracle under flash-attn's
rule (error <= 2x the naive backend's error in the same dtype; gradients 3x), over awkward shapes and
every mask kind, plus the invariants: fully masked rows give 0 with finite zero gradients, NaN/Inf in
keys no query may see changes nothing, determinism, dropout keep-rate and float64 gradcheck.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import pytest
import torch

import attnkit
from attnkit import Causal, Custom, Document, KeyPadding, SlidingWindow
from attnkit.inputs import AttentionInputs
from attnkit.masks import BlockSparse

from .reference import flash_rule_ok, max_error, reference_attention

# ATTNKIT_TEST_DEVICE=cuda runs the whole suite on a GPU (the oracle runs there in float64 too).
DEVICE = torch.device(os.environ.get("ATTNKIT_TEST_DEVICE", "cpu"))
EXACT = [name for name, impl in attnkit.list_backends().items() if impl.exact]


@dataclass(frozen=True)
class Shape:
    B: int
    Hq: int
    Hkv: int
    Tq: int
    Tk: int
    D: int
    Dv: int

    def __str__(self):
        return f"B{self.B}-Hq{self.Hq}-Hkv{self.Hkv}-Tq{self.Tq}-Tk{self.Tk}-D{self.D}" + (
            f"-Dv{self.Dv}" if self.Dv != self.D else ""
        )


SHAPES = [
    Shape(1, 1, 1, 1, 1, 8, 8),
    Shape(2, 2, 2, 2, 5, 8, 8),
    Shape(2, 4, 4, 17, 17, 64, 64),
    Shape(1, 9, 3, 97, 127, 59, 59),  # 9 heads, GQA 3, Tq < Tk
    Shape(1, 4, 1, 127, 97, 21, 21),  # MQA, Tq > Tk
    Shape(1, 2, 2, 257, 257, 111, 111),
    Shape(1, 4, 2, 1, 1023, 128, 128),  # one-token decode
    Shape(1, 2, 1, 1025, 1025, 64, 64),
    Shape(1, 2, 2, 1023, 17, 64, 32),  # Dv != D
]


def _doc_ids(B, T):
    g = torch.Generator().manual_seed(T)
    cuts = torch.rand(B, T, generator=g) < 0.05
    return cuts.long().cumsum(dim=1)


# name -> builder(shape) -> mask
MASKS = {
    "none": lambda s: None,
    "Causal": lambda s: Causal(),
    "SlidingWindow": lambda s: SlidingWindow(16, 0),
    "SlidingWindow2": lambda s: SlidingWindow(7, 5),
    "KeyPadding": lambda s: KeyPadding([max(1, s.Tk - 3 * b) for b in range(s.B)]),
    "Document": lambda s: Document(_doc_ids(s.B, max(s.Tq, s.Tk))),
    "Dense": lambda s: (torch.rand(s.B, 1, s.Tq, s.Tk, generator=torch.Generator().manual_seed(1)) < 0.7).to(DEVICE),
    "Custom": lambda s: Custom(lambda b, h, q, k: (q - k) % 3 != 1, name="mod3"),
    "Causal&KeyPadding": lambda s: Causal() & KeyPadding([s.Tk] + [max(1, s.Tk // 2)] * (s.B - 1)),
    "SlidingWindow|Document": lambda s: SlidingWindow(4, 0) | Document(_doc_ids(s.B, max(s.Tq, s.Tk))),
    "BigBird": lambda s: BlockSparse.bigbird(-(-max(s.Tq, s.Tk) // 16), 16, seed=3),
    "Strided": lambda s: BlockSparse.strided(-(-max(s.Tq, s.Tk) // 16), 16, stride=3),
}


def _inputs(shape: Shape, dtype, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape.B, shape.Hq, shape.Tq, shape.D, generator=g)
    k = torch.randn(shape.B, shape.Hkv, shape.Tk, shape.D, generator=g)
    v = torch.randn(shape.B, shape.Hkv, shape.Tk, shape.Dv, generator=g)
    do = torch.randn(shape.B, shape.Hq, shape.Tq, shape.Dv, generator=g)
    return [x.to(DEVICE, dtype).requires_grad_(requires_grad) for x in (q, k, v)], do.to(DEVICE, dtype)


def _run(backend, qkv, do, **kwargs):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in qkv)
    out = attnkit.attention(q, k, v, backend=backend, **kwargs)
    out.backward(do)
    return out.detach(), (q.grad, k.grad, v.grad)


def _reference(qkv, do, **kwargs):
    q, k, v = (x.detach().double().requires_grad_(True) for x in qkv)
    out, _ = reference_attention(q, k, v, **kwargs)
    out.backward(do.double())
    return out.detach(), (q.grad, k.grad, v.grad)


def _skip_unless_supported(backend, qkv, **kwargs):
    reasons = attnkit.get_backend(backend).not_supported_reasons(AttentionInputs.create(*qkv, **kwargs))
    if reasons:
        pytest.skip(f"{backend}: {'; '.join(reasons)}")


# Long shapes run with the masks whose structure differs most; every mask runs on the others.
LONG_MASKS = ("none", "Causal", "Causal&KeyPadding", "BigBird")
CASES = [
    (shape, mask_name)
    for shape in SHAPES
    for mask_name in MASKS
    if shape.Tq * shape.Tk < 500_000 or mask_name in LONG_MASKS
]


@functools.lru_cache(maxsize=8)
def _baselines(shape: Shape, mask_name: str, dtype: torch.dtype):
    """The naive backend's and the float64 oracle's outputs and gradients, shared by all backends
    of a case (the tests of one case run on one xdist worker: see the xdist_group marks)."""
    mask = MASKS[mask_name](shape)
    qkv, do = _inputs(shape, dtype)
    return _run("naive", qkv, do, mask=mask), _reference(qkv, do, mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "shape,mask_name",
    [pytest.param(s, m, id=f"{m}-{s}", marks=pytest.mark.xdist_group(f"{m}-{s}")) for s, m in CASES],
)
@pytest.mark.parametrize("backend", EXACT)
def test_matches_reference(backend, shape, mask_name, dtype):
    """Outputs and gradients within flash-attn's rule of the float64 oracle."""
    if dtype == torch.bfloat16 and shape.Tq * shape.Tk > 300_000:
        pytest.skip("bf16 is covered at moderate sizes")
    if "Document" in mask_name and shape.Tq > shape.Tk:
        pytest.skip("Document ids exist only for positions >= 0; bottom-right alignment puts queries before 0")
    mask = MASKS[mask_name](shape)
    qkv, do = _inputs(shape, dtype)
    _skip_unless_supported(backend, qkv, mask=mask)
    out, grads = _run(backend, qkv, do, mask=mask)
    (naive_out, naive_grads), (ref_out, ref_grads) = _baselines(shape, mask_name, dtype)
    assert out.shape == (shape.B, shape.Hq, shape.Tq, shape.Dv) and out.dtype == dtype
    err, naive_err = max_error(out, ref_out), max_error(naive_out, ref_out)
    assert flash_rule_ok(err, naive_err, factor=2, dtype=dtype), f"out error {err:.3g} vs naive {naive_err:.3g}"
    for name, g, ng, rg in zip("qkv", grads, naive_grads, ref_grads):
        assert g is not None and torch.isfinite(g).all(), f"d{name} missing or not finite"
        err, naive_err = max_error(g, rg), max_error(ng, rg)
        assert flash_rule_ok(err, naive_err, factor=3, dtype=dtype), f"d{name} error {err:.3g} vs naive {naive_err:.3g}"


@pytest.mark.parametrize("backend", EXACT)
def test_float16_tiny(backend):
    shape = Shape(1, 2, 1, 9, 13, 16, 16)
    qkv, do = _inputs(shape, torch.float16)
    _skip_unless_supported(backend, qkv, mask=Causal())
    out, _ = _run(backend, qkv, do, mask=Causal())
    naive_out, _ = _run("naive", qkv, do, mask=Causal())
    ref_out, _ = _reference(qkv, do, mask=Causal())
    assert flash_rule_ok(max_error(out, ref_out), max_error(naive_out, ref_out), factor=2, dtype=torch.float16)


@pytest.mark.parametrize("backend", EXACT)
def test_lse_matches_reference(backend):
    shape = Shape(2, 4, 2, 33, 47, 32, 32)
    qkv, _ = _inputs(shape, torch.float32, requires_grad=False)
    mask = Causal() & KeyPadding([47, 30])
    _skip_unless_supported(backend, qkv, mask=mask, return_lse=True)
    out, lse = attnkit.attention(*qkv, mask=mask, return_lse=True, backend=backend)
    ref_out, ref_lse = reference_attention(*qkv, mask=mask)
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-5)
    assert (lse[~finite] == float("-inf")).all()


@pytest.mark.parametrize("backend", EXACT)
def test_fully_masked_rows_zero_with_finite_grads(backend):
    """Rows with no visible key give exactly 0 and zero, finite gradients (never NaN)."""
    shape = Shape(2, 2, 2, 9, 6, 16, 16)
    qkv, do = _inputs(shape, torch.float32)
    # batch 1 has no valid key at all; Tq > Tk makes the first 3 causal rows of batch 0 empty too.
    mask = Causal() & KeyPadding([6, 0])
    _skip_unless_supported(backend, qkv, mask=mask)
    out, (dq, dk, dv) = _run(backend, qkv, do, mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.equal(dq[1], torch.zeros_like(dq[1])) and torch.equal(dk[1], torch.zeros_like(dk[1]))
    assert torch.equal(dq[0, :, :3], torch.zeros_like(dq[0, :, :3]))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", EXACT)
def test_poison_in_unseen_keys_changes_nothing(backend, poison):
    shape = Shape(2, 4, 2, 5, 12, 16, 16)
    qkv, do = _inputs(shape, torch.float32)
    mask = Causal() & KeyPadding([12, 8])
    _skip_unless_supported(backend, qkv, mask=mask)
    clean_out, clean_grads = _run(backend, qkv, do, mask=mask)
    q, k, v = (x.detach().clone() for x in qkv)
    k[1, :, 8:] = poison
    v[1, :, 8:] = poison
    out, (dq, dk, dv) = _run(backend, [q, k, v], do, mask=mask)
    assert torch.allclose(out, clean_out, atol=1e-6, rtol=0)
    assert torch.allclose(dq, clean_grads[0], atol=1e-5, rtol=0)
    assert torch.allclose(dv[:, :, :8], clean_grads[2][:, :, :8], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", EXACT)
def test_deterministic(backend):
    shape = Shape(2, 4, 2, 65, 65, 32, 32)
    qkv, do = _inputs(shape, torch.float32)
    _skip_unless_supported(backend, qkv, mask=Causal())
    a, ga = _run(backend, qkv, do, mask=Causal())
    b, gb = _run(backend, qkv, do, mask=Causal())
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))


@pytest.mark.parametrize("backend", EXACT)
def test_bias_and_scale(backend):
    shape = Shape(2, 4, 2, 17, 23, 16, 16)
    qkv, do = _inputs(shape, torch.float32)
    bias = torch.randn(1, 4, 17, 23, device=DEVICE, requires_grad=True)
    kwargs = dict(mask=Causal(), bias=bias, scale=0.3)
    _skip_unless_supported(backend, qkv, **kwargs)
    out = attnkit.attention(*qkv, backend=backend, **kwargs)
    ref, _ = reference_attention(*qkv, **{**kwargs, "bias": bias.detach()})
    assert max_error(out, ref) <= 1e-5
    out.backward(do)
    assert bias.grad is not None and torch.isfinite(bias.grad).all()


@pytest.mark.parametrize("backend", EXACT)
def test_gradcheck_float64(backend):
    shape = Shape(1, 2, 1, 4, 6, 5, 3)
    qkv, _ = _inputs(shape, torch.float64)
    mask = Causal() & KeyPadding([5])
    _skip_unless_supported(backend, qkv, mask=mask)
    fn = lambda q, k, v: attnkit.attention(q, k, v, mask=mask, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(qkv), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("p", [0.25, 0.6])
@pytest.mark.parametrize("backend", EXACT)
def test_dropout_keep_rate(backend, p):
    """With uniform weights and V = identity, each output entry is 1/Tk/(1-p) or 0: the fraction
    of nonzeros is the keep rate and the mean is preserved."""
    B, H, T = 4, 4, 128
    q = torch.zeros(B, H, T, 16, device=DEVICE)
    k = torch.zeros(B, H, T, 16, device=DEVICE)
    v = torch.eye(T, device=DEVICE).expand(B, H, T, T).contiguous()
    _skip_unless_supported(backend, [q, k, v], dropout_p=p)
    torch.manual_seed(0)
    out = attnkit.attention(q, k, v, dropout_p=p, backend=backend)
    kept = (out != 0).float().mean().item()
    n = out.numel()
    assert abs(kept - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    assert torch.allclose(out[out != 0], torch.tensor(1 / T / (1 - p), device=DEVICE), rtol=1e-4)


def test_auto_never_picks_approximate():
    shape = Shape(1, 2, 2, 64, 64, 16, 16)
    qkv, _ = _inputs(shape, torch.float32, requires_grad=False)
    for mask in (None, Causal(), SlidingWindow(8, 0)):
        chosen = attnkit.explain(*qkv, mask=mask).chosen
        assert attnkit.get_backend(chosen).exact


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from .test_masks import mask_trees  # noqa: E402


@pytest.mark.parametrize("backend", EXACT)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    B=st.integers(1, 2), Hkv=st.integers(1, 3), groups=st.integers(1, 3),
    Tq=st.integers(1, 24), Tk=st.integers(1, 24), D=st.integers(1, 40),
)
def test_random_shapes_and_mask_trees(backend, data, B, Hkv, groups, Tq, Tk, D):
    """Property: on random shapes and random trees of masks, every exact backend equals the oracle."""
    mask = data.draw(mask_trees())
    if mask.batch_size not in (None, 1, B):
        B = mask.batch_size  # per-example masks fix the batch size
    shape = Shape(B, Hkv * groups, Hkv, Tq, Tk, D, D)
    q_offset = data.draw(st.integers(0, 4))
    kwargs = dict(mask=mask, q_offset=q_offset, kv_offset=0)
    qkv, do = _inputs(shape, torch.float64)
    try:
        AttentionInputs.create(*qkv, **kwargs)
    except ValueError:
        return  # e.g. Document ids shorter than these positions: rejected, which is right
    if attnkit.get_backend(backend).not_supported_reasons(AttentionInputs.create(*qkv, **kwargs)):
        return
    out, grads = _run(backend, qkv, do, **kwargs)
    ref, ref_grads = _reference(qkv, do, **kwargs)
    assert max_error(out, ref) < 1e-10
    for g, rg in zip(grads, ref_grads):
        assert max_error(g, rg) < 1e-10
