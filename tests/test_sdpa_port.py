"""PyTorch's CPU scaled-dot-product-attention regression cases, in our own words (after
``test/test_transformers.py`` of pytorch/pytorch), run on every exact backend that takes them:
large half-precision inputs that overflow an unscaled q·kᵀ, fully masked rows, scale edge cases,
top-left causal with a bias, a float32 ALiBi bias on bfloat16 inputs, and decode shapes.

Behaviour not fixed yet is in ``NOT_YET`` (strict xfail: a fix makes the case pass and the mark
fail loudly, so the entry is dropped with the fix).
"""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import Causal, KeyPadding
from attnkit.inputs import AttentionInputs

from .reference import (
    DEVICE, device_unavailable, flash_rule_ok, max_error, reference_attention, reference_attention_lowp,
)

if device_unavailable():
    pytest.skip(device_unavailable(), allow_module_level=True)

EXACT = [name for name, impl in attnkit.list_backends().items() if impl.exact]

# (test name, backend) -> reason
NOT_YET = {
}


def backends_for(test: str, make_call, ids=None):
    """pytest params of the exact backends that report no reasons for ``make_call()``'s arguments."""
    q, k, v, kwargs = make_call()
    params = []
    for b in EXACT:
        if attnkit.get_backend(b).not_supported_reasons(AttentionInputs.create(q, k, v, **kwargs)):
            continue
        key = b if ids is None else f"{b}-{ids}"
        marks = [pytest.mark.xfail(strict=True, reason=NOT_YET[test, key])] if (test, key) in NOT_YET else []
        params.append(pytest.param(b, id=key, marks=marks))
    return params


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _large_half():
    x = torch.full((1, 2, 16, 80), 256.0, dtype=torch.float16, device=DEVICE)
    return x, x.clone(), x.clone(), dict(mask=Causal())


@pytest.mark.parametrize("backend", backends_for("test_large_half_inputs_stay_finite", _large_half))
def test_large_half_inputs_stay_finite(backend):
    """PyTorch issue 160841: fp16 q = k = v = 256.0 with D = 80: q·kᵀ = 5.2e6 overflows fp16 unless
    scaled first; the scaled scores (5.9e5 / sqrt(80)) are equal, so the output is exactly 256."""
    q, k, v, kwargs = _large_half()
    out = attnkit.attention(q, k, v, backend=backend, **kwargs)
    assert torch.isfinite(out).all()
    assert (out.float() - 256.0).abs().max() <= 0.25  # one float16 ulp at 256 (p @ v rounds in fp16)


def _masked_rows():
    q, k, v = _randn(2, 2, 6, 8), _randn(2, 2, 6, 8, seed=1), _randn(2, 2, 6, 8, seed=2)
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool, device=DEVICE)
    keep[0, :, 2] = False  # one row of batch 0 sees nothing
    keep[1] = False  # batch 1 sees nothing at all
    return q, k, v, dict(mask=keep)


@pytest.mark.parametrize("backend", backends_for("test_fully_masked_rows", _masked_rows))
def test_fully_masked_rows(backend):
    """SDPA's math path returned NaN for rows with an all-False boolean mask; ours give 0 and
    finite (zero) gradients, and the other rows are unaffected."""
    q, k, v, kwargs = _masked_rows()
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out = attnkit.attention(q, k, v, backend=backend, **kwargs)
    out.sum().backward()
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2])) and torch.equal(out[1], torch.zeros_like(out[1]))
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()
    assert torch.equal(q.grad[1], torch.zeros_like(q.grad[1]))
    ref, _ = reference_attention(q.detach(), k.detach(), v.detach(), **kwargs)
    assert max_error(out, ref) < 1e-5


SCALES = [0.0, -0.5, 1e-6, 1e3]


def _scale_call():
    return _randn(1, 2, 9, 16), _randn(1, 2, 9, 16, seed=1), _randn(1, 2, 9, 16, seed=2), dict(mask=Causal())


@pytest.mark.parametrize("backend,scale", [
    pytest.param(p.values[0], scale, id=p.id, marks=p.marks) for scale in SCALES
    for p in backends_for("test_scale_edge_cases", lambda: (*_scale_call()[:3], dict(_scale_call()[3], scale=scale)),
                          scale)
])
def test_scale_edge_cases(backend, scale):
    """scale = 0 averages the visible values uniformly; negative, tiny and large scales follow the
    same math (large: a finite, near-argmax result)."""
    q, k, v, kwargs = _scale_call()
    out = attnkit.attention(q, k, v, backend=backend, scale=scale, **kwargs)
    ref, _ = reference_attention(q, k, v, scale=scale, **kwargs)
    assert torch.isfinite(out).all()
    assert max_error(out, ref) <= 1e-4
    if scale == 0.0:  # row i averages values 0..i
        mean = v.cumsum(2) / torch.arange(1, 10, device=DEVICE).view(1, 1, -1, 1)
        torch.testing.assert_close(out, mean, atol=1e-5, rtol=0)


def _top_left_bias():
    q, k, v = _randn(1, 2, 3, 8), _randn(1, 2, 7, 8, seed=1), _randn(1, 2, 7, 8, seed=2)
    return q, k, v, dict(mask=Causal(), q_offset=0, bias=_randn(1, 2, 3, 7, seed=3))


@pytest.mark.parametrize("backend", backends_for("test_top_left_causal_with_bias", _top_left_bias))
def test_top_left_causal_with_bias(backend):
    """Tq < Tk, top-left causal (q_offset=0, as T5's static-cache decoding) with an additive bias."""
    q, k, v, kwargs = _top_left_bias()
    out = attnkit.attention(q, k, v, backend=backend, **kwargs)
    ref, _ = reference_attention(q, k, v, **kwargs)
    assert max_error(out, ref) <= 1e-5


def _alibi_bf16(T=256):
    q, k, v = (_randn(1, 4, T, 32, dtype=torch.bfloat16, seed=s) for s in range(3))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE).view(1, 4, 1, 1)
    pos = torch.arange(T, device=DEVICE)
    bias = -(slopes * (pos[None, :] - pos[:, None]).abs()).float()  # float32, up to -128
    return q, k, v, dict(mask=Causal(), bias=bias)


@pytest.mark.parametrize("backend", backends_for("test_float32_alibi_bias_on_bfloat16", _alibi_bf16))
def test_float32_alibi_bias_on_bfloat16(backend):
    """A float32 bias on bf16 inputs must not be rounded to bf16 first (|bias| up to 128 has a bf16
    spacing of 0.5, which changes the weights): 2x the low-precision reference, which adds it in float32."""
    q, k, v, kwargs = _alibi_bf16()
    out = attnkit.attention(q, k, v, backend=backend, **kwargs)
    ref, _ = reference_attention(q, k, v, **kwargs)
    lowp, _ = reference_attention_lowp(q, k, v, **kwargs)
    assert flash_rule_ok(max_error(out, ref), max_error(lowp, ref), factor=2, dtype=torch.bfloat16)


def _decode():
    q, k, v = _randn(3, 8, 1, 64), _randn(3, 2, 300, 64, seed=1), _randn(3, 2, 300, 64, seed=2)
    return q, k, v, dict(mask=Causal() & KeyPadding([300, 129, 1]))


@pytest.mark.parametrize("backend", backends_for("test_decode_gqa_with_padding", _decode))
def test_decode_gqa_with_padding(backend):
    """One query token against a long padded GQA cache (SDPA's decode regression shapes)."""
    q, k, v, kwargs = _decode()
    out = attnkit.attention(q, k, v, backend=backend, **kwargs)
    ref, _ = reference_attention(q, k, v, **kwargs)
    lowp, _ = reference_attention_lowp(q, k, v, **kwargs)
    assert flash_rule_ok(max_error(out, ref), max_error(lowp, ref), factor=2, dtype=torch.float32)


def test_naive_bfloat16_gradients_over_many_queries_are_rounded_once():
    """PyTorch's CPU SDPA test (bfloat16, 1030 queries, 17 keys, ``out.sum()``) holds gradients to
    atol = rtol = 0.05; naive rounded ``P·V``'s backward ``dP = dO·Vᵀ`` to bfloat16, and with dO the
    same for every query that rounding is the same for each of the ~1000 queries dK sums over:
    dK drifted up to 8 bfloat16 steps (0.5 at 8.7). The reference computes in float32 and rounds
    once, so every result and gradient is within a bfloat16 step (2**-8, relative) of float64."""
    g = torch.Generator().manual_seed(0)
    B, H, Tq, Tk, D = 4, 2, 900, 23, 16
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(DEVICE, torch.bfloat16) for n in (Tq, Tk, Tk))
    mask = KeyPadding(torch.randint(1, Tk + 1, (B,), generator=g))
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_in, mask=mask)[0]
    ref.sum().backward()
    lowp = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.attention(*lowp, mask=mask, backend="naive")
    out.sum().backward()
    for name, got, want in [("out", out.detach(), ref.detach())] + [
            (f"d{n}", t.grad, r.grad) for n, t, r in zip("qkv", lowp, ref_in)]:
        excess = (got.double() - want).abs() - 2 ** -8 * want.abs()
        assert float(excess.max()) <= 1e-3, (name, float(excess.max()))
