"""attention(): SDPA-compatible arguments, argument checks, and the precision fixes of the core path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit
import attnkit.nn
from attnkit import Causal, KeyPadding
from attnkit.backends.naive import NaiveOptions
from attnkit.backends.tiled import TiledOptions

from .inputs import qkv


def _qkv(B=2, Hq=4, Hkv=4, Tq=6, Tk=9, D=8, dtype=torch.float32, seed=0):
    return qkv(B, Hq, Hkv, Tq, Tk, D, dtype=dtype, seed=seed)


# -- SDPA drop-in ---------------------------------------------------------------------------------
@pytest.mark.parametrize("Tq,Tk", [(6, 9), (9, 6), (7, 7), (1, 5)])
@pytest.mark.parametrize("backend", ["auto", "naive", "sdpa", "tiled"])
def test_is_causal_is_sdpas_top_left_mask(Tq, Tk, backend):
    q, k, v = _qkv(Tq=Tq, Tk=Tk)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attnkit.attention(q, k, v, is_causal=True, backend=backend), expected)
    torch.testing.assert_close(attnkit.attention(q, k, v, None, 0.0, True, backend=backend), expected)  # positionally


@pytest.mark.parametrize("backend", ["auto", "naive", "sdpa", "tiled"])
def test_attn_mask_bool_and_float_as_in_sdpa(backend):
    q, k, v = _qkv()
    keep = torch.rand(2, 1, 6, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., 0] = True  # SDPA's own result for a fully masked row is not 0: keep every row attending
    torch.testing.assert_close(attnkit.attention(q, k, v, attn_mask=keep, backend=backend),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=keep))
    additive = torch.zeros(6, 9).masked_fill(~keep[0, 0], float("-inf")) + torch.randn(6, 9)
    torch.testing.assert_close(attnkit.attention(q, k, v, additive, scale=0.3, backend=backend),
                               F.scaled_dot_product_attention(q, k, v, additive, scale=0.3))


def test_gqa_and_dropout_keywords_as_in_sdpa():
    q, k, v = _qkv(Hq=4, Hkv=2)
    torch.testing.assert_close(attnkit.attention(q, k, v, is_causal=True, enable_gqa=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    torch.testing.assert_close(attnkit.attention(q, k, v, dropout_p=0.0),
                               F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


@pytest.mark.parametrize("kwargs,match", [
    (dict(is_causal=True, attn_mask=torch.ones(6, 9, dtype=torch.bool)), "is_causal=True with attn_mask"),
    (dict(is_causal=True, mask=Causal()), "is_causal=True with mask="),
    (dict(is_causal=True, q_offset=3), "top-left"),
    (dict(attn_mask=torch.ones(6, 9, dtype=torch.bool), mask=Causal()), "attn_mask \\(bool\\) with mask="),
    (dict(attn_mask=torch.zeros(6, 9), bias=torch.zeros(6, 9)), "attn_mask \\(float, additive\\) with bias="),
])
def test_sdpa_arguments_that_conflict_are_refused(kwargs, match):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=match):
        attnkit.attention(q, k, v, **kwargs)


def test_sdpa_argument_types_are_checked():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="is_causal: expected True or False"):
        attnkit.attention(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match="attn_mask: expected dtype torch.bool"):
        attnkit.attention(q, k, v, attn_mask=torch.ones(6, 9, dtype=torch.int64))
    with pytest.raises(TypeError, match="attn_mask: expected a bool or float tensor"):
        attnkit.attention(q, k, v, attn_mask=[[True]])


def test_float_mask_hint_does_not_invert_an_additive_mask():
    q, k, v = _qkv()
    with pytest.raises(TypeError) as info:
        attnkit.attention(q, k, v, mask=torch.zeros(6, 9))
    text = str(info.value)
    assert "bias=" in text and "attn_mask=" in text and ".bool()" not in text


# -- argument checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(), (9,)])
def test_bias_needs_at_least_two_dims(shape):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"bias: expected at least 2 dims .* got shape"):
        attnkit.attention(q, k, v, bias=torch.zeros(shape))


def test_options_are_checked_by_type():
    with pytest.raises(TypeError, match=r"NaiveOptions\(return_weights='no'\): expected True or False, got str"):
        NaiveOptions(return_weights="no")
    with pytest.raises(TypeError, match=r"TiledOptions\(upcast='yes'\): expected True or False or None"):
        TiledOptions(upcast="yes")
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="backend 'sdpa' takes no options, got TiledOptions"):
        attnkit.attention(q, k, v, backend="sdpa", options=TiledOptions())
    with pytest.raises(TypeError, match="takes TiledOptions, got NaiveOptions"):
        attnkit.attention(q, k, v, backend="tiled", options=NaiveOptions())


# -- precision and crashes of the core path -------------------------------------------------------
def test_float32_bias_keeps_its_precision_on_bf16_inputs():
    """A large-magnitude bias rounded to bf16 before SDPA costs several times the kernel's error."""
    n, H = 256, 2
    q, k, v = _qkv(B=1, Hq=H, Hkv=H, Tq=n, Tk=n, D=32)
    positions = torch.arange(n, dtype=torch.float32) + 2000.0
    bias = (0.05 * positions).view(1, 1, 1, n).expand(1, H, n, n)  # per-key scores of 100..113
    ref = attnkit.attention(q.double(), k.double(), v.double(), bias=bias.double(), mask=Causal(), backend="naive")
    lp = [x.bfloat16() for x in (q, k, v)]
    naive_err = (attnkit.attention(*lp, bias=bias, mask=Causal(), backend="naive").double() - ref).abs().max()
    for backend in ("sdpa", "auto"):
        err = (attnkit.attention(*lp, bias=bias, mask=Causal(), backend=backend).double() - ref).abs().max()
        assert err <= 2 * naive_err + 1e-3, (backend, float(err), float(naive_err))


@pytest.mark.parametrize("bias_shape", [(1, 4, 6, 9), (6, 9), (1, 1, 1, 9), (1, 4, 6, 1)])
def test_top_left_causal_with_bias_and_fewer_queries(bias_shape):
    q, k, v = _qkv(Tq=6, Tk=9)
    bias = torch.randn(bias_shape)
    expected = attnkit.attention(q, k, v, mask=Causal(), q_offset=0, bias=bias, backend="naive")
    for backend in ("sdpa", "auto"):
        torch.testing.assert_close(attnkit.attention(q, k, v, mask=Causal(), q_offset=0, bias=bias, backend=backend),
                                   expected)
    torch.testing.assert_close(attnkit.attention(q, k, v, is_causal=True, bias=bias), expected)


def test_fp16_products_do_not_overflow():
    """PyTorch's CPU SDPA regression case: fp16 inputs of 256.0 at D=80 have a finite answer."""
    q = torch.full((1, 2, 4, 80), 256.0, dtype=torch.float16)
    v = torch.randn(1, 2, 4, 80).half()
    expected = v.float().mean(dim=2, keepdim=True).expand(1, 2, 4, 80)  # equal scores: the mean of v
    for backend in ("naive", "auto"):
        out = attnkit.attention(q, q, v, backend=backend)
        assert torch.isfinite(out).all(), backend
        torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)
    weights = attnkit.attention_weights(q, q)
    torch.testing.assert_close(weights.float(), torch.full((1, 2, 4, 4), 0.25))
    mha = attnkit.nn.MultiHeadAttention(attnkit.nn.AttentionConfig(embed_dim=160, num_heads=2)).half()
    out, w = mha(torch.full((1, 4, 160), 8.0, dtype=torch.float16), need_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()


def test_padded_sdpa_equals_naive_with_bias():
    q, k, v = _qkv()
    mask = KeyPadding([9, 4])
    bias = torch.randn(1, 4, 6, 9)
    torch.testing.assert_close(attnkit.attention(q, k, v, mask=mask, bias=bias, backend="sdpa"),
                               attnkit.attention(q, k, v, mask=mask, bias=bias, backend="naive"))


def test_readme_sdpa_section_runs():
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "contract.md").read_text()
    section = readme.split("## Coming from `F.scaled_dot_product_attention`", 1)[1]
    exec(compile(re.search(r"```python\n(.*?)```", section, re.S).group(1), "contract.md", "exec"), {})
