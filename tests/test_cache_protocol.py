"""The cache protocol: caches are storage, attention() reads what update() returns.

Score modifiers, sinks and biases reach every cache kind (cached decode == full forward for
Gemma-2-, gpt-oss- and ALiBi-style layers on int8 and paged caches), a step that fails in one
layer leaves every layer with the same tokens, caches report finite K/V to attention, and no
storage or kernel module calls attention()."""

import ast
import pathlib

import pytest
import torch

import attnkit
import attnkit.nn.attention as mha_module
from attnkit import Causal, attention
from attnkit.cache import KVCache, PagedKVCache
from attnkit.kv_handle import KVHandle

from .test_cache import _model

T = 19

# Gemma-2 (soft-capped logits), gpt-oss (sinks), ALiBi, and all three with T5 buckets' cousin.
STYLES = {
    "gemma2": dict(softcap=3.0),
    "gpt_oss": dict(sinks=True),
    "alibi": dict(position="alibi"),
    "alibi_softcap_sinks": dict(position="alibi", softcap=2.5, sinks=True),
}


def _styled(style):
    model = _model(**STYLES[style])
    with torch.no_grad():  # sinks start at zero: make them matter
        for layer in model.layers:
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.copy_(torch.linspace(-1.0, 2.0, layer.self_attn.sinks.numel()))
    return model


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("kind", ["static-int8", "paged", "paged-int8"])
def test_score_modifiers_and_sinks_reach_int8_and_paged_caches(style, kind):
    model = _styled(style)
    x = torch.randint(0, 50, (3, T))
    with torch.no_grad():
        full = model(x)
        if kind == "static-int8":
            cache = model.make_cache("static", max_len=T, quantize="int8")
        else:
            cache = model.make_cache("paged", num_blocks=40, block_size=5,
                                     quantize="int8" if kind.endswith("int8") else None)
            cache.select([cache.add_sequence() for _ in range(3)])
        outs = [model(x[:, :6], cache=cache)] + [model(x[:, s:s + 2], cache=cache) for s in range(6, T, 2)]
    out = torch.cat(outs, 1)
    err = (out - full).abs().max()
    bound = 0.03 * full.abs().max() if kind.endswith("int8") else 2e-5
    assert err <= bound, err
    if kind.endswith("int8"):
        assert err > 0  # the keys really were read back from int8


@pytest.mark.parametrize("style", ["gemma2", "gpt_oss", "alibi_softcap_sinks"])
def test_ragged_paged_rows_with_score_modifiers_equal_their_full_forward(style):
    """Rows of different lengths (continuous batching): ALiBi reads each row's own positions."""
    model = _styled(style)
    x = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        full = model(x)
        cache = model.make_cache("paged", num_blocks=40, block_size=3)
        a, b = cache.add_sequence(), cache.add_sequence()
        cache.select([a])
        first = model(x[:1, :5], cache=cache)  # a runs ahead by 5 tokens
        cache.select([a, b])
        outs = [model(torch.stack([x[0, 5 + s:6 + s], x[1, s:s + 1]]), cache=cache) for s in range(T - 5)]
    out = torch.cat(outs, 1)
    assert cache.lengths() == [T, T - 5]
    assert torch.allclose(torch.cat([first, out[:1]], 1), full[:1], atol=2e-5)
    assert torch.allclose(out[1:], full[1:, :T - 5], atol=2e-5)


def test_decode_reads_the_handle_in_place_and_a_bias_reaches_it():
    g = torch.Generator().manual_seed(11)
    cache = KVCache.quantized(1, max_len=40)
    k, v = torch.randn(2, 3, 29, 7, generator=g), torch.randn(2, 3, 29, 5, generator=g)
    cache[0].update(k[:, :, :27], v[:, :, :27])
    h, h2, offset = cache[0].update(k[:, :, 27:], v[:, :, 27:])
    assert isinstance(h, KVHandle) and h is h2 and offset == 0 and h.format == "int8"
    q = torch.randn(2, 6, 2, 7, generator=g)
    bias = torch.randn(1, 6, 2, 29, generator=g)
    assert attnkit.explain(q, h, h, bias=bias, mask=Causal()).chosen == "decode"
    out = attention(q, h, h, bias=bias, mask=Causal())
    kd, vd = h.dense(torch.float32)
    ref = attention(q, kd, vd, bias=bias, mask=Causal(), backend="naive")
    assert torch.allclose(out, ref, atol=1e-5)


def _layers_lengths(cache):
    if isinstance(cache, PagedKVCache):
        return [layer.row_lengths() for layer in cache.layers]
    return [[layer.seq_len] for layer in cache.layers]


@pytest.mark.parametrize("kind", ["paged-int8", "paged", "int8", "static", "dynamic"])
def test_a_step_refused_in_a_later_layer_leaves_every_layer_in_step(kind):
    """Layer 2 of 3 refuses its keys after layers 0 and 1 appended: all layers keep the old
    length, and the next good step reads exactly what it would have read."""
    g = torch.Generator().manual_seed(5)
    B, H, D = 3, 2, 5
    if kind.startswith("paged"):
        cache = PagedKVCache(3, num_blocks=30, block_size=4, quantize="int8" if kind == "paged-int8" else None)
        cache.select([cache.add_sequence() for _ in range(B)])
    else:
        cache = {"int8": lambda: KVCache.quantized(3, max_len=32), "static": lambda: KVCache.static(3, 32),
                 "dynamic": lambda: KVCache.dynamic(3)}[kind]()
    history = [torch.randn(B, H, 9, D, generator=g) for _ in range(3)]
    for layer, kv in zip(cache, history):
        layer.update(kv, kv)
    new = torch.randn(B, H, 2, D, generator=g)
    cache[0].update(new, new)
    cache[1].update(new, new)
    with pytest.raises(ValueError):
        cache[2].update(new[..., :3], new[..., :3])  # wrong head dim: refused
    assert _layers_lengths(cache) == [[9] * len(_layers_lengths(cache)[0])] * 3
    if isinstance(cache, PagedKVCache):
        assert cache.lengths() == [9] * B
    else:
        assert cache.seq_len == 9
    q = torch.randn(B, 2 * H, 1, D, generator=g)
    step = torch.randn(B, H, 1, D, generator=g)
    for layer, kv in zip(cache, history):
        k, v, offset = layer.update(step, step)
        got = attention(q, k, v, kv_offset=offset)
        ref_k = torch.cat([kv, step], 2)
        if isinstance(k, KVHandle) and "int8" in k.format:
            ref_k = k.dense(torch.float32)[0]
        ref = attention(q, ref_k, ref_k, backend="naive")
        assert torch.allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("kind", ["static", "paged", "int8"])
def test_the_layer_tells_attention_the_cache_is_finite(kind, monkeypatch):
    seen = []
    real = mha_module.attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("kv_finite"))
        return real(*args, **kwargs)

    monkeypatch.setattr(mha_module, "attention", spy)
    model = _model()
    x = torch.randint(0, 50, (1, 7))
    with torch.no_grad():
        if kind == "paged":
            cache = model.make_cache("paged", num_blocks=8, block_size=4)
            cache.select([cache.add_sequence()])
        else:
            cache = model.make_cache("static", max_len=8, quantize="int8" if kind == "int8" else None)
        model(x[:, :6], cache=cache)
        model(x[:, 6:], cache=cache)
        assert seen and all(flag is True for flag in seen), seen
        seen.clear()
        model.layers[1].self_attn.qkv_proj.bias.data[-1] = float("nan")  # a NaN value in layer 1 only
        model(x[:, :1], cache=cache)
    assert seen == [True, False]
    assert [layer.finite for layer in cache] == [True, False]
    assert [layer.seq_len for layer in cache] == [8, 8]  # NaN keys are stored, not refused mid-model


def test_unwritten_slots_hold_zeros():
    """Blocks freed by one sequence come back zeroed to the next (int8: zero values, scale 1)."""
    cache = PagedKVCache(1, num_blocks=3, block_size=4, quantize="int8")
    a = cache.add_sequence()
    cache.select([a])
    cache[0].update(torch.randn(1, 2, 10, 3) + 5, torch.randn(1, 2, 10, 3) + 5)
    cache.free(a)
    b = cache.add_sequence()
    cache.select([b])
    cache[0].update(torch.ones(1, 2, 1, 3), torch.ones(1, 2, 1, 3))
    block = cache.pool.tables[b][0]
    assert (cache[0].k[:, block, 1:] == 0).all() and (cache[0].k_scale[:, block, 1:] == 1).all()


def test_score_modifiers_are_built_once_per_layer_not_per_call():
    layer = _styled("alibi_softcap_sinks").layers[0].self_attn
    first = layer.score_mod()
    assert layer.score_mod() is first
    layer.double()  # the slopes buffer is replaced: the modifiers follow it
    again = layer.score_mod()
    assert again is not first and again[0].slopes.dtype == torch.float64


# The layers below functional.py and the storage layer: none of them may run attention itself.
_NO_ATTENTION_CALLS = ["cache", "backends", "masks", "inputs.py", "dispatch", "registry.py", "kv_handle.py",
                       "score_mods.py", "hardware.py"]


def test_no_storage_or_kernel_module_calls_attention():
    root = pathlib.Path(attnkit.__file__).parent
    offenders = []
    for entry in _NO_ATTENTION_CALLS:
        path = root / entry
        for file in sorted(path.rglob("*.py") if path.is_dir() else [path]):
            tree = ast.parse(file.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (
                        (node.module or "").endswith("functional")
                        or any(alias.name in ("attention", "varlen_attention") for alias in node.names)):
                    offenders.append(f"{file.relative_to(root)}:{node.lineno}")
                if isinstance(node, ast.Attribute) and node.attr == "attention" and isinstance(node.value, ast.Name) \
                        and node.value.id in ("attnkit", "functional"):
                    offenders.append(f"{file.relative_to(root)}:{node.lineno}")
    assert not offenders, offenders


def test_a_handle_is_checked_like_tensors():
    cache = KVCache.quantized(1, max_len=12)
    cache[0].update(torch.randn(1, 2, 4, 6), torch.randn(1, 2, 4, 6))
    h, _, _ = cache[0].update(torch.randn(1, 2, 1, 6), torch.randn(1, 2, 1, 6))
    q = torch.randn(1, 4, 1, 6)
    with pytest.raises(TypeError, match=r"q: expected the dtype of the cached keys, torch.float32, got torch.float64"):
        attention(q.double(), h, h)
    with pytest.raises(TypeError, match="both k and v"):
        attention(q, h, torch.randn(1, 2, 5, 6))
    with pytest.raises(ValueError, match="kv_offset"):
        attention(q, h, h, kv_offset=3)
    with pytest.raises(ValueError, match="head dim"):
        attention(torch.randn(1, 4, 1, 5), h, h)


@pytest.mark.parametrize("scan", ["C", "sum"])
def test_huge_finite_tokens_read_as_unknown_never_as_wrong(scan, monkeypatch):
    """The finiteness check reads the new tokens once: in C a bit test per element, exact; as a
    sum (without the built extension), finite values whose sum overflows mark the cache
    not-known-finite (the NaN/Inf policy then looks). Either way the values stay exact."""
    from attnkit.csrc import loader

    if scan == "sum":
        monkeypatch.setattr(loader, "finite", lambda x: None)
    elif loader.fastpath() is None:
        pytest.skip("the native extension is not built")
    cache = KVCache.quantized(1, max_len=6)
    k = torch.full((1, 1, 3, 4), 3e38)
    cache[0].update(k, k)
    h, _, _ = cache[0].update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
    assert h.finite == (scan == "C")
    kd, _ = h.dense()
    assert torch.isfinite(kd).all() and torch.allclose(kd[0, 0, :3], k[0, 0], rtol=1e-2)
