"""Conformance of every registered exact backend, generated from the registry.

A backend is tested here the moment it is registered: against the float64 oracle under flash-attn's
rule (error <= 2x the error of the independent low-precision reference in the same dtype;
gradients 3x), over awkward shapes and every mask kind, plus the invariants: fully masked rows
give 0 with finite zero gradients, NaN/Inf in keys no query may see changes nothing, determinism,
dropout keep-rate and float64 gradcheck.

The grid is built at collection time from each backend's ``not_supported_reasons``: combinations a
backend declines are not collected (``test_declines`` checks the important refusals explicitly).
``ATTNKIT_TEST_DEVICE=cuda`` runs it on a GPU (the oracle runs there in float64 too).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import pytest
import torch

import attnkit
from attnkit import Causal, Custom, Document, KeyPadding, SlidingWindow, TopK
from attnkit.inputs import AttentionInputs
from attnkit.masks import BlockSparse

from .reference import (
    DEVICE, device_unavailable, flash_rule_ok, max_error, reference_attention, reference_attention_lowp,
)

if device_unavailable():
    pytest.skip(device_unavailable(), allow_module_level=True)

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


def _topk(s, k=7):
    """Key lists (B, 1, Tq, k) over the call's keys: unsorted, with repeats and -1 padding."""
    g = torch.Generator().manual_seed(s.Tq + s.Tk)
    idx = torch.randint(0, s.Tk, (s.B, 1, s.Tq, k), generator=g)
    return idx.masked_fill(torch.rand(s.B, 1, s.Tq, k, generator=g) < 0.2, -1)


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
    "CustomBH": lambda s: Custom(lambda b, h, q, k: (q + k + b + h) % 3 != 0, name="uses-b-and-h"),
    "Causal&KeyPadding": lambda s: Causal() & KeyPadding([s.Tk] + [max(1, s.Tk // 2)] * (s.B - 1)),
    "SlidingWindow|Document": lambda s: SlidingWindow(4, 0) | Document(_doc_ids(s.B, max(s.Tq, s.Tk))),
    "BigBird": lambda s: BlockSparse.bigbird(-(-max(s.Tq, s.Tk) // 16), 16, seed=3),
    "Strided": lambda s: BlockSparse.strided(-(-max(s.Tq, s.Tk) // 16), 16, stride=3),
    "TopK": lambda s: TopK(_topk(s)),
    "TopK&Causal": lambda s: TopK(_topk(s)) & Causal(),
}
# Behaviour not fixed yet, in one place: (mask name, predicate on the shape) -> reason. Strict: a
# fix makes the case pass and the mark fail loudly, so it is dropped with the fix.
KNOWN_FAILURES: dict = {}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Long shapes run with the masks whose structure differs most; every mask runs on the others.
LONG_MASKS = ("none", "Causal", "Causal&KeyPadding", "BigBird")


def _placeholders(shape: Shape, dtype):
    """Zero-storage tensors of the case's shapes, enough to ask a backend for its reasons."""
    one = torch.zeros((), device=DEVICE, dtype=dtype)
    return (one.expand(shape.B, shape.Hq, shape.Tq, shape.D), one.expand(shape.B, shape.Hkv, shape.Tk, shape.D),
            one.expand(shape.B, shape.Hkv, shape.Tk, shape.Dv))


def _declined(backend: str, shape: Shape, dtype, **kwargs) -> bool:
    """True when ``attention()`` rejects the case for everyone or the backend reports reasons."""
    try:
        inp = AttentionInputs.create(*_placeholders(shape, dtype), **kwargs)
    except ValueError:  # e.g. Document ids do not cover query positions before 0 (Tq > Tk, bottom-right)
        return True
    return bool(attnkit.get_backend(backend).not_supported_reasons(inp))


def _grid():
    params = []
    for backend in EXACT:
        for shape in SHAPES:
            for mask_name, build in MASKS.items():
                if shape.Tq * shape.Tk >= 500_000 and mask_name not in LONG_MASKS:
                    continue
                for dtype_name, dtype in DTYPES.items():
                    if dtype == torch.bfloat16 and shape.Tq * shape.Tk > 300_000:
                        continue  # bf16 is covered at moderate sizes
                    if mask_name == "CustomBH" and (dtype != torch.float32 or shape.Tq * shape.Tk > 300):
                        continue  # the b/h indexing is what it tests, not precision or length
                    if _declined(backend, shape, dtype, mask=build(shape)):
                        continue
                    case = f"{mask_name}-{shape}-{dtype_name}"
                    marks = [pytest.mark.xdist_group(case)]
                    known = KNOWN_FAILURES.get(mask_name)
                    if known and known[0](shape):
                        marks.append(pytest.mark.xfail(strict=True, reason=known[1]))
                    params.append(pytest.param(backend, shape, mask_name, dtype, id=f"{backend}-{case}", marks=marks))
    return params


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


def _reference(qkv, do, lowp=False, **kwargs):
    """The float64 oracle, or (``lowp``) the same math in the inputs' dtype: outputs and gradients."""
    cast = (lambda x: x.detach().clone()) if lowp else (lambda x: x.detach().double())
    q, k, v = (cast(x).requires_grad_(True) for x in qkv)
    out, _ = (reference_attention_lowp if lowp else reference_attention)(q, k, v, **kwargs)
    out.backward(do.to(out.dtype))
    return out.detach(), (q.grad, k.grad, v.grad)


@functools.lru_cache(maxsize=8)
def _baselines(shape: Shape, mask_name: str, dtype: torch.dtype):
    """The low-precision reference's and the float64 oracle's outputs and gradients, shared by all
    backends of a case (the tests of one case run on one xdist worker: see the xdist_group marks)."""
    mask = MASKS[mask_name](shape)
    qkv, do = _inputs(shape, dtype)
    return _reference(qkv, do, lowp=True, mask=mask), _reference(qkv, do, mask=mask)


def check_flash_rule(out, grads, lowp, ref, dtype):
    """Assert flash-attn's rule: output within 2x, gradients within 3x the low-precision reference's error."""
    (lp_out, lp_grads), (ref_out, ref_grads) = lowp, ref
    err, lp_err = max_error(out, ref_out), max_error(lp_out, ref_out)
    assert flash_rule_ok(err, lp_err, factor=2, dtype=dtype), (
        f"out error {err:.3g} vs low-precision reference {lp_err:.3g}")
    for name, g, lg, rg in zip("qkv", grads, lp_grads, ref_grads):
        assert g is not None and torch.isfinite(g).all(), f"d{name} missing or not finite"
        err, lp_err = max_error(g, rg), max_error(lg, rg)
        assert flash_rule_ok(err, lp_err, factor=3, dtype=dtype), (
            f"d{name} error {err:.3g} vs low-precision reference {lp_err:.3g}")


@pytest.mark.parametrize("backend,shape,mask_name,dtype", _grid())
def test_matches_reference(backend, shape, mask_name, dtype):
    """Outputs and gradients within flash-attn's rule of the float64 oracle."""
    mask = MASKS[mask_name](shape)
    qkv, do = _inputs(shape, dtype)
    out, grads = _run(backend, qkv, do, mask=mask)
    assert out.shape == (shape.B, shape.Hq, shape.Tq, shape.Dv) and out.dtype == dtype
    lowp, ref = _baselines(shape, mask_name, dtype)
    check_flash_rule(out, grads, lowp, ref, dtype)


def test_the_rule_catches_a_slightly_wrong_backend():
    """The yardstick is independent of the backends: naive passes, an attention that is off by a
    1% scale error or that ignores one key fails (with naive as its own yardstick both would pass)."""
    shape, mask = Shape(2, 4, 2, 33, 47, 32, 32), Causal() & KeyPadding([47, 30])
    qkv, do = _inputs(shape, torch.float32)
    lowp, ref = _reference(qkv, do, lowp=True, mask=mask), _reference(qkv, do, mask=mask)
    check_flash_rule(*_run("naive", qkv, do, mask=mask), lowp, ref, torch.float32)
    wrong_scale = _run("naive", qkv, do, mask=mask, scale=1.01 * 32**-0.5)
    wrong_mask = _run("naive", qkv, do, mask=Causal() & KeyPadding([47, 29]))
    for out, grads in (wrong_scale, wrong_mask):
        with pytest.raises(AssertionError, match="error"):
            check_flash_rule(out, grads, lowp, ref, torch.float32)


def supporting(shape: Shape, dtype=torch.float32, **kwargs) -> list[str]:
    """The exact backends that accept a call of ``shape`` with ``kwargs`` (collected for the others: none)."""
    return [b for b in EXACT if not _declined(b, shape, dtype, **kwargs)]


# (backend, description, call kwargs, a phrase of the reason): what each backend must refuse.
DECLINES = [
    ("sdpa", "lse", dict(return_lse=True), "log-sum-exp"),
    ("sliding_window", "no mask", dict(), "banded"),
    ("sliding_window", "causal only", dict(mask=Causal()), "banded"),
    ("sliding_window", "dropout", dict(mask=SlidingWindow(4, 0), dropout_p=0.1), "dropout"),
    ("block_sparse", "no layout", dict(mask=Causal()), "BlockSparse"),
    ("tiled", "dropout", dict(dropout_p=0.1), "dropout"),
]


@pytest.mark.parametrize("backend,kwargs,phrase", [pytest.param(b, kw, p, id=f"{b}-{d}") for b, d, kw, p in DECLINES])
def test_declines(backend, kwargs, phrase):
    """What a backend cannot honour it declines with a reason (these cases are absent from the grid)."""
    if backend not in EXACT:
        pytest.fail(f"{backend} is no longer registered: update DECLINES")
    reasons = attnkit.get_backend(backend).not_supported_reasons(
        AttentionInputs.create(*_placeholders(Shape(1, 2, 2, 8, 8, 4, 4), torch.float32), **kwargs))
    assert any(phrase in r for r in reasons), reasons


def test_every_backend_runs_the_bulk_of_the_grid():
    """Guard against a grid emptied by an over-eager reason: naive and tiled run every case."""
    counts = {b: 0 for b in EXACT}
    for param in _grid():
        counts[param.values[0]] += 1
    assert counts["naive"] == counts["tiled"] == max(counts.values()) > 100, counts
    assert counts["sliding_window"] > 0 and counts["block_sparse"] > 0, counts


F16 = Shape(1, 2, 1, 9, 13, 16, 16)


@pytest.mark.parametrize("backend", supporting(F16, torch.float16, mask=Causal()))
def test_float16_tiny(backend):
    qkv, do = _inputs(F16, torch.float16)
    out, grads = _run(backend, qkv, do, mask=Causal())
    lowp = _reference(qkv, do, lowp=True, mask=Causal())
    check_flash_rule(out, grads, lowp, _reference(qkv, do, mask=Causal()), torch.float16)


LSE = Shape(2, 4, 2, 33, 47, 32, 32)
LSE_MASK = Causal() & KeyPadding([47, 30])


@pytest.mark.parametrize("backend", supporting(LSE, mask=LSE_MASK, return_lse=True))
def test_lse_matches_reference(backend):
    qkv, _ = _inputs(LSE, torch.float32, requires_grad=False)
    out, lse = attnkit.attention(*qkv, mask=LSE_MASK, return_lse=True, backend=backend)
    ref_out, ref_lse = reference_attention(*qkv, mask=LSE_MASK)
    assert lse.shape == (2, 4, 33) and lse.dtype == torch.float32
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-5)
    assert (lse[~finite] == float("-inf")).all()
    assert max_error(out, ref_out) < 1e-5


EMPTY = Shape(2, 2, 2, 9, 6, 16, 16)
# batch 1 has no valid key at all; Tq > Tk makes the first 3 causal rows of batch 0 empty too.
EMPTY_MASK = Causal() & KeyPadding([6, 0])


@pytest.mark.parametrize("backend", supporting(EMPTY, mask=EMPTY_MASK))
def test_fully_masked_rows_zero_with_finite_grads(backend):
    """Rows with no visible key give exactly 0 and zero, finite gradients (never NaN)."""
    qkv, do = _inputs(EMPTY, torch.float32)
    out, (dq, dk, dv) = _run(backend, qkv, do, mask=EMPTY_MASK)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    assert out[0, :, 3:].abs().amin() > 0  # the rows that see keys are not zeroed too
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.equal(dq[1], torch.zeros_like(dq[1])) and torch.equal(dk[1], torch.zeros_like(dk[1]))
    assert torch.equal(dq[0, :, :3], torch.zeros_like(dq[0, :, :3]))


POISON = Shape(2, 4, 2, 5, 12, 16, 16)
POISON_MASK = Causal() & KeyPadding([12, 8])


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", supporting(POISON, mask=POISON_MASK))
def test_poison_in_unseen_keys_changes_nothing(backend, poison):
    qkv, do = _inputs(POISON, torch.float32)
    clean_out, clean_grads = _run(backend, qkv, do, mask=POISON_MASK)
    q, k, v = (x.detach().clone() for x in qkv)
    k[1, :, 8:] = poison
    v[1, :, 8:] = poison
    out, (dq, dk, dv) = _run(backend, [q, k, v], do, mask=POISON_MASK)
    assert torch.allclose(out, clean_out, atol=1e-6, rtol=0)
    assert torch.allclose(dq, clean_grads[0], atol=1e-5, rtol=0)
    assert torch.allclose(dv[:, :, :8], clean_grads[2][:, :, :8], atol=1e-5, rtol=0)


DET = Shape(2, 4, 2, 65, 65, 32, 32)


@pytest.mark.parametrize("backend", supporting(DET, mask=Causal()))
def test_deterministic(backend):
    qkv, do = _inputs(DET, torch.float32)
    a, ga = _run(backend, qkv, do, mask=Causal())
    b, gb = _run(backend, qkv, do, mask=Causal())
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))


BIAS = Shape(2, 4, 2, 17, 23, 16, 16)


def _bias(requires_grad=False):
    g = torch.Generator().manual_seed(5)
    return torch.randn(1, 4, 17, 23, generator=g).to(DEVICE).requires_grad_(requires_grad)


@pytest.mark.parametrize("backend", supporting(BIAS, mask=Causal(), bias=_bias(), scale=0.3))
def test_bias_and_scale(backend):
    qkv, do = _inputs(BIAS, torch.float32)
    bias = _bias(requires_grad=True)
    kwargs = dict(mask=Causal(), bias=bias, scale=0.3)
    out = attnkit.attention(*qkv, backend=backend, **kwargs)
    ref, _ = reference_attention(*qkv, **{**kwargs, "bias": bias.detach()})
    assert max_error(out, ref) <= 1e-5
    out.backward(do)
    # d(bias) of softmax is p * (dp - rowsum(p * dp)), the gradient of the scores: compare with float64.
    b64 = bias.detach().double().requires_grad_(True)
    ref64, _ = reference_attention(*(x.detach() for x in qkv), **{**kwargs, "bias": b64})
    ref64.backward(do.double())
    assert max_error(bias.grad, b64.grad) <= 1e-5


GRADCHECK = Shape(1, 2, 1, 4, 6, 5, 3)
GRADCHECK_MASK = Causal() & KeyPadding([5])


@pytest.mark.parametrize("backend", supporting(GRADCHECK, torch.float64, mask=GRADCHECK_MASK))
def test_gradcheck_float64(backend):
    qkv, _ = _inputs(GRADCHECK, torch.float64)
    fn = lambda q, k, v: attnkit.attention(q, k, v, mask=GRADCHECK_MASK, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, tuple(qkv), eps=1e-6, atol=1e-5)


DROPOUT = Shape(4, 4, 4, 128, 128, 16, 128)


@pytest.mark.parametrize("p", [0.25, 0.6])
@pytest.mark.parametrize("backend", supporting(DROPOUT, dropout_p=0.25))
def test_dropout_keep_rate(backend, p):
    """With uniform weights and V = identity, each output entry is 1/Tk/(1-p) or 0: the fraction
    of nonzeros is the keep rate and the mean is preserved."""
    B, H, T = 4, 4, 128
    q = torch.zeros(B, H, T, 16, device=DEVICE)
    k = torch.zeros(B, H, T, 16, device=DEVICE)
    v = torch.eye(T, device=DEVICE).expand(B, H, T, T).contiguous()
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
