import math

import pytest
import torch
import torch.nn.functional as F

from attnkit import Causal
from attnkit.nn import DecoderLayer, EncoderLayer, FeedForward, TransformerConfig

E, H = 16, 4


def _config(**kw):
    return TransformerConfig(vocab_size=10, embed_dim=E, num_heads=H, num_layers=1, ffn_dim=24, **kw)


def _fill(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.3)
    return module


def _attention_ref(x, W, b, Wo, bo, causal=False):
    """Textbook multi-head self-attention in float64 from fused [q; k; v] weights."""
    B, T, _ = x.shape
    d = E // H
    q, k, v = (x @ W.T + b).split(E, dim=-1)
    q, k, v = (t.view(B, T, H, d).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, E)
    return out @ Wo.T + bo


def _layer_ref(layer, x, norm_first, causal=False):
    p = {n: t.double() for n, t in layer.named_parameters()}
    ln = lambda h, i: F.layer_norm(h, (E,), p[f"norm{i}.weight"], p[f"norm{i}.bias"], 1e-5)  # noqa: E731
    attn = lambda h: _attention_ref(h, p["self_attn.qkv_proj.weight"], p["self_attn.qkv_proj.bias"],  # noqa: E731
                                    p["self_attn.out_proj.weight"], p["self_attn.out_proj.bias"], causal)
    ffn = lambda h: F.gelu(h @ p["ffn.fc1.weight"].T + p["ffn.fc1.bias"]) @ p["ffn.fc2.weight"].T + p["ffn.fc2.bias"]  # noqa: E731
    if norm_first:
        x = x + attn(ln(x, 1))
        return x + ffn(ln(x, 2))
    x = ln(x + attn(x), 1)
    return ln(x + ffn(x), 2)


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_ln", "post_ln"])
def test_encoder_layer_matches_hand_written_reference(norm_first):
    layer = _fill(EncoderLayer(_config(norm_first=norm_first))).double()
    x = torch.randn(2, 7, E, dtype=torch.float64)
    assert torch.allclose(layer(x), _layer_ref(layer, x, norm_first), atol=1e-10)


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_ln", "post_ln"])
def test_decoder_layer_matches_reference_and_is_causal(norm_first):
    layer = _fill(DecoderLayer(_config(norm_first=norm_first))).double()
    x = torch.randn(2, 7, E, dtype=torch.float64)
    out = layer(x)
    assert torch.allclose(out, _layer_ref(layer, x, norm_first, causal=True), atol=1e-10)
    y = x.clone()
    y[:, 5:] += torch.randn(E, dtype=torch.float64)
    assert torch.allclose(layer(y)[:, :5], out[:, :5], atol=1e-12)


def test_float32_layer_close_to_float64_reference():
    layer = _fill(EncoderLayer(_config()))
    x = torch.randn(2, 9, E)
    assert torch.allclose(layer(x).double(), _layer_ref(layer, x.double(), True), atol=1e-4)


def test_gated_feed_forward():
    ffn = _fill(FeedForward(_config(gated=True, activation="silu")))
    x = torch.randn(3, E)
    ref = ffn.fc2(F.silu(ffn.fc_gate(x)) * ffn.fc1(x))
    assert torch.allclose(ffn(x), ref)
    assert FeedForward(_config()).fc_gate is None


def test_decoder_cross_attention_uses_memory():
    layer = _fill(DecoderLayer(_config(), cross_attention=True))
    x, mem = torch.randn(2, 3, E), torch.randn(2, 5, E)
    out = layer(x, mem)
    assert out.shape == (2, 3, E)
    assert not torch.allclose(out, layer(x, mem + 1))
    with pytest.raises(ValueError, match="memory"):
        layer(x)
    with pytest.raises(ValueError, match="memory"):
        DecoderLayer(_config())(x, mem)


def test_decoder_default_mask_is_sliding_window_when_configured():
    layer = _fill(DecoderLayer(_config(sliding_window=2)))
    x = torch.randn(1, 6, E)
    y = x.clone()
    y[:, 0] += torch.randn(E)  # position 0 is outside the window of positions >= 3
    assert torch.allclose(layer(x)[:, 3:], layer(y)[:, 3:])
    assert not torch.allclose(layer(x, mask=Causal())[:, 3:], layer(y, mask=Causal())[:, 3:])


@pytest.mark.parametrize("bad", [dict(activation="tanh"), dict(position="xpos"), dict(embed_dim=10, num_heads=4),
                                 dict(num_kv_heads=3), dict(dropout=1.0), dict(norm="batch")])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        TransformerConfig(**{**dict(embed_dim=16, num_heads=4), **bad})


def test_attention_config_derivation():
    cfg = _config(position="rope", num_kv_heads=2, attention_dropout=0.1)
    a = cfg.attention_config()
    assert (a.embed_dim, a.num_heads, a.num_kv_heads, a.dropout, a.position) == (E, H, 2, 0.1, "rope")
    assert cfg.attention_config(cross=True).position == "none"
    assert cfg.attention_config(cross=True).cross_attention


def test_ffn_width_is_the_feed_forward_width_and_hidden_dim_is_its_deprecated_name():
    from attnkit.nn.layers import TransformerConfig

    config = TransformerConfig(vocab_size=16, embed_dim=8, num_heads=2, num_layers=1)
    assert config.ffn_width == 32 and TransformerConfig(vocab_size=16, embed_dim=8, num_heads=2, num_layers=1,
                                                        ffn_dim=12).ffn_width == 12
    with pytest.warns(DeprecationWarning, match="renamed ffn_width"):
        assert config.hidden_dim == 32
