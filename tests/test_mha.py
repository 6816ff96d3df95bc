"""MultiHeadAttention: equals torch.nn.MultiheadAttention after conversion; GQA, cross, weights."""

from __future__ import annotations

import pytest
import torch

import attnkit
import attnkit.backends.naive
from attnkit import Causal
from attnkit.nn import AttentionConfig, MultiHeadAttention


@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_matches_outputs_and_weights(bias):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(48, 6, bias=bias, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(ref).eval()
    x = torch.randn(3, 11, 48)
    kpm = torch.zeros(3, 11, dtype=torch.bool)
    kpm[1, 6:] = True
    causal_ignore = torch.triu(torch.ones(11, 11, dtype=torch.bool), 1)  # torch: True = ignore
    want, want_w = ref(x, x, x, key_padding_mask=kpm, attn_mask=causal_ignore, average_attn_weights=False)
    mask = attnkit.from_key_padding_mask(kpm) & Causal()
    got, got_w = ours(x, mask=mask, need_weights=True)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got_w, want_w, atol=1e-6)
    for backend in ("sdpa", "naive"):
        with attnkit.use_backend(backend):
            assert torch.allclose(ours(x, mask=mask), want, atol=1e-5)


def test_gqa_shapes_and_backend_from_config(monkeypatch):
    cfg = AttentionConfig(64, 8, num_kv_heads=2, backend="naive")
    layer = MultiHeadAttention(cfg)
    assert layer.qkv_proj.out_features == (8 + 2 * 2) * 8
    naive, ran = attnkit.get_backend("naive"), []
    forward = naive.forward
    monkeypatch.setattr(naive, "forward",
                        classmethod(lambda cls, inp, options: ran.append(inp.Hkv) or forward(inp, options)))
    out = layer(torch.randn(2, 5, 64), mask=Causal())  # sdpa is what auto would pick here
    assert out.shape == (2, 5, 64)
    assert ran == [2]  # the configured backend ran, once, with the unrepeated K/V heads


@pytest.mark.parametrize("backend", ["naive", "tiled", "sdpa"])
def test_the_configured_backend_actually_runs(backend, monkeypatch):
    ran = []
    for name, impl in attnkit.list_backends().items():
        original = impl.forward.__func__

        def spy(cls, inp, options, _original=original, _name=name):
            ran.append(_name)
            return _original(cls, inp, options)

        monkeypatch.setattr(impl, "forward", classmethod(spy))
    layer = MultiHeadAttention(AttentionConfig(32, 4, backend=backend))
    layer(torch.randn(2, 5, 32), mask=Causal())
    assert ran == [backend]


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(head_dim=True), ValueError, r"AttentionConfig\(head_dim=True\): expected a positive int or None"),
    (dict(bias="no"), TypeError, r"AttentionConfig\(bias='no'\): expected True or False, got str"),
    (dict(kv_dim=0, cross_attention=True), ValueError, r"AttentionConfig\(kv_dim=0\): expected a positive int"),
    (dict(rope_base=0.0, position="rope"), ValueError,
     r"AttentionConfig\(rope_base=0.0\): expected a finite number > 0"),
    (dict(rope_base=float("nan")), ValueError, "rope_base"),
    (dict(dropout=float("nan")), ValueError, r"AttentionConfig\(dropout=nan\): expected a finite number"),
    (dict(backend="sdpa", backend_options=attnkit.backends.naive.NaiveOptions()), TypeError,
     "backend 'sdpa' takes no options, got NaiveOptions"),
    (dict(backend="tiled", backend_options=attnkit.backends.naive.NaiveOptions()), TypeError,
     "backend 'tiled' takes TiledOptions, got NaiveOptions"),
])
def test_config_nonsense_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        AttentionConfig(32, 4, **kwargs)


def test_transformer_config_and_rope_nonsense_is_refused():
    from attnkit.nn import TransformerConfig
    from attnkit.nn.positional import RotaryEmbedding

    for eps in (0.0, -1e-5, float("inf")):
        with pytest.raises(ValueError, match=r"TransformerConfig\(layer_norm_eps=.*\): expected a finite number > 0"):
            TransformerConfig(layer_norm_eps=eps)
    with pytest.raises(ValueError, match=r"TransformerConfig\(rope_base=-10.0\)"):
        TransformerConfig(position="rope", rope_base=-10.0)
    with pytest.raises(ValueError, match=r"RotaryEmbedding\(base=0.0\)"):
        RotaryEmbedding(8, base=0.0)


def test_cross_attention_with_memory_of_other_width():
    layer = MultiHeadAttention(AttentionConfig(32, 4, cross_attention=True, kv_dim=24))
    out, w = layer(torch.randn(2, 5, 32), torch.randn(2, 7, 24), need_weights=True)
    assert out.shape == (2, 5, 32) and w.shape == (2, 4, 5, 7)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 5))


def test_dropout_only_in_training():
    layer = MultiHeadAttention(AttentionConfig(32, 4, dropout=0.5))
    x = torch.randn(2, 9, 32)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    torch.manual_seed(1)
    a = layer(x)
    torch.manual_seed(2)
    assert not torch.allclose(a, layer(x))
