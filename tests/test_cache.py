import pytest
import torch

from attnkit import Causal, SlidingWindow
from attnkit.cache import (
    DynamicLayerCache,
    KVCache,
    SlidingWindowLayerCache,
    StateCache,
    StaticLayerCache,
)
from attnkit.inputs import AttentionInputs
from attnkit.nn import AttentionConfig, MultiHeadAttention
from attnkit.registry import list_backends as backends

from .inputs import tiny_gpt

T, WINDOW = 37, 5
KINDS = ["dynamic", "static", "sliding_window"]


def _offset_backends():
    """Exact backends that can run cached decoding (offsets, Causal/SlidingWindow masks, GQA)."""
    q = torch.randn(2, 4, 3, 8)
    k = v = torch.randn(2, 2, 9, 8)
    names = []
    for name, impl in backends().items():
        if not impl.exact:
            continue
        ok = all(
            not impl.not_supported_reasons(AttentionInputs.create(q, k, v, mask=m, q_offset=12, kv_offset=6))
            for m in (Causal(), SlidingWindow(WINDOW, 0))
        )
        if ok:
            names.append(name)
    return names


BACKENDS = _offset_backends()


def _model(backend="auto", kind="dynamic", position="rope", **kw):
    return tiny_gpt(num_kv_heads=2, position=position, backend=backend,
                    sliding_window=WINDOW if kind == "sliding_window" else None, **kw)


def _decode(model, x, cache, chunk):
    outs = [model(x[:, s : s + chunk], cache=cache) for s in range(0, x.shape[1], chunk)]
    return torch.cat(outs, dim=1)


def test_there_is_an_offset_backend():
    assert "naive" in BACKENDS


@pytest.mark.parametrize("chunk", [1, 3, 16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decoding_equals_full_forward(backend, kind, chunk):
    model = _model(backend, kind)
    x = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        full = model(x)  # causal, or SlidingWindow(WINDOW, 0) for the sliding-window model
        cache = model.make_cache(kind, max_len=T)
        out = _decode(model, x, cache, chunk)
    assert cache.seq_len == T
    assert torch.allclose(out, full, atol=1e-5, rtol=1e-4), (out - full).abs().max()


@pytest.mark.parametrize("position", ["learned", "sinusoidal", "alibi", "none"])
def test_cached_decoding_with_every_position_kind(position):
    model = _model(position=position)
    x = torch.randint(0, 50, (1, 20))
    with torch.no_grad():
        assert torch.allclose(_decode(model, x, model.make_cache("dynamic"), 3), model(x), atol=1e-5)


def test_static_equals_dynamic():
    model = _model()
    x = torch.randint(0, 50, (3, 21))
    with torch.no_grad():
        a = _decode(model, x, model.make_cache("dynamic"), 1)
        b = _decode(model, x, model.make_cache("static", max_len=30), 1)
    assert torch.allclose(a, b, atol=1e-6)


def test_sliding_window_cache_equals_full_forward_with_sliding_window_mask():
    model = _model(kind="sliding_window")
    x = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        ref = _model()(x)  # same weights, plain causal model: differs once the window matters
        full = model(x)
        out = _decode(model, x, model.make_cache("sliding_window"), 1)
    assert torch.allclose(out, full, atol=1e-5)
    assert not torch.allclose(out[:, WINDOW + 1 :], ref[:, WINDOW + 1 :], atol=1e-3)


def test_sliding_window_cache_too_small_is_rejected():
    model = _model(kind="sliding_window")
    with pytest.raises(ValueError, match="window"):
        model(torch.randint(0, 50, (1, 3)), cache=KVCache.sliding_window(2, WINDOW - 1))
    with pytest.raises(ValueError, match="window"):
        _model()(torch.randint(0, 50, (1, 3)), cache=KVCache.sliding_window(2, 8))


def test_sliding_window_ring_positions_and_chronological_keys():
    cache = SlidingWindowLayerCache(4)
    for t in range(6):
        k = torch.full((1, 1, 1, 2), float(t))
        k_all, _, kv_offset = cache.update(k, k)
        assert kv_offset == max(0, t - 4)
        assert k_all[0, 0, :, 0].tolist() == [float(p) for p in range(kv_offset, t + 1)]  # contiguous, in order
    assert cache.positions().tolist() == [4, 5, 2, 3]  # slot p % 4 holds position p
    k = torch.arange(6, 13, dtype=torch.float).view(1, 1, 7, 1).expand(1, 1, 7, 2)
    k_all, _, kv_offset = cache.update(k, k)  # a chunk longer than the window
    assert kv_offset == 2 and k_all[0, 0, :, 0].tolist() == [float(p) for p in range(2, 13)]
    assert sorted(cache.positions().tolist()) == [9, 10, 11, 12]
    with pytest.raises(ValueError, match="crop"):
        cache.crop(5)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_crop_then_continue(kind):
    model = _model()
    x = torch.randint(0, 50, (2, 12))
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 7) % 50
    with torch.no_grad():
        cache = model.make_cache(kind, max_len=12)
        model(x, cache=cache)
        cache.crop(8)
        assert cache.seq_len == 8
        out = model(y[:, 8:], cache=cache)
        assert torch.allclose(out, model(y)[:, 8:], atol=1e-5)
    with pytest.raises(ValueError, match="length"):
        cache.crop(13)


@pytest.mark.parametrize("kind", KINDS)
def test_reorder_for_beam_search(kind):
    model = _model(kind=kind)
    x = torch.randint(0, 50, (3, 10))
    index = torch.tensor([2, 0, 0])
    with torch.no_grad():
        cache = model.make_cache(kind, max_len=12)
        model(x[:, :9], cache=cache)
        cache.reorder(index)
        out = model(x[index, 9:], cache=cache)
        assert torch.allclose(out, model(x[index])[:, 9:], atol=1e-5)


def test_reset_and_static_overflow():
    model = _model()
    x = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        cache = model.make_cache("static", max_len=6)
        first = model(x, cache=cache)
        with pytest.raises(ValueError, match="max_len"):
            model(x[:, :1], cache=cache)
        cache.reset()
        assert cache.seq_len == 0
        assert torch.allclose(model(x, cache=cache), first)


def test_layer_cache_validation():
    with pytest.raises(ValueError):
        StaticLayerCache(0)
    with pytest.raises(ValueError):
        SlidingWindowLayerCache(-1)
    cache = DynamicLayerCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="holds"):
        cache.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    with pytest.raises(TypeError):
        KVCache([])
    with pytest.raises(ValueError, match="kind"):
        KVCache.create("paged", 2)
    with pytest.raises(ValueError, match="layers"):
        _model()(torch.zeros(1, 2, dtype=torch.long), cache=KVCache.dynamic(3))


def test_multi_head_attention_cache_sets_offsets():
    torch.manual_seed(0)
    mha = MultiHeadAttention(AttentionConfig(embed_dim=16, num_heads=4, num_kv_heads=2, position="rope")).eval()
    x = torch.randn(2, 9, 16)
    full = mha(x, mask=Causal())
    cache = StaticLayerCache(9)
    out = torch.cat([mha(x[:, :4], mask=Causal(), cache=cache), mha(x[:, 4:], mask=Causal(), cache=cache)], 1)
    assert torch.allclose(out, full, atol=1e-6)
    assert cache.k.shape == (2, 2, 9, 4)  # K/V heads stored unrepeated
    with pytest.raises(ValueError, match="q_offset"):
        mha(x, mask=Causal(), cache=DynamicLayerCache(), q_offset=3)


class _PrefixMean:
    """A toy recurrent state: causal running mean of v (ignores q and k), to test the hook."""

    def __init__(self):
        self.reset()

    def step(self, q, k, v):
        total = (self.sum if self.sum is not None else 0) + v.cumsum(2)
        counts = torch.arange(self.seq_len + 1, self.seq_len + v.shape[2] + 1).view(1, 1, -1, 1)
        self.sum = total[:, :, -1:]
        self.seq_len += v.shape[2]
        return (total / counts).repeat_interleave(q.shape[1] // v.shape[1], dim=1)

    def reset(self):
        self.sum, self.seq_len = None, 0


def test_state_cache_hook_is_called_by_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(AttentionConfig(embed_dim=16, num_heads=4))
    x = torch.randn(3, 8, 16)
    whole = mha(x, cache=StateCache(_PrefixMean))
    cache = StateCache(_PrefixMean)
    parts = torch.cat([mha(x[:, :5], cache=cache), mha(x[:, 5:], cache=cache)], 1)
    assert torch.allclose(parts, whole, atol=1e-6) and cache.seq_len == 8
    cache.reorder(torch.tensor([1, 1, 0]))
    assert cache.state.sum.shape[0] == 3
    with pytest.raises(ValueError, match="crop"):
        cache.crop(4)
    with pytest.raises(ValueError, match="causal"):
        mha(x, cache=StateCache(_PrefixMean), mask=SlidingWindow(2, 0))
    cache.reset()
    assert cache.seq_len == 0 and cache.state.sum is None


def test_state_cache_with_recurrent_linear_attention():
    torch.manual_seed(0)
    mha = MultiHeadAttention(AttentionConfig(embed_dim=16, num_heads=4, backend="linear"))
    x = torch.randn(2, 10, 16)
    with torch.no_grad():
        full = mha(x, mask=Causal())
        cache = StateCache.recurrent("linear", head_dim=4)
        out = torch.cat([mha(x[:, t : t + 1], mask=Causal(), cache=cache) for t in range(10)], 1)
    assert torch.allclose(out, full, atol=1e-4)


def test_linear_attention_gpt_decodes_with_a_recurrent_cache():
    model = _model(backend="linear", position="rope")
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        full = model(x)
        out = _decode(model, x, model.make_cache("recurrent"), 3)
    assert torch.allclose(out, full, atol=1e-4)
    from attnkit.generation import generate

    assert generate(model, x[:, :4], 5, cache="recurrent").shape == (2, 9)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_decoding_is_as_accurate_as_the_full_forward(kind):
    """flash-attn's rule on logits: |decode_bf16 - ref| <= 2 |full_bf16 - ref| + eps, ref = float64."""
    model = _model(kind=kind)
    x = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        ref = model.double()(x)
        model = model.to(torch.bfloat16)
        full = model(x).double()
        out = _decode(model, x, model.make_cache(kind, max_len=20), 1).double()
    assert (out - ref).abs().max() <= 2 * (full - ref).abs().max() + 1e-3


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_cache_reused_after_the_model_changed_dtype_names_the_dtype(kind):
    model = _model()
    x = torch.randint(0, 50, (2, 6))
    cache = KVCache.create(kind, 2, max_len=64 if kind == "static" else None)
    with torch.no_grad():
        model(x, cache=cache)
        model.to(torch.bfloat16)
        with pytest.raises(ValueError) as info:
            model(x[:, :1], cache=cache)
    text = str(info.value)
    assert "dtype" in text and "torch.float32" in text and "torch.bfloat16" in text and "reset()" in text, text
    assert "batch" not in text, text  # the batch is the same: only what differs is named
